"""`keras-memopt demo`: its arguments, and the demo itself in a fresh process."""

import math
import os
import re
import subprocess
import sys

import pytest

from keras_memopt import demo

pytestmark = pytest.mark.line_independent


class TestArguments:
    @pytest.mark.parametrize("value", ["0", "-3", "2.5", "many"])
    def test_non_positive_integer_is_refused(self, value, capsys):
        with pytest.raises(SystemExit) as exit_info:
            demo.main(["--micro-batch-size", value])
        assert exit_info.value.code == 2
        assert re.search(r"--micro-batch-size: must be a positive integer", capsys.readouterr().err)

    def test_micro_batch_larger_than_batch_is_refused(self, capsys):
        status = demo.main(["--batch-size", "64", "--micro-batch-size", "128"])
        assert status == 2
        error = capsys.readouterr().err
        assert "must not exceed --batch-size" in error
        assert "micro_batch_size=128, batch_size=64" in error

    def test_every_setting_reaches_each_run(self, monkeypatch, capsys):
        calls = []

        def fake_call(function, payload, env=None, timeout=None, name=None):
            calls.append((function, payload, env))
            status = "oom" if payload["run"] == "plain" else "trained"
            return dict(run=payload["run"], status=status, seconds=1.0, peak_mib=10.0,
                        loss=[0.5], error="ResourceExhaustedError: OOM when allocating")

        monkeypatch.setattr(demo._subprocess, "call", fake_call)
        argv = ["--batch-size", "96", "--micro-batch-size", "32", "--memory-limit-mb", "50",
                "--epochs", "3", "--steps-per-epoch", "4", "--depth", "5", "--width", "7",
                "--jit-compile"]
        assert demo.main(argv) == 0
        expected = dict(batch_size=96, micro_batch_size=32, memory_limit_mb=50, epochs=3,
                        steps_per_epoch=4, depth=5, width=7, jit_compile=True)
        assert [payload["run"] for _, payload, _ in calls] == [
            "plain", "accumulating", "plain-unlimited"
        ]
        for function, payload, env in calls:
            assert function == "keras_memopt.demo:train"
            assert {k: v for k, v in payload.items() if k != "run"} == expected
            assert env["TF_CPU_ALLOCATOR_USE_BFC"] == "true"
            assert env["TF_ENABLE_ONEDNN_OPTS"] == "0"
            assert env["CUDA_VISIBLE_DEVICES"] == "-1"  # it trains on the CPU
        assert [env["TF_CPU_BFC_MEM_LIMIT_IN_MB"] for _, _, env in calls] == [
            "50", "50", str(demo._UNLIMITED_MB)
        ]
        assert "Plain Keras ran out of memory at batch 96" in capsys.readouterr().out

    @pytest.mark.parametrize(
        "micro, words", [("64", "(1 micro-batch, "), ("16", "(4 micro-batches, ")]
    )
    def test_micro_batches_are_counted_in_words(self, monkeypatch, capsys, micro, words):
        def fake_call(function, payload, env=None, timeout=None, name=None):
            return dict(run=payload["run"], status="trained", seconds=1.0, peak_mib=10.0,
                        loss=[0.5])

        monkeypatch.setattr(demo._subprocess, "call", fake_call)
        demo.main(["--batch-size", "64", "--micro-batch-size", micro])
        assert words in capsys.readouterr().out

    def test_interrupt_stops_with_status_130(self, monkeypatch, capsys):
        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr(demo._subprocess, "call", interrupted)
        assert demo.main([]) == 130
        assert capsys.readouterr().err.strip() == (
            "keras-memopt demo: interrupted; the run in progress was stopped."
        )

    def test_a_crashed_run_is_reported_with_its_output(self, monkeypatch, capsys):
        def crashed(function, payload, env=None, timeout=None, name=None):
            output = demo._subprocess.Output(["-c"], -11, "", "Fatal Python error: Segfault")
            raise demo._subprocess.ChildFailed(f"{name} exited with status -11.", output)

        monkeypatch.setattr(demo._subprocess, "call", crashed)
        assert demo.main([]) == 1
        out = capsys.readouterr().out
        assert "FAILED: The accumulating run exited with status -11." in out
        assert "Fatal Python error: Segfault" in out

    def test_out_of_memory_line_is_not_cut_mid_word(self):
        error = (
            "ResourceExhaustedError: OOM when allocating tensor with shape[8192,512] and type "
            "float on /job:localhost/replica:0/task:0/device:CPU:0 by allocator cpu"
        )
        text = demo._describe(dict(status="oom", seconds=3.0, peak_mib=190.0, error=error), 200)
        assert error in text
        long = error + " and then" + " very long words" * 40
        line = demo._describe(dict(status="oom", seconds=3.0, peak_mib=190.0, error=long), 200)
        first = line.splitlines()[0]
        assert error in first and first.endswith(" ...")
        assert first.removesuffix(" ...").split()[-1] in ("very", "long", "words"), first


@pytest.mark.slow
def test_demo_plain_keras_runs_out_of_memory_and_accumulation_trains():
    env = dict(os.environ)
    # The demo sets the allocator variables for its own children; nothing
    # inherited from this test session may stand in for them.
    for name in ("TF_CPU_ALLOCATOR_USE_BFC", "TF_CPU_BFC_MEM_LIMIT_IN_MB", "TF_ENABLE_ONEDNN_OPTS"):
        env.pop(name, None)
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from keras_memopt.cli import main; sys.exit(main(['demo']))",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout
    assert result.returncode == 0, output + result.stderr[-3000:]
    limit = demo.DEFAULTS["memory_limit_mb"]

    plain = output.split("1. plain keras.Model")[1].split("2. AccumulatingModel")[0]
    assert "OUT OF MEMORY" in plain, output
    # The whole OOM line, up to the allocator's name.
    assert re.search(
        r"ResourceExhaustedError: OOM when allocating tensor with shape\[[\d,]+\] "
        r"and type \w+ on \S+ by allocator \S+\n", plain
    ), output

    summary = output.split("Summary")[1]
    needed = float(re.search(r"plain keras.Model needs\s+(\d+) MiB", summary).group(1))
    used, loss = re.search(
        r"AccumulatingModel used\s+(\d+) MiB, final loss (\S+)", summary
    ).groups()
    assert needed > limit, output
    assert float(used) < limit, output
    assert math.isfinite(float(loss)), output
    assert "Plain Keras ran out of memory at batch 8192" in output
