"""Metrics that layers update as they run, weighted by each micro-batch's share.

A layer may update a metric of its own in `call` (tf_keras's `add_metric`, a
Keras 3 layer's `keras.metrics.Mean` attribute); `fit` logs it. Plain Keras
runs the layer once per step on the whole batch; the micro-batch loop runs it
once per micro-batch. At the first step `classify` tells, for each such `Mean`,
from one forward pass on a few samples and one on the same samples repeated,
how its updates add up (`weighted` then weighs each micro-batch's):

- per element (its count grows with the samples: a per-sample tensor): the
  micro-batches' updates are the batch's as they are;
- a mean over samples (one value per call, the same when the samples repeat):
  each micro-batch's update weighs by its share of the batch;
- a sum over samples (one value per call, doubled): its value counts whole,
  its count by the share.

Anything else (a maximum) is logged as the mean of its micro-batches' values,
with a warning. A forward pass that is not the step's own (the counts of a
masked output's loss) leaves them as they were.
"""

from __future__ import annotations

import contextlib
import warnings

import tensorflow as tf

from keras_memopt import _keras

# IDLE: not updated by a forward pass (another method of its layer updates it).
ELEMENTS, MEAN, SUM, IDLE = "elements", "mean", "sum", "idle"
# Relative difference within which two probes' figures count as equal.
_RTOL = 1e-3


def layer_means(model) -> list:
    """The `Mean` metrics (a total and a count) of `model`'s layers, not its own
    (the loss trackers and compiled metrics), in layer order."""
    found, seen = [], set()
    for layer in _keras.sublayers(model, include_self=False):
        for metric in getattr(layer, "_metrics", ()):
            if id(metric) not in seen and _is_mean(metric):
                seen.add(id(metric))
                found.append(metric)
    return found


def _is_mean(metric) -> bool:
    return hasattr(metric, "total") and hasattr(metric, "count")


def classify(model, once, twice, alone) -> tuple:
    """The kind of each of `layer_means(model)` (ELEMENTS, MEAN, SUM, IDLE or None),
    from forward passes on the inputs `once` (a few samples), `twice` (the same
    samples repeated) and each of `alone` (one of those samples), in the
    strategy's replicas, at perturbed weights (put back after). What they change
    in the metrics is the caller's to put back."""
    means = layer_means(model)
    if not means:
        return ()
    strategy = model.distribute_strategy

    def deltas(x):
        values = strategy.run(_deltas, args=(model, means, x))
        return strategy.experimental_local_results(values)[0].numpy()

    with _perturbed(model.trainable_variables):
        probes = [deltas(x) for x in (once, twice, *alone)]
    kinds = []
    for index, metric in enumerate(means):
        (total, count), (total2, count2), *singles = (probe[index] for probe in probes)
        kind = _kind((total, count), (total2, count2), [tuple(s) for s in singles])
        if kind is None:
            warnings.warn(
                f"Metric {metric.name!r}, which a layer updates in `call`, is neither a mean "
                "nor a sum over samples, nor one value per sample (a maximum, say): "
                "AccumulatingModel logs the mean of its micro-batches' values, not the "
                "batch's value.",
                stacklevel=2,
            )
        kinds.append(kind)
    return tuple(kinds)


@contextlib.contextmanager
def _perturbed(variables):
    """The trainable weights moved by a fixed random step, then put back: a value
    that the initial weights make zero whatever the samples (a sum of a
    LayerNormalization's outputs, whose offsets start at zero) tells its kind.
    The weights are kept in host memory meanwhile, not on the device."""
    with tf.device("/CPU:0"):
        kept = [tf.identity(v) for v in variables]
    for index, variable in enumerate(variables):
        step = tf.random.stateless_normal(variable.shape, seed=[index, 0], dtype=variable.dtype)
        variable.assign_add(0.1 * step)
    try:
        yield
    finally:
        for variable, value in zip(variables, kept, strict=True):
            variable.assign(value)


def _deltas(model, means, x):
    before = _state(means)
    model(x, training=False)
    return tf.stack(_state(means)) - tf.stack(before)


def _state(means) -> list:
    return [tf.stack([_read(metric.total), _read(metric.count)]) for metric in means]


def _read(variable) -> tf.Tensor:
    return tf.cast(tf.convert_to_tensor(variable), tf.float64)


def _close(a, b) -> bool:
    return abs(a - b) <= _RTOL * max(abs(a), abs(b), 1e-12)


def _kind(once, twice, singles):
    """The kind of one metric from its (total, count) added by each probe."""
    (total, count), (total2, count2) = once, twice
    totals = sum(t for t, _ in singles)
    if not any((total, count, total2, count2, totals)):
        return IDLE
    if count <= 0:
        return None
    if _close(count2, 2 * count) and _close(total2, 2 * total) and _close(total, totals):
        return ELEMENTS
    if not all(_close(c, count) for c in (count2, *(c for _, c in singles))):
        return None
    if _close(total2, total) and _close(total, totals / len(singles)):
        return MEAN
    if _close(total2, 2 * total) and _close(total, totals):
        return SUM
    return None


def weighted(model, kinds, share, fn):
    """`fn()`, with what it adds to the layers' `Mean` metrics weighted for a
    micro-batch that is `share` of the batch (`kinds` from `classify`);
    `share=None`: with nothing added (a forward pass that is not the step's)."""
    means = layer_means(model)
    pairs = list(zip(means, (*kinds, *[None] * (len(means) - len(kinds))), strict=False))
    if share is not None:
        pairs = [(metric, kind) for metric, kind in pairs if kind in (MEAN, SUM)]
    if not pairs:
        return fn()
    before = [(tf.identity(m.total), tf.identity(m.count)) for m, _ in pairs]
    result = fn()
    for (metric, kind), (total, count) in zip(pairs, before, strict=True):
        weight = tf.cast(0.0 if share is None else share, total.dtype)
        added = metric.total - total
        whole = kind == SUM and share is not None  # a sum's value counts whole
        metric.total.assign(total + (added if whole else added * weight))
        metric.count.assign(count + (metric.count - count) * weight)
    return result
