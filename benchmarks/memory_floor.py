"""The memory floor: what a step of AccumulatingModel holds beyond plain Keras's.

For an MLP whose weights are a large part of its memory, a CNN and a
transformer, each configuration trains in a fresh worker process on
TensorFlow's BFC CPU allocator, and the figure is the *step peak*: the
allocator's peak during a training step above what is in use when the step
starts (weights, optimizer state, the batch), for each of `--steps` steps
after two warm-up steps, in `--repeats` processes. Configurations, all at
micro-batch `b`:

- plain Keras (`keras.Model`) training on a batch of `b`;
- `AccumulatingModel` training on the whole batch in micro-batches of `b`;
- the same with `OOMBackoff` attached (its rollback and update check);
- with recomputation: both models built with `keras_memopt.Remat` around
  every block (plain Keras + Remat against AccumulatingModel + Remat), and
  `AccumulatingModel(..., remat="auto")`.

The table gives each configuration's highest step peak in W, the bytes of
the trainable weights (float32): plain Keras's, and the others' above the
plain model they are compared with (plain + Remat for the recomputed ones).
Accumulation needs one copy of the weights more than plain Keras at the same
micro-batch (the gradient sum, +1 W at most); the rest is what the package
adds. The highest, because a step runs out of memory at its highest peak;
TensorFlow's executor orders a step's ops by the run times it measures as
it goes, so a step's peak varies between steps and processes in plain Keras
too, and so does the allocator's rounding (a chunk less than twice a request
is handed out whole). `--statistic lowest` gives the lowest instead, where
a copy the package makes shows in every order. `--json` gives every step's
peak. `peak ÷ floor` divides the AccumulatingModel's step peak plus what is
in use at its start by the analytical floor: weights, optimizer state, the
gradient sum and one micro-batch's activations (`keras_memopt.planning`'s
estimate from the model's shapes).

The batch itself is the input pipeline's and is outside the step peak: at
micro-batch `b` an AccumulatingModel's batch is the effective batch, which
plain Keras at batch `b` does not hold.

Run: python benchmarks/memory_floor.py  (about 30 minutes on 2 busy cores;
     TF_USE_LEGACY_KERAS=1 for tf_keras; --models mlp --optimizers adam for
     a quick look)
"""

from __future__ import annotations

import argparse
import json

import _common

_common.use_allocator_env()  # before TensorFlow starts

MODELS = {
    # name: (effective batch, micro-batches measured)
    "mlp": (4096, (64, 512)),
    "cnn": (256, (16, 64)),
    "transformer": (128, (8, 32)),
}
OPTIMIZERS = ("adam", "adamw", "sgd")
KINDS = (
    "plain", "accumulating", "backoff", "plain_remat", "accumulating_remat", "accumulating_auto",
)


# -- the worker: one configuration in a fresh process ------------------------------------


def _blocks(name):
    """The model's input and its blocks (each a list of layers), on both Keras lines."""
    from keras_memopt._keras import keras

    layers = keras.layers
    if name == "mlp":
        return keras.Input((256,)), [[layers.Dense(1024, activation="relu")] for _ in range(4)]
    if name == "cnn":
        blocks = []
        for filters in (32, 32, 64, 64):
            blocks.append([
                layers.Conv2D(filters, 3, padding="same", use_bias=False),
                layers.BatchNormalization(),
                layers.Activation("relu"),
            ])
        return keras.Input((32, 32, 3)), blocks
    width = 128
    return keras.Input((64,), dtype="int32"), [[layers.Embedding(1000, width)]] + [
        [_TransformerBlock(width)] for _ in range(2)
    ]


def _TransformerBlock(width):  # noqa: N802 - builds a layer, named like one
    return _common.transformer_block_class()(width)


def _model(name, kind, micro_batch_size):
    from keras_memopt import AccumulatingModel, Remat
    from keras_memopt._keras import keras

    keras.utils.set_random_seed(0)
    inputs, blocks = _blocks(name)
    x = inputs
    remat = kind.endswith("_remat")
    for block in blocks:
        if remat and not isinstance(block[0], keras.layers.Embedding):
            # One recomputed segment per block: it keeps only the block's input.
            x = Remat(block[0] if len(block) == 1 else keras.Sequential(block))(x)
        else:
            for layer in block:
                x = layer(x)
    if name == "transformer":
        x = keras.layers.GlobalAveragePooling1D()(x)
    elif name == "cnn":
        x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(10)(x)
    if kind.startswith("plain"):
        return keras.Model(inputs, outputs)
    auto = "auto" if kind == "accumulating_auto" else None
    return AccumulatingModel(inputs, outputs, micro_batch_size=micro_batch_size, remat=auto)


def _optimizer(name):
    from keras_memopt._keras import keras

    if name == "adam":
        return keras.optimizers.Adam(1e-3)
    if name == "adamw":
        return keras.optimizers.AdamW(1e-3, weight_decay=0.01)
    return keras.optimizers.SGD(0.01, momentum=0.9)


def _batch(name, size):
    """A batch made on the device (in the allocator), the same in every process."""
    import tensorflow as tf

    seed = (0, 1)
    if name == "mlp":
        x = tf.random.stateless_uniform((size, 256), seed)
    elif name == "cnn":
        x = tf.random.stateless_uniform((size, 32, 32, 3), seed)
    else:
        x = tf.random.stateless_uniform((size, 64), seed, maxval=1000, dtype=tf.int32)
    return x, tf.random.stateless_uniform((size,), seed, maxval=10, dtype=tf.int32)


def _step(model, kind, data, batch_size):
    """The function that runs one training step of `model` on `data`."""
    import tensorflow as tf

    from keras_memopt.callbacks import OOMBackoff

    if kind.startswith("plain"):
        model.optimizer.build(model.trainable_variables)
        return tf.function(model.train_step)
    # Keras's fit prepares the runner (first-step state, an attached OOMBackoff).
    callbacks = [OOMBackoff(verbose=0)] if kind == "backoff" else []
    model.fit(*data, batch_size=batch_size, epochs=1, verbose=0, callbacks=callbacks)
    runner = model.make_train_function()
    if kind == "backoff":
        model.oom_policy = callbacks[0].policy  # as while attached to `fit`
    return runner.run


def worker(task):
    """One configuration in this process: its step peaks and state, in bytes."""
    import numpy as np
    import tensorflow as tf

    from keras_memopt._keras import LEGACY, keras, optimizer_variables
    from keras_memopt.planning import MemoryPlanner

    tf.config.threading.set_inter_op_parallelism_threads(task["inter_op_threads"])
    name, kind, b = task["model"], task["kind"], task["micro_batch_size"]
    batch_size = MODELS[name][0]
    model = _model(name, kind, b)
    model.compile(
        _optimizer(task["optimizer"]),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    data = _batch(name, b if kind.startswith("plain") else batch_size)
    step = _step(model, kind, data, batch_size)
    for _ in range(2):
        step(data)
    peaks = []
    for _ in range(task["steps"]):
        tf.config.experimental.reset_memory_stats("CPU:0")
        start = tf.config.experimental.get_memory_info("CPU:0")["current"]
        step(data)
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - start)

    def size(tensors):
        return sum(int(np.prod(t.shape)) * tf.as_dtype(t.dtype).size for t in tensors)

    return dict(
        task,
        keras="tf_keras" if LEGACY else "keras3",
        peaks=peaks,
        weights=size(model.trainable_variables),
        optimizer_state=size(optimizer_variables(model.optimizer)),
        in_use=start - size(data),
        batch=size(data),
        activations=MemoryPlanner(model).activation_bytes_per_sample * b,
    )


# -- the table ------------------------------------------------------------------------------


def measure(models, optimizers, kinds, steps, repeats, inter_op_threads, jobs):
    tasks = [
        dict(model=name, kind=kind, optimizer=optimizer, micro_batch_size=b, steps=steps,
             inter_op_threads=inter_op_threads, process=process)
        for process in range(repeats)
        for name in models
        for b in MODELS[name][1]
        for optimizer in optimizers
        for kind in kinds
    ]
    return _common.run_workers(__file__, tasks, jobs)


COLUMNS = (
    # (heading, kind, the kind it is compared with)
    ("AccumulatingModel", "accumulating", "plain"),
    ("+ OOMBackoff", "backoff", "plain"),
    ("plain + Remat", "plain_remat", None),
    ("AccumulatingModel + Remat", "accumulating_remat", "plain_remat"),
    ('remat="auto"', "accumulating_auto", "plain_remat"),
)


def _pick(answers, statistic="highest"):
    """Each configuration's highest (or lowest) step peak over its steps and processes, in bytes."""
    pick = max if statistic == "highest" else min
    picked = {}
    for a in answers:
        key = (a["keras"], a["model"], a["optimizer"], a["micro_batch_size"], a["kind"])
        picked[key] = pick(picked.get(key, pick(a["peaks"])), pick(a["peaks"]))
    return picked


def _cell(peaks, key, kind, base, w):
    """`kind`'s step peak above `base`'s in W, or its own in W."""
    if (*key, kind) not in peaks:
        return "-"
    if base is None:
        return f"{peaks[(*key, kind)] / w:.2f} W"
    return f"{(peaks[(*key, kind)] - peaks[(*key, base)]) / w:+.2f} W"


def table(answers, statistic="highest"):
    """The floor table: each figure from the highest (or lowest) step peak of its configuration."""
    peaks = _pick(answers, statistic)
    first = {}
    for a in answers:
        first.setdefault((a["keras"], a["model"], a["optimizer"], a["micro_batch_size"]), a)
    lines = [
        "| Keras | model | optimizer | b | W (MiB) | plain at b "
        + "".join(f"| {heading} " for heading, _, _ in COLUMNS)
        + "| peak ÷ floor |",
        "|---|---|---|---:|---:|---:|" + "---:|" * (len(COLUMNS) + 1),
    ]
    for key in sorted(first):
        a = first[key]
        w = a["weights"]
        floor = a["in_use"] + w + a["activations"]  # weights, slots, the sum, activations
        accumulating = peaks.get((*key, "accumulating"))
        ratio = "-" if accumulating is None else f"{(a['in_use'] + accumulating) / floor:.2f}"
        cells = "".join(f"| {_cell(peaks, key, kind, base, w)} " for _, kind, base in COLUMNS)
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {w / 2**20:.2f} "
            f"| {_cell(peaks, key, 'plain', None, w)} {cells}| {ratio} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--steps", type=int, default=8, help="measured steps per process")
    parser.add_argument("--statistic", choices=("highest", "lowest"), default="highest",
                        help="which step peak of each configuration the table gives")
    parser.add_argument("--repeats", type=int, default=2, help="processes per configuration")
    parser.add_argument("--inter-op-threads", type=int, default=1,
                        help="TensorFlow's inter-op threads in the workers (1: the same "
                             "order of ops every step; 0: TensorFlow's default)")
    args = _common.parse_or_work(parser, worker, argv, jobs=2)
    if args is None:
        return
    answers = measure(args.models, args.optimizers, args.kinds, args.steps, args.repeats,
                      args.inter_op_threads, args.jobs)
    print(json.dumps(answers, indent=1) if args.json else table(answers, args.statistic))


if __name__ == "__main__":
    main()
