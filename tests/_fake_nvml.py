"""A stand-in for nvidia-ml-py's `pynvml`, for tests on machines without NVIDIA GPUs."""

import sys
import types

from keras_memopt import memory

GIB = 2**30


class FakeNvml(types.ModuleType):
    """GPUs with a UUID, a name and a total memory, in NVML's (PCI bus) order."""

    class NVMLError(Exception):
        pass

    def __init__(self, gpus):
        super().__init__("pynvml")
        self.gpus = gpus  # [(uuid, name, total bytes)]
        self.initialised = 0

    def nvmlInit(self):
        self.initialised += 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        if not 0 <= index < len(self.gpus):
            raise self.NVMLError("Invalid Argument")
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid):
        for index, gpu in enumerate(self.gpus):
            if gpu[0] == uuid:
                return index
        raise self.NVMLError("Not Found")

    def nvmlDeviceGetName(self, handle):
        return self.gpus[handle][1]

    def nvmlDeviceGetMemoryInfo(self, handle):
        total = self.gpus[handle][2]
        return types.SimpleNamespace(total=total, used=total // 4, free=total - total // 4)


def install(monkeypatch, count=4):
    """Puts `count` fake GPUs of 8, 16, 24, ... GiB ("NVIDIA A", "B", ...) in place of
    pynvml, with NVML not yet initialised and `CUDA_VISIBLE_DEVICES` unset."""
    module = FakeNvml(
        [(f"GPU-{i}aaa", f"NVIDIA {chr(ord('A') + i)}", 8 * (i + 1) * GIB) for i in range(count)]
    )
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.setattr(memory, "_nvml_module", None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return module


def uninstall(monkeypatch):
    """Makes `import pynvml` fail, as without nvidia-ml-py."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(memory, "_nvml_module", None)
