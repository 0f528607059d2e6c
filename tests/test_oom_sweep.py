"""Out-of-memory recovery under a sweep of real memory limits.

Two models with BatchNormalization and Dropout (an MLP and a CNN) train three
steps at a whole batch as one micro-batch, with `OOMBackoff`, under a grid of
three real CPU allocator limits (`TF_CPU_BFC_MEM_LIMIT_IN_MB`) from below what the
smallest micro-batch needs to just under what the whole batch needs. Each run
is supervised (`keras-memopt run`, with `keras_memopt.callbacks.
BackupAndRestore`), since under some limits TensorFlow itself crashes. Every
run must end in one of two ways:

- trained, with every variable (weights, BatchNorm statistics, seed states,
  optimizer state) equal to a clean run without a limit that used the same
  micro-batch sizes at the same steps, and one optimizer update per batch;
- stopped by one `ResourceExhaustedError`, at `min_micro_batch_size` or at
  once where no micro-batch size can help (the gradient sum beside the
  model's state does not fit), with every variable equal to the clean run's
  before the step that failed.

Any other error, a hang (each run has a deadline), or a crash the supervisor
could not restart fails the test. The runs wait on TensorFlow's allocator
(about 10 s per out-of-memory error) far more than they compute, so they run
side by side.
"""

import json
import math
import sys
import textwrap

import numpy as np
import pytest
from _helpers import SAME_COMPUTATION
from conftest import LEGACY, last_json

from keras_memopt import _subprocess

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        LEGACY,
        reason="the step runner is the same on both Keras lines; tf_keras's default "
        "dropout draws with stateful random ops that no rollback can replay",
    ),
]

# Both models' peaks are mostly activations, so the smallest micro-batch
# needs far less than the batch. Small enough that the children of the
# test spend more time waiting on the allocator than computing.
BATCHES = {"mlp": 2048, "cnn": 512}
MINIMUM, STEPS = 32, 3
STATE_DOES_NOT_FIT = "Out of memory before the first step"

CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import tensorflow as tf
    import keras_memopt as kmo
    from keras_memopt._keras import keras

    kind, mode, out, schedule_path = sys.argv[1:5]
    MINIMUM, STEPS = {minimum}, {steps}

    def data(kind):
        batch = {batches}[kind]
        rng = np.random.RandomState(0)
        shape = (batch, 64) if kind == "mlp" else (batch, 16, 16, 3)
        return batch, rng.standard_normal(shape).astype("float32"), rng.randint(0, 10, batch)

    def build(kind, micro_batch_size):
        keras.utils.set_random_seed(0)
        if kind == "mlp":
            inputs = keras.Input((64,))
            x = inputs
            for _ in range(3):
                x = keras.layers.Dense(256, activation="relu")(x)
                x = keras.layers.BatchNormalization()(x)
                x = keras.layers.Dropout(0.3)(x)
        else:
            inputs = keras.Input((16, 16, 3))
            x = inputs
            for filters in (32, 64):
                x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
                x = keras.layers.BatchNormalization()(x)
                x = keras.layers.MaxPooling2D()(x)
            x = keras.layers.Dropout(0.3)(keras.layers.Flatten()(x))
        outputs = keras.layers.Dense(10)(x)
        model = kmo.AccumulatingModel(inputs, outputs, micro_batch_size=micro_batch_size)
        model.compile(keras.optimizers.Adam(1e-3),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    if mode != "replay":
        BATCH, x, y = data(kind)

    def state(model):
        values = [np.asarray(v) for v in model.variables]
        values += [np.asarray(v) for v in model.optimizer.variables]
        return values

    class Record(keras.callbacks.Callback):
        # The micro-batch each step trained with (the supervisor's restarts
        # redo steps, which overwrite their entries).
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            try:
                with open(schedule_path) as handle:
                    schedule = json.load(handle)
            except OSError:
                schedule = dict()
            schedule[str(self.epoch)] = int(self.model.micro_batch_size_for(BATCH))
            with open(schedule_path, "w") as handle:
                json.dump(schedule, handle)

    class BuildPeak(keras.callbacks.Callback):
        # What the process needed before the first step: the data and the
        # model; the optimizer's variables, made at the first step, stay.
        def on_train_begin(self, logs=None):
            self.peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]

        def on_train_end(self, logs=None):
            current = tf.config.experimental.get_memory_info("CPU:0")["current"]
            self.peak = max(self.peak, current)

    if mode == "peak":  # no limit: the step's peak at a micro-batch size
        sizes = [int(s) for s in schedule_path.split(",")]
        peaks = dict()
        for size in sizes:
            model, built = build(kind, size), BuildPeak()
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[built])
            peaks["build"] = max(peaks.get("build", 0), built.peak)
            tf.config.experimental.reset_memory_stats("CPU:0")
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
            peaks[size] = tf.config.experimental.get_memory_info("CPU:0")["peak"]
            del model
        print(json.dumps(peaks))
    elif mode == "replay":  # no limit: the clean runs the sweep's runs must equal (any kind)
        runs = json.load(open(out))
        for run in runs:
            BATCH, x, y = data(run["kind"])
            schedule = {{int(k): v for k, v in run["schedule"].items()}}
            model = build(run["kind"], schedule.get(0, BATCH))

            class Replay(keras.callbacks.Callback):
                def on_epoch_begin(self, epoch, logs=None):
                    self.model.micro_batch_size = schedule[epoch]

            if run["steps"]:
                model.fit(x, y, batch_size=BATCH, epochs=run["steps"], shuffle=False,
                          verbose=0, callbacks=[Replay()])
            else:
                model.optimizer.build(model.trainable_variables)
            np.savez(run["reference"], *state(model))
    else:  # under a limit, supervised
        model = build(kind, BATCH)
        backoff = kmo.callbacks.OOMBackoff(factor=0.125, min_micro_batch_size=MINIMUM, verbose=0)
        callbacks = [kmo.callbacks.BackupAndRestore(out + ".backup"), backoff, Record()]
        try:
            model.fit(x, y, batch_size=BATCH, epochs=STEPS, shuffle=False, verbose=0,
                      callbacks=callbacks)
            result = dict(outcome="trained")
        except tf.errors.ResourceExhaustedError as error:
            result = dict(outcome="stopped", message=str(error))
        result["steps"] = int(model.optimizer.iterations.numpy())
        result["model_variables"] = len(model.variables)
        np.savez(out, *state(model))
        print("SWEEP " + json.dumps(result))
    """
).format(batches=BATCHES, minimum=MINIMUM, steps=STEPS)


def _run_all(commands, timeout=900):
    """Runs `(name, args, env)` children side by side; their outputs, in order."""
    children = [_subprocess.start(args, env=env, name=name) for name, args, env in commands]
    outputs = _subprocess.wait_all(children, timeout=timeout)
    for (name, _, _), output in zip(commands, outputs, strict=True):
        assert output.returncode == 0, f"{name}:\n{output.tail()}"
    return outputs


def _limits(peaks, batch):
    """Three whole MiB limits: one below the smallest micro-batch's peak, two up to the batch's.

    The lowest lies halfway between what the process needs before the first
    step (below that no micro-batch size can help: an MLP's model, optimizer
    and data are most of its peak at a small micro-batch) and that peak,
    rounded up.
    """
    build, low, high = (peaks[key] / 2**20 for key in ("build", str(MINIMUM), str(batch)))
    lowest = math.ceil((build + low) / 2)
    grid = np.linspace(max(math.ceil(low), lowest + 1), 0.97 * high, 2)
    return [lowest] + [int(limit) for limit in grid]


def _result(output):
    lines = [line for line in output.stdout.splitlines() if line.startswith("SWEEP ")]
    assert lines, output.tail()
    return json.loads(lines[-1][len("SWEEP "):])


def test_every_limit_ends_trained_or_stopped_cleanly(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    unlimited = _subprocess.tensorflow_env()
    # Each peak in a process of its own: what an earlier model leaves behind
    # would raise a later one's.
    sizes = [(kind, size) for kind in BATCHES for size in (BATCHES[kind], MINIMUM)]
    outputs = _run_all(
        [(f"{kind} peak at {size}", [str(script), kind, "peak", "-", str(size)], unlimited)
         for kind, size in sizes]
    )
    peaks = {kind: dict() for kind in BATCHES}
    for (kind, _), output in zip(sizes, outputs, strict=True):
        peaks[kind].update(last_json(output))
    runs, commands = [], []
    print({kind: {size: round(peak / 2**20, 2) for size, peak in peaks[kind].items()}
           for kind in BATCHES})
    for kind in BATCHES:
        for limit in _limits(peaks[kind], BATCHES[kind]):
            folder = tmp_path / f"{kind}{limit}"
            folder.mkdir()
            runs.append(dict(kind=kind, limit=limit, state=str(folder / "state.npz"),
                             schedule=str(folder / "schedule.json"),
                             reference=str(folder / "reference.npz")))
            supervised = [
                "-m", "keras_memopt.cli", "run", "--factor", "0.125",
                "--min-micro-batch-size", str(MINIMUM), "--",
                sys.executable, str(script), kind, "sweep", runs[-1]["state"],
                runs[-1]["schedule"],
            ]
            env = _subprocess.tensorflow_env(cpu_memory_limit_mb=limit)
            commands.append((f"{kind} under {limit} MiB", supervised, env))
    for run, output in zip(runs, _run_all(commands), strict=True):
        result = _result(output)
        run.update(outcome=result["outcome"], steps=result["steps"],
                   restarts=output.stderr.count("restarting it"))
        run["schedule"] = json.loads(open(run["schedule"]).read()) if result["steps"] else {}
        run["compared"] = None  # every variable
        if result["outcome"] == "trained":
            assert result["steps"] == STEPS, run
        elif result["message"].startswith(STATE_DOES_NOT_FIT):
            # At the lowest limit the allocator may not fit the optimizer's
            # variables (its free bytes are not one free block): a clean stop
            # before any step, with the model's variables as they were built.
            assert result["steps"] == 0 and "whatever the micro-batch size" in result["message"]
            run["compared"] = result["model_variables"]
        else:
            message = result["message"]
            assert (f"min_micro_batch_size={MINIMUM}" in message
                    or "a smaller micro-batch needs no less memory there" in message), run
            assert "the model, optimizer and metrics are as they were" in message

    # Every clean run in one process: without a limit, nothing one leaves changes another's
    # figures (each builds its model from the same seed).
    path = tmp_path / "runs.json"
    path.write_text(json.dumps(runs))
    _run_all([("clean runs", [str(script), "-", "replay", str(path), "-"], unlimited)])
    for run in runs:
        received, expected = np.load(run["state"]), np.load(run["reference"])
        compared = run["compared"] or len(expected.files)
        assert run["compared"] or len(received.files) == len(expected.files), run
        for index in range(compared):
            np.testing.assert_allclose(
                received[f"arr_{index}"], expected[f"arr_{index}"], **SAME_COMPUTATION,
                err_msg=f"{run['kind']} under {run['limit']} MiB, variable {index}",
            )
    for kind in BATCHES:
        # The grid covers both ends: below the smallest micro-batch's peak the
        # run stops (at the minimum, or at once where the gradient sum cannot
        # fit), or trains at the minimum (the allocator waits for memory that
        # other threads free, so a peak is not a hard need); above it a run
        # trains after backing off.
        ends = [run for run in runs if run["kind"] == kind]
        assert ends[0]["outcome"] == "stopped" or ends[0]["schedule"]["0"] == MINIMUM, ends
        assert any(run["outcome"] == "trained" and run["schedule"]["0"] < BATCHES[kind]
                   for run in ends), ends
    print(json.dumps([{k: run[k] for k in ("kind", "limit", "outcome", "schedule", "restarts")}
                      for run in runs]))
