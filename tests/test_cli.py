import pytest

from keras_memopt.cli import main


@pytest.fixture
def saved_model(keras_module, tmp_path):
    inputs = keras_module.Input((64,))
    hidden = keras_module.layers.Dense(128, activation="relu")(inputs)
    model = keras_module.Model(inputs, keras_module.layers.Dense(10)(hidden))
    model.compile(optimizer="adam", loss="mse")
    path = tmp_path / "model.keras"
    model.save(str(path))
    return str(path)


def test_plan_prints_a_table(saved_model, capsys):
    assert main(["plan", saved_model, "--batch-size", "256", "--budget", "8GiB"]) == 0
    out = capsys.readouterr().out
    for part in ("parameters", "optimizer slots", "activations", "peak", "budget"):
        assert part in out
    assert "micro_batch_size=256" in out
    assert "8.00 GiB" in out


def test_plan_splits_when_the_budget_is_tight(saved_model, capsys):
    # Fixed part (params, 2 slots, accumulators, gradients) is about 0.5 MiB.
    assert main(["plan", saved_model, "--batch-size", "8192", "--budget", "4MB"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("recommendation"))
    micro = int(line.split("micro_batch_size=")[1].split(",")[0])
    assert 1 <= micro < 8192


@pytest.mark.parametrize(
    "budget, message",
    [("8XB", "Received: budget='8XB'"), ("1KiB", "below what the parameters alone need")],
)
def test_plan_bad_budget_is_a_clear_error(saved_model, capsys, budget, message):
    assert main(["plan", saved_model, "--batch-size", "64", "--budget", budget]) == 2
    assert message in capsys.readouterr().err


def test_plan_missing_file(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "nope.keras"), "--batch-size", "8",
                 "--budget", "1GiB"]) == 2
    assert "error" in capsys.readouterr().err


def test_plan_loads_in_safe_mode(keras_module, tmp_path, capsys):
    inputs = keras_module.Input((4,))
    outputs = keras_module.layers.Lambda(lambda t: t * 2)(inputs)
    path = str(tmp_path / "lambda.keras")
    keras_module.Model(inputs, outputs).save(path)
    assert main(["plan", path, "--batch-size", "8", "--budget", "1GiB"]) == 2
    assert "safe" in capsys.readouterr().err.lower()


def test_plan_profile_measures_real_steps(saved_model, capsys):
    assert main(["plan", saved_model, "--batch-size", "64", "--budget", "1GiB",
                 "--profile"]) == 0
    assert "peak (measured)" in capsys.readouterr().out
