"""benchmarks/gpu_check.py, the one check of the GPU claims, works before a GPU comes.

Its small mode (tiny models, a few steps) runs here in a fresh process on TensorFlow's BFC CPU
allocator: the memory part's rows are all there with real figures, accumulation lowers the peak,
and every part that needs a GPU says that it was skipped. The report's rows are checked on made-up
results of the GPU's parts, and the time budget without starting anything.
"""

import json
import pathlib

import pytest
from _helpers import load_benchmark
from conftest import HAS_GPU, KERAS_LINE, LEGACY

from keras_memopt import _subprocess

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPT = BENCHMARKS / "gpu_check.py"
CONFIGS = {"accumulating_8", "accumulating_4_remat", "accumulating_4", "plain_4",
           "accumulating_2", "plain_1"}


@pytest.fixture(scope="module")
def small_check(tmp_path_factory):
    """(printed output, JSON) of `gpu_check.py --small` in a fresh process."""
    path = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    output = _subprocess.run([str(SCRIPT), "--small", "--json", str(path)], env=KERAS_LINE,
                             timeout=300, name="gpu_check.py --small")
    assert output.returncode == 0, output.tail()
    return output.stdout, json.loads(path.read_text())


def _memory(report, model, dtype):
    return {row["config"]: row for row in report["rows"]
            if row["part"] == "memory" and row["model"] == model and row["dtype"] == dtype}


@pytest.mark.slow
@pytest.mark.skipif(LEGACY, reason="docs/gpu.md's command runs on Keras 3: that pass runs it")
class TestSmallCheck:
    def test_every_configuration_of_the_mlp_has_figures(self, small_check):
        _, report = small_check
        rows = _memory(report, "mlp", "float32")
        assert set(rows) == CONFIGS
        for row in rows.values():
            assert row["status"] == "ok", row
            assert row["peak_mib"] > 0 and row["step_s"] > 0, row
        assert rows["plain_1"]["peak_vs_plain"] == 1.0
        assert rows["plain_1"]["step_vs_plain"] == 1.0
        assert rows["accumulating_4"]["samples_per_step"] == rows["plain_1"]["batch"]
        assert rows["plain_4"]["samples_per_step"] == rows["plain_1"]["batch"] // 4

    @pytest.mark.parametrize(
        # The CNN is left out: at the small scale, the CPU convolution's own 64 MiB scratch
        # buffer is most of any configuration's peak.
        "model, dtype", [("mlp", "float32"), ("mlp", "mixed_float16"), ("transformer", "float32")]
    )
    @pytest.mark.skipif(HAS_GPU, reason="reads the CPU's BFC allocator as the device")
    def test_accumulation_at_a_quarter_peaks_below_the_whole_batch(self, small_check, model,
                                                                     dtype):
        rows = _memory(small_check[1], model, dtype)
        assert rows["accumulating_4"]["peak_mib"] < 0.8 * rows["plain_1"]["peak_mib"], rows

    def test_every_model_ran_in_its_dtype(self, small_check):
        _, report = small_check
        assert report["scale"] == "small"
        rows = [r for r in report["rows"] if r["part"] == "memory"]
        assert {(r["model"], r["dtype"]) for r in rows} == {
            ("mlp", "float32"), ("mlp", "mixed_float16"), ("cnn", "float32"),
            ("transformer", "float32"),
        }
        assert all(r["status"] == "ok" for r in rows)
        # The model was built under the policy its row names (clear_session resets it).
        assert all(r["policy"] == r["dtype"] for r in rows), [
            (r["model"], r["config"], r["dtype"], r["policy"]) for r in rows]

    @pytest.mark.skipif(HAS_GPU, reason="expects a machine without GPUs")
    def test_the_gpu_parts_say_they_were_skipped(self, small_check):
        printed, report = small_check
        assert report["facts"]["gpus"] == []
        parts = {(r["part"], r["config"]): r for r in report["rows"] if r["part"] != "memory"}
        assert set(parts) == {("oom_backoff", "bfc"), ("oom_backoff", "cuda_malloc_async"),
                              ("logical_devices", "2 x GPU:0"),
                              ("memory_logger", "MemoryLogger()")}
        lines = printed.splitlines()
        for (part, config), row in parts.items():
            assert row["status"].startswith("skipped: "), row
            assert any(line.startswith(f"| {part} |") and f"| {config} |" in line
                       and row["status"] in line for line in lines), (part, config)
        # MemoryLogger itself ran: only its NVML columns need a GPU.
        columns = parts["memory_logger", "MemoryLogger()"]["columns"]
        assert "memory_cpu0_peak_mib" in columns and not any("nvml" in k for k in columns)
        assert "no GPU" in printed.splitlines()[0]


# -- the report, on made-up results (no TensorFlow) -------------------------------------


@pytest.fixture(scope="module")
def report_module():
    return load_benchmark("_gpu_report")


def _oom_result(backoffs, steps=(12.5, 0.1, 0.12)):
    return dict(status="ok", allocator="bfc", peak_mib=3000.0, peak_half_mib=1800.0,
                ballast_mib=9000.0, nvml_used_mib=14000.0, tf_current_mib=2000.0,
                backoffs=backoffs, final_micro_batch_size=4096, steps=list(steps), epoch_s=13.0,
                failing_allocation=dict(seconds=10.01, error="ResourceExhaustedError",
                                        message="OOM when allocating"))


class TestReport:
    def test_a_backoff_is_described_with_its_times(self, report_module):
        event = dict(failed_micro_batch_size=8192, micro_batch_size=4096,
                     failed_step_seconds=10.4, recovery_seconds=0.021)
        row = report_module.oom_row(_oom_result([event]), "bfc")
        assert row["step_s"] == 12.5
        assert "backed off 8192 → 4096" in row["note"]
        assert "failed attempt 10.40 s" in row["note"] and "rollback 0.021 s" in row["note"]
        assert "a normal one 0.110 s" in row["note"]
        assert "failed after 10.01 s (ResourceExhaustedError)" in row["note"]

    def test_no_out_of_memory_error_is_said(self, report_module):
        row = report_module.oom_row(_oom_result([]), "cuda_malloc_async")
        assert row["note"].startswith("no out-of-memory error")
        assert "step_s" not in row

    def test_nvml_columns_missing_on_a_gpu_is_a_failure(self, report_module):
        row = report_module.logger_row({"memory_gpu0_peak_mib": 10.0}, gpu=True)
        assert row["status"] == "failed: no NVML columns"
        row = report_module.logger_row(
            {"memory_gpu0_peak_mib": 10.0, "memory_nvml0_used_mib": 900.0}, gpu=True)
        assert row["status"] == "ok" and "memory_nvml0_used_mib 900" in row["note"]

    def test_a_failed_child_is_named_by_its_exception(self, report_module):
        error = _subprocess.ChildFailed("worker {...} exited with status 1.", _subprocess.Output(
            [], 1, "", "Traceback (most recent call last):\n  File ...\n"
            "tensorflow.python.framework.errors_impl.InternalError: CUDA error\n"))
        assert report_module.why_failed(error) == (
            "tensorflow.python.framework.errors_impl.InternalError: CUDA error")

    def test_the_table_has_a_line_per_row(self, report_module):
        rows = [dict(part="memory", model="mlp", dtype="float32", config="plain_1",
                     label="plain keras.Model, batch 8", status="ok", peak_mib=0.25,
                     peak_vs_plain=1.0, step_s=0.002, step_vs_plain=1.0),
                dict(part="logical_devices", model="mlp", dtype="float32", config="2 x GPU:0",
                     status="skipped: no GPU visible to TensorFlow")]
        found = dict(gpus=["NVIDIA H200 (compute capability (9, 0))"], tensorflow="2.21.0",
                     keras="3.15.1")
        lines = report_module.table(found, "gpu", rows, 431.0).splitlines()
        assert "NVIDIA H200" in lines[0] and "431 s" in lines[0]
        assert len(lines) == 4 + len(rows)
        assert "| 0.25 | 1.00x |" in lines[4]
        assert lines[5].endswith("| skipped: no GPU visible to TensorFlow |")


def test_no_part_starts_once_the_budget_is_spent():
    gpu_check = load_benchmark("gpu_check")
    clock = gpu_check.Clock(budget=0)
    result = gpu_check.run_part("memory", {}, 45, clock, "a part")
    assert result["status"].startswith("skipped: the time budget was spent")
    assert "seconds" not in result  # nothing was started
