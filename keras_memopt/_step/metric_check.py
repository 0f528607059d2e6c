"""Whether each compiled metric adds up over micro-batches: found once, at the first step.

The step updates the compiled metrics with each micro-batch's outputs, which
gives the batch's figure when a metric accumulates per-sample values (a mean
of them, counts of a confusion matrix, sums such as `R2Score`'s). A metric
that computes one value from the batch's samples together does not: a
correlation over the batch (`keras.metrics.PearsonCorrelation(axis=0)`), or a
metric function that returns one scalar for the batch, which Keras averages
over batches, so the step would average it over micro-batches instead.

`coupled(model, x, y)` updates the compiled metrics with the outputs of four
samples (the first two, repeated) once, and again as a micro-batch of one and
one of three, in inference mode: a metric whose figure differs couples the
samples. The caller puts back what this changes (`loss_check.check`).
"""

from __future__ import annotations

import warnings

import numpy as np

from keras_memopt import _keras
from keras_memopt._step import loop as _loop

_RTOL = 1e-4  # float32 sums of the same values in another order


def coupled(model, x, y) -> list:
    """The names of the compiled metrics whose figure on the samples `x`
    (four or more) is not that of the same samples as two micro-batches."""
    once = _results(model, [(x, y)])
    parts = [_loop.micro_slice(d, 0, 1) for d in (x, y)]
    rest = [_loop.micro_slice(d, 1, int(_loop.batch_size_of(x)) - 1) for d in (x, y)]
    split = _results(model, [parts, rest])
    return [name for name, value in once.items() if not _same(value, split.get(name))]


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


def _results(model, batches) -> dict:
    for metric in model.metrics:
        metric.reset_state()
    strategy = model.distribute_strategy
    with warnings.catch_warnings():  # Keras's warnings come from the step, once
        warnings.simplefilter("ignore")
        for x, y in batches:
            strategy.run(_update, args=(model, x, y))
    results = _keras.compiled_metric_results(model)
    return {name: np.asarray(value, dtype=np.float64) for name, value in results.items()}


def _update(model, x, y):
    _keras.update_metrics(model, x, y, model(x, training=False), None)


def _same(a, b) -> bool:
    if b is None or np.shape(a) != np.shape(b):
        return False
    return bool(np.allclose(a, b, rtol=_RTOL, atol=1e-6, equal_nan=True))
