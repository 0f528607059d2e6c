"""The compiled metrics and the layers' own on repeated samples (`keras_memopt._step.probe`)."""

from __future__ import annotations

import contextlib
import warnings

import tensorflow as tf

from keras_memopt import _keras
from keras_memopt._step import loop as _loop
from keras_memopt._step.layer_metrics import ELEMENTS, IDLE, MEAN, SUM, layer_means
from keras_memopt._step.probe import in_replica, tolerance
from keras_memopt._step.seen import NEGLIGIBLE, close

# -- the compiled metrics --------------------------------------------------------------


def coupled(model, x, y) -> list:
    """The compiled metrics whose figure on the samples `x` (four or more) is not that of the
    same samples as micro-batches of one and the rest, by name."""
    once = _metric_results(model, [(x, y)])
    rest = int(_loop.batch_size_of(x)) - 1
    split = _metric_results(model, [_loop.micro_slice((x, y), 0, 1),
                                    _loop.micro_slice((x, y), 1, rest)])
    return [name for name, value in once.items()
            if name not in split or not close(value, split[name], atol=NEGLIGIBLE)]


def _metric_results(model, batches) -> dict:
    for metric in model.metrics:
        metric.reset_state()
    for x, y in batches:
        in_replica(model, _update_metrics, model, x, y)
    return _keras.compiled_metric_results(model)


def _update_metrics(model, x, y):
    _keras.update_metrics(model, x, y, model(x, training=False), None)
    return ()


def message(names) -> str:
    return (
        "AccumulatingModel updates the compiled metrics with each micro-batch's "
        "outputs, which gives the batch's figure for a metric of per-sample values "
        "(a mean of them, a confusion matrix's counts); these metrics compute one "
        "value from the batch's samples together (a correlation over the batch, "
        "a metric function that returns one scalar per batch), so on the same "
        "outputs as two micro-batches they logged another figure. Pass "
        "`whole_batch_loss=True` to AccumulatingModel, which updates the metrics "
        "once with the whole batch's outputs (for about one more forward pass), or "
        "use a metric that returns one value per sample. Received: metrics "
        f"{sorted(names)}, whole_batch_loss=False"
    )


# -- the layers' own metrics -------------------------------------------------------------


def layer_metric_kinds(model, once, twice, alone) -> tuple:
    """The kind of each of `layer_metrics.layer_means(model)` (ELEMENTS, MEAN, SUM, IDLE or None,
    warned about), from forward passes on the inputs `once` (a few samples), `twice` (repeated) and
    each of `alone`, at perturbed weights (put back after). The caller puts back the metrics."""
    means = layer_means(model)
    if not means:
        return ()
    rtol = tolerance(model.compute_dtype)
    with _perturbed(model.trainable_variables):
        probes = [_layer_metric_updates(model, means, x) for x in (once, twice, *alone)]
    kinds = []
    for index, metric in enumerate(means):
        once, twice, *singles = (probe[index] for probe in probes)
        kind = _layer_metric_kind(once, twice, singles, rtol)
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


def _layer_metric_kind(once, twice, singles, rtol):
    """The kind of one metric from the `(total, count)` each probe added."""
    (total, count), (total2, count2) = once, twice
    totals = sum(t for t, _ in singles)
    if not any((total, count, total2, count2, totals)):
        return IDLE
    if count <= 0:
        return None
    if close(count2, 2 * count, rtol) and close(total2, 2 * total, rtol) and close(
        total, totals, rtol
    ):
        return ELEMENTS
    if not all(close(c, count, rtol) for c in (count2, *(c for _, c in singles))):
        return None
    if close(total2, total, rtol) and close(total, totals / len(singles), rtol):
        return MEAN
    if close(total2, 2 * total, rtol) and close(total, totals, rtol):
        return SUM
    return None


def _layer_metric_updates(model, means, x) -> list:
    """`(total, count)` of each of `means` after a forward pass on `x` from zero."""
    for metric in means:
        metric.reset_state()

    def run(x):
        model(x, training=False)
        return tf.stack([tf.cast(tf.stack([tf.convert_to_tensor(m.total),
                                           tf.convert_to_tensor(m.count)]), tf.float64)
                         for m in means])

    return in_replica(model, run, x)


@contextlib.contextmanager
def _perturbed(variables):
    """The trainable weights moved by a fixed random step, then put back (kept in host memory): a
    value the initial weights make zero whatever the samples (a sum of a LayerNormalization's
    outputs, whose offsets start at zero) tells its kind."""
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
