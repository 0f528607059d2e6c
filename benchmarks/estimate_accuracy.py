"""The planner's shapes-only estimate against plain Keras's measured step peak.

For each family and batch size, `MemoryPlanner(model, optimizer="adam")
.estimate(batch).peak` (no measurement: the traced step, see
`keras_memopt.planning.estimate`) is compared with what plain Keras
(`keras.Model`, Adam, sparse cross-entropy, `train_on_batch`) peaks at: the
allocator's peak over 4 steps after 4 (the first traces), less what was in
use before the model was built (so weights, optimizer slots, gradients and the
batch count), on TensorFlow's BFC CPU allocator, each in a fresh process;
the median of `--repeats` processes and their spread (highest − lowest over
the median).

Families: `transformer` (Embedding(1000, 128), 4 post-norm encoder blocks of
layers, 64 tokens), `transformer_layer` (2 blocks, each one custom `Layer`),
`cnn` (4 blocks of Conv2D, BatchNormalization, ReLU on 32x32x3), `mlp` (8
Dense(1024) on 1024 features), and sequence taggers on 48 tokens of
Embedding(500, 64): `gru_masked` (`mask_zero=True`, GRU(128,
return_sequences), Dense(10): the issue's tagger), `gru`, `lstm_masked`,
`bilstm_masked` (Bidirectional(LSTM(128))).

Run: python benchmarks/estimate_accuracy.py  (with --repeats 2, 10 to 12 minutes on 2 busy cores;
     TF_USE_LEGACY_KERAS=1 for tf_keras; --families gru_masked --batches 64 for
     a quick look; --inter-op-threads 1 for one op at a time)
"""

from __future__ import annotations

import argparse
import json
import statistics

import _common

_common.use_allocator_env()  # before TensorFlow starts

FAMILIES = (
    "transformer", "transformer_layer", "cnn", "mlp",
    "gru_masked", "gru", "lstm_masked", "bilstm_masked",
)
BATCHES = (16, 64, 256)
# Steps before the measured ones: a bidirectional layer's gradient loops run
# ahead of their weight-gradient sums (see `keras_memopt._remat.loops`) from
# the third or fourth step on, not in the first ones after tracing.
WARM_UP, MEASURED = 4, 4


def build(name):
    """The family's plain `keras.Model`."""
    from keras_memopt._keras import keras

    keras.utils.set_random_seed(0)
    layers = keras.layers
    if name in ("transformer", "transformer_layer", "cnn", "mlp"):
        import remat_choice

        inputs, blocks, head, width = remat_choice.family(name)
        x = keras.layers.Embedding(1000, width)(inputs) if width else inputs
        for block in blocks:
            x = block(x)
        return keras.Model(inputs, head(x), name=name)
    kind, masked = name.split("_")[0], name.endswith("_masked")
    inputs = keras.Input((48,), dtype="int32")
    x = layers.Embedding(500, 64, mask_zero=masked)(inputs)
    recurrent = layers.GRU if kind == "gru" else layers.LSTM
    x = recurrent(128, return_sequences=True)(x) if kind != "bilstm" else (
        layers.Bidirectional(layers.LSTM(128, return_sequences=True))(x))
    return keras.Model(inputs, layers.Dense(10)(x), name=name)


def worker(task):
    """Plain Keras's measured step peak and the planner's estimate, in bytes."""
    import tensorflow as tf

    from keras_memopt._keras import LEGACY, keras
    from keras_memopt.planning import MemoryPlanner

    tf.config.threading.set_inter_op_parallelism_threads(task["inter_op_threads"])
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    model = build(task["family"])
    model.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _common.synthetic_batch(model, task["batch"], vocabulary=400)
    for _ in range(WARM_UP):
        model.train_on_batch(x, y)
    tf.config.experimental.reset_memory_stats("CPU:0")
    for _ in range(MEASURED):
        model.train_on_batch(x, y)
    measured = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
    planner = MemoryPlanner(build(task["family"]), optimizer="adam")
    return dict(task, keras="tf_keras" if LEGACY else "keras3", measured=measured,
                estimate=planner.estimate(task["batch"]).peak)


def table(answers):
    by_key = {}
    for a in answers:
        by_key.setdefault((FAMILIES.index(a["family"]), a["family"], a["batch"]), []).append(a)
    lines = [
        "| family | batch | measured MiB (spread) | estimate MiB | estimate ÷ measured |",
        "|---|---:|---:|---:|---:|",
    ]
    worst = 1.0
    for (_, name, batch), runs in sorted(by_key.items()):
        measured = [r["measured"] for r in runs]
        median = statistics.median(measured)
        estimate = runs[0]["estimate"]
        ratio = estimate / median
        worst = max(worst, ratio, 1 / ratio)
        spread = (max(measured) - min(measured)) / median
        lines.append(
            f"| {name} | {batch} | {median / 2**20:.1f} ({spread:.0%}) "
            f"| {estimate / 2**20:.1f} | {ratio:.2f} |"
        )
    lines.append(f"\nfurthest from 1: a factor of {worst:.2f}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--repeats", type=int, default=3, help="processes per configuration")
    parser.add_argument("--inter-op-threads", type=int, default=0,
                        help="TensorFlow's inter-op threads (0: its default)")
    args = _common.parse_or_work(parser, worker, argv)
    if args is None:
        return
    tasks = [dict(family=name, batch=batch, process=p, inter_op_threads=args.inter_op_threads)
             for p in range(args.repeats) for name in args.families for batch in args.batches]
    answers = _common.run_workers(__file__, tasks, args.jobs)
    print(json.dumps(answers, indent=1) if args.json else table(answers))


if __name__ == "__main__":
    main()
