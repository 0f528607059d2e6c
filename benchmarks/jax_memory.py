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

A second table is recomputation's (`remat=`, `jax.checkpoint`): the TensorFlow
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


def every(step, depth):
    """`remat=`'s cut layers for a segment of `step` hidden layers of `mlp`."""
    return [f"hidden_{index}" for index in range(step - 1, depth, step)]


def step_memory(model, batch_size, optimizer=None) -> dict:
    """Compiles `model` (Adam unless `optimizer`) and returns its train step's
    memory for a batch of `batch_size`, in bytes: temporaries, arguments, outputs,
    and W, the trainable weights' bytes."""
    model.compile(optimizer=optimizer or keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch_size, *model.inputs[0].shape[1:])).astype(keras.backend.floatx())
    y = rng.integers(0, model.outputs[0].shape[-1], batch_size)
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
    print()
    rows, auto = remat_rows(AccumulatingModel)
    _print_table(rows)
    print(f"\nremat='auto' chose {auto.remat_choice}")


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
