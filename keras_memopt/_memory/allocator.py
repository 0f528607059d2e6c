"""TensorFlow's allocator figures per device: bytes in use and the peak.

Where a CPU has figures: under TensorFlow's default CPU allocator with oneDNN
on (TensorFlow's default on x86), for allocations of 256 KiB or more only
(smaller ones go to a pool it does not count); under its BFC allocator
(`TF_CPU_ALLOCATOR_USE_BFC=true` before TensorFlow starts), for every
allocation; with oneDNN off (`TF_ENABLE_ONEDNN_OPTS=0`) and no BFC, none
(TensorFlow 2.21). A GPU always has them.

The train step measures its own peak (`reset_step_peak`, `step_peak`); a
reader's peak since its own window began (`allocator_memory`) still counts
what that reset away.

Importing this module does not import TensorFlow (the functions do).
"""

from __future__ import annotations


def _device_spec(device):
    import tensorflow as tf

    return tf.DeviceSpec.from_string(device if "/" in device else f"/device:{device}")


def device_tag(device: str) -> str:
    """`"GPU:0"` → `"gpu0"`: a name safe in CSV columns and summary names."""
    spec = _device_spec(device)
    return f"{(spec.device_type or 'cpu').lower()}{spec.device_index or 0}"


def canonical_device(device: str) -> str:
    """`"/device:GPU:0"`, `"/GPU:0"`, `"GPU:0"` → `"GPU:0"`."""
    spec = _device_spec(device)
    return f"{spec.device_type or 'CPU'}:{spec.device_index or 0}"


def default_device() -> str:
    """The first logical GPU, else `"CPU:0"`."""
    import tensorflow as tf

    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def allocator_memory(device: str | None = None) -> dict | None:
    """Current and peak bytes of TensorFlow's allocator on `device`, or None.

    A GPU always has these figures. A CPU has them under TensorFlow's
    default allocator with oneDNN on (TensorFlow's default; allocations of
    256 KiB or more only) and under its BFC allocator
    (`TF_CPU_ALLOCATOR_USE_BFC=true` before TensorFlow starts; every
    allocation), not with oneDNN off and no BFC.

    Args:
        device: str, a logical device such as `"GPU:0"`. Defaults to the
            first GPU, else `"CPU:0"`.

    Returns:
        `{"device": ..., "current": bytes, "peak": bytes}`, or None where the
        device gives no figures.

    Example:

    ```python
    info = allocator_memory()
    if info is not None:
        print(format_bytes(info["peak"]), "peak on", info["device"])
    ```
    """
    import tensorflow as tf

    device = device or default_device()
    try:
        info = tf.config.experimental.get_memory_info(device)
    except (ValueError, RuntimeError, tf.errors.OpError):
        return None
    peak = max(info["peak"], _PEAKS_RESET_AWAY.get(canonical_device(device), 0))
    return dict(device=device, current=info["current"], peak=peak)


# Peaks the step runner reset to measure one step (`reset_step_peak`), per
# device: `allocator_memory` still reports them until a reader starts a new
# window (`start_peak_window`), so that a user's peak is not lost.
_PEAKS_RESET_AWAY: dict[str, int] = {}


def reset_step_peak(device: str) -> int | None:
    """Starts a new peak window on `device` for one step; returns its current bytes.

    What the allocator's peak was before is kept for `allocator_memory`.
    Returns None where the device gives no figures.
    """
    import tensorflow as tf

    info = allocator_memory(device)
    if info is None:
        return None
    key = canonical_device(device)
    _PEAKS_RESET_AWAY[key] = max(_PEAKS_RESET_AWAY.get(key, 0), info["peak"])
    tf.config.experimental.reset_memory_stats(device)
    return info["current"]


def step_peak(device: str) -> int | None:
    """The allocator's peak on `device` since `reset_step_peak`, or None."""
    import tensorflow as tf

    try:
        return tf.config.experimental.get_memory_info(device)["peak"]
    except (ValueError, RuntimeError, tf.errors.OpError):
        return None


def start_peak_window(device: str):
    """Starts a reader's new peak window on `device` (one that has figures)."""
    import tensorflow as tf

    _PEAKS_RESET_AWAY.pop(canonical_device(device), None)
    tf.config.experimental.reset_memory_stats(device)
