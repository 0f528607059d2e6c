import os
import types

import _fake_nvml
import pytest
import tensorflow as tf
from conftest import run_python, without_gpu

from keras_memopt import devices
from keras_memopt.devices import configure_devices

pytestmark = pytest.mark.line_independent


class TestValidation:
    @pytest.mark.parametrize(
        "kwargs, match",
        [
            ({"memory_growth": "yes"}, "Received: memory_growth='yes'"),
            ({"logical_devices": 0}, "Received: logical_devices=0"),
            ({"allocator": "malloc"}, "Received: allocator='malloc'"),
            ({"memory_limit": "4 bananas"}, "Received: memory_limit='4 bananas'"),
            ({"gpus": 0}, "Received: gpus=0"),
            ({"memory_growth": True, "memory_limit": "1GiB"}, "cannot be combined"),
        ],
    )
    def test_bad_arguments_change_nothing(self, kwargs, match, monkeypatch):
        monkeypatch.delenv("TF_GPU_ALLOCATOR", raising=False)
        with pytest.raises(ValueError, match=match):
            configure_devices(**{"allocator": "cuda_malloc_async", **kwargs})
        assert "TF_GPU_ALLOCATOR" not in os.environ

    def test_allocator_after_initialisation_is_a_clear_error(self, monkeypatch):
        monkeypatch.delenv("TF_GPU_ALLOCATOR", raising=False)
        tf.config.list_logical_devices()  # initialises TensorFlow
        with pytest.raises(RuntimeError, match="already initialised its devices"):
            configure_devices(allocator="cuda_malloc_async")
        assert "TF_GPU_ALLOCATOR" not in os.environ

    @without_gpu
    def test_no_gpu_warns_and_returns_nothing(self):
        with pytest.warns(UserWarning, match="no GPU"):
            assert configure_devices(memory_growth=True) == []


class _FakeConfig:
    """Records the calls `configure_devices` makes for fake GPUs (two by default)."""

    def __init__(self, monkeypatch, names=("NVIDIA A", "NVIDIA B")):
        self.gpus = [
            types.SimpleNamespace(name=f"/physical_device:GPU:{i}") for i in range(len(names))
        ]
        self.names = dict(zip((g.name for g in self.gpus), names, strict=True))
        self.calls = []
        monkeypatch.setattr(devices, "_tensorflow_initialised", lambda: False)
        monkeypatch.setattr(tf.config, "list_physical_devices",
                            lambda kind=None: self.gpus if kind == "GPU" else [])
        monkeypatch.setattr(tf.config.experimental, "get_device_details",
                            lambda gpu: {"device_name": self.names[gpu.name]})
        monkeypatch.setattr(tf.config.experimental, "set_memory_growth",
                            lambda gpu, value: self.calls.append(("growth", gpu.name, value)))
        monkeypatch.setattr(
            tf.config, "set_logical_device_configuration",
            lambda gpu, configs: self.calls.append(
                ("logical", gpu.name, [c.memory_limit for c in configs])),
        )


class TestGpuControlFlow:
    def test_memory_growth_on_chosen_gpus(self, monkeypatch):
        fake = _FakeConfig(monkeypatch)
        assert len(configure_devices(memory_growth=True, gpus=[1])) == 1
        assert fake.calls == [("growth", "/physical_device:GPU:1", True)]

    def test_one_limit_per_gpu(self, monkeypatch):
        fake = _FakeConfig(monkeypatch)
        configure_devices(memory_limit=["4GiB", "2048MiB"])
        assert fake.calls == [("logical", "/physical_device:GPU:0", [4096]),
                              ("logical", "/physical_device:GPU:1", [2048])]

    def test_split_one_gpu(self, monkeypatch):
        fake = _FakeConfig(monkeypatch)
        configure_devices(memory_limit="3GiB", logical_devices=2, gpus=[0])
        assert fake.calls == [("logical", "/physical_device:GPU:0", [3072, 3072])]

    def test_limit_list_length_must_match(self, monkeypatch):
        fake = _FakeConfig(monkeypatch)
        with pytest.raises(ValueError, match="one limit per chosen GPU"):
            configure_devices(memory_limit=["1GiB"])
        assert fake.calls == []

    def test_missing_gpu_index(self, monkeypatch):
        _FakeConfig(monkeypatch)
        with pytest.raises(ValueError, match="there is no GPU 5"):
            configure_devices(memory_growth=True, gpus=[5])

    def test_tensorflow_refusal_becomes_a_clear_error(self, monkeypatch):
        _FakeConfig(monkeypatch)

        def refuse(gpu, value):
            raise RuntimeError("Physical devices cannot be modified after being initialized")

        monkeypatch.setattr(tf.config.experimental, "set_memory_growth", refuse)
        with pytest.raises(RuntimeError, match="Call `keras_memopt.configure_devices"):
            configure_devices(memory_growth=True)


@pytest.fixture
def fake_nvml(monkeypatch):
    """Four NVML GPUs of 8, 16, 24 and 32 GiB, named NVIDIA A to D."""
    return _fake_nvml.install(monkeypatch)


class TestSplitReadsTheRightGpu:
    """A split without a limit shares the chosen GPU's own total memory (from NVML)."""

    def test_the_chosen_gpus_total_not_the_first_gpus(self, monkeypatch, fake_nvml):
        fake = _FakeConfig(monkeypatch)
        configure_devices(logical_devices=2, gpus=[1])
        # GPU 1 has 16 GiB: two logical devices of 8 GiB (GPU 0's 8 GiB gave 4 GiB each).
        assert fake.calls == [("logical", "/physical_device:GPU:1", [8192, 8192])]

    def test_each_gpu_its_own_total(self, monkeypatch, fake_nvml):
        fake = _FakeConfig(monkeypatch)
        configure_devices(logical_devices=4)
        assert fake.calls == [("logical", "/physical_device:GPU:0", [2048] * 4),
                              ("logical", "/physical_device:GPU:1", [4096] * 4)]
        assert fake_nvml.initialised == 1  # once per process

    def test_cuda_visible_devices_maps_tensorflows_numbers_to_nvmls(
        self, monkeypatch, fake_nvml
    ):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
        fake = _FakeConfig(monkeypatch, names=("NVIDIA D", "NVIDIA B"))
        configure_devices(logical_devices=2)
        # TensorFlow's GPU 0 is NVML's 3 (32 GiB), its GPU 1 is NVML's 1 (16 GiB).
        assert fake.calls == [("logical", "/physical_device:GPU:0", [16384] * 2),
                              ("logical", "/physical_device:GPU:1", [8192] * 2)]

    def test_cuda_visible_devices_by_uuid(self, monkeypatch, fake_nvml):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-2aaa")
        fake = _FakeConfig(monkeypatch, names=("NVIDIA C",))
        configure_devices(logical_devices=3)
        assert fake.calls == [("logical", "/physical_device:GPU:0", [8192] * 3)]

    def test_a_gpu_nvml_cannot_tell_asks_for_a_limit_and_changes_nothing(
        self, monkeypatch, fake_nvml
    ):
        monkeypatch.delenv("TF_GPU_ALLOCATOR", raising=False)
        # CUDA's default order (fastest first) put NVML's GPU 1 first.
        fake = _FakeConfig(monkeypatch, names=("NVIDIA B", "NVIDIA A"))
        with pytest.raises(ValueError, match=r"CUDA_DEVICE_ORDER=PCI_BUS_ID.*"
                           r"Pass `memory_limit`. Received: gpu='/physical_device:GPU:0'"):
            configure_devices(logical_devices=2, allocator="cuda_malloc_async")
        assert fake.calls == []
        assert "TF_GPU_ALLOCATOR" not in os.environ

    def test_without_nvml_a_split_needs_a_limit(self, monkeypatch):
        _fake_nvml.uninstall(monkeypatch)
        fake = _FakeConfig(monkeypatch)
        with pytest.raises(ValueError, match=r"nvidia-ml-py is not installed.*memory_limit=None"):
            configure_devices(logical_devices=2, gpus=[1])
        assert fake.calls == []


@without_gpu
@pytest.mark.slow
def test_fresh_process_without_gpus_configures_warns_and_trains():
    result = run_python(
        """
        import os, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from keras_memopt.devices import configure_devices
            configured = configure_devices(memory_growth=True, allocator="cuda_malloc_async")
        import numpy as np
        from keras_memopt._keras import keras
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)
        print("configured", configured)
        print("allocator", os.environ["TF_GPU_ALLOCATOR"])
        print("warned", any("no GPU" in str(w.message) for w in caught))
        """
    )
    assert "configured []" in result.stdout
    assert "allocator cuda_malloc_async" in result.stdout
    assert "warned True" in result.stdout
