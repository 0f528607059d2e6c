"""The seam to the Keras line in use for losses: Keras's loss container, the terms of `model.losses`
and the reported loss's trackers, on Keras 3 and tf_keras (`keras_memopt._keras` for the rest)."""

import contextlib

import tensorflow as tf

from keras_memopt import _dtypes
from keras_memopt._keras import LEGACY, keras

# tf_keras's loss container weighs the loss it reports by the call's dynamic batch size
# and adds the terms of `model.losses` itself: a micro-batch's loss is expressed per
# sample of the micro-batch there. Keras 3's container leaves the terms to the step.
PER_SAMPLE_CONTAINER = LEGACY


def compute_loss(model, x, y, y_pred, sample_weight, training):
    """The model's `compute_loss` (a user's override included), regularisation included."""
    if LEGACY:
        return model.compute_loss(x, y, y_pred, sample_weight)
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
    )


def compiled_loss_container(model):
    """Keras's container of the losses given to `compile`, or None."""
    return getattr(model, "compiled_loss" if LEGACY else "_compile_loss", None)


def compiled_loss(model, y, y_pred, sample_weight, terms):
    """The compiled losses plus `terms`, by Keras's own container. tf_keras's container also updates
    the reported loss (weighted by the dynamic batch size); Keras 3's updates its per-output loss
    trackers."""
    container = compiled_loss_container(model)
    if LEGACY:
        # None where no output has a loss and there are no terms.
        loss = container(y, y_pred, sample_weight, regularization_losses=terms)
        return tf.zeros([], keras.backend.floatx()) if loss is None else loss
    loss = container(y, y_pred, sample_weight)
    loss = tf.zeros([], keras.backend.floatx()) if loss is None else loss
    for term in terms:
        loss += tf.cast(term, loss.dtype)
    return loss


def additional_loss(model, term):
    """A term of `model.losses` as Keras adds it to the loss (scaled for replicas)."""
    if LEGACY:
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        term = tf.reduce_sum(_dtypes.widened(term))
        return term / replicas if replicas > 1 else term
    return model._aggregate_additional_loss(term)


def loss_with_terms(model, x, y, y_pred, sample_weight, terms, training):
    """The loss of outputs `y_pred` as Keras computes it, with `terms` in place of
    `model.losses` (a user's `compute_loss` included on Keras 3; the compiled loss on
    tf_keras, which has no hook to replace them: see `losses_replaced`)."""
    if LEGACY:
        return compiled_loss(model, y, y_pred, sample_weight, list(terms))
    with losses_replaced(model, terms):
        return compute_loss(model, x, y, y_pred, sample_weight, training)


@contextlib.contextmanager
def losses_replaced(model, terms):
    """Keras 3: `model.losses` is `terms` inside (`whole_batch_loss`'s terms summed over the
    micro-batches); tf_keras has no such hook."""
    saved = model._losses_override
    model._losses_override = list(terms)
    try:
        yield
    finally:
        model._losses_override = saved


def output_loss_trackers(model):
    """Keras 3's per-output loss trackers (`Mean` metrics), in output order; none on
    tf_keras, whose container weighs them itself (`PER_SAMPLE_CONTAINER`)."""
    container = compiled_loss_container(model)
    return list(container.metrics) if container is not None and not LEGACY else []


def unweighted_loss_metric(model):
    """tf_keras's reported loss where no output has a loss (the loss is only `model.losses`): its
    container then weighs each call by one, not by the call's samples, so a step must update it
    once. None otherwise (Keras 3 tracks the loss in the step, `track_loss`)."""
    if not LEGACY or any(tf.nest.flatten(getattr(model, "loss", None))):
        return None
    container = compiled_loss_container(model)
    # Made with the container; listed in its `metrics` only once it is built.
    return getattr(container, "_total_loss_mean", None)


def track_loss(model, loss, batch_size):
    """Records a batch's loss the way Keras's own train and test steps do."""
    if LEGACY:
        return  # Tracked per micro-batch in `compute_loss`.
    tracker = getattr(model, "_loss_tracker", None)
    if tracker is None:
        return
    # Keras divides the loss by the number of replicas so that summing gradients across replicas
    # gives the global mean; the reported loss is the replica's own mean.
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    tracker.update_state(loss * replicas, sample_weight=batch_size)
