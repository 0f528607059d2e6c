"""Each micro-batch's exact fraction of the batch's loss, and the loss of a whole batch.

A micro-batch's fraction is its count over the batch's, as Keras counts (docs/accumulation.md,
"The semantics"), given to Keras's own loss computation as scalar sample weights.

Keras 3 updates each per-output loss tracker with the batch's *static* size, unknown inside the loop
(each micro-batch counts as one; eagerly `_one_update_each` makes it so): the trackers are set after
the loop (`OutputLossTrackers`). tf_keras weights them by the dynamic size, so there micro-batch
losses are per sample of the micro-batch, their total weighted by `n_i / N`."""

from __future__ import annotations

import contextlib
import dataclasses

import tensorflow as tf

from keras_memopt import _dtypes, _keras
from keras_memopt._keras import losses as _keras_losses
from keras_memopt._step import loop as _loop
from keras_memopt._step.seen import SUM


@dataclasses.dataclass(frozen=True)
class LossForm:
    """What the first step's probe found (`_step.probe`): a kind per term of `model.losses`, an
    `ignore_class` (or None) per flat output, whether an output carries a mask."""

    terms: tuple[str, ...] = ()
    ignore_classes: tuple = ()
    masked: bool = False
    # Per flat output, whether its loss sums over the batch (`reduction="sum"`); () where none does.
    summed: tuple = ()
    # One kind per `Mean` metric the layers update in `call` (`layer_metrics`).
    metrics: tuple = ()

    @property
    def counted_by(self) -> str | None:
        """What the batch's counts need, known before the loop: "outputs" (a forward pass: an output
        carries a mask), "targets" (an ignored class only), or None (Keras counts samples)."""
        if self.masked:
            return "outputs"
        return "targets" if any(c is not None for c in self.ignore_classes) else None


def overrides(model, name) -> bool:
    """Whether `model`'s class overrides `keras.Model.<name>`."""
    return getattr(type(model), name) is not getattr(_keras.keras.Model, name)


def has_compiled_loss(model) -> bool:
    return _keras_losses.compiled_loss_container(model) is not None


def output_losses(model, y=None) -> list:
    """Each flat output's compiled loss (None where it has none); a dict of losses matched by
    name (the targets' keys where they are a dict: a subclassed model names them nowhere else)."""
    outputs = y if isinstance(y, dict) else None
    if outputs is None and isinstance(model, _keras.Functional):
        outputs = _keras.nested_inputs_outputs(model)[1]
    if isinstance(outputs, dict):
        names = sorted(outputs)  # the order `tf.nest.flatten` gives a dict's values
    else:
        names = list(getattr(model, "output_names", None) or [])
    loss = getattr(model, "loss", None)
    if isinstance(loss, dict):
        return [loss.get(name) for name in names]
    if isinstance(loss, (list, tuple)):
        return list(loss)
    return [loss] * max(len(names), 1)


def reduction_of(loss) -> str | None:
    """A `keras.losses.Loss`'s reduction in lower case, on both lines (None: a
    function or a name, which average over the samples)."""
    reduction = getattr(loss, "reduction", None)
    return None if reduction is None else str(reduction).lower()


def ignore_classes(model, y=None) -> tuple:
    """The `ignore_class` of each flat output's compiled loss (None where none)."""
    classes = []
    for item in output_losses(model, y):
        config = item.get_config() if hasattr(item, "get_config") else {}
        classes.append(config.get("ignore_class"))
    return tuple(classes) if any(c is not None for c in classes) else ()


def summed_outputs(model, y=None) -> tuple:
    """Whether each flat output's compiled loss sums over the batch (`reduction="sum"`:
    its micro-batches' losses add up to the batch's unweighted); () where none does."""
    summed = tuple(reduction_of(item) == "sum" for item in output_losses(model, y))
    return summed if any(summed) else ()


# Reductions that split over micro-batches: means (weighted by the fraction) and the sum.
_SPLIT_REDUCTIONS = (None, "sum_over_batch_size", "mean", "auto", "sum")


def check_reduction(loss, whole_batch_loss):
    """Refuses a `keras.losses.Loss` whose reduction the micro-batches cannot add up to."""
    for item in tf.nest.flatten(loss):
        reduction = reduction_of(item)
        if reduction in _SPLIT_REDUCTIONS:
            continue
        if reduction == "mean_with_sample_weight" and whole_batch_loss:
            continue  # one ratio of the whole batch's sums, evaluated once
        hint = (
            " or pass `whole_batch_loss=True` to evaluate it once on the whole batch's outputs"
            if reduction == "mean_with_sample_weight"
            else ""
        )
        raise ValueError(
            "AccumulatingModel needs losses that average over the samples of a "
            "batch (reduction='sum_over_batch_size', Keras's default, or 'mean') or "
            "sum over them ('sum'), so that the micro-batches' losses add up to the "
            f"batch's; use one of those{hint}. Received: loss={type(item).__name__} with "
            f"reduction={reduction!r}, whole_batch_loss={whole_batch_loss}"
        )


class LossSplit:
    """How `model`'s loss splits over micro-batches; `form` (a `LossForm`) is found at the first
    step (`probe.loss.loss_form`)."""

    def __init__(self, model):
        self.model = model
        self.form: LossForm | None = None

    def divisor_masks(self, y, y_pred, form=None) -> list:
        """Per flat output, what Keras divides its loss by: its mask, and'ed with
        the elements its loss does not ignore; None where it counts samples."""
        masks = output_masks(y_pred) if y_pred is not None else []
        ignored = (form or self.form or LossForm()).ignore_classes
        if not ignored:
            return masks
        targets = _flat_targets(y, len(ignored))
        masks = masks or [None] * len(ignored)
        for index, ignore in enumerate(ignored):
            if ignore is None or targets[index] is None:
                continue
            kept = tf.not_equal(targets[index], tf.cast(ignore, targets[index].dtype))
            mask = masks[index]
            if mask is not None:
                kept = tf.logical_and(tf.reshape(kept, tf.shape(mask)), tf.cast(mask, tf.bool))
            masks[index] = kept
        return masks

    def batch_counts(self, forward, data, size, jit_compile=False):
        """What Keras divides each output's loss by over the whole batch (0: samples), as
        `form.counted_by` says: from the targets, or micro-batch by micro-batch with `forward`
        in inference mode where an output carries a mask."""
        counted_by = (self.form or LossForm()).counted_by
        if counted_by is None:
            return no_counts()
        if counted_by == "targets":
            return counts(self.divisor_masks(data[1], None))

        def count(micro):
            x, y, _ = micro
            y_pred = forward(x, training=False)
            return counts(self.divisor_masks(y, y_pred))

        return _loop.accumulate(count, data, size, jit_compile=jit_compile)

    def micro_batch_loss(self, x, y, y_pred, sample_weight, batch_size, valid, training):
        """The micro-batch's part of the batch's loss (what its gradient is taken of); `valid`
        is `batch_counts`'."""
        model = self.model
        fraction = _loop.fraction_of(_loop.batch_size_of((x, y, sample_weight)), batch_size)
        if overrides(model, "compute_loss") or not (has_compiled_loss(model) or model.losses):
            # A user's own loss (or Keras's error where there is none).
            loss = _keras_losses.compute_loss(model, x, y, y_pred, sample_weight, training)
            return loss * tf.cast(fraction, loss.dtype)
        if _keras_losses.PER_SAMPLE_CONTAINER:
            # The container adds the terms, per sample of the micro-batch.
            terms = [self._term(t, i, 1.0, 1.0 / fraction) for i, t in enumerate(model.losses)]
            return self.compiled_fraction(y, y_pred, sample_weight, fraction, valid, terms)
        if has_compiled_loss(model):
            loss = self.compiled_fraction(y, y_pred, sample_weight, fraction, valid)
        else:  # `compile(loss=None)`: the terms of `model.losses` are the loss
            loss = tf.zeros([], _dtypes.sum_dtype(_keras.keras.backend.floatx()))
        for index, term in enumerate(model.losses):
            term = _keras_losses.additional_loss(model, term)
            loss += tf.cast(self._term(term, index, fraction, 1.0), loss.dtype)
        return loss

    def compiled_fraction(self, y, y_pred, sample_weight, fraction, valid, terms=(), form=None):
        """A micro-batch's compiled loss, its fraction of the batch's (`terms`: tf_keras)."""
        form = form or self.form or LossForm()
        masks = self.divisor_masks(y, y_pred, form)
        if _keras_losses.PER_SAMPLE_CONTAINER:
            # Per sample of the micro-batch (see the module docstring).
            fractions = _output_fractions(masks, form.summed, valid, fraction, None)
            weights = _output_weights(y_pred, sample_weight, fractions)
            loss = _keras_losses.compiled_loss(self.model, y, y_pred, weights, list(terms))
            return loss * tf.cast(fraction, loss.dtype)
        fractions = _output_fractions(masks, form.summed, valid, fraction, fraction)
        weights = _output_weights(y_pred, sample_weight, fractions)
        with _one_update_each(self.model, y_pred):
            return _keras_losses.compiled_loss(self.model, y, y_pred, weights, [])

    def penalty(self, fraction) -> tf.Tensor:
        """The terms of `model.losses` of the last call, each with its fraction, summed (not
        scaled for replicas: Keras scales it where it adds it)."""
        terms = [self._term(t, i, fraction, 1.0) for i, t in enumerate(self.model.losses)]
        if not terms:
            return tf.zeros([], _dtypes.sum_dtype(_keras.keras.backend.floatx()))
        return tf.add_n([tf.cast(t, terms[0].dtype) for t in terms])

    def whole_batch_loss(self, x, y, y_pred, sample_weight, penalty, training):
        """The batch's loss of its outputs `y_pred`, as Keras computes it, plus `penalty`
        (the summed terms of `model.losses` of every micro-batch, see `penalty`)."""
        return _keras_losses.loss_with_terms(
            self.model, x, y, y_pred, sample_weight, [penalty], training
        )

    def _term(self, term, index, mean_fraction, sum_fraction):
        kinds = (self.form or LossForm()).terms
        kind = kinds[index] if index < len(kinds) else None
        term = tf.reduce_sum(_dtypes.widened(term))
        return term * tf.cast(sum_fraction if kind == SUM else mean_fraction, term.dtype)


def _masked_fraction(mask, valid, index):
    """The micro-batch's fraction of output `index`'s count over the batch (float64)."""
    count = tf.reduce_sum(tf.cast(mask, tf.float64))
    return tf.math.divide_no_nan(count, valid[index])


def _output_fractions(masks, summed, valid, fraction, samples):
    """What each flat output's loss of a micro-batch is weighted by, relative to `fraction`:
    `samples` where Keras counts samples (for every output: `samples` itself, not a list), its
    count's fraction where it counts elements, one where the loss sums over the batch."""
    summed = summed or (False,) * len(masks)
    if not any(summed) and all(mask is None for mask in masks):
        return samples
    one = tf.ones([], tf.float64)
    fractions = []
    for index, (mask, sums) in enumerate(zip(masks, summed, strict=True)):
        if sums:
            fractions.append(one / fraction if samples is None else one)
        elif mask is not None:
            counted = _masked_fraction(mask, valid, index)
            fractions.append(counted / fraction if samples is None else counted)
        else:
            fractions.append(samples)
    return fractions


def _output_weights(y_pred, sample_weight, fractions):
    """Sample weights carrying each output's fraction (`fractions`: one for all outputs, or
    one per flat output, None leaving the weight as it is); `sample_weight` as Keras hands it."""
    if _loop.static_batch_size(y_pred) == 1:
        # Keras 3 squeezes a lone sample's loss (eager) with a scalar weight to a scalar,
        # which its reduction leaves unscaled for the replicas: a weight per sample.
        fractions = tf.nest.map_structure(
            lambda s: None if s is None else tf.reshape(s, [1]), fractions)
    if not isinstance(fractions, list):
        # Every output's fraction is the micro-batch's: each weight scaled by it.
        if sample_weight is None:
            return fractions
        return tf.nest.map_structure(lambda w: _scaled(w, fractions), sample_weight)
    flat = tf.nest.flatten(y_pred)
    if tf.nest.is_nested(sample_weight):
        user = tf.nest.flatten(sample_weight)
    else:
        user = [sample_weight] * len(flat)
    weights = [_scaled(w, s) for w, s in zip(user, fractions, strict=True)]
    return tf.nest.pack_sequence_as(y_pred, weights) if tf.nest.is_nested(y_pred) else weights[0]


def _scaled(sample_weight, fraction):
    """`sample_weight` times `fraction` in the wider of its float dtype and Keras's (a float32
    product would round a float64 model's fraction); `fraction` alone without a weight."""
    if fraction is None:
        return sample_weight
    if sample_weight is None:
        return fraction
    dtype = tf.as_dtype(_keras.keras.backend.floatx())
    if sample_weight.dtype.is_floating and sample_weight.dtype.size > dtype.size:
        dtype = sample_weight.dtype
    return tf.cast(sample_weight, dtype) * tf.cast(fraction, dtype)


class OutputLossTrackers:
    """Sets the loss trackers the loop updates once per micro-batch (Keras 3's per output;
    tf_keras's reported loss where no output has a loss) to one update with the batch: made
    before the loop, `apply` after."""

    def __init__(self, model):
        self.trackers = _keras_losses.output_loss_trackers(model)
        self.unweighted = _keras_losses.unweighted_loss_metric(model)
        self.before = [
            (tf.identity(t.total.value), tf.identity(t.count.value)) for t in self.trackers
        ]
        if self.unweighted is not None:  # tf_keras's: a variable's `value` is a method
            self.unweighted_before = [tf.identity(v) for v in self.unweighted.variables]

    def apply(self, weight, scale, loss):
        """`weight`: the batch's static size (Keras 3's weight of a batch's loss);
        `scale` turns this replica's loss into its mean; `loss`: the loop's sum."""
        for tracker, (total, count) in zip(self.trackers, self.before, strict=True):
            # Inside the loop each micro-batch added its fraction of the loss with weight one.
            loss_of_output = (tracker.total - total) * tf.cast(scale, tracker.total.dtype)
            tracker.total.assign(total)
            tracker.count.assign(count)
            tracker.update_state(loss_of_output, sample_weight=weight)
        if self.unweighted is not None:
            # One call with the batch's loss, unscaled for the replicas, as tf_keras's
            # container adds the terms of `model.losses` where no output has a loss.
            total, count = self.unweighted_before
            replicas = tf.distribute.get_strategy().num_replicas_in_sync
            value = tf.cast(loss, tf.float64) * tf.cast(scale, tf.float64) * replicas
            self.unweighted.total.assign(total + tf.cast(value, total.dtype))
            self.unweighted.count.assign(count + tf.ones_like(count))


@contextlib.contextmanager
def _one_update_each(model, y_pred):
    """Inside, Keras 3's per-output loss trackers take a call's loss with weight one, as in the
    traced loop, not by the static batch size Keras sees where the step runs eagerly."""
    size = tf.nest.flatten(y_pred)[0].shape[0]
    trackers = _keras_losses.output_loss_trackers(model) if size not in (None, 1) else []
    before = [(tf.identity(t.total.value), tf.identity(t.count.value)) for t in trackers]
    yield
    for tracker, (total, count) in zip(trackers, before, strict=True):
        added = tracker.count - count  # the weight Keras gave (zero: not updated)
        tracker.total.assign(total + tf.math.divide_no_nan(tracker.total - total, added))
        tracker.count.assign(count + tf.minimum(added, tf.ones_like(added)))


def output_masks(y_pred) -> list:
    """The Keras mask of each (flat) output, or None where it has none."""
    return [_keras.get_mask(t) for t in tf.nest.flatten(y_pred)]


def counts(masks) -> tf.Tensor:
    """Elements kept by each mask (0 where there is none), float64."""
    counts = [
        tf.zeros([], tf.float64) if mask is None else tf.reduce_sum(tf.cast(mask, tf.float64))
        for mask in masks
    ]
    return tf.stack(counts) if counts else no_counts()


def no_counts() -> tf.Tensor:
    """The counts of a loss that counts samples: none (`micro_batch_loss`'s `valid`)."""
    return tf.zeros([0], tf.float64)


def _flat_targets(y, outputs):
    """The targets of each flat output (as Keras pairs them for the usual structures)."""
    if not tf.nest.is_nested(y):
        return [y] * outputs
    flat = tf.nest.flatten(y)
    return flat if len(flat) == outputs else [None] * outputs
