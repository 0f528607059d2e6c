"""`configure_devices`: GPU memory settings, in one call before any model (docs/devices.md)."""

from __future__ import annotations

import dataclasses
import os
import warnings

import tensorflow as tf

from keras_memopt._validation import positive_int
from keras_memopt.memory import MIB, NvmlUnavailable, nvml, nvml_handle_of_tf_gpu, parse_bytes

__all__ = ["configure_devices"]

_ALLOCATORS = ("cuda_malloc_async", "bfc")


def configure_devices(
    memory_growth: bool | None = None,
    memory_limit=None,
    logical_devices: int | None = None,
    allocator: str | None = None,
    gpus: list[int] | None = None,
) -> list:
    """Sets up GPU memory before TensorFlow starts: growth, limits, splits.

    Call it once, at the start of the program, before building a model: TensorFlow fixes its devices
    when it first uses them. Every argument left as None leaves TensorFlow's default. On a machine
    without GPUs it warns and changes nothing but the allocator setting. See docs/devices.md.

    Args:
        memory_growth: bool, whether TensorFlow takes GPU memory as it needs it (so that
            processes can share a GPU). Defaults to None (off).
        memory_limit: a size (bytes, or a string such as `"4GiB"`), or a list of sizes, one per
            chosen GPU: what TensorFlow may use on each. Defaults to None (no limit).
        logical_devices: int, logical devices per chosen GPU, each getting `memory_limit`, or an
            even share of the GPU's memory read with NVML. Defaults to None (one).
        allocator: str, `"cuda_malloc_async"` (CUDA's stream-ordered allocator, against
            fragmentation) or `"bfc"` (TensorFlow's default). Defaults to None (`TF_GPU_ALLOCATOR`).
        gpus: list of int, the indices of the physical GPUs to configure, as TensorFlow numbers them
            (after `CUDA_VISIBLE_DEVICES`). Defaults to all.

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
        ValueError: for invalid arguments (checked before anything changes), memory growth combined
            with a limit or split, or a split without a limit where the GPU's memory cannot be read.
        RuntimeError: if TensorFlow has already initialised its devices.
    """
    settings = _Settings.checked(memory_growth, memory_limit, logical_devices, allocator, gpus)
    if settings.changes_allocator() and _tensorflow_initialised():
        raise _initialised_error("the GPU allocator")
    physical = tf.config.list_physical_devices("GPU")
    chosen = _choose(physical, settings)
    plans = [
        _plan_gpu(index, gpu, position, settings)
        for position, (index, gpu) in enumerate(chosen)
    ]
    if settings.wants_gpu_settings() and chosen and _tensorflow_initialised():
        raise _initialised_error("GPU memory growth, limits and logical devices")

    _set_allocator(settings.allocator)
    if not physical:
        if settings.wants_gpu_settings():
            warnings.warn(
                "configure_devices: this machine has no GPU that TensorFlow can "
                "use, so memory growth, limits and logical devices were not "
                "applied; training runs on the CPU.",
                stacklevel=2,
            )
        return []
    _apply(plans)
    return [gpu for _, gpu in chosen]


@dataclasses.dataclass
class _Settings:
    """The arguments of `configure_devices`, checked; `limits` in bytes."""

    memory_growth: bool | None
    limits: int | list[int] | None
    logical_devices: int | None
    allocator: str | None
    gpus: list[int] | None
    memory_limit: object  # as given, for error messages

    @classmethod
    def checked(cls, memory_growth, memory_limit, logical_devices, allocator, gpus):
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
        return cls(memory_growth, limits, logical_devices, allocator,
                   None if gpus is None else list(gpus), memory_limit)

    def changes_allocator(self):
        wanted = "cuda_malloc_async" if self.allocator == "cuda_malloc_async" else None
        return self.allocator is not None and wanted != (os.environ.get("TF_GPU_ALLOCATOR") or None)

    def wants_gpu_settings(self):
        return (
            self.memory_growth is not None
            or self.limits is not None
            or self.logical_devices is not None
        )

    def splits(self):
        return self.limits is not None or (self.logical_devices or 1) > 1


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


def _choose(physical, settings):
    """(TensorFlow's index, physical device) of each GPU to configure."""
    if settings.gpus is None:
        chosen = list(enumerate(physical))
    else:
        missing = [i for i in settings.gpus if i >= len(physical)]
        if missing and physical:
            raise ValueError(
                f"This machine has {len(physical)} GPU(s); there is no GPU "
                f"{missing[0]}. Received: gpus={settings.gpus!r}"
            )
        chosen = [(i, physical[i]) for i in settings.gpus if i < len(physical)]
    if isinstance(settings.limits, list) and chosen and len(settings.limits) != len(chosen):
        raise ValueError(
            "A list of memory limits needs one limit per chosen GPU: "
            f"{len(chosen)} GPU(s), {len(settings.limits)} limit(s). "
            f"Received: memory_limit={settings.memory_limit!r}"
        )
    return chosen


@dataclasses.dataclass
class _GpuPlan:
    gpu: object
    memory_growth: bool | None
    logical_limits_mib: list[int] | None  # one per logical device, or None: no split


def _plan_gpu(index, gpu, position, settings):
    """What to set on TensorFlow's GPU `index`, the `position`-th chosen GPU."""
    if not settings.splits():
        return _GpuPlan(gpu, settings.memory_growth, None)
    count = settings.logical_devices or 1
    limit = settings.limits[position] if isinstance(settings.limits, list) else settings.limits
    if limit is None:
        limit = _total_memory(index, gpu) // count
    return _GpuPlan(gpu, settings.memory_growth, [max(limit // MIB, 1)] * count)


def _total_memory(index, gpu):
    """TensorFlow's GPU `index`'s total memory in bytes, from NVML."""
    try:
        details = tf.config.experimental.get_device_details(gpu)
    except (ValueError, RuntimeError, TypeError):
        details = {}
    try:
        handle = nvml_handle_of_tf_gpu(index, details.get("device_name"))
        return int(nvml().nvmlDeviceGetMemoryInfo(handle).total)
    except NvmlUnavailable as error:
        raise ValueError(
            "Splitting a GPU into logical devices needs a memory limit per device, "
            f"and the GPU's total memory could not be read ({error}). Pass "
            f"`memory_limit`. Received: gpu={gpu.name!r}, memory_limit=None"
        ) from None


def _set_allocator(allocator):
    if allocator == "cuda_malloc_async":
        os.environ["TF_GPU_ALLOCATOR"] = "cuda_malloc_async"
    elif allocator == "bfc":
        os.environ.pop("TF_GPU_ALLOCATOR", None)


def _apply(plans):
    try:
        for plan in plans:
            if plan.memory_growth is not None:
                tf.config.experimental.set_memory_growth(plan.gpu, plan.memory_growth)
            if plan.logical_limits_mib is not None:
                tf.config.set_logical_device_configuration(
                    plan.gpu,
                    [tf.config.LogicalDeviceConfiguration(memory_limit=m)
                     for m in plan.logical_limits_mib],
                )
    except RuntimeError as error:
        raise _initialised_error("GPU memory growth, limits and logical devices") from error
