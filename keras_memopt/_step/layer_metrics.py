"""Metrics that layers update as they run, weighted by each micro-batch's fraction.

A layer's own `Mean` (tf_keras's `add_metric`, a Keras 3 layer's `keras.metrics.Mean`) is updated
once per micro-batch, as the first step's probe found its updates add up (docs/accumulation.md)."""

from __future__ import annotations

import tensorflow as tf

from keras_memopt import _keras

# IDLE: not updated by a forward pass (another method of its layer updates it).
ELEMENTS, MEAN, SUM, IDLE = "elements", "mean", "sum", "idle"


def layer_means(model) -> list:
    """The `Mean` metrics of `model`'s layers, not its own (loss trackers, compiled), in order."""
    found, seen = [], set()
    for layer in _keras.sublayers(model, include_self=False):
        for metric in getattr(layer, "_metrics", ()):
            if id(metric) not in seen and _is_mean(metric):
                seen.add(id(metric))
                found.append(metric)
    return found


def _is_mean(metric) -> bool:
    return hasattr(metric, "total") and hasattr(metric, "count")


def weighted(model, kinds, fraction, fn):
    """`fn()`, what it adds to the layers' `Mean` metrics weighted for a micro-batch `fraction` of
    the batch (`kinds`: the probe's); `fraction=None`: nothing added (a pass not the step's)."""
    means = layer_means(model)
    pairs = list(zip(means, (*kinds, *[None] * (len(means) - len(kinds))), strict=False))
    if fraction is not None:
        pairs = [(metric, kind) for metric, kind in pairs if kind in (MEAN, SUM)]
    if not pairs:
        return fn()
    before = [(tf.identity(m.total), tf.identity(m.count)) for m, _ in pairs]
    result = fn()
    for (metric, kind), (total, count) in zip(pairs, before, strict=True):
        weight = tf.cast(0.0 if fraction is None else fraction, total.dtype)
        added = metric.total - total
        whole = kind == SUM and fraction is not None  # a sum's value counts whole
        metric.total.assign(total + (added if whole else added * weight))
        metric.count.assign(count + (metric.count - count) * weight)
    return result
