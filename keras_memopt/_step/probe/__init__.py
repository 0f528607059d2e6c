"""The first step's probe: a few samples, repeated, to see what the loss and metrics do.

Before the first step, in inference mode and putting back what it changes, on the batch's first two
samples, on them repeated and on each alone: the loss and each term of `model.losses`
(`probe.loss`), the compiled metrics and the layers' `Mean`s (`probe.metrics`), a custom step's
`loss_fn`. What each value tells, and the tolerances: `_step.seen` (shared with the JAX line)."""

from __future__ import annotations

import warnings

import tensorflow as tf

from keras_memopt import _keras
from keras_memopt._step import loop as _loop
from keras_memopt._step.seen import pair_starts, tolerance_of


def tolerance(dtype=tf.float32) -> float:
    """The relative tolerance of values computed in `dtype` (`seen.tolerance_of`)."""
    return tolerance_of(tf.as_dtype(dtype).name)


# -- the samples ---------------------------------------------------------------------


def pairs(data):
    """The batch's first two samples, then its next pairs (`seen.pair_starts`)."""
    for start in pair_starts(int(_loop.batch_size_of(data))):
        yield _loop.micro_slice(data, start, 2)


def repeat(data):
    """Every sample twice (`x + x`), masks and the logits behind softmax or sigmoid outputs too."""
    return _rebuilt(data, lambda t: _loop.concat_rows([t, t]))


def sample(data, index):
    """Sample `index` of a batch, as `repeat` keeps masks and logits."""
    return _rebuilt(data, lambda t: _loop.rows(t, index, 1))


def _rebuilt(data, rows):
    def rebuilt(t):
        if t is None:
            return None
        mask, logits = _keras.get_mask(t), _keras.logits_of(t)
        result = rows(t)
        if logits is not None:
            result = _keras.carry_logits(result, rows(logits), t)
        if mask is not None:
            _keras.set_mask(result, rows(mask))
        return result

    return tf.nest.map_structure(rebuilt, data)


def in_replica(model, fn, *args):
    """`fn(*args)` in the first replica (where Keras updates its trackers), as Python
    numbers; Keras's warnings come from the step, once."""
    strategy = model.distribute_strategy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        values = strategy.run(fn, args=args)
    return tf.nest.map_structure(
        lambda v: strategy.experimental_local_results(v)[0].numpy().tolist(), values
    )
