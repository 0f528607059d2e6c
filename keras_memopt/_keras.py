"""The one seam between keras_memopt and the Keras line in use.

TensorFlow picks the Keras line with `TF_USE_LEGACY_KERAS`: unset, `tf.keras`
is Keras 3; set to `1`, it is tf_keras (Keras 2), the line that
tensorflow-model-optimization needs. keras_memopt follows the same switch.
Everything that differs between the two lines lives here, so the rest of the
package is written once.
"""

import os

import tensorflow as tf

LEGACY = os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true")

if LEGACY:
    import tf_keras as keras
else:
    import keras

# Keras hides its functional model class; both lines return it from
# `Model.__new__` when given functional arguments (without initialising it).
Functional = type(keras.Model.__new__(keras.Model, inputs=[], outputs=[]))

register_serializable = keras.saving.register_keras_serializable
unpack_x_y_sample_weight = keras.utils.unpack_x_y_sample_weight

# Loss reductions under which a batch's loss is the per-sample mean, the form
# that micro-batches weighted by their share of the batch reproduce exactly.
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "auto")


def is_functional_call(args, kwargs):
    """Whether model constructor arguments describe a functional model."""
    return (
        len(args) == 2
        or (len(args) == 1 and "outputs" in kwargs)
        or ("inputs" in kwargs and "outputs" in kwargs)
    )


def loss_reduction(loss):
    """The reduction of a `keras.losses.Loss` instance, or None for others."""
    reduction = getattr(loss, "reduction", None)
    return None if reduction is None else str(reduction).lower()


def mean_reduction(reduction):
    return reduction is None or reduction in _MEAN_REDUCTIONS


def resolve_jit_compile(model, jit_compile):
    """What `compile(jit_compile=...)` resolves to for this model."""
    if LEGACY:
        return bool(jit_compile) and jit_compile != "auto"
    return bool(model.jit_compile)


def compile_kwargs(jit_compile):
    """`compile` keyword arguments for the outer step's compilation."""
    return {"jit_compile": False} if LEGACY else {"jit_compile": jit_compile}


def compute_loss(model, x, y, y_pred, sample_weight, training):
    """The model's total loss for one micro-batch, regularisation included."""
    if LEGACY:
        # tf_keras tracks the reported loss inside `compiled_loss`, weighted by
        # the micro-batch size, which adds up to the batch's mean.
        return model.compute_loss(x, y, y_pred, sample_weight)
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
    )


def track_loss(model, loss, batch_size):
    """Records a batch's loss the way Keras's own train and test steps do."""
    if LEGACY:
        return  # Tracked per micro-batch in `compute_loss`.
    tracker = getattr(model, "_loss_tracker", None)
    if tracker is None:
        return
    # Keras divides the loss by the number of replicas so that summing
    # gradients across replicas gives the global mean; the reported loss is
    # the replica's own mean.
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    tracker.update_state(loss * replicas, sample_weight=batch_size)


def scale_loss(optimizer, loss):
    """Applies the loss scale of a mixed-precision optimizer, if any."""
    if optimizer is None:
        return loss
    if LEGACY:
        if isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer):
            return optimizer.get_scaled_loss(loss)
        return loss
    return optimizer.scale_loss(loss)


def apply_gradients(optimizer, gradients, variables):
    """One optimizer update; a loss-scale optimizer unscales and skips
    non-finite gradients (and lowers its scale) as in plain Keras."""
    if LEGACY and isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer):
        gradients = optimizer.get_unscaled_gradients(gradients)
    optimizer.apply_gradients(zip(gradients, variables, strict=True))
