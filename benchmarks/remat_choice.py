"""`remat="auto"` against the obvious choices: no recomputation and one `Remat` per block.

Each family is a stack of blocks and a head, trained as an `AccumulatingModel`
(Adam, sparse cross-entropy, four micro-batches per batch) in three forms:

- none: the blocks' layers inline in the functional graph, `remat=None`;
- per block: each block wrapped in `keras_memopt.Remat` (a custom block layer
  as it is, a block of layers as a functional model of them);
- auto: the blocks inline, `remat="auto"` (what it chose is printed below the
  table: `model.remat_choice`).

Families: `transformer`, an Embedding(1000, 128) and 4 post-norm encoder
blocks built from layers (MultiHeadAttention with 4 heads, a GELU
feed-forward of 512), 64 tokens; `transformer_layer`, the memory floor's
(benchmarks/memory_floor.py): 2 blocks, each one custom `Layer`; `mlp`, 8
Dense(1024, relu) blocks on 1024 features; `mlp_floor`, the memory floor's 4
Dense(1024) on 256 features; `gelu_stack`, `silu_stack` and `relu_stack`, 8
Dense(1024) blocks with that activation on 256 features (a transformer's
feed-forward half, issue 55); `cnn`, the memory floor's 4 blocks of Conv2D
(3x3, same, no bias), BatchNormalization and ReLU on 32x32x3 images.

Memory: each configuration trains in a fresh worker process on TensorFlow's
BFC CPU allocator; the figure is the step peak, the allocator's peak during
a train step above what is in use when the step starts (weights, optimizer
state, the batch), over `--steps` steps after two warm-up steps, in
`--repeats` processes: the lowest, and the spread (highest − lowest over
the lowest) that TensorFlow's op order gives the same configuration.

Time: the three forms of a family at one micro-batch size run in one more
process, their epochs of `--time-steps` steps interleaved in a shuffled order
each round; the ratio is the median over `--rounds` rounds of a form's epoch
time over none's in the same round.

Run: python benchmarks/remat_choice.py  (with --repeats 2 --rounds 3, 22
     minutes on 2 busy cores; TF_USE_LEGACY_KERAS=1 for tf_keras; --families
     cnn --no-time for a quick look)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import _common

_common.use_allocator_env()  # before TensorFlow starts

FAMILIES = {
    # name: micro-batch sizes measured (the batch is four micro-batches)
    "transformer": (16, 64),
    "transformer_layer": (8, 32),
    "mlp": (16, 128),
    "mlp_floor": (64, 512),
    "gelu_stack": (64, 256),
    "silu_stack": (256,),
    "relu_stack": (256,),
    "cnn": (16, 64),
}
FORMS = ("none", "per block", "auto")


def _encoder_block(x, width=128):
    from keras_memopt._keras import keras

    layers = keras.layers
    attended = layers.MultiHeadAttention(4, width // 4)(x, x)
    x = layers.LayerNormalization()(layers.Add()([x, attended]))
    inner = layers.Dense(width)(layers.Dense(4 * width, activation="gelu")(x))
    return layers.LayerNormalization()(layers.Add()([x, inner]))


def _conv_block(x, filters):
    from keras_memopt._keras import keras

    layers = keras.layers
    x = layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
    return layers.Activation("relu")(layers.BatchNormalization()(x))


def family(name):
    """(input, blocks, head): each block a function of a tensor, the head too."""
    from keras_memopt._keras import keras

    layers = keras.layers
    if name == "transformer":
        blocks = [_encoder_block] * 4
        return keras.Input((64,), dtype="int32"), blocks, _pooled_head(1), 128
    if name == "transformer_layer":
        block = _common.transformer_block_class()
        blocks = [lambda x, block=block: block(128)(x)] * 2
        return keras.Input((64,), dtype="int32"), blocks, _pooled_head(1), 128
    if name in ("mlp", "mlp_floor") or name.endswith("_stack"):
        depth, features = (4, 256) if name == "mlp_floor" else (8, 1024 if name == "mlp" else 256)
        activation = name[:-len("_stack")] if name.endswith("_stack") else "relu"
        blocks = [lambda x: layers.Dense(1024, activation=activation)(x)] * depth
        return keras.Input((features,)), blocks, lambda x: layers.Dense(10)(x), None
    blocks = [lambda x, f=f: _conv_block(x, f) for f in (32, 32, 64, 64)]
    return keras.Input((32, 32, 3)), blocks, _pooled_head(2), None


def _pooled_head(rank):
    from keras_memopt._keras import keras

    pool = keras.layers.GlobalAveragePooling1D if rank == 1 else keras.layers.GlobalAveragePooling2D
    return lambda x: keras.layers.Dense(10)(pool()(x))


def build(name, form, micro_batch_size):
    """The family's `AccumulatingModel` in `form` ("none", "per block", "auto")."""
    from keras_memopt import AccumulatingModel, Remat
    from keras_memopt._keras import keras

    keras.utils.set_random_seed(0)
    inputs, blocks, head, vocabulary_width = family(name)
    x = inputs
    if vocabulary_width:
        x = keras.layers.Embedding(1000, vocabulary_width)(x)
    for block in blocks:
        if form == "per block":
            block_input = keras.Input(tuple(x.shape[1:]), dtype=x.dtype)
            x = Remat(keras.Model(block_input, block(block_input)))(x)
        else:
            x = block(x)
    remat = "auto" if form == "auto" else None
    return AccumulatingModel(inputs, head(x), micro_batch_size=micro_batch_size, remat=remat)


def _compiled(name, form, micro):
    import warnings

    from keras_memopt._keras import keras

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "found nothing worth recomputing"
        model = build(name, form, micro)
    model.compile(
        keras.optimizers.Adam(1e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    return model, _common.synthetic_batch(model, 4 * micro)


def memory_worker(task):
    """One configuration's step peaks (bytes), in this process."""
    import tensorflow as tf

    from keras_memopt._keras import LEGACY

    model, (x, y) = _compiled(task["family"], task["form"], task["micro"])
    for _ in range(2):
        model.train_on_batch(x, y)
    peaks = []
    for _ in range(task["steps"]):
        tf.config.experimental.reset_memory_stats("CPU:0")
        start = tf.config.experimental.get_memory_info("CPU:0")["current"]
        model.train_on_batch(x, y)
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - start)
    choice = getattr(model, "remat_choice", "-")  # older checkouts have none
    return dict(task, keras="tf_keras" if LEGACY else "keras3", peaks=peaks,
                segments=len(model.recomputed_segments), choice=choice,
                estimate=_estimate(task, choice))


def _estimate(task, choice):
    """What `remat="auto"` estimates for `task`'s form (bytes), or None where
    it has no such candidate (or this checkout no estimate)."""
    import warnings

    try:
        from keras_memopt._remat.candidates import PER_BLOCK
        from keras_memopt._remat.segments import estimated_candidates
    except ImportError:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inline = build(task["family"], "none", task["micro"])
    for name, _, peak in estimated_candidates(inline, task["micro"]):
        if task["form"] == "none" and name == "none":
            return peak
        if task["form"] == "per block" and name == PER_BLOCK:
            return peak
        if task["form"] == "auto" and choice.startswith((f"{name} (", f"{name}:")):
            return peak
    return None


def time_worker(task):
    """Each form's epoch time over none's, per round, in this process."""
    models = {form: _compiled(task["family"], form, task["micro"]) for form in FORMS}
    for model, (x, y) in models.values():
        for _ in range(2):
            model.train_on_batch(x, y)
    ratios = {form: [] for form in FORMS}
    order = list(FORMS)
    for _ in range(task["rounds"]):
        random.shuffle(order)
        seconds = {}
        for form in order:
            model, (x, y) = models[form]
            started = time.perf_counter()
            for _ in range(task["steps"]):
                model.train_on_batch(x, y)
            seconds[form] = time.perf_counter() - started
        for form in FORMS:
            ratios[form].append(seconds[form] / seconds["none"])
    return dict(task, ratios=ratios)


def worker(task):
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(task["inter_op_threads"])
    return time_worker(task) if task["kind"] == "time" else memory_worker(task)


def table(memory, times):
    """Markdown: per family and micro-batch, each form's lowest step peak, spread and time."""
    lowest, highest, notes, estimates = {}, {}, {}, {}
    for answer in memory:
        key = (answer["family"], answer["micro"], answer["form"])
        estimates[key] = answer.get("estimate")
        lowest[key] = min(lowest.get(key, min(answer["peaks"])), min(answer["peaks"]))
        highest[key] = max(highest.get(key, max(answer["peaks"])), max(answer["peaks"]))
        if answer["form"] == "auto":
            notes[key[:2]] = (answer["segments"], answer["choice"])
    ratio = {(t["family"], t["micro"], form): statistics.median(t["ratios"][form])
             for t in times for form in FORMS}
    lines = [
        "| family | micro-batch | none MiB (spread) | per block MiB (spread) | auto MiB (spread) "
        "| auto ÷ lower of the two | estimate ÷ measured: none, per block, auto "
        "| time: per block | time: auto |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, micro in sorted({key[:2] for key in lowest}):
        mib, low = 2**20, {f: lowest.get((name, micro, f)) for f in FORMS}
        cells = [f"{low[f] / mib:.1f} ({(highest[(name, micro, f)] - low[f]) / low[f]:.0%})"
                 if low[f] else "-" for f in FORMS]
        versus = "-"
        if low["auto"] and low["none"] and low["per block"]:
            versus = f"{low['auto'] / min(low['none'], low['per block']):.2f}"
        accuracy = ", ".join(
            f"{estimates[(name, micro, f)] / low[f]:.2f}"
            if low[f] and estimates.get((name, micro, f)) else "-" for f in FORMS
        )
        times_cells = [f"{ratio[(name, micro, f)]:.2f}" if (name, micro, f) in ratio else "-"
                       for f in ("per block", "auto")]
        row = [*cells, versus, accuracy, *times_cells]
        lines.append(f"| {name} | {micro} | " + " | ".join(row) + " |")
    lines.append("")
    for (name, micro), (segments, choice) in sorted(notes.items()):
        lines.append(f"- {name}, micro-batch {micro}: {segments} recomputed segment(s); {choice}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--steps", type=int, default=4, help="measured steps per process")
    parser.add_argument("--repeats", type=int, default=3, help="processes per configuration")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds")
    parser.add_argument("--time-steps", type=int, default=3, help="steps per timed epoch")
    parser.add_argument("--no-time", action="store_true", help="memory only")
    parser.add_argument("--inter-op-threads", type=int, default=0,
                        help="TensorFlow's inter-op threads in the workers (0: its default, "
                             "as training runs; 1: one op at a time)")
    parser.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    parser.add_argument("--micro", type=int, nargs="+", help="micro-batch sizes (default: each "
                        "family's)")
    parser.add_argument("--checkout", default=_common.REPOSITORY,
                        help="the checkout whose keras_memopt the workers import (an older "
                             "commit's, to compare)")
    args = _common.parse_or_work(parser, worker, argv)
    if args is None:
        return
    threads = args.inter_op_threads
    memory_tasks = [
        dict(kind="memory", family=name, micro=micro, form=form, steps=args.steps, process=p,
             inter_op_threads=threads)
        for p in range(args.repeats) for name in args.families
        for micro in (args.micro or FAMILIES[name]) for form in args.forms
    ]
    time_tasks = [] if args.no_time else [
        dict(kind="time", family=name, micro=max(args.micro or FAMILIES[name]), rounds=args.rounds,
             steps=args.time_steps, inter_op_threads=threads)
        for name in args.families
    ]
    memory = _common.run_workers(__file__, memory_tasks, args.jobs, args.checkout)
    times = _common.run_workers(__file__, time_tasks, checkout=args.checkout)
    print(json.dumps(memory + times, indent=1) if args.json else table(memory, times))


if __name__ == "__main__":
    main()
