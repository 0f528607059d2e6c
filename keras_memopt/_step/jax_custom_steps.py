"""What custom train steps use on JAX: `accumulate_gradients` (a mixin of the JAX
`AccumulatingModel`), and the warning when one splits nothing.

Keras's JAX `train_step(state, data)` is stateless: a custom one takes the
gradients of a function of the variables' values, `jax.value_and_grad(loss_fn,
has_aux=True)` in Keras's guide. `accumulate_gradients` is that call over the
micro-batches of the batch, in the loop of the model's own step
(`keras_memopt._step.jax_step.Split`: `jax.lax.scan` over the equal ones, the
last one at its own shape, each device's share split under `DataParallel`),
each micro-batch's loss weighted by its fraction of the batch's samples.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from keras_memopt._keras import keras
from keras_memopt._step.custom_steps import warn_whole_batch_step
from keras_memopt._step.jax_fractions import Refused
from keras_memopt._step.jax_step import Split, batch_size_of

tree = keras.tree

_NOT_ON_JAX = (
    "AccumulatingModel.accumulate_gradients does not take {what} on the JAX backend yet; "
    "use the TensorFlow backend (KERAS_BACKEND=tensorflow) for it. Received: {received}"
)


class JaxCustomSteps:
    """`accumulate_gradients` on JAX (a mixin of `AccumulatingModel`)."""

    def accumulate_gradients(self, loss_fn, data, variables, state=None, optimizer=None,
                             forward=None):
        """The batch's loss and gradients, computed micro-batch by micro-batch (JAX).

        The building block of a custom stateless `train_step(self, state, data)`:
        where Keras's guide calls `jax.value_and_grad(loss_fn)`, this runs
        `loss_fn` over the micro-batches of `data` in the loop the model's own
        step uses (one micro-batch's activations alive at a time), weights
        each micro-batch's loss by its fraction of the batch (its samples over
        the batch's) and returns the batch's loss and the summed gradients:
        what `jax.value_and_grad` over the whole batch gives when `loss_fn`
        returns a mean over samples. Call it as often as a step needs (a GAN's
        discriminator and generator).

        Without `state`, `loss_fn(variables, micro_batch)` returns the
        micro-batch's mean loss and the result is `(loss, gradients)`, as on
        the TensorFlow line. With `state` (the non-trainable variables' values:
        BatchNormalization's statistics, seed generators),
        `loss_fn(variables, micro_batch, state)` returns
        `(loss, (outputs, state))`, the state is carried from one micro-batch
        to the next, and the result is `((loss, (outputs, state)), gradients)`,
        what `jax.value_and_grad(loss_fn, has_aux=True)` returns, with the
        whole batch's `outputs` in order (for the metrics) and the state after
        the last micro-batch.

        Args:
            loss_fn: a function of the values to differentiate and one
                micro-batch (a slice of `data`, same structure), and of
                `state` where it is given (see above).
            data: the batch: an array or a nest (tuple, dict) of arrays whose
                first axis is the batch.
            variables: the values to differentiate (a nest of arrays, such as
                the trainable variables' values from the step's `state`).
            state: a nest of arrays carried from one micro-batch to the next.
                Defaults to None.
            optimizer: not on JAX yet for a loss-scale optimizer; another one
                is accepted and unused (it scales nothing).
            forward: not on JAX yet (a loss over the whole batch's outputs).

        Returns:
            `(loss, gradients)`, or `((loss, (outputs, state)), gradients)`
            with `state`; `gradients` has the structure of `variables`.

        Example:

        ```python
        def train_step(self, state, data):
            trainable, non_trainable, optimizer_variables, metrics = state
            x, y = data

            def loss_fn(trainable, micro_batch, non_trainable):
                x, y = micro_batch
                y_pred, non_trainable = self.stateless_call(
                    trainable, non_trainable, x, training=True)
                return keras.losses.mean_squared_error(y, y_pred).mean(), (y_pred, non_trainable)

            (loss, (y_pred, non_trainable)), grads = self.accumulate_gradients(
                loss_fn, (x, y), trainable, state=non_trainable)
            trainable, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, grads, trainable)
            ...
        ```

        Raises:
            NotImplementedError: for `forward` or a loss-scale optimizer
                (while the step is traced: the model is left as it was).
            ValueError: if `data` holds no array.
        """
        _refuse_not_on_jax(self, optimizer, forward)
        self._splits_in_step = True
        split = Split(self.micro_batch_size_for, batch_size_of(data))
        with_state = state is not None

        def weighted(values, micro_batch, carried):
            fraction = batch_size_of(micro_batch) / split.size
            if with_state:
                loss, (outputs, carried) = loss_fn(values, micro_batch, carried)
            else:
                loss, outputs = loss_fn(values, micro_batch), ()
            loss = jnp.asarray(loss)
            return loss * jnp.asarray(fraction, loss.dtype), (outputs, carried)

        grad_fn = jax.value_and_grad(weighted, has_aux=True)

        def micro(carried, micro_batch):
            (loss, (outputs, carried)), grads = grad_fn(variables, micro_batch, carried)
            return carried, (loss, grads), outputs

        zeros = (jnp.zeros([], _loss_dtype(loss_fn, variables, data, state, split)),
                 tree.map_structure(jnp.zeros_like, variables))
        (loss, grads), state, outputs = split.run(micro, zeros, state, data)
        if with_state:
            return (loss, (outputs, state)), grads
        return loss, grads


def warned_when_whole(model, step_function):
    """`step_function(state, iterator)` that, after its first call (which traces
    the step), warns once per class where the model's `train_step` called
    neither `accumulate_gradients` nor the model's own step though its setting
    splits batches (the TensorFlow line's warning)."""
    model._splits_in_step = False
    traced = []

    def checked(state, iterator):
        outputs = step_function(state, iterator)
        if not traced:
            traced.append(True)
            splits = model.micro_batch_size is not None or (model.accumulation_steps or 1) > 1
            if splits and not model._splits_in_step:
                warn_whole_batch_step(model, "super().train_step(state, data)")
        return outputs

    return checked


def _loss_dtype(loss_fn, variables, data, state, split):
    """The dtype of `loss_fn`'s loss on a micro-batch (traced for its shapes only)."""
    part = tree.map_structure(lambda t: None if t is None else t[: split.m], data)
    args = (variables, part) if state is None else (variables, part, state)
    shapes = jax.eval_shape(loss_fn, *args)
    loss = shapes if state is None else shapes[0]
    return jnp.result_type(loss)


def _refuse_not_on_jax(model, optimizer, forward):
    if forward is not None:
        raise Refused(_NOT_ON_JAX.format(
            what="`forward` (a loss over the whole batch's outputs)",
            received=f"forward={forward!r}",
        ))
    for name, value in (("optimizer", optimizer), ("the model's optimizer",
                                                   getattr(model, "optimizer", None))):
        if isinstance(value, keras.optimizers.LossScaleOptimizer):
            raise Refused(_NOT_ON_JAX.format(
                what="a `LossScaleOptimizer` (mixed_float16's loss scaling)",
                received=f"{name}={type(value).__name__}",
            ))
