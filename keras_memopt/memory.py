"""Reading memory: TensorFlow's allocator per device, the host process, NVML."""

from __future__ import annotations

import re

import tensorflow as tf

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")

MIB = 2**20


def parse_bytes(value, name="size"):
    """A memory size in bytes from an int (bytes) or a string with a unit.

    Units: B, KB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB, TiB (powers
    of 1024), case-insensitive; a bare number is bytes.

    Example: `parse_bytes("8GiB") == 8 * 2**30`.
    """
    if isinstance(value, bool):
        value = str(value)
    if isinstance(value, (int, float)) and value > 0:
        return int(value)
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None or (match.group(2) or "b").lower() not in _UNITS:
        raise ValueError(
            f"`{name}` must be a positive number of bytes or a string such as "
            f"'512MiB' or '8GB' (units: {', '.join(_unit_names())}). "
            f"Received: {name}={value!r}"
        )
    size = float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()]
    if size <= 0:
        raise ValueError(f"`{name}` must be positive. Received: {name}={value!r}")
    return int(size)


def _unit_names():
    return ["B", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB"]


def format_bytes(size):
    """`size` bytes as a short human string in binary units ("1.50 GiB")."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{int(size)} B"


def _device_tag(device):
    """`"GPU:0"` → `"gpu0"`: a name safe in CSV columns and summary names."""
    spec = tf.DeviceSpec.from_string(device if "/" in device else f"/device:{device}")
    return f"{(spec.device_type or 'cpu').lower()}{spec.device_index or 0}"


def _canonical(device):
    spec = tf.DeviceSpec.from_string(device if "/" in device else f"/device:{device}")
    return f"{spec.device_type or 'CPU'}:{spec.device_index or 0}"


class MemoryReader:
    """Reads current and peak memory figures, in MiB, as one flat dict.

    Three sources, each optional:

    - TensorFlow's allocator, per device: bytes in use now and the peak since
      the last reset (`tf.config.experimental.get_memory_info`). GPUs always
      have these figures; a CPU has them only when TensorFlow runs its BFC
      allocator there (`TF_CPU_ALLOCATOR_USE_BFC=true`).
    - The host process's resident set size (psutil).
    - NVML, where `nvidia-ml-py` is installed and finds GPUs: memory used and
      total per physical GPU, which counts every process and the CUDA
      context, not only TensorFlow's allocator.

    A figure that is not available is left out of `read()`; why is recorded
    once in `unavailable`.

    Args:
        devices: list of str, the logical devices to read (`"GPU:0"`,
            `"CPU:0"`). Defaults to every logical GPU, or `["CPU:0"]` on a
            machine without GPUs.
        host: bool, whether to read the host process's RSS. Defaults to True.
        nvml: bool, whether to read NVML. Defaults to True.

    Example:

    ```python
    reader = MemoryReader()
    reader.reset_peaks()
    model.fit(x, y, epochs=1)
    print(reader.read())  # {"memory_gpu0_current_mib": ..., "memory_gpu0_peak_mib": ...}
    ```
    """

    def __init__(self, devices: list[str] | None = None, host: bool = True, nvml: bool = True):
        if devices is not None:
            if isinstance(devices, str) or not all(isinstance(d, str) for d in devices):
                raise ValueError(
                    "`devices` must be a list of device names such as ['GPU:0']. "
                    f"Received: devices={devices!r}"
                )
            devices = [_canonical(d) for d in devices]
        self._devices = devices
        self.host = bool(host)
        self.nvml = bool(nvml)
        self.unavailable: dict[str, str] = {}
        self._allocator_ok: dict[str, bool] = {}
        self._process = None
        self._nvml_handles = None

    @property
    def devices(self) -> list[str]:
        """The logical devices whose allocator figures are read."""
        if self._devices is None:
            gpus = tf.config.list_logical_devices("GPU")
            self._devices = [_canonical(d.name) for d in gpus] or ["CPU:0"]
        return list(self._devices)

    def _allocator(self, device):
        if self._allocator_ok.get(device) is False:
            return None
        try:
            info = tf.config.experimental.get_memory_info(device)
        except (ValueError, RuntimeError, tf.errors.OpError) as error:
            self._allocator_ok[device] = False
            self.unavailable[f"allocator {device}"] = (
                f"TensorFlow's allocator gives no memory figures for {device} ({error}). "
                "On a CPU, set TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow starts."
            )
            return None
        self._allocator_ok[device] = True
        return info

    def _rss(self):
        if self._process is None:
            try:
                import psutil

                self._process = psutil.Process()
            except ImportError:
                self._process = False
                self.unavailable["host"] = "psutil is not installed: no host RSS figure."
        return None if self._process is False else self._process.memory_info().rss

    def _nvml(self):
        if self._nvml_handles is None:
            self._nvml_handles = []
            try:
                import pynvml

                pynvml.nvmlInit()
                count = pynvml.nvmlDeviceGetCount()
                self._nvml_handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
                self._pynvml = pynvml
            except ImportError:
                self.unavailable["nvml"] = (
                    "nvidia-ml-py is not installed: no NVML figures "
                    "(pip install keras_memopt[nvml])."
                )
            except Exception as error:  # pynvml raises its own NVMLError family
                self.unavailable["nvml"] = f"NVML is not available: {error}."
            if not self._nvml_handles and "nvml" not in self.unavailable:
                self.unavailable["nvml"] = "NVML finds no GPUs."
        figures = {}
        for index, handle in enumerate(self._nvml_handles):
            info = self._pynvml.nvmlDeviceGetMemoryInfo(handle)
            figures[f"memory_nvml{index}_used_mib"] = info.used / MIB
            figures[f"memory_nvml{index}_total_mib"] = info.total / MIB
        return figures

    def read(self) -> dict[str, float]:
        """The available figures, in MiB, keyed `memory_<source>_<figure>_mib`."""
        figures = {}
        for device in self.devices:
            info = self._allocator(device)
            if info is not None:
                tag = _device_tag(device)
                figures[f"memory_{tag}_current_mib"] = info["current"] / MIB
                figures[f"memory_{tag}_peak_mib"] = info["peak"] / MIB
        if self.host:
            rss = self._rss()
            if rss is not None:
                figures["memory_host_rss_mib"] = rss / MIB
        if self.nvml:
            figures.update(self._nvml())
        return figures

    def reset_peaks(self):
        """Starts a new peak window on every device that has allocator figures."""
        for device in self.devices:
            if self._allocator(device) is not None:
                tf.config.experimental.reset_memory_stats(device)
