"""`whole_batch_loss=True` on JAX: the loss of the whole batch's outputs, exact, in micro-batches.

Gradient caching (GradCache) around Keras's own loss, as on the TensorFlow line
(`keras_memopt._step.whole_batch`, docs/whole-batch-loss.md), inside the one
compiled, stateless step of `keras_memopt._step.jax_step` (its `Split` runs the
micro-batches):

1. every micro-batch forward (`model.stateless_call`, no gradient), its outputs
   kept and its part of the terms of `model.losses` (`jax_terms.weighted`: a
   sum over the samples as it is, any other `n_i / N` of itself) summed;
2. the loss once, Keras's `stateless_compute_loss` on the whole batch's outputs
   (float16 and bfloat16 outputs cast to float32 first; the Keras masks the
   micro-batches' outputs carried attached) with those terms, and its gradient with
   respect to the outputs (`jax.value_and_grad`). Keras's cross-entropies on JAX
   read a softmax or sigmoid output itself, not the logits behind it (a traced
   array keeps no `_keras_logits`): the outputs are all the loss reads;
3. every micro-batch forward again under `jax.grad`, back-propagating its rows
   of that gradient, plus its share of the terms, scaled as the optimizer scales
   a loss; the gradients add up (`jax_step`'s fold) to one `stateless_apply`.

The non-trainable state (seed generators, BatchNormalization's moving
statistics) is carried from one micro-batch to the next in both passes, each
from the step's start, so each micro-batch of pass 3 starts from the state its
pass 1 started from: Dropout draws the same masks in both, and the state ends
as it ends without the option, advanced once per micro-batch (no copy of each
micro-batch's state is kept; the step returns pass 1's). The loss tracker, the
per-output loss trackers (from step 2's one call) and the compiled metrics see
the whole batch once: plain Keras's figures at the whole batch.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from keras_memopt import _keras
from keras_memopt._keras import jax as _jax
from keras_memopt._keras import keras
from keras_memopt._step import jax_step, jax_terms, per_update
from keras_memopt._step.jax_fractions import Refused, masked_outputs, with_masks

tree = keras.tree


def train_step(model, micro_batch_size, state, data):
    """Keras's JAX `train_step(state, data)` for `model` with `whole_batch_loss=True`,
    in micro-batches of `micro_batch_size(batch_size)` samples."""
    trainable, non_trainable, optimizer_variables, metrics_variables = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    _refuse_call_assigned(model)
    split = jax_step.Split(micro_batch_size, jax_step.batch_size_of(x))
    y_pred, penalty, after, masks = _outputs(model, split, trainable, non_trainable, x,
                                             training=True)
    floating = _floating(y_pred)

    def loss_of(values):
        outputs = with_masks(_replaced(y_pred, floating, values), *masks)
        return _loss(model, (trainable, after, metrics_variables), x, y, outputs,
                     sample_weight, penalty, training=True)

    widened = [_widened(tree.flatten(y_pred)[i]) for i in floating]
    (loss, metrics_variables), cotangents = jax.value_and_grad(loss_of, has_aux=True)(widened)
    grads = _backward(model, split, (trainable, non_trainable, optimizer_variables),
                      x, floating, cotangents)
    trainable, optimizer_variables = model.optimizer.stateless_apply(
        optimizer_variables, grads, trainable
    )
    # Keras's train step hands the metrics the outputs without their masks.
    logs, metrics_variables = _jax.update_metrics(
        model, metrics_variables, loss, x, y, y_pred, sample_weight
    )
    return logs, (trainable, after, optimizer_variables, metrics_variables)


def test_step(model, micro_batch_size, state, data):
    """Keras's JAX `test_step(state, data)` for `model` with `whole_batch_loss=True`:
    the loss and metrics of the whole batch's outputs, one micro-batch's
    activations at a time."""
    trainable, non_trainable, metrics_variables = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    split = jax_step.Split(micro_batch_size, jax_step.batch_size_of(x))
    y_pred, penalty, after, masks = _outputs(model, split, trainable, non_trainable, x,
                                             training=False)
    y_pred = with_masks(y_pred, *masks)
    loss, metrics_variables = _loss(model, (trainable, after, metrics_variables), x, y,
                                    y_pred, sample_weight, penalty, training=False)
    logs, metrics_variables = _jax.update_metrics(
        model, metrics_variables, loss, x, y, y_pred, sample_weight
    )  # with their masks, as Keras's test step hands them
    return logs, (trainable, after, metrics_variables)


def _outputs(model, split, trainable, non_trainable, x, training):
    """Step 1: `(outputs, penalty, non_trainable, masks)`, the whole batch's outputs
    in order, its share of the terms of `model.losses` summed (None where the model
    adds none), the state after the last micro-batch, and the Keras masks the
    outputs carried (`with_masks(outputs, *masks)` attaches them)."""
    kwargs = {"training": training} if _keras.calls_with_training(model) else {}
    counted, kept = [], []

    def first(non_trainable, xs):
        y_pred, non_trainable, losses = _jax.stateless_call_with_losses(
            model, trainable, non_trainable, xs, **kwargs
        )
        counted[:] = [len(losses)]
        fraction = jax_step.batch_size_of(xs) / split.size
        masks, kept[:] = masked_outputs(y_pred)
        return non_trainable, _summed_terms(model, losses, fraction), (y_pred, masks)

    zero = jnp.zeros([], _wide_dtype(keras.backend.floatx()))
    penalty, after, (y_pred, masks) = split.run(first, zero, non_trainable, x)
    return y_pred, penalty if counted[0] else None, after, (masks, kept)


def _loss(model, state, x, y, y_pred, sample_weight, penalty, training):
    """Step 2: `(loss, metrics_variables)`, Keras's loss of the whole batch's outputs
    `y_pred` (their masks attached by the caller) with `penalty` as the terms of `model.losses`."""
    trainable, non_trainable, metrics_variables = state
    terms = [] if penalty is None else [penalty]
    with _jax.losses_replaced(model, terms) if terms else contextlib.nullcontext():
        loss, (_, _, metrics_variables) = model.stateless_compute_loss(
            trainable, non_trainable, metrics_variables,
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training,
        )
    return loss, metrics_variables


def _backward(model, split, state, x, floating, cotangents):
    """Step 3: the gradients of the trainable variables, each micro-batch's forward
    run again from the state its step 1 started from, its rows of `cotangents`
    (one per output of `floating`) back-propagated, with its share of the terms."""
    trainable, non_trainable, optimizer_variables = state
    kwargs = {"training": True} if _keras.calls_with_training(model) else {}
    zeros = jax_step.zero_parts(model, trainable)  # (gradients, loss, trackers): its fold's

    def second(non_trainable, part):
        xs, rows = part
        fraction = jax_step.batch_size_of(xs) / split.size

        def surrogate(trainable):
            y_pred, after, losses = _jax.stateless_call_with_losses(
                model, trainable, non_trainable, xs, **kwargs
            )
            flat = tree.flatten(y_pred)
            parts = [jnp.sum(flat[i].astype(c.dtype) * c)
                     for i, c in zip(floating, rows, strict=True)]
            total = sum(parts, _summed_terms(model, losses, fraction))
            return _scaled(model, optimizer_variables, total), after

        grads, non_trainable = jax.grad(surrogate, has_aux=True)(trainable)
        return non_trainable, (grads, *zeros[1:]), ()

    (grads, _, _), _, _ = split.run(
        second, zeros, non_trainable, (x, list(cotangents)), fold=jax_step.gradient_fold(model)
    )
    return grads


def _summed_terms(model, losses, fraction):
    """A micro-batch's part of the terms `losses` of `model.losses` (`jax_terms.weighted`:
    a sum over the samples as it is, any other times `fraction`, `n_i / N`), summed in
    the sum's dtype."""
    total = jnp.zeros([], _wide_dtype(keras.backend.floatx()))
    terms = [jnp.sum(_widened(term)).astype(total.dtype) for term in losses]
    for term in jax_terms.weighted(model, terms, fraction):
        total = total + term
    return total


def _scaled(model, optimizer_variables, loss):
    """`loss` scaled as the optimizer scales it (a `LossScaleOptimizer`'s scale)."""
    mapping = list(zip(model.optimizer.variables, optimizer_variables, strict=True))
    with keras.StatelessScope(state_mapping=mapping):
        return model.optimizer.scale_loss(loss)


def _floating(y_pred) -> list:
    """The indices of the floating outputs among `y_pred`'s flat ones: those the
    loss is differentiated with respect to."""
    return [i for i, t in enumerate(tree.flatten(y_pred))
            if jnp.issubdtype(jnp.result_type(t), jnp.floating)]


def _replaced(y_pred, indices, values):
    """`y_pred` with its flat outputs at `indices` replaced by `values`."""
    flat = list(tree.flatten(y_pred))
    for index, value in zip(indices, values, strict=True):
        flat[index] = value
    return tree.pack_sequence_as(y_pred, flat)


def _wide_dtype(dtype):
    """float32 for float16 and bfloat16 (mixed precision), `dtype` itself otherwise."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype("float32") if dtype in (jnp.float16, jnp.bfloat16) else dtype


def _widened(t):
    return t.astype(_wide_dtype(t.dtype))


def _refuse_call_assigned(model):
    """Refuses the state a training call sets whatever the batch (a
    `SpectralNormalization`'s kernel and `vector_u`), as the TensorFlow line does
    with the option: each micro-batch runs forward twice."""
    assigned = per_update.call_assigned_weights(model)
    if assigned:
        raise Refused(
            "`whole_batch_loss=True` runs each micro-batch forward twice, which would "
            "divide a `SpectralNormalization`'s kernel twice. Train such a model without "
            f"it. Received: whole_batch_loss=True, {len(assigned)} weight(s) assigned in "
            "every training call"
        )
