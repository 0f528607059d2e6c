"""Gradient accumulation: peak memory and time against plain Keras.

For an MLP, a small CNN and a small transformer block, each trained with Adam
at the same effective batch, this compares plain `keras.Model` with
`AccumulatingModel` at micro-batches of 1/2, 1/4 and 1/8 of the batch, and
with Keras's optimizer-side `gradient_accumulation_steps` (the input pipeline
then delivers batch/k samples and the optimizer applies every k-th step),
with `jit_compile=False` and `True`.

Peaks: every configuration runs alone in a worker process on TensorFlow's BFC
CPU allocator, so its peak is its own: the allocator peak over one epoch after
a warm-up epoch (deterministic).

Times: all configurations of a model run in one further process, so that what
differs from process to process (where the allocator put the weights, how the
thread pools ran; up to ~10% on the MLP in two earlier versions of this
script) is not read as a difference between configurations. An epoch is
STEPS_PER_EPOCH effective batches; its time is the sum of its training
steps, each timed from `on_train_batch_begin` to `on_train_batch_end`.
(Timing the whole `fit` call instead adds `fit`'s own fixed cost, which here
jumps between ~0 and ~0.2 s from one call to the next, in plain Keras as much
as anywhere, and swamped the step times of the first version.) The timed
epochs are interleaved, in a shuffled order each round; a configuration's
time ratio is the median over rounds of its epoch time divided by plain
Keras's epoch time in the same round.

Run: python benchmarks/accumulation.py   (about 30 minutes on 2 cores;
      --models mlp --repeats 3 for a quicker look, --help for the rest)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import _common

_common.use_allocator_env()  # quiet; and the workers' settings, before TensorFlow starts

from keras_memopt import _subprocess  # noqa: E402

# Effective batch per model; chosen so that activations, not weights,
# dominate plain Keras's peak, and one epoch takes a few seconds on 2 cores.
BATCH = {"mlp": 4096, "cnn": 256, "transformer": 128}
MODELS = tuple(BATCH)
SPLITS = (2, 4, 8)
STEPS_PER_EPOCH = 4


def build(name):
    from keras_memopt._keras import keras

    if name == "mlp":
        inputs, outputs = _common.mlp(256, depth=12, width=512)
    elif name == "cnn":
        inputs, outputs = _common.cnn([32, 32, "pool", 64, 64, "pool"], padding="same")
    elif name == "transformer":
        inputs, outputs = _common.transformer(length=128, blocks=2)
    else:
        raise ValueError(f"Unknown model. Expected one of {MODELS}. Received: name={name!r}")
    return keras.Model(inputs, outputs, name=name)


def batch_data(name, size):
    import numpy as np

    rng = np.random.default_rng(0)
    if name == "mlp":
        x = rng.standard_normal((size, 256)).astype("float32")
    elif name == "cnn":
        x = rng.standard_normal((size, 32, 32, 3)).astype("float32")
    else:
        x = rng.integers(0, 1000, (size, 128)).astype("int32")
    return x, rng.integers(0, 10, size).astype("int32")


# -- workers --------------------------------------------------------------------------


def setup(config):
    """The model of one configuration, and a function that trains it for one
    epoch and returns the seconds its training steps took."""
    import tensorflow as tf

    import keras_memopt as kmo
    from keras_memopt._keras import keras

    keras.utils.set_random_seed(0)
    name, batch, kind, split = config["model"], config["batch"], config["kind"], config["split"]
    model = build(name)
    optimizer = keras.optimizers.Adam(1e-4)
    pipeline_batch = batch
    if kind == "accumulating":
        model = kmo.AccumulatingModel.from_model(model, micro_batch_size=batch // split)
    elif kind == "keras_ga":
        optimizer = keras.optimizers.Adam(1e-4, gradient_accumulation_steps=split)
        pipeline_batch = batch // split
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=config["jit_compile"],
    )
    x, y = batch_data(name, batch)
    # One effective batch held in memory, delivered STEPS_PER_EPOCH times.
    dataset = (
        tf.data.Dataset.from_tensors((x, y)).unbatch().batch(pipeline_batch).repeat(STEPS_PER_EPOCH)
    )

    class StepTimer(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.seconds = 0.0

        def on_train_batch_begin(self, batch, logs=None):
            self.started = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.seconds += time.perf_counter() - self.started

    timer = StepTimer()

    def epoch():
        model.fit(dataset, epochs=1, verbose=0, callbacks=[timer])
        return timer.seconds

    return model, epoch


def peak_worker(config):
    """One configuration alone in its TensorFlow: its allocator peak."""
    import tensorflow as tf

    model, epoch = setup(config)
    epoch()  # traces and builds the optimizer
    tf.config.experimental.reset_memory_stats("CPU:0")
    resting = tf.config.experimental.get_memory_info("CPU:0")["current"]
    epoch()
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    weights = sum(int(v.numpy().nbytes) for v in model.weights)
    return dict(peak=peak, resting=resting, weights=weights)


def time_worker(configs, repeats, seed):
    """All configurations of a model in one TensorFlow: their epoch times, by round.

    One process for all, so that what differs between processes (where the
    allocator placed the weights, how the thread pools were scheduled; up to
    ~10% on the MLP) is not mistaken for a difference between configurations.
    """
    epochs = [setup(config)[1] for config in configs]
    for epoch in epochs:
        epoch()  # traces and builds the optimizer
    rng = random.Random(seed)
    rounds = []
    for _ in range(repeats):
        order = list(range(len(configs)))
        rng.shuffle(order)
        seconds = [0.0] * len(configs)
        for index in order:
            seconds[index] = epochs[index]()
        rounds.append(seconds)
    return rounds


# -- parent ----------------------------------------------------------------------------


def start(task):
    return _subprocess.start(
        [os.path.abspath(__file__), "--worker", json.dumps(task)],
        env=_common.ALLOCATOR_ENV,
        name=f"worker {task}",
    )


def results(workers):
    """Each worker's result, once all have finished (all are stopped if one fails)."""
    outputs = _subprocess.wait_all(workers)
    return [_subprocess.result_of(o, w.name) for w, o in zip(workers, outputs, strict=True)]


def configurations(name, jit_compile, legacy):
    batch = BATCH[name]
    base = dict(model=name, batch=batch, jit_compile=jit_compile)
    yield dict(base, kind="plain", split=1)
    for split in SPLITS:
        yield dict(base, kind="accumulating", split=split)
    if not legacy:  # tf_keras optimizers have no `gradient_accumulation_steps`
        for split in SPLITS:
            yield dict(base, kind="keras_ga", split=split)


def label(config):
    batch, split = config["batch"], config["split"]
    if config["kind"] == "plain":
        return f"plain keras.Model, batch {batch}"
    if config["kind"] == "accumulating":
        return f"AccumulatingModel, micro-batch {batch // split} (1/{split})"
    return f"Keras gradient_accumulation_steps={split} (batch {batch // split})"


def measure(name, jit_compile, repeats, legacy, seed):
    configs = list(configurations(name, jit_compile, legacy))
    # Peaks: one process per configuration (side by side: a peak does not
    # depend on the load). Times: then one process for all of them.
    peaks = results([start({"peak": c}) for c in configs])
    (rounds,) = results([start({"time": configs, "repeats": repeats, "seed": seed})])
    rows = []
    for index, (config, peak) in enumerate(zip(configs, peaks, strict=True)):
        ratios = [seconds[index] / seconds[0] for seconds in rounds]
        rows.append(
            dict(
                config=config,
                peak_mib=peak["peak"] / 2**20,
                resting_mib=peak["resting"] / 2**20,
                weights_mib=peak["weights"] / 2**20,
                epoch_s=statistics.median(seconds[index] for seconds in rounds),
                ratio=statistics.median(ratios),
                ratio_range=(min(ratios), max(ratios)),
            )
        )
    return rows


def table(rows):
    lines = [
        "| model | jit_compile | configuration | peak MiB | peak vs plain "
        "| time vs plain (median, range) | plain epoch s |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        config = row["config"]
        plain = next(
            r
            for r in rows
            if r["config"]["kind"] == "plain"
            and r["config"]["model"] == config["model"]
            and r["config"]["jit_compile"] == config["jit_compile"]
        )
        low, high = row["ratio_range"]
        lines.append(
            f"| {config['model']} | {config['jit_compile']} | {label(config)} "
            f"| {row['peak_mib']:.0f} | {row['peak_mib'] / plain['peak_mib']:.2f}x "
            f"| {row['ratio']:.2f}x ({low:.2f}-{high:.2f}) | {plain['epoch_s']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument(
        "--jit-compile", nargs="+", choices=("false", "true"), default=["false", "true"]
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed epochs per configuration")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        task = json.loads(args.worker)
        if "peak" in task:
            answer = peak_worker(task["peak"])
        else:
            answer = time_worker(task["time"], task["repeats"], task["seed"])
        _subprocess.send_result(answer)
        return 0
    legacy = os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true")
    rows = []
    for name in args.models:
        for jit in args.jit_compile:
            started = time.perf_counter()
            new = measure(name, jit == "true", args.repeats, legacy, seed=len(rows))
            rows += new
            print(
                f"# {name}, jit_compile={jit}: {time.perf_counter() - started:.0f} s; weights "
                f"{new[0]['weights_mib']:.1f} MiB, plain resting {new[0]['resting_mib']:.1f} MiB",
                file=sys.stderr,
                flush=True,
            )
    print(table(rows))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
