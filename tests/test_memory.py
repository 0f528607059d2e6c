import _fake_nvml
import numpy as np
import pytest
import tensorflow as tf
from conftest import without_gpu

from keras_memopt import memory
from keras_memopt.memory import MemoryReader, allocator_memory, format_bytes, parse_bytes

pytestmark = pytest.mark.line_independent


class TestParseBytes:
    @pytest.mark.parametrize(
        "text, expected",
        [("8GiB", 8 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000),
         ("100kb", 100_000), ("64", 64), (" 2 mib ", 2 * 2**20), (4096, 4096)],
    )
    def test_units(self, text, expected):
        assert parse_bytes(text) == expected

    @pytest.mark.parametrize(
        "bad", ["8XB", "lots", "", "-1GB", 0, -5, None, True, 0.5, "0.5", float("nan"), 1e400]
    )
    def test_unknown_unit_or_bad_value_is_refused(self, bad):
        with pytest.raises(ValueError, match="Received: budget="):
            parse_bytes(bad, "budget")

    def test_format_bytes(self):
        assert format_bytes(3 * 2**30) == "3.00 GiB"
        assert format_bytes(1536 * 2**10) == "1.50 MiB"
        assert format_bytes(12) == "12 B"


class TestMemoryReader:
    def test_reads_allocator_and_host_figures(self):
        reader = MemoryReader(["CPU:0"], nvml=False)
        figures = reader.read()
        assert {"memory_cpu0_current_mib", "memory_cpu0_peak_mib", "memory_host_rss_mib"} <= set(
            figures
        )
        assert figures["memory_cpu0_peak_mib"] >= figures["memory_cpu0_current_mib"]
        assert figures["memory_host_rss_mib"] > 10

    def test_peak_window_sees_a_freed_allocation(self):
        reader = MemoryReader(["CPU:0"], host=False, nvml=False)
        reader.reset_peaks()
        before = reader.read()["memory_cpu0_current_mib"]
        with tf.device("CPU:0"):
            big = tf.ones((4 * 2**20 // 4,), tf.float32) + 1.0  # 4 MiB
            del big
        figures = reader.read()
        np.testing.assert_allclose(figures["memory_cpu0_current_mib"], before, atol=0.5)
        assert figures["memory_cpu0_peak_mib"] - before >= 3.9

    def test_reset_starts_a_new_window(self):
        reader = MemoryReader(["CPU:0"], host=False, nvml=False)
        with tf.device("CPU:0"):
            big = tf.ones((8 * 2**20 // 4,), tf.float32) * 2.0
            del big
        reader.reset_peaks()
        figures = reader.read()
        np.testing.assert_allclose(
            figures["memory_cpu0_peak_mib"], figures["memory_cpu0_current_mib"], atol=0.5
        )

    @without_gpu
    def test_device_without_figures_is_left_out_with_a_reason(self):
        reader = MemoryReader(["GPU:0"], host=False, nvml=False)
        assert reader.read() == {}
        assert "allocator GPU:0" in reader.unavailable
        reader.reset_peaks()  # does nothing, raises nothing

    def test_nvml_figures_per_gpu(self, monkeypatch):
        _fake_nvml.install(monkeypatch, count=2)
        figures = MemoryReader(["CPU:0"], host=False, nvml=True).read()
        nvml = {name: value for name, value in figures.items() if "nvml" in name}
        # The fakes use a quarter of 8 and 16 GiB.
        assert nvml == {"memory_nvml0_used_mib": 2048.0, "memory_nvml0_total_mib": 8192.0,
                        "memory_nvml1_used_mib": 4096.0, "memory_nvml1_total_mib": 16384.0}

    def test_nvml_absent_where_tensorflow_sees_a_gpu_is_recorded_not_raised(self, monkeypatch):
        _fake_nvml.uninstall(monkeypatch)
        gpu = tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")
        monkeypatch.setattr(
            tf.config, "list_physical_devices", lambda kind=None: [gpu] if kind == "GPU" else []
        )
        reader = MemoryReader(["CPU:0"], host=False, nvml=True)
        assert not any("nvml" in name for name in reader.read())
        assert reader.unavailable["nvml"] == (
            'no NVML figures: nvidia-ml-py is not installed (pip install "keras_memopt[nvml]").'
        )

    @without_gpu
    @pytest.mark.parametrize("installed", [True, False])
    def test_nvml_absent_without_a_gpu_is_not_worth_saying(self, monkeypatch, installed):
        if installed:
            _fake_nvml.install(monkeypatch, count=0)  # NVML answers, finds no GPUs
        else:
            _fake_nvml.uninstall(monkeypatch)
        reader = MemoryReader(["CPU:0"], host=False, nvml=True)
        assert set(reader.read()) == {"memory_cpu0_current_mib", "memory_cpu0_peak_mib"}
        assert reader.unavailable == {}

    def test_second_logical_cpu(self):
        figures = MemoryReader(["CPU:1"], host=False, nvml=False).read()
        assert "memory_cpu1_peak_mib" in figures

    def test_devices_must_be_a_list(self):
        with pytest.raises(ValueError, match="Received: devices='CPU:0'"):
            MemoryReader("CPU:0")


class TestAllocatorMemory:
    def test_cpu_figures_under_the_bfc_allocator(self):
        with tf.device("CPU:0"):
            kept = tf.ones((2**20 // 4,), tf.float32) * 3.0  # 1 MiB in use while read
            info = allocator_memory("CPU:0")
        assert info["device"] == "CPU:0"
        assert info["current"] >= 2**20 and info["peak"] >= info["current"]
        del kept

    @without_gpu
    def test_default_device_is_the_cpu_without_gpus(self):
        assert allocator_memory()["device"] == "CPU:0"

    def test_device_without_figures_gives_none(self):
        assert allocator_memory("GPU:7") is None


class TestNvml:
    def test_initialised_once(self, monkeypatch):
        fake = _fake_nvml.install(monkeypatch, count=1)
        assert memory.nvml() is fake and memory.nvml() is fake
        assert fake.initialised == 1

    def test_missing_package_says_what_to_install(self, monkeypatch):
        _fake_nvml.uninstall(monkeypatch)
        with pytest.raises(memory.NvmlUnavailable, match=r'pip install "keras_memopt\[nvml\]"'):
            memory.nvml()

    def test_tensorflows_gpu_outside_cuda_visible_devices(self, monkeypatch):
        _fake_nvml.install(monkeypatch, count=2)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
        assert memory.nvml_handle_of_tf_gpu(0) == 1
        with pytest.raises(memory.NvmlUnavailable, match="GPU 1 is not in CUDA_VISIBLE_DEVICES"):
            memory.nvml_handle_of_tf_gpu(1)
