"""`keras-memopt run`: a training process that dies is restarted with a smaller micro-batch."""

import json
import os
import runpy
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from _helpers import SAME_COMPUTATION
from conftest import KERAS_LINE

from keras_memopt import _subprocess, supervise

# Trains an MLP with Dropout and BatchNorm for four epochs with
# keras_memopt's BackupAndRestore (Keras 3's own does not back up the seed
# generators, so a resumed Dropout draws other masks). While its micro-batch
# is larger than `crash_above`, the process dies of SIGSEGV at the first step
# of epoch 2 (a stand-in for TensorFlow's own crash under memory pressure,
# which a model's training does not produce on demand; the real crash is
# below); `switch_at`, for the reference run, sets the micro-batch instead.
SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    import keras_memopt as kmo
    from keras_memopt import AccumulatingModel
    from keras_memopt._keras import keras

    out, backup, crash_above, switch_at, switch_to = sys.argv[1:6]
    crash_above, switch_at, switch_to = int(crash_above), int(switch_at), int(switch_to)
    rng = np.random.RandomState(0)
    x = rng.normal(size=(96, 6)).astype("float32")
    y = rng.randint(0, 3, 96)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    hidden = keras.layers.BatchNormalization()(hidden)
    if keras.__name__ == "tf_keras":
        hidden = keras.layers.Dropout(0.3, seed=1, rng_type="stateless")(hidden)
    else:
        hidden = keras.layers.Dropout(0.3, seed=1)(hidden)
    model = AccumulatingModel(inputs, keras.layers.Dense(3)(hidden), micro_batch_size=32)
    model.compile(keras.optimizers.Adam(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class Crash(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch  # BackupAndRestore starts a restart at its epoch
            if epoch == switch_at:
                self.model.micro_batch_size = switch_to

        def on_train_batch_begin(self, batch, logs=None):
            size = self.model.micro_batch_size_for(32)
            if self.epoch == 2 and batch == 0 and size > crash_above:
                os.kill(os.getpid(), signal.SIGSEGV)

    callbacks = [kmo.callbacks.BackupAndRestore(backup), Crash()]
    model.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0, callbacks=callbacks)
    np.savez(out, *model.get_weights(), size=model.micro_batch_size_for(32))
    """
)


def _keras_env():
    return {**_subprocess.tensorflow_env(), **KERAS_LINE}


@pytest.mark.slow
@pytest.mark.line_independent(
    reason="the supervisor's restarts are process machinery; on tf_keras the cap's reaching "
    "the model is test_the_cap_reaches_the_model, a resume from the backup "
    "test_backup_and_restore.py")
def test_a_crashed_run_restarts_smaller_and_ends_as_a_run_that_switched(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    supervised = tmp_path / "supervised.npz"
    command = [
        sys.executable, "-m", "keras_memopt.cli", "run", "--factor", "0.5", "--",
        sys.executable, str(script), str(supervised), str(tmp_path / "backup"), "16", "-1", "0",
    ]
    result = subprocess.run(
        command, env={**os.environ, **_keras_env()}, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # One restart (a crash of a restarted run, under its cap: test_a_chosen_onednn_setting_is_kept).
    restarts = [line for line in result.stderr.splitlines() if "restarting it" in line]
    assert len(restarts) == 1, result.stderr[-3000:]
    assert "died of SIGSEGV at micro_batch_size=32" in restarts[0]
    assert "with micro_batch_size at most 16" in restarts[0]

    # The run that never crashed: epochs 0 and 1 at 32, then 16 (the backup is
    # taken at each epoch's end; the restart redoes epoch 2 from its start). In
    # this process, whose TensorFlow has the children's settings (a fresh one
    # costs 3 to 4 CPU-s): the script seeds everything it draws from.
    reference = tmp_path / "reference.npz"
    arguments = [str(reference), str(tmp_path / "backup_reference"), "1000", "2", "16"]
    monkeypatch.setattr(sys, "argv", [str(script), *arguments])
    runpy.run_path(str(script))
    received, expected = np.load(supervised), np.load(reference)
    assert int(received["size"]) == 16
    assert sorted(received.files) == sorted(expected.files)
    for key in expected.files:
        np.testing.assert_allclose(received[key], expected[key], **SAME_COMPUTATION, err_msg=key)


def test_an_error_exit_is_not_restarted(tmp_path):
    code = "import sys; print('trained'); sys.exit(3)"
    assert supervise.supervise([sys.executable, "-c", code], verbose=0) == 3


def test_a_crash_before_any_step_is_not_restarted(tmp_path, capsys):
    code = "import os, signal; os.kill(os.getpid(), signal.SIGABRT)"
    returncode = supervise.supervise([sys.executable, "-c", code])
    assert returncode == -signal.SIGABRT
    assert "died of SIGABRT before any training step; not restarting" in capsys.readouterr().err


def test_verbose_0_says_nothing(capsys):
    code = "import os, signal; os.kill(os.getpid(), signal.SIGABRT)"
    assert supervise.supervise([sys.executable, "-c", code], verbose=0) == -signal.SIGABRT
    assert capsys.readouterr().err == ""


# Reports micro-batch 4, notes the oneDNN setting it was started with, and
# dies of SIGSEGV.
_CRASH_AT_4 = (
    "import json, os, signal, sys\n"
    "json.dump({'micro_batch_size': 4}, open(os.environ['KERAS_MEMOPT_RUN_STATE'], 'w'))\n"
    "open(sys.argv[1], 'a').write(os.environ.get('TF_ENABLE_ONEDNN_OPTS', '-') + '\\n')\n"
    "os.kill(os.getpid(), signal.SIGSEGV)\n"
)


def test_a_crash_at_the_minimum_is_retried_once_without_onednn(tmp_path, monkeypatch, capsys):
    log = tmp_path / "onednn.txt"
    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
    command = [sys.executable, "-c", _CRASH_AT_4, str(log)]
    returncode = supervise.supervise(command, min_micro_batch_size=4)
    assert returncode == -signal.SIGSEGV
    assert log.read_text().split() == ["-", "0"]
    err = capsys.readouterr().err
    assert "at micro_batch_size=4; restarting it (restart 1 of at most 5) with " \
        "micro_batch_size at most 4 and oneDNN kernels off (TF_ENABLE_ONEDNN_OPTS=0)" in err
    assert "at the smallest micro-batch allowed (4); not restarting" in err


def test_a_chosen_onednn_setting_is_kept(tmp_path, monkeypatch, capsys):
    log = tmp_path / "onednn.txt"
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "1")
    command = [sys.executable, "-c", _CRASH_AT_4, str(log)]
    assert supervise.supervise(command, min_micro_batch_size=2) == -signal.SIGSEGV
    assert log.read_text().split() == ["1", "1"]  # at 4, then capped at 2, where it stops
    err = capsys.readouterr().err
    assert "oneDNN" not in err
    assert "at the smallest micro-batch allowed (2); not restarting" in err


# A real crash: with oneDNN on, a fused MatMul+BiasAdd+Relu whose output does
# not fit under a 2 MiB allocator limit dies of SIGSEGV (the kernel goes on
# without its output); TensorFlow's own kernels report ResourceExhaustedError.
_ONEDNN_CRASH = textwrap.dedent(
    """
    import tensorflow as tf
    from keras_memopt import supervise

    w = tf.Variable(tf.random.normal([64, 256]))
    b = tf.Variable(tf.zeros([256]))

    @tf.function
    def dense_relu(x):
        return tf.nn.relu(tf.matmul(x, w) + b)

    dense_relu(tf.ones([8, 64]))
    supervise.SizeFile().write(2048)  # as a model does at its first step
    try:
        dense_relu(tf.ones([2048, 64]))  # a [2048, 256] output: 2 MiB
    except tf.errors.ResourceExhaustedError:
        print("out of memory, reported")
    """
)


@pytest.mark.slow
@pytest.mark.line_independent
def test_a_real_onednn_crash_is_restarted_without_onednn(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(_ONEDNN_CRASH)
    env = {**os.environ, **_subprocess.tensorflow_env(cpu_memory_limit_mb=2)}
    del env["TF_ENABLE_ONEDNN_OPTS"]  # TensorFlow's default: on
    command = [sys.executable, "-m", "keras_memopt.cli", "run", "--", sys.executable, str(script)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    restarts = [line for line in result.stderr.splitlines() if "restarting it" in line]
    assert len(restarts) == 1, result.stderr[-3000:]
    assert "died of SIGSEGV at micro_batch_size=2048" in restarts[0]
    assert "oneDNN kernels off (TF_ENABLE_ONEDNN_OPTS=0)" in restarts[0]
    assert result.stdout.strip().splitlines()[-1] == "out of memory, reported"


def test_the_cap_reaches_the_model(monkeypatch):
    from keras_memopt import AccumulatingModel
    from keras_memopt._keras import keras

    monkeypatch.setenv(supervise.CAP_VARIABLE, "12")
    inputs = keras.Input((3,))
    model = AccumulatingModel(inputs, keras.layers.Dense(1)(inputs), accumulation_steps=2)
    assert model.micro_batch_size_for(64) == 12  # 32 by the steps, capped
    assert model.micro_batch_size_for(16) == 8
    monkeypatch.setenv(supervise.CAP_VARIABLE, "zero")
    with pytest.raises(ValueError, match="KERAS_MEMOPT_MAX_MICRO_BATCH_SIZE must be a positive"):
        AccumulatingModel(inputs, keras.layers.Dense(1)(inputs))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(command=[]), r"`command` must name the training command"),
        (dict(command=["x"], factor=1.5), r"`factor` must be a number between 0 and 1"),
        (dict(command=["x"], min_micro_batch_size=0), r"`min_micro_batch_size` must be"),
        (dict(command=["x"], max_restarts=-1), r"`max_restarts` must be a non-negative"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        supervise.supervise(**kwargs)


def test_the_state_file_is_written_whole(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    monkeypatch.setenv(supervise.STATE_VARIABLE, str(path))
    size_file = supervise.SizeFile()
    size_file.write(64)
    size_file.write(64)
    size_file.write(32)
    assert json.loads(path.read_text()) == {"micro_batch_size": 32}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
