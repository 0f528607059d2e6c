"""Reading memory: byte sizes, TensorFlow's allocator per device, the host process, NVML.

The one home in keras_memopt for each of these needs:

- `parse_bytes` / `format_bytes`: sizes such as `"8GiB"` to bytes and back;
- `bytes_if_known` / `bytes_per_sample`: the bytes of tensors from their
  shapes and dtypes;
- `allocator_memory`: TensorFlow's allocator figures for one device;
- `nvml` / `nvml_handle_of_tf_gpu`: NVML (nvidia-ml-py), initialised once
  per process, and the NVML device behind one of TensorFlow's GPUs;
- `MemoryReader`: all of the above, and the host's RSS, as one flat dict.

Importing this module does not import TensorFlow (the functions that read it
do), so that the command line can check sizes before TensorFlow loads.
"""

from __future__ import annotations

import os
import re

import psutil

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

    Raises:
        ValueError: naming `name`, for anything but a positive size.
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


# -- TensorFlow's allocator -------------------------------------------------------------


def bytes_if_known(shape, dtype, unknown_dim: int | None = None) -> int | None:
    """Bytes of a tensor of `shape` and `dtype`.

    Args:
        shape: the dimensions; None for an unknown one.
        dtype: the element type.
        unknown_dim: int, the size to count an unknown dimension as.
            Defaults to None: an unknown dimension makes the result None,
            since there is no honest number (the planner refuses such
            shapes; a caller that only compares sizes may count them as 1).
    """
    size = 1
    for dim in shape:
        if dim is None:
            if unknown_dim is None:
                return None
            dim = unknown_dim
        size *= int(dim)
    import tensorflow as tf

    return size * tf.as_dtype(dtype).size


def bytes_per_sample(tensors, unknown_dim: int | None = None) -> int | None:
    """Bytes of one sample of a (nest of) symbolic tensors, batch axis dropped.

    None if a dimension but the batch axis is unknown, unless `unknown_dim`
    says what to count it as (see `bytes_if_known`).
    """
    import tensorflow as tf

    total = 0
    for tensor in tf.nest.flatten(tensors):
        size = bytes_if_known(tuple(tensor.shape)[1:], tensor.dtype, unknown_dim)
        if size is None:
            return None
        total += size
    return total


def _device_spec(device):
    import tensorflow as tf

    return tf.DeviceSpec.from_string(device if "/" in device else f"/device:{device}")


def _device_tag(device):
    """`"GPU:0"` → `"gpu0"`: a name safe in CSV columns and summary names."""
    spec = _device_spec(device)
    return f"{(spec.device_type or 'cpu').lower()}{spec.device_index or 0}"


def _canonical(device):
    spec = _device_spec(device)
    return f"{spec.device_type or 'CPU'}:{spec.device_index or 0}"


def default_device() -> str:
    """The first logical GPU, else `"CPU:0"`."""
    import tensorflow as tf

    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def allocator_memory(device: str | None = None) -> dict | None:
    """Current and peak bytes of TensorFlow's allocator on `device`, or None.

    A GPU always has these figures; a CPU has them only under TensorFlow's
    BFC allocator (`TF_CPU_ALLOCATOR_USE_BFC=true` before TensorFlow starts).

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
    peak = max(info["peak"], _PEAKS_RESET_AWAY.get(_canonical(device), 0))
    return dict(device=device, current=info["current"], peak=peak)


# Peaks the step runner reset to measure one step (`reset_step_peak`), per
# device: `allocator_memory` still reports them until a reader starts a new
# window (`MemoryReader.reset_peaks`), so that a user's peak is not lost.
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
    key = _canonical(device)
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


def device_total(device: str) -> int | None:
    """The bytes TensorFlow's allocator may hand out on `device`, where known.

    A logical GPU's configured memory limit, else its total (NVML); the CPU
    BFC allocator's limit (`TF_CPU_BFC_MEM_LIMIT_IN_MB`). None otherwise.
    """
    import tensorflow as tf

    spec = _device_spec(device)
    kind, index = (spec.device_type or "CPU").upper(), spec.device_index or 0
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
    """The `pynvml` module of nvidia-ml-py, NVML initialised (once per process).

    Raises:
        NvmlUnavailable: if nvidia-ml-py is not installed or NVML does not
            start (no NVIDIA driver).
    """
    global _nvml_module
    if _nvml_module is None:
        try:
            import pynvml
        except ImportError:
            raise NvmlUnavailable(
                "nvidia-ml-py is not installed (pip install keras_memopt[nvml])"
            ) from None
        try:
            pynvml.nvmlInit()
        except Exception as error:  # pynvml raises its own NVMLError family
            raise NvmlUnavailable(f"NVML is not available: {error}") from None
        _nvml_module = pynvml
    return _nvml_module


def nvml_handle_of_tf_gpu(index: int, device_name: str | None = None):
    """The NVML handle of TensorFlow's physical GPU number `index`.

    TensorFlow numbers the GPUs CUDA shows it: `CUDA_VISIBLE_DEVICES`
    (indices or `GPU-` UUIDs) picks and orders them, while NVML numbers every
    GPU of the machine. With `CUDA_VISIBLE_DEVICES` unset, TensorFlow's GPU
    `index` is taken to be NVML's; that holds when CUDA orders GPUs by PCI bus
    (`CUDA_DEVICE_ORDER=PCI_BUS_ID`, or GPUs of one model), so where
    `device_name` (TensorFlow's name for the GPU) is given, NVML's device must
    bear the same name.

    Raises:
        NvmlUnavailable: if NVML is unavailable or the GPU cannot be told.
    """
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

    Three sources:

    - TensorFlow's allocator, per device: bytes in use now and the peak since
      the last reset (`tf.config.experimental.get_memory_info`). GPUs always
      have these figures; a CPU has them only when TensorFlow runs its BFC
      allocator there (`TF_CPU_ALLOCATOR_USE_BFC=true`).
    - The host process's resident set size (psutil).
    - NVML, where `nvidia-ml-py` is installed and finds GPUs: memory used and
      total per physical GPU (numbered as NVML numbers them), which counts
      every process and the CUDA context, not only TensorFlow's allocator.

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
            devices = [_canonical(d) for d in devices]
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
            import tensorflow as tf

            gpus = tf.config.list_logical_devices("GPU")
            self._devices = [_canonical(d.name) for d in gpus] or ["CPU:0"]
        return list(self._devices)

    def _allocator(self, device):
        if self._allocator_ok.get(device) is False:
            return None
        info = allocator_memory(device)
        self._allocator_ok[device] = info is not None
        if info is None:
            self.unavailable[f"allocator {device}"] = (
                f"TensorFlow's allocator gives no memory figures for {device}. "
                "On a CPU, set TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow starts."
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
                self.unavailable["nvml"] = f"no NVML figures: {error}."
            if not self._nvml_handles and "nvml" not in self.unavailable:
                self.unavailable["nvml"] = "NVML finds no GPUs."
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
                tag = _device_tag(device)
                figures[f"memory_{tag}_current_mib"] = info["current"] / MIB
                figures[f"memory_{tag}_peak_mib"] = info["peak"] / MIB
        if self.host:
            figures["memory_host_rss_mib"] = self._process.memory_info().rss / MIB
        if self.nvml:
            figures.update(self._nvml())
        return figures

    def reset_peaks(self):
        """Starts a new peak window on every device that has allocator figures."""
        import tensorflow as tf

        for device in self.devices:
            if self._allocator(device) is not None:
                _PEAKS_RESET_AWAY.pop(_canonical(device), None)
                tf.config.experimental.reset_memory_stats(device)
