"""The README's figure: peak memory of one training step, plain Keras against keras_memopt.

One model, a stack of transformer blocks (6 blocks, width 128, 4 heads, 128
tokens), trained with SGD at a batch of 64 in three configurations:

- a plain `keras.Model`;
- an `AccumulatingModel` with micro-batches of 16 (4 per batch);
- the same with `remat="auto"` (recomputed segments).

Each configuration runs in its own fresh Python process (a fresh TensorFlow,
`keras_memopt._subprocess.call`) on TensorFlow's BFC CPU allocator
(`_subprocess.tensorflow_env`), which reports real current and peak bytes. A
measurement is the allocator's peak over one training epoch of two steps,
after a warm-up epoch that traces the step and builds the optimizer
(everything the allocator holds: weights, optimizer state and the step's
working memory).

Run: python benchmarks/figure.py  (about a minute on 2 cores; writes
     docs/images/peak_memory.png and prints the figures as a table)
"""

from __future__ import annotations

import argparse
import os
import pathlib

HERE = pathlib.Path(__file__).resolve().parent
OUTPUT = HERE.parent / "docs" / "images" / "peak_memory.png"
BATCH, MICRO, STEPS = 64, 16, 2
CONFIGS = [
    ("plain keras.Model", dict(kind="plain")),
    (f"AccumulatingModel\nmicro_batch_size={MICRO}", dict(kind="accumulating")),
    (f"AccumulatingModel\nmicro_batch_size={MICRO}\nremat=\"auto\"", dict(
        kind="accumulating", remat="auto"
    )),
]


def measure(config):
    """In the child: trains one configuration; returns its resident and step peak bytes."""
    import _common
    import numpy as np
    import tensorflow as tf

    from keras_memopt import AccumulatingModel
    from keras_memopt._keras import keras

    keras.utils.set_random_seed(0)
    inputs, outputs = _common.transformer(length=128, blocks=6, add_layers=True)
    if config["kind"] == "plain":
        model = keras.Model(inputs, outputs)
    else:
        model = AccumulatingModel(
            inputs, outputs, micro_batch_size=MICRO, remat=config.get("remat")
        )
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.RandomState(0)
    x = rng.randint(0, 1000, (BATCH * STEPS, 128)).astype("int32")
    y = rng.randint(0, 10, BATCH * STEPS)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)  # trace, warm up
    tf.config.experimental.reset_memory_stats("CPU:0")
    resident = tf.config.experimental.get_memory_info("CPU:0")["current"]
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    return dict(resident=resident, step=peak - resident)


def run_all():
    from keras_memopt import _subprocess

    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    env = {**_subprocess.tensorflow_env(cpu_memory_limit_mb=8192), "PYTHONPATH": path}
    return [
        _subprocess.call("figure:measure", config, env=env, timeout=900, name=label)
        for label, config in CONFIGS
    ]


def draw(results, output):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2**20
    labels = [label for label, _ in CONFIGS]
    totals = [(r["resident"] + r["step"]) / mib for r in results]
    figure, axes = plt.subplots(figsize=(7, 3.6), dpi=120)
    axes.bar(labels, totals, color=["#9aa5b1", "#d1495b", "#2e86ab"])
    for index, total in enumerate(totals):
        axes.text(index, total, f"{total:.0f} MiB", ha="center", va="bottom")
    axes.set_ylabel("allocator peak (MiB)")
    axes.set_ylim(0, max(totals) * 1.15)
    axes.set_title(f"Peak memory of a training step: one transformer, batch {BATCH}")
    axes.spines[["top", "right"]].set_visible(False)
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=pathlib.Path, default=OUTPUT)
    args = parser.parse_args(argv)
    results = run_all()
    print("| configuration | resident MiB | step peak above it MiB | total MiB |")
    print("|---|---:|---:|---:|")
    for (label, _), r in zip(CONFIGS, results, strict=True):
        resident, step = r["resident"] / 2**20, r["step"] / 2**20
        name = label.replace("\n", ", ")
        print(f"| {name} | {resident:.0f} | {step:.0f} | {resident + step:.0f} |")
    draw(results, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
