"""Memory of one compiled train step on Keras 3's JAX backend, from XLA's own analysis.

    KERAS_BACKEND=jax python benchmarks/jax_memory.py

Nothing runs the step: `jax.jit(model.train_step, donate_argnums=0)` (as Keras's
JAX trainer compiles it) is lowered and compiled for a batch, and
`memory_analysis()` gives its temporaries and the sizes of its arguments (the
state: weights, optimizer slots, metrics; and the batch) and outputs. The
figures are deterministic for a given jax and XLA. The model is DESIGN.md's
MLP: 256 -> 4 x Dense(1024, relu) -> 10, Adam, float32, a batch of 128, split
four ways (micro-batches of 32):

- plain Keras at the whole batch (128), and at the micro-batch (32);
- Keras's own accumulation (`Adam(gradient_accumulation_steps=4)`) at 32,
  which takes four `fit` steps per update;
- `AccumulatingModel(micro_batch_size=32)` at 128: four micro-batches in one
  step, one update;
- and, for scale, plain Keras and `AccumulatingModel(micro_batch_size=32)`
  at a batch of 4096 (128 micro-batches).

Two more tables check a step at an eighth of the batch against plain Keras at
the whole batch (the footprint at most a quarter of plain Keras's): the MLP at
a batch of 16384, and a transformer block (`transformer`: Embedding(4096, 128),
MultiHeadAttention with 4 heads of 32 and LayerNormalization, a Dense(512, relu)
-> Dense(128) feed-forward part with LayerNormalization, the mean over its 128
tokens, Dense(10)) at a batch of 256: plain Keras at the batch and at an eighth,
Keras's `gradient_accumulation_steps=8` at an eighth, and
`AccumulatingModel(micro_batch_size=batch / 8)` at the batch, with the ratio.

A last table is recomputation's (`remat=`, `jax.checkpoint`): the TensorFlow
line's `gelu_stack`, 256 -> 8 x Dense(1024, gelu) -> 10, whose activations
outweigh its weights, as `AccumulatingModel(micro_batch_size=256)` at a batch
of 1024, without recomputation, with segments of 1, 2 and 4 hidden layers, and
with `remat="auto"`'s choice (printed below the table: what it chose, and how
many candidates it compiled in how long).

It prints Markdown tables in MiB (docs/benchmarks.md keeps them). The
footprint is what the step holds at once: temporaries + arguments + the
outputs that do not reuse a donated argument's buffer. (Compiled without
donation, as DESIGN.md's first figures were, plain Keras's step shows no
temporaries: XLA writes its intermediates into new output buffers, beside
the arguments.)
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from keras_memopt._keras import BACKEND, keras  # noqa: E402

MIB = 2**20


def mlp(cls=None, features=256, width=1024, depth=4, activation="relu", **kwargs):
    """DESIGN.md's MLP (or a smaller one), built as `cls` (plain `keras.Model` by
    default); its hidden layers are named `hidden_0`, `hidden_1`, ... (the cut
    points of `remat=`)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((features,))
    hidden = inputs
    for index in range(depth):
        hidden = keras.layers.Dense(width, activation=activation, name=f"hidden_{index}")(hidden)
    outputs = keras.layers.Dense(10)(hidden)
    return (cls or keras.Model)(inputs, outputs, **kwargs)


def batch(model, batch_size):
    """A batch of `batch_size` inputs for `model` (token ids below its Embedding's
    `input_dim` for an integer input, else normal floats) and class labels."""
    rng = np.random.default_rng(0)
    spec = model.inputs[0]
    shape = (batch_size, *spec.shape[1:])
    if "int" in str(spec.dtype):
        vocab = next(layer.input_dim for layer in model.layers
                     if isinstance(layer, keras.layers.Embedding))
        x = rng.integers(0, vocab, shape).astype(spec.dtype)
    else:
        x = rng.normal(size=shape).astype(keras.backend.floatx())
    return x, rng.integers(0, model.outputs[0].shape[-1], batch_size)


def transformer(cls=None, vocab=4096, length=128, dim=128, heads=4, ff=512, classes=10,
                **kwargs):
    """A transformer encoder block as a classifier, built as `cls` (plain `keras.Model`
    by default): token ids -> Embedding(vocab, dim) -> MultiHeadAttention(heads,
    dim / heads) with a residual and LayerNormalization -> Dense(ff, relu) ->
    Dense(dim) with a residual and LayerNormalization -> the mean over the tokens ->
    Dense(classes)."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((length,), dtype="int32")
    x = keras.layers.Embedding(vocab, dim)(tokens)
    attended = keras.layers.MultiHeadAttention(heads, dim // heads)(x, x)
    x = keras.layers.LayerNormalization()(keras.layers.Add()([x, attended]))
    hidden = keras.layers.Dense(ff, activation="relu")(x)
    fed = keras.layers.Dense(dim)(hidden)
    x = keras.layers.LayerNormalization()(keras.layers.Add()([x, fed]))
    outputs = keras.layers.Dense(classes)(keras.layers.GlobalAveragePooling1D()(x))
    return (cls or keras.Model)(tokens, outputs, **kwargs)


def every(step, depth):
    """`remat=`'s cut layers for a segment of `step` hidden layers of `mlp`."""
    return [f"hidden_{index}" for index in range(step - 1, depth, step)]


def step_memory(model, batch_size, optimizer=None) -> dict:
    """Compiles `model` (Adam unless `optimizer`) and returns its train step's
    memory for a batch of `batch_size`, in bytes: temporaries, arguments, outputs,
    and W, the trainable weights' bytes."""
    model.compile(optimizer=optimizer or keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = batch(model, batch_size)
    model.train_on_batch(x, y)  # builds the optimizer's slots and the metrics
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    compiled = jax.jit(model.train_step, donate_argnums=0).lower(state, (x, y)).compile()
    analysis = compiled.memory_analysis()
    weights = sum(int(np.prod(v.shape)) * v.dtype.itemsize
                  for v in (np.asarray(w) for w in state[0]))
    return {
        "temporaries": analysis.temp_size_in_bytes,
        "arguments": analysis.argument_size_in_bytes,
        "outputs": analysis.output_size_in_bytes,
        "aliased": analysis.alias_size_in_bytes,
        "weights": weights,
    }


def main():
    if BACKEND != "jax":
        raise SystemExit(f"Run with KERAS_BACKEND=jax. Received: backend {BACKEND!r}")
    from keras_memopt import AccumulatingModel

    rows = [
        ("plain Keras, batch 128", step_memory(mlp(), 128)),
        ("plain Keras, batch 32", step_memory(mlp(), 32)),
        ("Keras `gradient_accumulation_steps=4`, batch 32",
         step_memory(mlp(), 32, keras.optimizers.Adam(1e-3, gradient_accumulation_steps=4))),
        ("`AccumulatingModel(micro_batch_size=32)`, batch 128",
         step_memory(mlp(AccumulatingModel, micro_batch_size=32), 128)),
        ("plain Keras, batch 4096", step_memory(mlp(), 4096)),
        ("`AccumulatingModel(micro_batch_size=32)`, batch 4096",
         step_memory(mlp(AccumulatingModel, micro_batch_size=32), 4096)),
    ]
    _print_table(rows)
    for build, batch_size in ((mlp, EIGHTH_MLP), (transformer, EIGHTH_TRANSFORMER)):
        print()
        rows = eighth_rows(AccumulatingModel, build, batch_size)
        _print_table(rows)
        print(f"footprint of `AccumulatingModel` / plain Keras's at {batch_size}: "
              f"{eighth_ratio(rows):.3f}")
    print()
    rows, auto = remat_rows(AccumulatingModel)
    _print_table(rows)
    print(f"\nremat='auto' chose {auto.remat_choice}")


# The claim of a step at an eighth of the batch: at most a quarter of plain Keras's
# footprint at the whole batch, where the activations outweigh the state. The MLP's
# batch is the first power of two where they do by enough (its state, 3 W, and the
# gradients' sum, 1 W, stay whole, and so does the batch itself, an argument); the
# transformer's activations outweigh its state from a few samples on.
EIGHTH_MLP, EIGHTH_TRANSFORMER = 16384, 256


def eighth_rows(accumulating_model, build, batch_size, **sizes):
    """Plain Keras at `batch_size` and at an eighth of it, Keras's own accumulation of
    8 at an eighth, and `AccumulatingModel` in micro-batches of an eighth at
    `batch_size`, for the model `build(cls, **sizes)` makes (`mlp`, `transformer`)."""
    micro = batch_size // 8
    keras_own = keras.optimizers.Adam(1e-3, gradient_accumulation_steps=8)
    return [
        (f"plain Keras, batch {batch_size}", step_memory(build(**sizes), batch_size)),
        (f"plain Keras, batch {micro}", step_memory(build(**sizes), micro)),
        (f"Keras `gradient_accumulation_steps=8`, batch {micro}",
         step_memory(build(**sizes), micro, keras_own)),
        (f"`AccumulatingModel(micro_batch_size={micro})`, batch {batch_size}",
         step_memory(build(accumulating_model, micro_batch_size=micro, **sizes), batch_size)),
    ]


def eighth_ratio(rows) -> float:
    """`AccumulatingModel`'s footprint over plain Keras's at the whole batch (`eighth_rows`)."""
    return footprint(rows[3][1]) / footprint(rows[0][1])


# docs/remat.md's `gelu_stack` (benchmarks/remat.py) on TensorFlow.
DEEP = {"features": 256, "width": 1024, "depth": 8, "activation": "gelu"}
DEEP_MICRO, DEEP_BATCH = 256, 1024


def remat_rows(accumulating_model):
    """The recomputation table's rows (DEEP without and with segments of 1, 2, 4, and
    `remat="auto"`'s), and the model `"auto"` chose for."""
    depth = DEEP["depth"]
    rows = [(f"`AccumulatingModel(micro_batch_size={DEEP_MICRO})`, batch {DEEP_BATCH}",
             step_memory(mlp(accumulating_model, micro_batch_size=DEEP_MICRO, **DEEP),
                         DEEP_BATCH))]
    for step in (1, 2, 4):
        model = mlp(accumulating_model, micro_batch_size=DEEP_MICRO,
                    remat=every(step, depth), **DEEP)
        per = "hidden layer" if step == 1 else f"{step} hidden layers"
        rows.append((f"the same, `remat=` a segment per {per}",
                     step_memory(model, DEEP_BATCH)))
    auto = mlp(accumulating_model, micro_batch_size=DEEP_MICRO, remat="auto", **DEEP)
    rows.append(('the same, `remat="auto"`', step_memory(auto, DEEP_BATCH)))
    return rows, auto


def _print_table(rows):
    weights = rows[0][1]["weights"]
    print(f"W (trainable weights) = {weights / MIB:.1f} MiB; jax {jax.__version__}, "
          f"keras {keras.__version__}, {jax.devices()[0].platform}")
    print("| step | temporaries | arguments | outputs (aliased) | footprint | footprint / W |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, figures in rows:
        cells = [figures[k] / MIB for k in ("temporaries", "arguments", "outputs", "aliased")]
        print(f"| {name} | {cells[0]:.1f} | {cells[1]:.1f} | {cells[2]:.1f} ({cells[3]:.1f}) "
              f"| {footprint(figures) / MIB:.1f} | {footprint(figures) / weights:.2f} |")


def footprint(figures) -> int:
    """Bytes the step holds at once: its temporaries, its arguments, and the outputs
    that do not reuse a donated argument's buffer."""
    return figures["temporaries"] + figures["arguments"] + figures["outputs"] - figures["aliased"]


if __name__ == "__main__":
    main()
