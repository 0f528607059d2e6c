"""`whole_batch_loss=True`: peak memory and step time of a contrastive loss in micro-batches.

Two CLIP-style two-tower models, trained with Adam on a symmetric InfoNCE
loss whose negatives are the batch's other rows (`clip_loss`):

- `clip`: two Dense 512-512 towers on 256 and 128 features, embeddings of
  128 each; batch 512, micro-batches of 64;
- `encoder`: an image tower of convolutions on 32x32x3 images
  (`_common.cnn`) and a text tower of an Embedding and two transformer blocks
  on 32 tokens (`_common.transformer`), embeddings of 128 each; batch 256,
  micro-batches of 32.

Configurations, each from the same initial weights:

- *plain@batch*: `keras.Model` at the whole batch, the CLIP loss;
- *plain@micro*: `keras.Model` at the micro-batch size, the CLIP loss (over
  the micro-batch: fewer negatives). The floor: one micro-batch's step;
- *without*: `AccumulatingModel` in micro-batches without the option. The
  CLIP loss is refused there (it couples the samples), so this runs a
  per-sample loss of the same outputs, the mean squared output
  (`squared_norm`): what plain accumulation costs, to which the option adds a
  forward pass;
- *with*: `AccumulatingModel(..., whole_batch_loss=True)`, the CLIP loss.

Peaks: each configuration runs alone in a fresh worker process on
TensorFlow's BFC CPU allocator (`--jobs` such processes side by side); the
step peak is the allocator's peak over an epoch after a warm-up epoch, above
what is resident before it (weights, optimizer state). At these sizes it is
not deterministic: the two towers run side by side, and the allocator counts
whole chunks, whose sizes depend on what was freed before (seen: a few
percent from process to process, and from epoch to epoch in one process,
also with one thread per pool). So each configuration runs in
`--peak-repeats` processes: the median, with the range. Each epoch delivers
one batch, made before the warm-up epoch, `STEPS` times. *Outputs* is what
the option keeps of the whole batch: both embeddings of every sample, in
float32 (their gradient, of the same size, is kept too).

Times: plain@batch, without and with (and *with, per-sample loss*: the option
on `squared_norm`, the same loss as *without*) live in one further process,
from the same initial weights, and their epochs are interleaved, in an order
that rotates each round, so that a busy machine slows them alike. An epoch's
time is the sum of its steps (`on_train_batch_begin` to
`on_train_batch_end`), in wall-clock time and in the process's CPU time (all
its threads); a ratio is the median over rounds of two configurations' epoch
times in the same round, with the range. On a shared machine wall-clock
ratios are noisy; CPU-time ratios much less so (what other processes take
does not count), so both are reported, and no absolute time.

Sanity check, in the time process: the loss logged after the first step with
the option equals plain Keras's at the whole batch (same weights, same batch).

Run: python benchmarks/whole_batch_loss.py          (both models: ~8 minutes on 2 cores)
     python benchmarks/whole_batch_loss.py --quick  (fewer steps, rounds and peak
                                                     processes: ~3 minutes)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import _common

_common.use_allocator_env()  # quiet; and the workers' settings, before TensorFlow starts

MODELS = {
    "clip": dict(batch=512, micro=64),
    "encoder": dict(batch=256, micro=32),
}
EMBEDDING = 128  # per tower
TOKENS = 32
CONFIGS = ("plain_batch", "plain_micro", "without", "with")
TIMED = ("plain_batch", "without", "with", "with_per_sample")
LABELS = {
    "plain_batch": "plain@batch",
    "plain_micro": "plain@micro",
    "without": "without",
    "with": "with",
    "with_per_sample": "with, per-sample loss",
}
# Steps per epoch and timed rounds: default, --quick.
STEPS = {"clip": (16, 8), "encoder": (2, 1)}
ROUNDS = (11, 5)
PEAK_REPEATS = (5, 1)  # processes per configuration


# -- workers ---------------------------------------------------------------------------


def clip_loss(y_true, y_pred):
    """Symmetric InfoNCE over the batch: row i of each tower matches row i of the other."""
    import tensorflow as tf

    images = tf.math.l2_normalize(y_pred[:, :EMBEDDING], axis=1)
    texts = tf.math.l2_normalize(y_pred[:, EMBEDDING:], axis=1)
    logits = 10.0 * tf.matmul(images, texts, transpose_b=True)
    labels = tf.range(tf.shape(logits)[0])
    cross_entropy = tf.nn.sparse_softmax_cross_entropy_with_logits
    return 0.5 * (cross_entropy(labels, logits) + cross_entropy(labels, tf.transpose(logits)))


def squared_norm(y_true, y_pred):
    """A per-sample loss of the same outputs: each row's mean squared output."""
    import tensorflow as tf

    return tf.reduce_mean(tf.square(y_pred), axis=-1)


def build(name):
    """The two-tower model's inputs and output (both embeddings, concatenated)."""
    from keras_memopt._keras import keras

    layers = keras.layers
    keras.utils.set_random_seed(0)
    if name == "clip":
        inputs, embeddings = [], []
        for features in (256, 128):
            inputs.append(keras.Input((features,)))
            x = inputs[-1]
            for _ in range(2):
                x = layers.Dense(512, activation="relu")(x)
            embeddings.append(layers.Dense(EMBEDDING)(x))
    else:
        image, image_embedding = _common.cnn([32, "pool", 64, "pool", 128], padding="same",
                                             classes=EMBEDDING)
        text, text_embedding = _common.transformer(TOKENS, blocks=2, width=128,
                                                   classes=EMBEDDING)
        inputs, embeddings = [image, text], [image_embedding, text_embedding]
    return inputs, layers.Concatenate()(embeddings)


def batch_data(name, size):
    """One batch: the two towers' inputs, and unused labels (the loss's labels
    are the batch's own rows)."""
    import numpy as np

    rng = np.random.default_rng(0)
    if name == "clip":
        x = [rng.standard_normal((size, f)).astype("float32") for f in (256, 128)]
    else:
        x = [
            rng.standard_normal((size, 32, 32, 3)).astype("float32"),
            rng.integers(0, 1000, (size, TOKENS)).astype("int32"),
        ]
    return x, np.zeros((size, 1), "float32")


def setup(name, config, steps, weights=None):
    """The model of one configuration, compiled, and `epoch()`: the seconds of
    its steps. `weights`: initial weights to start from (else the seed's)."""
    import tensorflow as tf

    import keras_memopt as kmo
    from keras_memopt._keras import keras

    spec = MODELS[name]
    inputs, outputs = build(name)
    if config.startswith("plain"):
        model = keras.Model(inputs, outputs)
    else:
        model = kmo.AccumulatingModel(
            inputs, outputs, micro_batch_size=spec["micro"],
            whole_batch_loss=config in ("with", "with_per_sample"),
        )
    if weights is not None:
        model.set_weights(weights)
    loss = squared_norm if config in ("without", "with_per_sample") else clip_loss
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss=loss, jit_compile=False)
    batch = spec["micro"] if config == "plain_micro" else spec["batch"]
    x, y = batch_data(name, batch)
    # One batch, made before any epoch (resident), delivered `steps` times.
    dataset = tf.data.Dataset.from_tensors(
        (tuple(tf.constant(t) for t in x), tf.constant(y))
    ).repeat(steps)
    clock = step_clock()

    def epoch():
        model.fit(dataset, epochs=1, verbose=0, callbacks=[clock])
        return clock.seconds

    epoch.clock = clock
    return model, epoch


def step_clock():
    """A callback: `seconds`, the wall and CPU seconds of the last epoch's
    steps (`on_train_batch_begin` to `on_train_batch_end`, summed), and
    `first_loss`, the loss logged after the first training step."""
    from keras_memopt._keras import keras

    class StepClock(keras.callbacks.Callback):
        first_loss = None

        def on_train_begin(self, logs=None):
            self.seconds = [0.0, 0.0]

        def on_train_batch_begin(self, batch, logs=None):
            self.started = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, batch, logs=None):
            self.seconds[0] += time.perf_counter() - self.started[0]
            self.seconds[1] += time.process_time() - self.started[1]
            if self.first_loss is None:
                self.first_loss = float(logs["loss"])

    return StepClock()


def peak_worker(task):
    """One configuration alone in its TensorFlow: its step peak and resident memory."""
    import tensorflow as tf

    model, epoch = setup(task["model"], task["config"], task["steps"])
    epoch()  # traces, builds the optimizer
    tf.config.experimental.reset_memory_stats("CPU:0")
    resident = tf.config.experimental.get_memory_info("CPU:0")["current"]
    epoch()
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    weights = sum(int(v.numpy().nbytes) for v in model.weights)
    return dict(step_peak=peak - resident, resident=resident, weights=weights,
                package=_common.package_file())


def time_worker(task):
    """The timed configurations of a model in one TensorFlow: epoch seconds by
    round, and the first step's loss of each."""
    name, steps = task["model"], task["steps"]
    reference, first_epoch = setup(name, "plain_batch", steps)
    weights = reference.get_weights()
    epochs = {"plain_batch": first_epoch}
    for config in TIMED[1:]:
        epochs[config] = setup(name, config, steps, weights)[1]
    for epoch in epochs.values():
        epoch()  # traces, builds the optimizer; its first step's loss is kept
    rounds = []
    for index in range(task["rounds"]):
        order = list(TIMED[index % len(TIMED):] + TIMED[: index % len(TIMED)])
        rounds.append({config: epochs[config]() for config in order})
    first = {config: epochs[config].clock.first_loss for config in TIMED}
    return dict(rounds=rounds, first_loss=first, package=_common.package_file())


# -- parent ----------------------------------------------------------------------------


def measure(name, args):
    """The peaks (`args.jobs` workers at a time), then the times (one worker, alone)."""
    steps = STEPS[name][args.quick]
    repeats = args.peak_repeats or PEAK_REPEATS[args.quick]
    tasks = [
        dict(kind="peak", model=name, config=c, steps=steps)
        for _ in range(repeats)
        for c in CONFIGS
    ]
    answers = []
    for first in range(0, len(tasks), args.jobs):
        answers += _common.results(
            [_common.start_worker(__file__, t) for t in tasks[first : first + args.jobs]]
        )
    peaks = {c: [a for t, a in zip(tasks, answers, strict=True) if t["config"] == c]
             for c in CONFIGS}
    task = dict(kind="time", model=name, steps=steps, rounds=args.rounds or ROUNDS[args.quick])
    (times,) = _common.results([_common.start_worker(__file__, task)])
    return dict(model=name, steps=steps, peaks=peaks, **times)


def ratios(row, numerator, denominator, clock=0):
    """(median, min, max) over rounds of the ratio of two configurations'
    epoch times: wall-clock (`clock=0`) or the process's CPU time (1)."""
    return _common.median_range(
        r[numerator][clock] / r[denominator][clock] for r in row["rounds"]
    )


def peak(row, config, key="step_peak"):
    """(median, min, max) over the processes of `config`'s peak."""
    return _common.median_range(answer[key] for answer in row["peaks"][config])


def mib(value):
    return f"{value / 2**20:.2f}" if value < 2**20 else f"{value / 2**20:.1f}"


def outputs_bytes(name):
    return MODELS[name]["batch"] * 2 * EMBEDDING * 4  # float32


def table(rows):
    lines = [
        "| model | batch / micro | step peak (MiB): plain@batch | plain@micro | without | with "
        "| outputs (MiB) | time, with ÷ without: wall; CPU | with ÷ plain@batch: wall; CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        spec = MODELS[row["model"]]

        def memory(config, row=row):
            median, low, high = peak(row, config)
            if low == high:
                return mib(median)
            return f"{mib(median)} ({mib(low)}–{mib(high)})"

        def ratio(a, b, row=row):
            return "; ".join(
                f"{median:.2f} ({low:.2f}–{high:.2f})"
                for median, low, high in (ratios(row, a, b, clock) for clock in (0, 1))
            )

        lines.append(
            f"| {row['model']} | {spec['batch']} / {spec['micro']} | "
            + " | ".join(memory(c) for c in CONFIGS)
            + f" | {mib(outputs_bytes(row['model']))} "
            f"| {ratio('with', 'without')} | {ratio('with', 'plain_batch')} |"
        )
    return "\n".join(lines)


def details(rows):
    """What the table leaves out: peak ranges, every time ratio in wall and
    CPU time, step seconds, the first step's losses."""
    lines = []
    pairs = (("with", "without"), ("with_per_sample", "without"), ("with", "plain_batch"),
             ("without", "plain_batch"))
    for row in rows:
        first = row["first_loss"]
        loss, plain = first["with"], first["plain_batch"]
        processes = len(row["peaks"]["with"])
        lines += [
            f"{row['model']}: weights {mib(row['peaks']['with'][0]['weights'])} MiB; "
            f"step peaks over {processes} processes, median (range) MiB: "
            + ", ".join(
                f"{LABELS[c]} {mib(peak(row, c)[0])} ({mib(peak(row, c)[1])}–"
                f"{mib(peak(row, c)[2])})"
                for c in CONFIGS
            ),
            "  resident (median) MiB: "
            + ", ".join(f"{LABELS[c]} {mib(peak(row, c, 'resident')[0])}" for c in CONFIGS),
        ]
        for clock, name in enumerate(("wall", "CPU")):
            seconds = {
                c: _common.median_range(r[c][clock] / row["steps"] for r in row["rounds"])[0]
                for c in TIMED
            }
            lines.append(
                f"  {name} time over {len(row['rounds'])} rounds, ratio median (range): "
                + ", ".join(
                    f"{LABELS[a]} ÷ {LABELS[b]} {m:.2f} ({lo:.2f}–{hi:.2f})"
                    for a, b in pairs
                    for m, lo, hi in [ratios(row, a, b, clock)]
                )
                + "; median step seconds "
                + ", ".join(f"{LABELS[c]} {v:.3f}" for c, v in seconds.items())
            )
        lines.append(
            f"  first step's loss: with {loss:.6f}, plain@batch {plain:.6f} "
            f"(relative difference {abs(loss - plain) / abs(plain):.1e}"
            f"{', MISMATCH' if abs(loss - plain) > 1e-5 * abs(plain) else ''})"
        )
    return "\n".join(lines)


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    add("--quick", action="store_true", help="fewer steps per epoch and timed rounds")
    add("--rounds", type=int, help="timed rounds per model (default 11; 5 with --quick)")
    add("--peak-repeats", type=int,
        help="processes per configuration's peak (default 5; 1 with --quick)")
    add("--jobs", type=int, default=2, help="peak workers at a time (default 2)")
    add("--json", help="also write the raw results to this file")
    add("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    if args.worker:
        task = json.loads(args.worker)
        answer = peak_worker(task) if task["kind"] == "peak" else time_worker(task)
        _common.subprocess_module().send_result(answer)
        return 0
    rows = []
    for name in args.models:
        started = time.perf_counter()
        rows.append(measure(name, args))
        print(f"# {name}: {time.perf_counter() - started:.0f} s; keras_memopt from "
              f"{rows[-1]['package']}", file=sys.stderr, flush=True)
    print(table(rows))
    print()
    print(details(rows))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
