"""Rematerialisation: peak memory and step time, `remat="auto"` against none.

For a deep MLP, a keras.applications ResNet50 at a small input size
(`weights=None`) and a stack of transformer blocks, this trains the same
functional `AccumulatingModel` (one micro-batch per batch, SGD) with
`remat=None` and with `remat="auto"`, and reports:

- the training step's peak memory above what is resident before the step
  (weights, optimizer state): TensorFlow's BFC CPU allocator peak over one
  epoch after a warm-up epoch, which is deterministic;
- the activation peak: that step peak less the plain model's step peak at a
  batch of one sample, which is what a step holds whatever the batch
  (gradients and their float32 accumulators, about twice the weights);
- the step time ratio: both models stay alive and their timed epochs are
  interleaved, so that a busy machine slows both alike; the ratio is the
  median over rounds of remat's epoch time over none's in the same round;
- the number of segments `"auto"` chose (`recomputed_segments`, and the
  last, which is not recomputed).

Run: python benchmarks/remat.py  (a few minutes on 2 cores; --models mlp
      --repeats 3 for a quicker look; --jit-compile to compile each step
      with XLA)
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common

_common.use_allocator_env()  # before TensorFlow starts

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_memopt import AccumulatingModel  # noqa: E402
from keras_memopt._keras import keras  # noqa: E402

# Batch per model: activations, not weights, dominate the step's memory, and
# one step takes about a second on 2 cores.
BATCH = {"mlp": 2048, "resnet50": 32, "transformer": 32}
STEPS_PER_EPOCH = 2


def build(name):
    """The model's inputs and outputs, and (x, y) for one epoch."""
    rng = np.random.RandomState(0)
    batch = BATCH[name]
    samples = batch * STEPS_PER_EPOCH
    if name == "mlp":
        inputs, outputs = _common.mlp(512, depth=16, width=512)
        data = rng.rand(samples, 512).astype("float32")
    elif name == "resnet50":
        base = keras.applications.ResNet50(
            weights=None, input_shape=(64, 64, 3), classes=10, classifier_activation=None
        )
        inputs, outputs = base.inputs, base.outputs
        data = rng.rand(samples, 64, 64, 3).astype("float32")
    else:
        inputs, outputs = _common.transformer(length=128, blocks=6, dropout=0.1, add_layers=True)
        data = rng.randint(0, 1000, (samples, 128)).astype("int32")
    labels = rng.randint(0, 10, samples)
    return inputs, outputs, (data, labels)


def _model(name, remat, jit_compile):
    keras.utils.set_random_seed(0)
    inputs, outputs, data = build(name)
    if name == "resnet50":  # keras.applications returns a list
        inputs, outputs = inputs[0], outputs[0]
    model = AccumulatingModel(inputs, outputs, remat=remat)
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    return model, data


def _epoch(model, data):
    x, y = data
    start = time.perf_counter()
    model.fit(x, y, batch_size=len(x) // STEPS_PER_EPOCH, epochs=1, verbose=0, shuffle=False)
    return time.perf_counter() - start


def _peak(model, data):
    _epoch(model, data)  # trace and warm up
    tf.config.experimental.reset_memory_stats("CPU:0")
    start = tf.config.experimental.get_memory_info("CPU:0")["current"]
    _epoch(model, data)
    return tf.config.experimental.get_memory_info("CPU:0")["peak"] - start


def measure(name, repeats, jit_compile):
    models = {}
    peaks = {}
    for remat in (None, "auto"):
        model, data = _model(name, remat, jit_compile)
        peaks[remat] = _peak(model, data)
        models[remat] = (model, data)
    model, (x, y) = models[None]
    floor = _peak(model, (x[:STEPS_PER_EPOCH], y[:STEPS_PER_EPOCH]))
    ratios = []
    for _ in range(repeats):
        times = {remat: _epoch(*models[remat]) for remat in (None, "auto")}
        ratios.append(times["auto"] / times[None])
    recomputed = models["auto"][0].recomputed_segments
    return dict(
        model=name,
        batch=BATCH[name],
        segments=len(recomputed) + 1 if recomputed else 0,
        peak_none=peaks[None] / 2**20,
        peak_auto=peaks["auto"] / 2**20,
        memory_ratio=peaks["auto"] / peaks[None],
        activations_none=(peaks[None] - floor) / 2**20,
        activations_auto=(peaks["auto"] - floor) / 2**20,
        activation_ratio=(peaks["auto"] - floor) / (peaks[None] - floor),
        time_ratio=statistics.median(ratios),
    )


def table(rows, jit_compile):
    lines = [
        "| model | batch | segments | step peak, none → auto (MiB) | ratio "
        "| activation peak, none → auto (MiB) | ratio | time ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']}{' (XLA)' if jit_compile else ''} | {r['batch']} | {r['segments']} "
            f"| {r['peak_none']:.0f} → {r['peak_auto']:.0f} | {r['memory_ratio']:.2f} "
            f"| {r['activations_none']:.0f} → {r['activations_auto']:.0f} "
            f"| {r['activation_ratio']:.2f} | {r['time_ratio']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(BATCH), choices=list(BATCH))
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per model")
    parser.add_argument("--jit-compile", action="store_true", help="XLA per micro-batch")
    args = parser.parse_args(argv)
    rows = []
    for name in args.models:
        rows.append(measure(name, args.repeats, args.jit_compile))
        keras.backend.clear_session()
    print(table(rows, args.jit_compile))


if __name__ == "__main__":
    main()
