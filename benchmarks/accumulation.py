"""Gradient accumulation: peak memory and time against plain Keras.

Each model is trained with Adam at the same effective batch as plain
`keras.Model`, as `AccumulatingModel` at micro-batches of 1/2, 1/4 and 1/8 of
the batch, and with Keras's optimizer-side `gradient_accumulation_steps` (the
input pipeline then delivers batch/k samples and the optimizer applies every
k-th step), with `jit_compile=False` and/or `True`.

Peaks: every configuration runs alone in a worker process on TensorFlow's BFC
CPU allocator: the allocator peak over one epoch after a warm-up epoch. It
repeats from epoch to epoch in one process, but where TensorFlow runs
independent ops side by side it can differ between processes:
`--peak-repeats N` measures each configuration in N processes and shows the
median and the range. *Resident* is the allocator's `current` between the
two epochs (weights, optimizer state, what the step functions keep alive).

Times: all configurations of a model run in one further process, so that what
differs between processes (where the allocator put the weights, how the
thread pools ran) is not read as a difference between configurations. An
epoch's time is the sum of its training steps, each timed from
`on_train_batch_begin` to `on_train_batch_end` (`fit`'s own fixed cost jumps
by ~0.2 s from call to call). Epochs are interleaved in a shuffled order each
round; *time vs plain* is the median over rounds of a configuration's epoch
time over plain Keras's in the same round, with the range.

`--constant-size` adds AccumulatingModel with its micro-batch size a constant
baked into the step's graph (as before the size became run-time state)
instead of the variable the step reads, in the same process.
`--compare-with PATH` also runs plain Keras and AccumulatingModel in workers
that import PATH's keras_memopt (an older commit's worktree); each checkout's
time worker times its own plain Keras, the checkouts' time workers alternate
(`--time-processes` each), and *this/other* is the median over paired rounds
of (this / its plain Keras) over (other / its plain Keras).

Models beyond `mlp`, `cnn` and `transformer`: `tiny` (2 x Dense(64), batch
64, 200 steps an epoch: what a step costs beyond its ops), `embedding` (a
200,000 x 128 Embedding, whose gradient is sparse), `tagger` (Embedding with
mask_zero=True, Bidirectional(LSTM), a per-token Dense: a masked per-token
loss) and `tagger_unmasked` (the same without mask_zero). The taggers also
time an inference-mode forward pass over the batch (`forward`: the work of
AccumulatingModel's pass that counts the unmasked tokens before its loop),
and `tagger` AccumulatingModel with that pass skipped (`uncounted`: for
timing only, its loss is wrong).

Run: python benchmarks/accumulation.py    (mlp without XLA: ~4 minutes on 2 cores)
     python benchmarks/accumulation.py --models mlp cnn transformer \\
         --jit-compile false true --constant-size --repeats 7
     python benchmarks/accumulation.py --models embedding --compare-with ../old-checkout
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

# Effective batch per model; chosen so that activations, not weights,
# dominate plain Keras's peak, and one epoch takes a few seconds on 2 cores
# (except `embedding`, whose table and optimizer slots are the point).
BATCH = {
    "mlp": 4096,
    "cnn": 256,
    "transformer": 128,
    "tiny": 64,
    "embedding": 2048,
    "tagger": 256,
    "tagger_unmasked": 256,
}
MODELS = tuple(BATCH)
SPLITS = (2, 4, 8)
STEPS_PER_EPOCH = 4
STEPS = {"tiny": 200}  # a step of ~1 ms: what each step costs beyond its ops shows
VOCABULARY = {"embedding": 200_000, "tagger": 20_000, "tagger_unmasked": 20_000}
SEQUENCE = {"transformer": 128, "embedding": 32, "tagger": 64, "tagger_unmasked": 64}
OPTIMIZERS = {"adam": 1e-4, "adagrad": 1e-2}


# -- workers ---------------------------------------------------------------------------


def build(name):
    from keras_memopt._keras import keras

    if name == "mlp":
        inputs, outputs = _common.mlp(256, depth=12, width=512)
    elif name == "tiny":
        inputs, outputs = _common.mlp(32, depth=2, width=64)
    elif name == "cnn":
        inputs, outputs = _common.cnn([32, 32, "pool", 64, 64, "pool"], padding="same")
    elif name == "transformer":
        inputs, outputs = _common.transformer(length=SEQUENCE[name], blocks=2)
    elif name == "embedding":
        inputs, outputs = _common.embedding_classifier(VOCABULARY[name], 128, SEQUENCE[name])
    elif name in ("tagger", "tagger_unmasked"):
        inputs, outputs = _common.tagger(
            VOCABULARY[name], 64, SEQUENCE[name], units=128, tags=17,
            mask_zero=name == "tagger",
        )
    else:
        raise ValueError(f"Unknown model. Expected one of {MODELS}. Received: name={name!r}")
    return keras.Model(inputs, outputs, name=name)


def batch_data(name, size):
    import numpy as np

    rng = np.random.default_rng(0)
    if name in ("mlp", "tiny"):
        x = rng.standard_normal((size, 256 if name == "mlp" else 32)).astype("float32")
    elif name == "cnn":
        x = rng.standard_normal((size, 32, 32, 3)).astype("float32")
    elif name in ("transformer", "embedding"):
        x = rng.integers(0, VOCABULARY.get(name, 1000), (size, SEQUENCE[name])).astype("int32")
    else:
        # Sentences of 1/4 to all of the sequence, padded with token 0; a tag per token.
        length = SEQUENCE[name]
        x = rng.integers(1, VOCABULARY[name], (size, length)).astype("int32")
        lengths = rng.integers(length // 4, length + 1, size)
        x[np.arange(length)[None, :] >= lengths[:, None]] = 0
        return x, rng.integers(0, 17, (size, length)).astype("int32")
    return x, rng.integers(0, 10, size).astype("int32")


def setup(config):
    """The model of one configuration, and a function that runs one epoch
    and returns the seconds its steps took."""
    import tensorflow as tf

    import keras_memopt as kmo
    from keras_memopt._keras import keras

    keras.utils.set_random_seed(0)
    name, batch, kind, split = config["model"], config["batch"], config["kind"], config["split"]
    model = build(name)
    x, y = batch_data(name, batch)
    if kind == "forward":
        return model, forward_epoch(model, x)
    optimizer = getattr(keras.optimizers, config["optimizer"].capitalize())
    rate = OPTIMIZERS[config["optimizer"]]
    pipeline_batch = batch
    if kind == "keras_ga":
        optimizer = optimizer(rate, gradient_accumulation_steps=split)
        pipeline_batch = batch // split
    else:
        optimizer = optimizer(rate)
    if kind in ("accumulating", "uncounted", "constant"):
        model = kmo.AccumulatingModel.from_model(model, micro_batch_size=batch // split)
        if kind == "uncounted":
            skip_counting_pass(model)
        elif kind == "constant":
            bake_micro_batch_size(model, batch // split)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=config["jit_compile"],
    )
    # One effective batch held in memory, delivered STEPS_PER_EPOCH times.
    dataset = (
        tf.data.Dataset.from_tensors((x, y))
        .unbatch()
        .batch(pipeline_batch)
        .repeat(STEPS.get(name, STEPS_PER_EPOCH))
    )
    timer = _common.step_timer()

    def epoch():
        model.fit(dataset, epochs=1, verbose=0, callbacks=[timer])
        return sum(timer.seconds)

    return model, epoch


def skip_counting_pass(model):
    """AccumulatingModel's step without its counting pass (`LossSplit.batch_counts`):
    for timing only, the loss is then wrong."""
    import tensorflow as tf

    split = getattr(getattr(model, "_run", None), "loss_split", None)
    if not hasattr(split, "batch_counts"):
        raise RuntimeError("This keras_memopt has no counting pass (`batch_counts`) to skip.")
    outputs = len(model.outputs)
    split.batch_counts = lambda forward, data, size, jit_compile=False: tf.ones([outputs])


def bake_micro_batch_size(model, size):
    """Makes the step read the micro-batch size as a constant in its graph
    (as keras_memopt did before it became a variable): for comparing the two."""
    import tensorflow as tf

    setting = getattr(model, "_setting", None)
    if not hasattr(setting, "size_tensor"):
        raise RuntimeError("This keras_memopt reads no run-time micro-batch setting.")
    setting.size_tensor = lambda batch_size: tf.minimum(
        tf.constant(size, batch_size.dtype), tf.maximum(batch_size, 1)
    )


def forward_epoch(model, x):
    """A function that runs STEPS_PER_EPOCH inference-mode forward passes over
    the batch `x` (the work of the counting pass) and returns their seconds."""
    import tensorflow as tf

    forward = tf.function(lambda x: model(x, training=False))
    x = tf.constant(x)

    def epoch():
        started = time.perf_counter()
        for _ in range(STEPS_PER_EPOCH):
            forward(x).numpy()
        return time.perf_counter() - started

    return epoch


def peak_worker(config):
    """One configuration alone in its TensorFlow: its allocator peak."""
    import tensorflow as tf

    model, epoch = setup(config)
    epoch()  # traces, builds the optimizer
    tf.config.experimental.reset_memory_stats("CPU:0")
    resident = tf.config.experimental.get_memory_info("CPU:0")["current"]
    epoch()
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    weights = sum(int(v.numpy().nbytes) for v in model.weights)
    return dict(peak=peak, resident=resident, weights=weights, package=_common.package_file())


def time_worker(configs, repeats, seed):
    """All configurations of a model in one TensorFlow: their epoch seconds, by round."""
    epochs = [setup(config)[1] for config in configs]
    for epoch in epochs:
        epoch()  # traces, builds the optimizer
    rng = random.Random(seed)
    rounds = []
    for _ in range(repeats):
        order = list(range(len(configs)))
        rng.shuffle(order)
        seconds = [0.0] * len(configs)
        for index in order:
            seconds[index] = epochs[index]()
        rounds.append(seconds)
    return dict(rounds=rounds, package=_common.package_file())


# -- parent ----------------------------------------------------------------------------


def configurations(name, jit_compile, optimizer, checkout, own=True, constant=False):
    """The configurations of a model. `own`: also those that do not depend
    on the checkout (Keras's accumulation, the forward pass) and those that
    patch this checkout's step; `constant`: AccumulatingModel with its
    micro-batch size baked in."""
    batch = BATCH[name]
    base = dict(model=name, batch=batch, jit_compile=jit_compile, optimizer=optimizer,
                checkout=checkout)
    yield dict(base, kind="plain", split=1)
    for split in SPLITS:
        yield dict(base, kind="accumulating", split=split)
    legacy = os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true")
    if own and not legacy:  # tf_keras optimizers have no `gradient_accumulation_steps`
        for split in SPLITS:
            yield dict(base, kind="keras_ga", split=split)
    if own and constant:
        for split in SPLITS:
            yield dict(base, kind="constant", split=split)
    if own and name == "tagger":
        for split in SPLITS[:2]:
            yield dict(base, kind="uncounted", split=split)
    if own and name.startswith("tagger"):
        yield dict(base, kind="forward", split=1)


def label(config):
    batch, split, kind = config["batch"], config["split"], config["kind"]
    micro = f"micro-batch {batch // split} (1/{split})"
    return {
        "plain": f"plain keras.Model, batch {batch}",
        "accumulating": f"AccumulatingModel, {micro}",
        "constant": f"AccumulatingModel, {micro}, size a graph constant",
        "uncounted": f"AccumulatingModel, {micro}, counting pass skipped",
        "keras_ga": f"Keras gradient_accumulation_steps={split} (batch {batch // split})",
        "forward": f"forward pass only, training=False, batch {batch}",
    }[kind]


def measure_peaks(configs, repeats, jobs):
    """Per configuration, the answers of `repeats` peak workers (`jobs` at a time)."""
    tasks = [config for config in configs for _ in range(repeats)]
    answers = []
    for first in range(0, len(tasks), jobs):
        answers += _common.results([
            _common.start_worker(__file__, {"peak": config}, config["checkout"])
            for config in tasks[first : first + jobs]
        ])
    return [answers[i : i + repeats] for i in range(0, len(answers), repeats)]


def measure_times(configs, repeats, processes, seed):
    """Per checkout (the keys of `configs`): its rounds of epoch seconds, the
    checkouts' time workers in turn, and the keras_memopt each imported."""
    checkouts = list(configs)
    rounds = {checkout: [] for checkout in checkouts}
    packages = {}
    for process in range(processes):
        for checkout in checkouts if process % 2 == 0 else checkouts[::-1]:
            task = {"time": configs[checkout], "repeats": repeats, "seed": seed + 100 * process}
            (answer,) = _common.results([_common.start_worker(__file__, task, checkout)])
            rounds[checkout] += answer["rounds"]
            packages[checkout] = answer["package"]
    return rounds, packages


def measure(name, jit_compile, args, seed):
    """One row per configuration of `name`, this checkout's and `args.other`'s."""
    checkouts = [_common.REPOSITORY] + ([args.other] if args.other else [])
    configs = {
        checkout: list(configurations(name, jit_compile, args.optimizer, checkout,
                                      own=index == 0, constant=args.constant_size))
        for index, checkout in enumerate(checkouts)
    }
    every = [config for checkout in checkouts for config in configs[checkout]]
    # Peaks side by side (a peak does not depend on the load), then the times.
    peaks = measure_peaks(every, args.peak_repeats, args.jobs)
    rounds, packages = measure_times(configs, args.repeats, args.processes, seed)
    rows = []
    for config, answers in zip(every, peaks, strict=True):
        mine = rounds[config["checkout"]]
        index = configs[config["checkout"]].index(config)
        rows.append(dict(
            config=config,
            packages=sorted({a["package"] for a in answers} | {packages[config["checkout"]]}),
            peak_mib=[a["peak"] / 2**20 for a in answers],
            resident_mib=[a["resident"] / 2**20 for a in answers],
            weights_mib=answers[0]["weights"] / 2**20,
            epoch_s=statistics.median(seconds[index] for seconds in mine),
            ratios=[seconds[index] / seconds[0] for seconds in mine],
        ))
    return rows


def mib(values, digits=None):
    """MiB figures of several processes: the median, and the range if they differ."""
    median, low, high = _common.median_range(values)
    if digits is None:
        digits = 0 if median >= 10 else 1
    if round(high - low, digits) == 0:
        return f"{median:.{digits}f}"
    return f"{median:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def ratio(values):
    median, low, high = _common.median_range(values)
    return f"{median:.2f}x ({low:.2f}-{high:.2f})"


def model_label(config):
    optimizer = "" if config["optimizer"] == "adam" else f" ({config['optimizer']})"
    return f"{config['model']}{optimizer}"


def find(rows, config, **changes):
    """The row of `config` with `changes` (e.g. another kind or checkout), or None."""
    wanted = {**config, **changes}
    return next((row for row in rows if row["config"] == wanted), None)


def table(rows):
    """This checkout's configurations against plain Keras."""
    lines = [
        "| model | jit_compile | configuration | peak MiB | peak vs plain "
        "| time vs plain (median, range) | plain epoch s | resident MiB |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        config = row["config"]
        if config["checkout"] != _common.REPOSITORY:
            continue
        plain = find(rows, config, kind="plain", split=1)
        peak_vs_plain = statistics.median(row["peak_mib"]) / statistics.median(plain["peak_mib"])
        lines.append(
            f"| {model_label(config)} | {config['jit_compile']} | {label(config)} "
            f"| {mib(row['peak_mib'])} | {peak_vs_plain:.2f}x | {ratio(row['ratios'])} "
            f"| {plain['epoch_s']:.2f} | {mib(row['resident_mib'], 1)} |"
        )
    return "\n".join(lines)


def comparison_table(rows, other):
    """Plain Keras and AccumulatingModel of this checkout against `other`'s."""
    lines = [
        f"this: {_common.REPOSITORY}; other: {other}",
        "",
        "| model | jit_compile | configuration | peak MiB this / other "
        "| resident MiB this / other | time vs plain, this | time vs plain, other "
        "| time this/other (median, range) |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        config = row["config"]
        theirs = find(rows, config, checkout=other)
        if config["checkout"] != _common.REPOSITORY or theirs is None:
            continue
        paired = [a / b for a, b in zip(row["ratios"], theirs["ratios"], strict=True)]
        lines.append(
            f"| {model_label(config)} | {config['jit_compile']} | {label(config)} "
            f"| {mib(row['peak_mib'])} / {mib(theirs['peak_mib'])} "
            f"| {mib(row['resident_mib'], 1)} / {mib(theirs['resident_mib'], 1)} "
            f"| {statistics.median(row['ratios']):.2f}x "
            f"| {statistics.median(theirs['ratios']):.2f}x | {ratio(paired)} |"
        )
    return "\n".join(lines)


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--models", nargs="+", choices=MODELS, default=["mlp"])
    add("--jit-compile", nargs="+", choices=("false", "true"), default=["false"])
    add("--repeats", type=int, default=5, help="timed rounds per time worker (default 5)")
    add("--optimizer", choices=tuple(OPTIMIZERS), default="adam", help="for every model")
    add("--constant-size", action="store_true",
        help="also AccumulatingModel with its micro-batch size a graph constant")
    add("--compare-with", metavar="PATH", dest="other",
        help="another checkout (the folder holding its keras_memopt/), measured too")
    add("--time-processes", type=int, dest="processes",
        help="time workers per checkout (default 3 with --compare-with, else 1)")
    add("--peak-repeats", type=int, default=1,
        help="processes per configuration's peak (the median is shown, with the range)")
    add("--jobs", type=int, default=4, help="peak workers at a time (default 4)")
    add("--json", help="also write the rows to this JSON file")
    add("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.other:
        args.other = os.path.abspath(args.other)
        if not os.path.isfile(os.path.join(args.other, "keras_memopt", "__init__.py")):
            parser.error("--compare-with takes the folder that holds a keras_memopt package. "
                         f"Received: --compare-with={args.other}")
    args.processes = args.processes or (3 if args.other else 1)
    return args


def main(argv=None):
    args = parse(argv)
    if args.worker:
        task = json.loads(args.worker)
        if "peak" in task:
            answer = peak_worker(task["peak"])
        else:
            answer = time_worker(task["time"], task["repeats"], task["seed"])
        _common.subprocess_module().send_result(answer)
        return 0
    rows = []
    for name in args.models:
        for jit in args.jit_compile:
            started = time.perf_counter()
            new = measure(name, jit == "true", args, seed=len(rows))
            rows += new
            packages = sorted({p for row in new for p in row["packages"]})
            print(
                f"# {name}, jit_compile={jit}: {time.perf_counter() - started:.0f} s; weights "
                f"{new[0]['weights_mib']:.1f} MiB; keras_memopt from {', '.join(packages)}",
                file=sys.stderr,
                flush=True,
            )
    print(table(rows))
    if args.other:
        print()
        print(comparison_table(rows, args.other))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
