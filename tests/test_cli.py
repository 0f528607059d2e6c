import re
import sys
import time

import pytest
from conftest import run_python, without_gpu

from keras_memopt import _subprocess, cli
from keras_memopt.cli import main
from keras_memopt.planning import MemoryEstimate, planner

pytestmark = pytest.mark.line_independent

# What pip writes for `[project.scripts] keras-memopt = "keras_memopt.cli:main"`.
LAUNCHER = """\
import sys
from keras_memopt.cli import main
if __name__ == '__main__':
    sys.argv[0] = sys.argv[0].removesuffix('.exe')
    sys.exit(main())
"""


@pytest.fixture
def saved_model(keras_module, tmp_path):
    inputs = keras_module.Input((64,))
    hidden = keras_module.layers.Dense(128, activation="relu")(inputs)
    model = keras_module.Model(inputs, keras_module.layers.Dense(10)(hidden))
    model.compile(optimizer="adam", loss="mse")
    path = tmp_path / "model.keras"
    model.save(str(path))
    return str(path)


@pytest.fixture
def launcher(tmp_path):
    """The `keras-memopt` console script, as pip installs it."""
    path = tmp_path / "bin" / "keras-memopt"
    path.parent.mkdir()
    path.write_text(LAUNCHER)
    return str(path)


@pytest.fixture(scope="module")
def accumulating_model_file(tmp_path_factory):
    """A saved AccumulatingModel (loaded by fresh processes in the tests)."""
    from keras_memopt import AccumulatingModel
    from keras_memopt._keras import keras

    path = str(tmp_path_factory.mktemp("saved") / "accumulating.keras")
    inputs = keras.Input((16,))
    model = AccumulatingModel(inputs, keras.layers.Dense(4)(inputs), micro_batch_size=8)
    model.compile(optimizer="adam", loss="mse")
    model.save(path)
    return path


def _recommended(out):
    line = next(line for line in out.splitlines() if line.startswith("recommendation"))
    return int(line.split("micro_batch_size=")[1].split(",")[0])


class TestShapesOnly:
    def test_plan_prints_a_table_that_says_what_its_figures_are(self, saved_model, capsys):
        assert main(["plan", saved_model, "--batch-size", "256", "--budget", "8GiB",
                     "--no-profile"]) == 0
        out = capsys.readouterr().out
        for part in ("parameters", "optimizer slots", "activations", "budget"):
            assert part in out
        assert "peak (shapes only)" in out and "estimated from shapes alone" in out
        assert "margin: 80%" in out and "8.00 GiB" in out
        assert "micro_batch_size=256" in out and "(1 micro-batch of a batch of 256)" in out

    def test_plan_keeps_the_wide_margin(self, saved_model, capsys):
        # Parameters, 2 slots, accumulators and gradients take about 0.5 MiB,
        # the input batch 2.1 MB: a fifth of 16 MB leaves room for some activations.
        assert main(["plan", saved_model, "--batch-size", "8192", "--budget", "16MB",
                     "--no-profile"]) == 0
        micro = _recommended(capsys.readouterr().out)
        assert 1 <= micro < 8192
        assert main(["plan", saved_model, "--batch-size", "8192", "--budget", "16MB",
                     "--no-profile", "--margin", "0.1"]) == 0
        assert _recommended(capsys.readouterr().out) > micro

    def test_margins_in_the_help_are_the_planners(self):
        numbers = re.findall(r"\d+\.\d+", cli._MARGINS_HELP)
        assert [float(n) for n in numbers[:2]] == [
            planner.MEASURED_MARGIN, planner.SHAPES_ONLY_MARGIN
        ]
        shapes_only = MemoryEstimate(1, 1, 1, 1, 1, 1, 1, 1)
        assert "4.7 times" in cli._MARGINS_HELP
        assert "4.7 times" in planner.MemoryPlan(1, 2**20, 1, None, shapes_only, True).table()


class TestErrors:
    @pytest.mark.parametrize(
        "budget, message",
        [("8XB", "Received: budget='8XB'"), ("1KiB", "below what the parameters alone need")],
    )
    def test_plan_bad_budget_is_a_clear_error(self, saved_model, capsys, budget, message):
        assert main(["plan", saved_model, "--batch-size", "64", "--budget", budget,
                     "--no-profile"]) == 2
        assert message in capsys.readouterr().err

    def test_bad_batch_size_is_an_argument_error(self, saved_model, capsys):
        with pytest.raises(SystemExit) as exit_info:
            main(["plan", saved_model, "--batch-size", "0", "--budget", "1GiB"])
        assert exit_info.value.code == 2
        assert "argument --batch-size: must be a positive integer, received '0'" in (
            capsys.readouterr().err
        )

    def test_bad_margin(self, saved_model, capsys):
        assert main(["plan", saved_model, "--batch-size", "8", "--budget", "1GiB",
                     "--margin", "1.5"]) == 2
        assert "Received: margin=1.5" in capsys.readouterr().err

    def test_plan_missing_file(self, tmp_path, capsys):
        path = str(tmp_path / "nope.keras")
        assert main(["plan", path, "--batch-size", "8", "--budget", "1GiB"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("keras-memopt plan: error: ") and path in err
        assert re.search("File not found|No file or directory found", err)

    def test_plan_loads_in_safe_mode(self, keras_module, tmp_path, capsys):
        inputs = keras_module.Input((4,))
        outputs = keras_module.layers.Lambda(lambda t: t * 2)(inputs)
        path = str(tmp_path / "lambda.keras")
        keras_module.Model(inputs, outputs).save(path)
        assert main(["plan", path, "--batch-size", "8", "--budget", "1GiB"]) == 2
        err = capsys.readouterr().err
        assert re.search(r"deserialization of a `?Lambda`? layer .*`safe_mode=False`", err)

    def test_interrupt_exits_with_130_and_one_line(self, saved_model, capsys, monkeypatch):
        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr(planner.MemoryPlanner, "plan", interrupted)
        assert main(["plan", saved_model, "--batch-size", "64", "--budget", "1GiB"]) == 130
        assert capsys.readouterr().err.strip() == (
            "keras-memopt plan: interrupted; the measurement in progress was stopped."
        )


class TestRun:
    def test_a_command_not_found_exits_127_with_one_line(self, capsys):
        assert main(["run", "--", "no-such-command-kmo", "--epochs", "2"]) == 127
        assert capsys.readouterr().err == (
            "keras-memopt run: error: command not found: no-such-command-kmo\n"
        )

    def test_a_file_that_cannot_be_run_exits_126(self, tmp_path, capsys):
        script = tmp_path / "train.sh"
        script.write_text("echo trained\n")  # not executable
        assert main(["run", "--", str(script)]) == 126
        assert capsys.readouterr().err == (
            f"keras-memopt run: error: cannot run {script}: Permission denied\n"
        )

    def test_help_names_the_packages_backup_callback(self, capsys):
        with pytest.raises(SystemExit):
            main(["run", "--help"])
        out = capsys.readouterr().out
        assert "keras_memopt.callbacks.BackupAndRestore" in out
        assert "keras.callbacks.BackupAndRestore" not in out.replace("keras_memopt.callbacks", "")


@without_gpu  # on a GPU, measurements run in this process
def test_plan_measures_by_default_and_says_so(saved_model, capsys):
    assert main(["plan", saved_model, "--batch-size", "64", "--budget", "1GiB"]) == 0
    out = capsys.readouterr().out
    progress = re.findall(
        r"measured micro-batch (\d+) of a batch of 64 on CPU:0: peak [\d.]+ [KM]iB "
        r"\([\d.]+ s, in a fresh process\)", out
    )
    assert progress and int(progress[-1]) == _recommended(out)
    assert "peak (measured)" in out and "margin: 10%" in out
    assert "estimated from shapes alone" not in out


class TestCommand:
    """The installed command: fast until its arguments are parsed."""

    @pytest.mark.parametrize("module", [False, True], ids=["script", "python-m"])
    def test_help_returns_at_once_without_tensorflow(self, launcher, module):
        command = ["-m", "keras_memopt.cli"] if module else [launcher]
        started = time.perf_counter()
        output = _subprocess.run(["-X", "importtime", *command, "--help"], timeout=120)
        seconds = time.perf_counter() - started
        assert output.returncode == 0, output.tail()
        assert "usage: keras-memopt" in output.stdout
        imported = {line.split("|")[-1].strip() for line in output.stderr.splitlines()}
        assert "keras_memopt" in imported  # the package, lazily
        assert not {"tensorflow", "keras", "numpy"} & imported
        assert seconds < 2.0  # importing TensorFlow alone takes 3-4 s here

    def test_argument_errors_return_at_once_without_tensorflow(self, launcher):
        for argv in (["plan", "m.keras", "--batch-size", "8", "--budget", "8XB"],
                     ["demo", "--batch-size", "0"]):
            output = _subprocess.run(["-X", "importtime", launcher, *argv], timeout=120)
            assert output.returncode == 2, output.tail()
            assert "tensorflow" not in {
                line.split("|")[-1].strip() for line in output.stderr.splitlines()
            }

    @pytest.mark.slow
    def test_plan_loads_a_saved_accumulating_model(self, launcher, accumulating_model_file):
        # The command loads the package lazily; it must still register
        # AccumulatingModel before loading a model that is one.
        output = _subprocess.run(
            [launcher, "plan", accumulating_model_file, "--batch-size", "64", "--budget", "1GiB",
             "--no-profile"],
            timeout=300,
        )
        assert output.returncode == 0, output.tail()
        assert "micro_batch_size=64" in output.stdout


@pytest.mark.slow
def test_import_registers_accumulating_model_for_load_model(accumulating_model_file):
    path = accumulating_model_file
    result = run_python(
        f"""
        import keras_memopt  # nothing else of keras_memopt is named
        from keras_memopt._keras import keras

        model = keras.models.load_model({path!r})
        print("RESULT", type(model).__name__, model.micro_batch_size)
        """
    )
    assert result.stdout.split("RESULT")[1].split() == ["AccumulatingModel", "8"]


@pytest.mark.parametrize(
    "program, command",
    [("/venv/bin/keras-memopt", True), (r"C:\venv\Scripts\keras-memopt.exe", False),
     ("keras-memopt.exe", True), ("keras-memopt-script.py", True),
     ("/venv/bin/pytest", False), ("-c", False), ("", False)],
)
def test_only_the_command_loads_lazily(monkeypatch, program, command):
    import keras_memopt

    monkeypatch.setattr(sys, "argv", [program])
    # (A Windows path is not split on this POSIX host: its basename is itself.)
    assert keras_memopt._launched_as_command() is command


@pytest.mark.parametrize(
    "arguments, command",
    [(["python", "-m", "keras_memopt.cli", "run"], True),
     (["python", "-X", "importtime", "-mkeras_memopt.cli"], True),
     (["python", "-m", "pytest", "--", "-m", "keras_memopt.cli"], False),
     (["python", "-m", "keras_memopt.demo"], False), (["python", "-m"], False)],
)
def test_python_m_of_the_command_loads_lazily(monkeypatch, arguments, command):
    import keras_memopt

    monkeypatch.setattr(sys, "argv", ["-m"])  # as Python sets it while finding the module
    monkeypatch.setattr(sys, "orig_argv", arguments)
    assert keras_memopt._launched_as_command() is command
