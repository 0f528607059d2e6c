"""TensorFlow's allocator figures per device: bytes in use and the peak (which CPUs have them:
docs/memory.md). The train step measures its own peak (`reset_step_peak`, `step_peak`); a
reader's peak (`allocator_memory`) still counts what that reset away. On Keras 3's JAX backend
the figures are JAX's (`memory_stats()`: a GPU's; none on its CPU client; a peak since the process
started, which JAX cannot reset), and TensorFlow's allocator is not read (that would start its GPU
runtime beside JAX's). Importing this module does not import TensorFlow."""

from __future__ import annotations


def on_jax() -> bool:
    """Whether Keras runs on JAX, whose own figures are read then."""
    from keras_memopt._keras import BACKEND

    return BACKEND == "jax"


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
    """The first logical GPU, else `"CPU:0"` (on JAX: its default device)."""
    if on_jax():
        from keras_memopt._memory import jax_memory

        return jax_memory.default_device()
    import tensorflow as tf

    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def allocator_memory(device: str | None = None) -> dict | None:
    """`{"device", "current", "peak"}` bytes of TensorFlow's allocator on `device` (default:
    the first GPU, else `"CPU:0"`), or None where the device gives no figures (docs/memory.md)."""
    device = device or default_device()
    if on_jax():
        from keras_memopt._memory import jax_memory

        return jax_memory.memory(canonical_device(device))
    import tensorflow as tf

    try:
        info = tf.config.experimental.get_memory_info(device)
    except (ValueError, RuntimeError, tf.errors.OpError):
        return None
    peak = max(info["peak"], _PEAKS_RESET_AWAY.get(canonical_device(device), 0))
    return dict(device=device, current=info["current"], peak=peak)


# Peaks the step runner reset per device to measure one step (`reset_step_peak`): reported by
# `allocator_memory` until a reader starts a new window, so that a user's peak is not lost.
_PEAKS_RESET_AWAY: dict[str, int] = {}


def reset_step_peak(device: str) -> int | None:
    """Starts a new peak window on `device` for one step (the peak before kept for
    `allocator_memory`); returns its current bytes, or None without figures (on JAX, whose
    peak cannot be reset, only the current bytes)."""
    import tensorflow as tf

    info = allocator_memory(device)
    if info is None or on_jax():
        return None if info is None else info["current"]
    key = canonical_device(device)
    _PEAKS_RESET_AWAY[key] = max(_PEAKS_RESET_AWAY.get(key, 0), info["peak"])
    tf.config.experimental.reset_memory_stats(device)
    return info["current"]


def step_peak(device: str) -> int | None:
    """The allocator's peak on `device` since `reset_step_peak`, or None (on JAX)."""
    if on_jax():
        return None
    import tensorflow as tf

    try:
        return tf.config.experimental.get_memory_info(device)["peak"]
    except (ValueError, RuntimeError, tf.errors.OpError):
        return None


def start_peak_window(device: str):
    """Starts a reader's new peak window on `device` (one that has figures; not on JAX)."""
    if on_jax():
        return
    import tensorflow as tf

    _PEAKS_RESET_AWAY.pop(canonical_device(device), None)
    tf.config.experimental.reset_memory_stats(device)
