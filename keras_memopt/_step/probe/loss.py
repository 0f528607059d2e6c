"""The loss and the terms of `model.losses` on repeated samples (`keras_memopt._step.probe`).

What is evaluated and why: docs/accumulation.md, "How the fraction is found". The loss comes from
one forward pass (a random layer cannot fool it), also one sample at a time as the micro-batches
weigh it (a ratio of sums, a Dice loss, does not add up) and weighted one on a sample (Keras may
divide by a count the fractions do not know)."""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from keras_memopt import _autograph, _keras
from keras_memopt._keras import losses as _keras_losses
from keras_memopt._step import batch_dependence as _batch_dependence
from keras_memopt._step import loop as _loop
from keras_memopt._step import losses as _losses
from keras_memopt._step import rollback as _rollback
from keras_memopt._step.losses import LossForm, overrides
from keras_memopt._step.probe import in_replica, pairs, repeat, sample, tolerance
from keras_memopt._step.probe import metrics as _metrics
from keras_memopt._step.seen import (
    NAN,
    Seen,
    coupled_loss_message,
    seen_terms,
    silent_terms,
    term_kind,
)


def loss_form(model, split, data, whole_batch_loss=False) -> LossForm:
    """How `model`'s loss and metrics split over micro-batches (`split`: its `LossSplit`).

    Raises:
        ValueError: for a loss of the outputs that does not average over the samples or a compiled
            metric that does not add up over micro-batches (both unless `whole_batch_loss`), or a
            term of `model.losses` that neither averages nor sums over them.
    """
    if whole_batch_loss and not _keras.REPLACES_MODEL_LOSSES and overrides(model, "compute_loss"):
        raise ValueError(
            "`whole_batch_loss=True` with an overridden `compute_loss` needs Keras 3: "
            "tf_keras has no way to hand it the micro-batches' `add_loss` terms. "
            "Compile the loss instead, or train on Keras 3. Received: "
            f"{type(model).__name__}.compute_loss on tf_keras"
        )
    x, y, _ = _keras.unpack_x_y_sample_weight(data)
    if not [t for t in tf.nest.flatten(x) if t is not None]:
        return LossForm()
    first = _loop.micro_slice(x, 0, 2), _loop.micro_slice(y, 0, 2)
    # What the probes change (metrics, random seeds, counters) is put back, and what
    # tf_keras's forward pass that builds the compiled metrics adds to the layers' own.
    snapshot = _rollback.Snapshot(
        lambda: _rollback.loop_variables(model), model.distribute_strategy
    )
    taken = snapshot.take()
    _keras.build_step_state(model, *first)
    form = LossForm((), _losses.ignore_classes(model, y), summed=_losses.summed_outputs(model, y))
    try:
        loss, terms, masked = _loss_and_terms(model, split, form, (x, y), whole_batch_loss)
        alone = [sample(first[0], i) for i in range(int(_loop.batch_size_of(first[0])))]
        metrics = _metrics.layer_metric_kinds(model, first[0], repeat(first[0]), alone)
        coupled = [] if whole_batch_loss or y is None else _metrics.coupled(model, *repeat(first))
        _batch_dependence.warn(model, x)
    finally:
        for metric in model.metrics:  # the loss trackers may be new
            metric.reset_state()
        snapshot.restore(taken)
    if coupled:
        raise ValueError(_metrics.message(coupled))
    if loss is not None and not np.isnan(loss[0].once):
        whole, one = loss
        changed = whole.not_a_mean() or (None if one.adds_up() else one.split(alone=True))
        if changed is not None:
            raise ValueError(
                coupled_loss_message(model, changed, overrides(model, "compute_loss"))
            )
    kinds = tuple(term_kind(index, *term) for index, term in enumerate(terms))
    return dataclasses.replace(form, terms=kinds, masked=masked, metrics=metrics)


def _loss_and_terms(model, split, form, data, whole_batch_loss):
    """`(loss, terms, masked)`: the loss as `(Seen, Seen of one sample)` (None with
    `whole_batch_loss`), each term of `model.losses` as `(Seen of its value, Seen of its gradient's
    norm)`, on the first pair where each tells something, and whether an output is masked."""
    evaluate = _evaluator(model, split, form)
    loss = terms = masked = None
    for pair in pairs(data):
        told = whole_batch_loss or (loss is not None and _tells(loss[0]))
        silent = silent_terms(terms)
        if told and terms is not None and not silent:
            break
        once = evaluate(pair, with_loss=not told)
        masked = once["masked"] if masked is None else masked
        if not told:
            loss = once["loss"], once["one"]
        if terms is None or silent:
            again, twice = evaluate(pair, False), evaluate(repeat(pair), False)
            terms = seen_terms(terms, once["terms"], again["terms"], twice["terms"])
    return loss, terms, masked


def _tells(loss) -> bool:
    """Whether the loss tells whether it is a mean (not zero on the samples, or none)."""
    return not loss.negligible or np.isnan(loss.once)


def _evaluator(model, split, form):
    """`evaluate(data, with_loss)`: `_evaluate`'s values on host, as `Seen`s where they are the
    loss's. Eager, but one `tf.function` for a model with float8 layers: Keras 3's float8 `Dense`
    takes gradients only in a graph. One, with shapes relaxed: a function per probe drew
    TensorFlow's warning about retracing."""

    def run(x, y, with_loss):
        return _evaluate(model, split, form, x, y, with_loss)

    if any(_loop.overwritten(v) for v in model.trainable_variables):
        run = _autograph.function(run, reduce_retracing=True)

    def evaluate(data, with_loss):
        v = in_replica(model, run, *data, with_loss)
        loss = Seen(v["loss"], v["repeated"], parts=v["parts"], magnitude=v["magnitude"],
                    rtol=float(v["rtol"]))
        one = Seen(v["own"], parts=v["alone"], magnitude=v["magnitude"], rtol=loss.rtol)
        terms = list(zip(v["terms"], v["norms"], strict=True))
        return dict(loss=loss, one=one, terms=terms, masked=bool(v["masked"]))

    return evaluate


def _evaluate(model, split, form, x, y, with_loss):
    """On one batch: the loss of the outputs and of them repeated (NaN: none), the parts of each
    sample where `with_loss` (`_each_sample`), each term of `model.losses` and its gradient's norm,
    and whether an output carries a mask. On the repeated samples the losses that sum over the batch
    (`form.summed`) are weighted by one half: a loss that splits then keeps its value."""
    # Not variables overwritten with their "gradient" (float8's scales): a new value, that stays.
    variables = [v for v in model.trainable_variables if not _loop.overwritten(v)]
    with tf.GradientTape(persistent=True) as tape:
        y_pred = model(x, training=False)
        terms = [tf.reduce_sum(tf.cast(t, tf.float32)) for t in model.losses]
    norms = [_norm(tape.gradient(term, variables)) for term in terms]
    del tape
    once = twice = nan = tf.constant(NAN)
    if overrides(model, "compute_loss"):
        once = _keras_losses.compute_loss(model, x, y, y_pred, None, training=False)
        twice = _keras_losses.compute_loss(
            model, repeat(x), repeat(y), repeat(y_pred), None, training=False
        )
    elif y is not None and _losses.has_compiled_loss(model):
        once = _keras_losses.compiled_loss(model, y, y_pred, None, [])
        halves = _halved_sums(y_pred, form.summed)
        twice = _keras_losses.compiled_loss(model, repeat(y), repeat(y_pred), halves, [])
    masked = any(_keras.get_mask(t) is not None for t in tf.nest.flatten(y_pred))
    parts = (nan,) * 4
    if with_loss and once is not nan:
        form = dataclasses.replace(form, masked=masked)
        parts = _each_sample(model, split, form, x, y, y_pred)
    values = dict(loss=once, repeated=twice, terms=terms, norms=norms, masked=float(masked),
                  rtol=tolerance(once.dtype))
    values.update(zip(("parts", "magnitude", "own", "alone"), parts, strict=True))
    return tf.nest.map_structure(lambda v: tf.cast(v, tf.float32), values)


def _halved_sums(y_pred, summed):
    """Sample weights of one half on outputs whose loss sums over the batch, one on the others."""
    if not summed:
        return None
    floatx = _keras.keras.backend.floatx()
    halves = [tf.constant(0.5 if s else 1.0, floatx) for s in summed]
    return tf.nest.pack_sequence_as(y_pred, halves) if tf.nest.is_nested(y_pred) else halves[0]


def _norm(gradients) -> tf.Tensor:
    """The global norm of `gradients` (float32), a sparse one's rows summed first."""
    squares = [tf.zeros([])]
    for gradient in gradients:
        if isinstance(gradient, tf.IndexedSlices):
            gradient = _loop.sum_rows(gradient).values
        if gradient is not None:
            squares.append(tf.reduce_sum(tf.square(tf.cast(gradient, tf.float32))))
    return tf.sqrt(tf.add_n(squares))


def _each_sample(model, split, form, x, y, y_pred):
    """`(parts, magnitude, own, alone)` on a few samples' outputs: the loss as micro-batches of one
    sample add it up (`split.compiled_fraction`, with the fractions `form` gives) and the sum of the
    parts' absolute values; and for the sample whose part differs most, the loss weighted one on it
    and zero elsewhere (`own`, NaN for an overridden `compute_loss`) and its part (`alone`)."""
    count = _loop.static_batch_size(y_pred)
    nan = tf.constant(NAN, tf.float64)
    if not count:
        return nan, nan, nan, nan
    valid = _losses.counts(split.divisor_masks(y, y_pred, form))
    parts, own = [], []
    for index in range(count):
        one = [sample(data, index) for data in (x, y, y_pred)]
        if overrides(model, "compute_loss"):
            loss = _keras_losses.compute_loss(model, *one, None, training=False)
            parts.append(loss * tf.cast(1 / count, loss.dtype))
            own.append(nan)
            continue
        fraction = _loop.fraction_of(1, count)
        parts.append(split.compiled_fraction(*one[1:], None, fraction, valid, form=form))
        own.append(_weighted_on(model, index, count, y, y_pred))
    parts, own = (tf.stack([tf.cast(v, tf.float64) for v in vs]) for vs in (parts, own))
    worst = tf.argmax(tf.where(tf.math.is_nan(own), tf.zeros_like(own), tf.abs(own - parts)))
    return tf.reduce_sum(parts), tf.reduce_sum(tf.abs(parts)), own[worst], parts[worst]


def _weighted_on(model, index, count, y, y_pred):
    """The outputs' compiled loss weighted one on sample `index` and zero elsewhere (weights of the
    output's shape without its last axis); NaN for a loss that takes no such weights."""
    floatx = _keras.keras.backend.floatx()

    def weights(output):
        shape = tf.shape(output)[:-1] if output.shape.rank > 1 else tf.shape(output)
        one = tf.one_hot(index, count, dtype=floatx)
        one = tf.reshape(one, [count] + [1] * (output.shape.rank - 2))
        return tf.broadcast_to(one, shape)

    try:
        return _keras_losses.compiled_loss(
            model, y, y_pred, tf.nest.map_structure(weights, y_pred), []
        )
    except (ValueError, TypeError, tf.errors.InvalidArgumentError):
        return tf.constant(NAN, tf.float64)
