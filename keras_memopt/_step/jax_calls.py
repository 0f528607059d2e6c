"""The JAX step's calls of the model on a micro-batch (`keras_memopt._step.jax_step`):
the gradient loop's and the forward pass that counts a masked output's elements
before it (`jax_fractions.Counter.totals`), alike, so that both see the same masks."""

from __future__ import annotations

from keras_memopt import _keras
from keras_memopt._step import per_update


def call_of(model, trainable, training, restart=None):
    """The step's own call of `model` on a micro-batch, `call(non_trainable, xs) ->
    (y_pred, non_trainable)`: in training mode or not (where `call` takes
    `training`), the state a training call sets whatever the batch first put back
    to the step's (`restart`: `restarting`'s)."""
    kwargs = {"training": training} if _keras.calls_with_training(model) else {}

    def call(non_trainable, xs):
        if restart is not None:
            non_trainable = restart(non_trainable)
        return model.stateless_call(trainable, non_trainable, xs, **kwargs)

    return call


def restarting(model, start):
    """`restart(non_trainable)`: `non_trainable` with the state a training call sets
    whatever the batch (`per_update.call_assigned_weights`: a
    `SpectralNormalization`'s `vector_u`, one power iteration from the step's value)
    put back to the step's, `start`: every micro-batch starts from the step's value,
    so the step ends where one call on the whole batch ends, as on the TensorFlow
    line. Carried over, it advanced once per micro-batch (9.7e-3 from plain Keras:
    the fuzzer's seed 18 on JAX)."""
    assigned = {id(v) for v in per_update.call_assigned_weights(model)}
    restarted = {i for i, v in enumerate(model.non_trainable_variables) if id(v) in assigned}

    def restart(non_trainable):
        return [start[i] if i in restarted else t for i, t in enumerate(non_trainable)]

    return restart
