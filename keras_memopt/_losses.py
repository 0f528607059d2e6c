"""Each micro-batch's exact share of the batch's loss.

Keras divides a loss by a count of the batch: its samples (the default
`"sum_over_batch_size"` reduction), or, when the model's output carries a mask
(`Embedding(mask_zero=True)`, `Masking`), its unmasked elements. Run on a
micro-batch, the same loss is divided by the micro-batch's own count, so its
share of the batch's loss is its count over the batch's:

- an output without a mask: `n_i / N` (samples);
- an output with a mask: `valid_i / valid` (unmasked elements; the batch's
  `valid` is counted before the loop, by `AccumulatingModel`);
- a term of `model.losses` (`add_loss`, activity and weight regularisers):
  `n_i / N` when it averages over samples or does not depend on them, and `1`
  when it sums over them (the micro-batches' sums add up to the batch's).

The shares enter Keras's own loss computation as sample weights (scalars, so
they broadcast onto any loss shape), so losses, masks, class and sample
weights, `loss_weights` and distribution scaling stay Keras's. What each term
does with the samples is found once, at the first step (`LossSplit.check`), by
evaluating the model on two samples and on the same two samples repeated.

Keras 3 updates each per-output loss tracker with the batch's *static* first
dimension, unknown inside the loop (so each micro-batch counts as one); the
trackers are set after the loop to what one update with the whole batch gives
(`OutputLossTrackers`). tf_keras weights them by the dynamic micro-batch size, so
there its micro-batch losses are expressed per sample of the micro-batch and
the step weights their total by `n_i / N` instead.
"""

from __future__ import annotations

import warnings

import numpy as np
import tensorflow as tf

from keras_memopt import _keras, _loop

MEAN, SUM = "mean", "sum"

# float32 evaluation of the same per-sample terms in another order.
_PROBE_RTOL = 1e-4


def output_masks(y_pred) -> list:
    """The Keras mask of each (flat) output, or None where it has none."""
    return [getattr(t, "_keras_mask", None) for t in tf.nest.flatten(y_pred)]


def valid_counts(y_pred) -> tf.Tensor:
    """Unmasked elements per output (0 for outputs without a mask), float32."""
    counts = [
        tf.zeros([]) if mask is None else tf.reduce_sum(tf.cast(mask, tf.float32))
        for mask in output_masks(y_pred)
    ]
    return tf.stack(counts) if counts else tf.zeros([0])


def _overrides(model, name):
    return getattr(type(model), name) is not getattr(_keras.keras.Model, name)


class LossSplit:
    """How `model`'s loss splits over micro-batches.

    `terms` holds, per term of `model.losses`, `MEAN` or `SUM` (see the module
    docstring); `check()` fills it in at the first step.
    """

    def __init__(self, model):
        self.model = model
        self.terms: tuple[str, ...] | None = None

    # -- the first step: what the loss terms do with the samples -------------------

    def check(self, data):
        """Classifies the loss terms on the first batch; raises for terms it cannot split.

        Runs eagerly, in inference mode, on the first two samples of `data` and
        on the same samples twice each; model state (metrics included) is left
        as it was. On tf_keras it also creates the variables the first traced
        step would create (`_keras.build_step_state`), so that step is traced once.
        """
        if self.terms is not None:
            return
        model = self.model
        x, y, _ = _keras.unpack_x_y_sample_weight(data)
        if not [t for t in tf.nest.flatten(x) if t is not None]:
            self.terms = ()
            return
        pair = _first_samples(x, 2), _first_samples(y, 2)
        twice = _repeat(pair[0]), _repeat(pair[1])
        _keras.build_step_state(model, *pair)
        metrics = list(model.metrics)
        saved = [[v.numpy() for v in m.variables] for m in metrics]
        try:
            once, doubled = self._probe(pair), self._probe(twice)
        finally:
            for metric in model.metrics:  # the loss trackers may be new
                metric.reset_state()
            for metric, values in zip(metrics, saved, strict=True):
                for variable, value in zip(metric.variables, values, strict=True):
                    variable.assign(value)
        compiled = MEAN if np.isnan(once[0]) else _kind(once[0], doubled[0])
        if compiled != MEAN:
            raise ValueError(
                "AccumulatingModel needs compiled losses that average over the "
                "samples of a batch, so that micro-batches weighted by their "
                "share of the batch add up to the batch's loss; this one "
                f"{_what(once[0], doubled[0])}. Return one loss value per sample "
                "from a loss function (Keras averages them), or use a "
                "`keras.losses.Loss` with the default reduction. Received: "
                f"loss={getattr(model, 'loss', None)!r}"
            )
        kinds = [_kind(a, b) for a, b in zip(once[1:], doubled[1:], strict=True)]
        for index, kind in enumerate(kinds):
            if kind is None:
                what = _what(once[1 + index], doubled[1 + index])
                raise ValueError(
                    "AccumulatingModel cannot split a loss term over micro-batches "
                    f"exactly: term {index} of `model.losses` {what}, neither the "
                    "same (a mean over samples) nor twice as large (a sum). Add it "
                    "as separate terms, one that sums over samples and one that "
                    f"does not. Received: model.losses[{index}]"
                )
        self.terms = tuple(kinds)

    def _probe(self, data):
        """`_evaluate(*data)` in a replica's context (where Keras updates its
        loss trackers), as a list; Keras's warnings come from the step, once."""
        strategy = self.model.distribute_strategy
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            values = strategy.run(self._evaluate, args=data)
        return strategy.experimental_local_results(values)[0].numpy().tolist()

    def _evaluate(self, x, y):
        """[compiled loss (NaN if none), each term of `model.losses`] on one batch."""
        model = self.model
        y_pred = model(x, training=False)
        terms = [tf.reduce_sum(tf.cast(t, tf.float32)) for t in model.losses]
        compiled = tf.constant(float("nan"))
        if y is not None and not _overrides(model, "compute_loss") and _has_compiled_loss(model):
            compiled = tf.cast(_keras.compiled_loss(model, y, y_pred, None, []), tf.float32)
        return tf.stack([compiled, *terms])

    # -- in the step ------------------------------------------------------------------

    def batch_counts(self, forward, data, size, jit_compile=False):
        """Unmasked elements per output over the whole batch: a forward pass, inference mode.

        Run micro-batch by micro-batch before the loop, when an output
        carries a mask (see the module docstring).
        """

        def count(micro):
            return valid_counts(forward(micro[0], training=False))

        return _loop.accumulate(count, data, size, jit_compile=jit_compile)

    def micro_batch_loss(self, x, y, y_pred, sample_weight, batch_size, valid, training):
        """The micro-batch's contribution to the batch's loss (what its gradient is taken of).

        `batch_size` is the batch's number of samples and `valid` its unmasked
        elements per output (see `valid_counts`).
        """
        model = self.model
        n = tf.cast(_loop.batch_size_of((x, y, sample_weight)), tf.float32)
        share = n / tf.cast(batch_size, tf.float32)
        if _overrides(model, "compute_loss") or not _has_compiled_loss(model):
            # A user's own loss: exact when it averages over samples.
            loss = _keras.compute_loss(model, x, y, y_pred, sample_weight, training)
            return loss * tf.cast(share, loss.dtype)
        masks = output_masks(y_pred)
        if _keras.LEGACY:
            # Per sample of the micro-batch (see the module docstring).
            shares = [
                _masked_share(mask, valid, i) / share if mask is not None else None
                for i, mask in enumerate(masks)
            ]
            weights = _output_weights(y_pred, sample_weight, shares, masks)
            terms = [self._term(t, i, 1.0, 1.0 / share) for i, t in enumerate(model.losses)]
            loss = _keras.compiled_loss(model, y, y_pred, weights, terms)
            return loss * tf.cast(share, loss.dtype)
        shares = [
            _masked_share(mask, valid, i) if mask is not None else share
            for i, mask in enumerate(masks)
        ]
        weights = _output_weights(y_pred, sample_weight, shares, masks)
        loss = _keras.compiled_loss(model, y, y_pred, weights, [])
        for index, term in enumerate(model.losses):
            term = _keras.additional_loss(model, term)
            loss += tf.cast(self._term(term, index, share, 1.0), loss.dtype)
        return loss

    def _term(self, term, index, mean_share, sum_share):
        kinds = self.terms or ()
        kind = kinds[index] if index < len(kinds) else MEAN
        term = tf.reduce_sum(tf.cast(term, tf.float32))
        return term * (sum_share if kind == SUM else mean_share)


def _masked_share(mask, valid, index):
    count = tf.reduce_sum(tf.cast(mask, tf.float32))
    return tf.math.divide_no_nan(count, valid[index])


def _output_weights(y_pred, sample_weight, shares, masks):
    """Sample weights carrying each output's share: one for all outputs, or one per output."""
    if all(mask is None for mask in masks):
        return _scaled(sample_weight, shares[0])
    flat = tf.nest.flatten(y_pred)
    if tf.nest.is_nested(sample_weight):
        user = tf.nest.flatten(sample_weight)
    else:
        user = [sample_weight] * len(flat)
    weights = [_scaled(w, s) for w, s in zip(user, shares, strict=True)]
    return tf.nest.pack_sequence_as(y_pred, weights) if tf.nest.is_nested(y_pred) else weights[0]


def _scaled(sample_weight, share):
    if share is None:
        return sample_weight
    if sample_weight is None:
        return share
    return tf.cast(sample_weight, tf.float32) * share


def _has_compiled_loss(model):
    return _keras.compiled_loss_container(model) is not None


class OutputLossTrackers:
    """Sets Keras 3's per-output loss trackers after the loop to one update with the batch.

    Take it (`OutputLossTrackers(model)`) before the loop and `apply(batch_size)`
    after: each tracker then holds what it held before plus the batch's loss
    for that output, weighted as Keras weights a whole batch.
    """

    def __init__(self, model):
        self.trackers = [] if _keras.LEGACY else _keras.output_loss_trackers(model)
        self.before = [
            (tf.identity(t.total.value), tf.identity(t.count.value)) for t in self.trackers
        ]

    def apply(self, weight, scale=1.0):
        for tracker, (total, count) in zip(self.trackers, self.before, strict=True):
            # Inside the loop each micro-batch added its share of the loss with weight one.
            loss = (tracker.total - total) * scale
            tracker.total.assign(total)
            tracker.count.assign(count)
            tracker.update_state(loss, sample_weight=weight)


# -- the probe's data -------------------------------------------------------------


def _first_samples(data, count):
    return tf.nest.map_structure(lambda t: None if t is None else t[:count], data)


def _repeat(data):
    return tf.nest.map_structure(lambda t: None if t is None else tf.concat([t, t], 0), data)


def _kind(once, twice):
    """MEAN if a value stays when every sample is repeated, SUM if it doubles, else None."""
    tolerance = _PROBE_RTOL * max(abs(once), abs(twice), 1e-12)
    if abs(twice - once) <= tolerance:
        return MEAN
    if abs(twice - 2 * once) <= tolerance:
        return SUM
    return None


def _what(once, twice):
    ratio = twice / once if once else np.inf
    return f"went from {once:.6g} to {twice:.6g} (x{ratio:.3g}) when every sample was repeated"
