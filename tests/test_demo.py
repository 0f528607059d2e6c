"""`keras-memopt demo`: its arguments, and the demo itself in a fresh process."""

import math
import os
import re
import subprocess
import sys

import pytest

from keras_memopt import demo


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

    def test_child_command_passes_every_setting_on(self):
        args = demo.build_parser().parse_args(
            [
                "--batch-size",
                "96",
                "--micro-batch-size",
                "32",
                "--memory-limit-mb",
                "50",
                "--jit-compile",
            ]
        )
        command = demo._child_command("accumulating", args)
        parsed = demo.build_parser().parse_args(command[3:])
        assert parsed.child == "accumulating"
        for name in (
            "batch_size",
            "micro_batch_size",
            "epochs",
            "steps_per_epoch",
            "depth",
            "width",
            "jit_compile",
        ):
            assert getattr(parsed, name) == getattr(args, name), name


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
    assert "ResourceExhaustedError: OOM when allocating tensor" in plain, output

    summary = output.split("Summary")[1]
    needed = float(re.search(r"plain keras.Model needs\s+(\d+) MiB", summary).group(1))
    used, loss = re.search(
        r"AccumulatingModel used\s+(\d+) MiB, final loss (\S+)", summary
    ).groups()
    assert needed > limit, output
    assert float(used) < limit, output
    assert math.isfinite(float(loss)), output
    assert "Plain Keras ran out of memory at batch 8192" in output
