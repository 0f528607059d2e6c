"""Reading memory: byte sizes, TensorFlow's allocator per device, NVML, and `MemoryReader`, all of
them and the host's RSS as one dict. The public home of `_memory.sizes` and `_memory.allocator`.
Importing it does not import TensorFlow (the command line checks sizes before TensorFlow loads)."""

from __future__ import annotations

import os

import psutil

from keras_memopt._memory.allocator import (
    allocator_memory,
    canonical_device,
    default_device,
    device_tag,
    on_jax,
    reset_step_peak,
    start_peak_window,
    step_peak,
)
from keras_memopt._memory.sizes import (
    MIB,
    bytes_if_known,
    bytes_per_sample,
    format_bytes,
    parse_bytes,
)

__all__ = [
    "MIB", "MemoryReader", "NvmlUnavailable", "allocator_memory", "bytes_if_known",
    "bytes_per_sample", "default_device", "device_total", "format_bytes", "nvml",
    "nvml_handle_of_tf_gpu", "parse_bytes", "reset_step_peak", "step_peak",
]


def device_total(device: str) -> int | None:
    """The bytes TensorFlow's allocator may hand out on `device` (a logical GPU's limit, else
    its NVML total; the CPU BFC allocator's limit; on JAX, its `bytes_limit`), or None."""
    if on_jax():
        from keras_memopt._memory import jax_memory

        return jax_memory.stats(canonical_device(device)).get("bytes_limit")
    import tensorflow as tf

    kind, index = canonical_device(device).split(":")
    kind, index = kind.upper(), int(index)
    if kind == "CPU":
        bfc = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() in ("1", "true")
        limit = os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB")
        return int(limit) * MIB if bfc and limit and limit.isdigit() else None
    if kind != "GPU":
        return None
    physical = tf.config.list_physical_devices("GPU")
    logical = []
    for gpu in physical:
        configs = tf.config.get_logical_device_configuration(gpu) or [None]
        logical.extend((gpu, c) for c in configs)
    if index >= len(logical):
        return None
    gpu, config = logical[index]
    if config is not None and getattr(config, "memory_limit", None):
        return int(config.memory_limit) * MIB
    try:
        handle = nvml_handle_of_tf_gpu(physical.index(gpu))
        return int(nvml().nvmlDeviceGetMemoryInfo(handle).total)
    except Exception:  # noqa: BLE001 - NVML missing or unusable: unknown
        return None


# -- NVML ----------------------------------------------------------------------------------


class NvmlUnavailable(RuntimeError):
    """NVML cannot answer; the message says why (and what to install)."""


_nvml_module = None


def nvml():
    """The `pynvml` module, NVML initialised once per process; `NvmlUnavailable` without
    nvidia-ml-py or a driver."""
    global _nvml_module
    if _nvml_module is None:
        try:
            import pynvml
        except ImportError:
            raise NvmlUnavailable(
                'nvidia-ml-py is not installed (pip install "keras_memopt[nvml]")'
            ) from None
        try:
            pynvml.nvmlInit()
        except Exception as error:  # pynvml raises its own NVMLError family
            raise NvmlUnavailable(f"NVML is not available: {error}") from None
        _nvml_module = pynvml
    return _nvml_module


def nvml_handle_of_tf_gpu(index: int, device_name: str | None = None):
    """The NVML handle of TensorFlow's physical GPU `index`, through `CUDA_VISIBLE_DEVICES`
    (indices or UUIDs; unset, the same index, which holds when CUDA orders GPUs by PCI bus, so
    NVML's name must match `device_name` where given). `NvmlUnavailable` where it cannot tell."""
    pynvml = nvml()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        entry = str(index)
    else:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if index >= len(entries):
            raise NvmlUnavailable(
                f"TensorFlow's GPU {index} is not in CUDA_VISIBLE_DEVICES={visible!r}"
            )
        entry = entries[index]
    try:
        if entry.isdigit():
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(entry))
        elif entry.startswith("GPU-"):
            handle = pynvml.nvmlDeviceGetHandleByUUID(entry)
        else:
            raise NvmlUnavailable(f"cannot find CUDA device {entry!r} in NVML")
        name = _text(pynvml.nvmlDeviceGetName(handle))
    except NvmlUnavailable:
        raise
    except Exception as error:  # NVMLError: no such device
        raise NvmlUnavailable(f"NVML has no device {entry!r}: {error}") from None
    if device_name is not None and name != device_name:
        raise NvmlUnavailable(
            f"TensorFlow's GPU {index} is a {device_name}, NVML's device {entry} a {name}: "
            "set CUDA_DEVICE_ORDER=PCI_BUS_ID so that CUDA numbers GPUs as NVML does"
        )
    return handle


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


# -- all figures as one dict -----------------------------------------------------------


class MemoryReader:
    """Reads current and peak memory figures, in MiB, as one flat dict.

    Sources: TensorFlow's allocator per device (in use and peak since the last reset; on a CPU see
    docs/memory.md), the host process's RSS, and NVML per physical GPU (every process, not only
    TensorFlow's allocator). A figure that is not available is left out of `read()`, and why is
    recorded once in `unavailable` (NVML's absence only where TensorFlow sees a GPU).

    Args:
        devices: list of str, the logical devices to read (`"GPU:0"`, `"CPU:0"`). Defaults to every
            logical GPU, or `["CPU:0"]` on a machine without GPUs.
        host: bool, whether to read the host process's RSS. Defaults to True.
        nvml: bool, whether to read NVML. Defaults to True.

    Example:

    ```python
    reader = MemoryReader()
    reader.reset_peaks()
    model.fit(x, y, epochs=1)
    print(reader.read())  # {"memory_gpu0_current_mib": ..., "memory_gpu0_peak_mib": ...}
    ```

    Raises:
        ValueError: if `devices` is not a list of device names.
    """

    def __init__(self, devices: list[str] | None = None, host: bool = True, nvml: bool = True):
        if devices is not None:
            if isinstance(devices, str) or not all(isinstance(d, str) for d in devices):
                raise ValueError(
                    "`devices` must be a list of device names such as ['GPU:0']. "
                    f"Received: devices={devices!r}"
                )
            devices = [canonical_device(d) for d in devices]
        self._devices = devices
        self.host = bool(host)
        self.nvml = bool(nvml)
        self.unavailable: dict[str, str] = {}
        self._allocator_ok: dict[str, bool] = {}
        self._process = psutil.Process() if self.host else None
        self._nvml_handles = None

    @property
    def devices(self) -> list[str]:
        """The logical devices whose allocator figures are read."""
        if self._devices is None:
            self._devices = _gpu_names() or ["CPU:0"]
        return list(self._devices)

    def _allocator(self, device):
        if self._allocator_ok.get(device) is False:
            return None
        info = allocator_memory(device)
        self._allocator_ok[device] = info is not None
        if info is None and on_jax():
            self.unavailable[f"allocator {device}"] = (
                f"JAX gives no memory figures for {device} (`memory_stats()` is None, as "
                "on its CPU client); the process's resident set size "
                "(`memory_host_rss_mib`) is recorded."
            )
        elif info is None:
            self.unavailable[f"allocator {device}"] = (
                f"TensorFlow's allocator gives no memory figures for {device}. "
                "On a CPU, set TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow starts "
                "(with oneDNN off, TensorFlow's default CPU allocator gives none)."
            )
        return info

    def _nvml(self):
        if self._nvml_handles is None:
            self._nvml_handles = []
            try:
                pynvml = nvml()
                count = pynvml.nvmlDeviceGetCount()
                self._nvml_handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            except NvmlUnavailable as error:
                reason = f"no NVML figures: {error}."
            else:
                reason = "NVML finds no GPUs."
            if not self._nvml_handles and _sees_a_gpu():
                self.unavailable["nvml"] = reason
        figures = {}
        for index, handle in enumerate(self._nvml_handles):
            info = nvml().nvmlDeviceGetMemoryInfo(handle)
            figures[f"memory_nvml{index}_used_mib"] = info.used / MIB
            figures[f"memory_nvml{index}_total_mib"] = info.total / MIB
        return figures

    def read(self) -> dict[str, float]:
        """The available figures, in MiB, keyed `memory_<source>_<figure>_mib`."""
        figures = {}
        for device in self.devices:
            info = self._allocator(device)
            if info is not None:
                tag = device_tag(device)
                figures[f"memory_{tag}_current_mib"] = info["current"] / MIB
                figures[f"memory_{tag}_peak_mib"] = info["peak"] / MIB
        if self.host:
            figures["memory_host_rss_mib"] = self._process.memory_info().rss / MIB
        if self.nvml:
            figures.update(self._nvml())
        return figures

    def reset_peaks(self):
        """Starts a new peak window on every device that has allocator figures."""
        for device in self.devices:
            if self._allocator(device) is not None:
                start_peak_window(device)


def _gpu_names() -> list[str]:
    """The logical GPUs (on JAX: JAX's, with TensorFlow's GPU runtime left unstarted)."""
    if on_jax():
        from keras_memopt._memory import jax_memory

        return [f"GPU:{index}" for index in range(len(jax_memory.gpus()))]
    import tensorflow as tf

    return [canonical_device(d.name) for d in tf.config.list_logical_devices("GPU")]


def _sees_a_gpu() -> bool:
    if on_jax():
        from keras_memopt._memory import jax_memory

        return bool(jax_memory.gpus())
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))
