"""`configure_devices`: GPU memory settings, in one call before any model."""

from __future__ import annotations

import os
import warnings

import tensorflow as tf

from keras_memopt._validation import positive_int
from keras_memopt.memory import MIB, parse_bytes

_ALLOCATORS = ("cuda_malloc_async", "bfc")


def _tensorflow_initialised():
    """Whether TensorFlow has created its devices (after which they are fixed)."""
    from tensorflow.python.eager import context

    return bool(getattr(context.context(), "_initialized", False))


def _initialised_error(what):
    return RuntimeError(
        f"TensorFlow has already initialised its devices, so {what} can no "
        "longer be changed. Call `keras_memopt.configure_devices(...)` at the "
        "start of the program, before building a model, creating a tensor or "
        "listing logical devices (in a notebook: restart the kernel and run it "
        "first)."
    )


def configure_devices(
    memory_growth: bool | None = None,
    memory_limit=None,
    logical_devices: int | None = None,
    allocator: str | None = None,
    gpus: list[int] | None = None,
) -> list:
    """Sets up GPU memory before TensorFlow starts: growth, limits, splits.

    Call it once, at the start of the program, before building a model:
    TensorFlow fixes its devices when it first uses them. Every argument left
    as None leaves that setting as TensorFlow's default.

    - `memory_growth=True` makes TensorFlow take GPU memory as it needs it
      instead of (nearly) all of it at start, so that several processes can
      share a GPU.
    - `memory_limit` caps what TensorFlow may use on each GPU: one size for
      all, or a list with one size per chosen GPU (for machines whose GPUs
      differ). It creates one logical device per GPU with that limit.
    - `logical_devices=n` splits each chosen GPU into n logical devices
      (`"GPU:0"`, `"GPU:1"`, ...) so that two models can train side by side;
      with `memory_limit` each part gets the limit, otherwise the GPU's
      memory is shared evenly among them, as TensorFlow requires a limit.
    - `allocator="cuda_malloc_async"` sets `TF_GPU_ALLOCATOR` to CUDA's
      stream-ordered allocator, which fights fragmentation; `"bfc"` restores
      TensorFlow's default.

    On a machine without GPUs it warns and changes nothing but the
    allocator setting, so the same script runs everywhere.

    Args:
        memory_growth: bool, whether to enable memory growth on the chosen
            GPUs. Defaults to None (TensorFlow's default, off).
        memory_limit: a size (bytes, or a string such as `"4GiB"`), or a
            list of sizes, one per chosen GPU. Defaults to None (no limit).
        logical_devices: int, logical devices per chosen GPU. Defaults to
            None (one).
        allocator: str, `"cuda_malloc_async"` or `"bfc"`. Defaults to None
            (leave `TF_GPU_ALLOCATOR` as it is).
        gpus: list of int, the indices of the physical GPUs to configure.
            Defaults to all.

    Returns:
        The list of configured physical GPUs (empty without GPUs).

    Example:

    ```python
    import keras_memopt as kmo

    kmo.configure_devices(memory_growth=True, allocator="cuda_malloc_async")
    # or: two logical GPUs of 8 GiB each on GPU 0, for two models side by side
    kmo.configure_devices(memory_limit="8GiB", logical_devices=2, gpus=[0])
    ```

    Raises:
        ValueError: for invalid arguments (checked before anything changes),
            or memory growth combined with a limit or split.
        RuntimeError: if TensorFlow has already initialised its devices.
    """
    if memory_growth is not None and not isinstance(memory_growth, bool):
        raise ValueError(
            "`memory_growth` must be True, False or None. "
            f"Received: memory_growth={memory_growth!r}"
        )
    if logical_devices is not None:
        positive_int("logical_devices", logical_devices)
    if allocator is not None and allocator not in _ALLOCATORS:
        raise ValueError(
            f"`allocator` must be one of {_ALLOCATORS}. Received: allocator={allocator!r}"
        )
    if memory_growth and (memory_limit is not None or (logical_devices or 1) > 1):
        raise ValueError(
            "Memory growth cannot be combined with a memory limit or a split into "
            "logical devices: TensorFlow needs a fixed size for those. Received: "
            f"memory_growth={memory_growth!r}, memory_limit={memory_limit!r}, "
            f"logical_devices={logical_devices!r}"
        )
    if gpus is not None and (
        isinstance(gpus, (str, int)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in gpus
        )
    ):
        raise ValueError(
            f"`gpus` must be a list of GPU indices such as [0, 1]. Received: gpus={gpus!r}"
        )
    if isinstance(memory_limit, (list, tuple)):
        limits = [parse_bytes(v, "memory_limit") for v in memory_limit]
    elif memory_limit is not None:
        limits = parse_bytes(memory_limit, "memory_limit")
    else:
        limits = None

    if allocator is not None:
        wanted = "cuda_malloc_async" if allocator == "cuda_malloc_async" else None
        current = os.environ.get("TF_GPU_ALLOCATOR") or None
        if wanted != current and _tensorflow_initialised():
            raise _initialised_error("the GPU allocator")

    physical = tf.config.list_physical_devices("GPU")
    if gpus is not None:
        missing = [i for i in gpus if i >= len(physical)]
        if missing and physical:
            raise ValueError(
                f"This machine has {len(physical)} GPU(s); there is no GPU "
                f"{missing[0]}. Received: gpus={gpus!r}"
            )
        chosen = [physical[i] for i in gpus if i < len(physical)]
    else:
        chosen = physical
    if isinstance(limits, list) and chosen and len(limits) != len(chosen):
        raise ValueError(
            "A list of memory limits needs one limit per chosen GPU: "
            f"{len(chosen)} GPU(s), {len(limits)} limit(s). "
            f"Received: memory_limit={memory_limit!r}"
        )
    wants_gpu_settings = (
        memory_growth is not None or limits is not None or logical_devices is not None
    )
    if wants_gpu_settings and chosen and _tensorflow_initialised():
        raise _initialised_error("GPU memory growth, limits and logical devices")

    if allocator == "cuda_malloc_async":
        os.environ["TF_GPU_ALLOCATOR"] = "cuda_malloc_async"
    elif allocator == "bfc":
        os.environ.pop("TF_GPU_ALLOCATOR", None)

    if not physical:
        if wants_gpu_settings:
            warnings.warn(
                "configure_devices: this machine has no GPU that TensorFlow can "
                "use, so memory growth, limits and logical devices were not "
                "applied; training runs on the CPU.",
                stacklevel=2,
            )
        return []

    try:
        for index, gpu in enumerate(chosen):
            if memory_growth is not None:
                tf.config.experimental.set_memory_growth(gpu, memory_growth)
            if limits is not None or (logical_devices or 1) > 1:
                limit = limits[index] if isinstance(limits, list) else limits
                count = logical_devices or 1
                if limit is None:
                    limit = _device_total(gpu, index) // count
                configs = [
                    tf.config.LogicalDeviceConfiguration(memory_limit=max(limit // MIB, 1))
                ] * count
                tf.config.set_logical_device_configuration(gpu, configs)
    except RuntimeError as error:
        raise _initialised_error("GPU memory growth, limits and logical devices") from error
    return chosen


def _device_total(gpu, index):
    """A GPU's total memory in bytes, from NVML or TensorFlow's device details."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).total)
    except Exception:  # nvidia-ml-py missing or NVML unusable: ask the user
        raise ValueError(
            "Splitting a GPU into logical devices needs a memory limit per device, "
            "and the GPU's total memory could not be read (NVML unavailable). "
            f"Pass `memory_limit`. Received: gpu={gpu.name!r}, memory_limit=None"
        ) from None
