"""Putting a failed step back: the state it may have changed, and copies to restore it from.

A training step of `AccumulatingModel` changes its state in two phases:

1. the micro-batch loop: BatchNormalization statistics, random seed states,
   metrics, step and pruning counters (`loop_variables`, with the optimizer's
   scalars): small;
2. the optimizer update, which starts only once every micro-batch has run
   (on every replica): the weights and the optimizer's variables
   (`update_variables`): as large as the model, twice or three times over.

An out-of-memory error in the loop changes nothing of the second kind, so
the copy a retry needs is of the first kind only (`Snapshot`, on the
device). Keeping the second kind on the device would cost their size again
at the update (a variable rewritten while a tensor still holds its old
buffer is copied first); where they must be kept, they are copied to host
memory (`HostCopy`).
"""

from __future__ import annotations

import contextlib

import numpy as np
import tensorflow as tf

from keras_memopt import _keras, distribute
from keras_memopt._step import per_update as _per_update


def _unique(groups):
    """The variables of `groups`, each once; tf_keras's weight handlers (a lookup
    table's vocabulary, listed among a layer's weights) are no variables."""
    seen, variables = set(), []
    for group in groups:
        for variable in group:
            if id(variable) not in seen and hasattr(variable, "assign"):
                seen.add(id(variable))
                variables.append(variable)
    return variables


def update_variables(model) -> list:
    """What an optimizer update changes: the trainable weights and the variables
    of the model's optimizers (`model.optimizer`, and others a custom step uses)."""
    groups = [model.trainable_variables]
    groups += [_keras.optimizer_variables(o) for o in _keras.optimizers_of(model)]
    return _unique(groups)


def state_variables(model) -> list:
    """Every variable a train, test or predict step of `model` may change.

    Weights (trainable and not: BatchNormalization statistics, Keras 3 seed
    generator states), optimizer variables (iterations, slots, loss scale),
    metric variables, tf_keras's step counters and Keras 3's global seed
    generator; each once.
    """
    return _unique([
        model.variables,
        update_variables(model),
        [v for metric in model.metrics for v in metric.variables],
        _keras.step_counters(model),
        _keras.global_random_state(),
    ])


def loop_variables(model) -> list:
    """What a step that failed before its update may have changed: `state_variables`
    but the update's, whose scalars excepted, and the weights a forward pass assigns
    (`SpectralNormalization`'s kernel).

    Under a strategy, a replica's update waits for every replica's gradients,
    but an optimizer may change a scalar of its own before that on one replica
    (Keras 3's Nadam its momentum product), while another replica is still in
    its micro-batches and runs out of memory there.
    """
    updated = {id(v) for v in update_variables(model) if tuple(v.shape) != ()}
    updated -= {id(v) for v in _per_update.call_assigned_weights(model)}  # assigned in the loop
    return [v for v in state_variables(model) if id(v) not in updated]


class Snapshot:
    """Takes and puts back the values of a list of variables, on the device.

    Taking costs no copy: TensorFlow tensors are immutable, so the values
    read stay valid while the step updates the variables. A variable
    rewritten while a snapshot holds it is copied by the update, so a
    snapshot is for variables that are small or left unchanged.

    Putting back assigns each variable eagerly: it runs only after a failed
    step, where tracing a function of every assignment would cost more than
    the assignments themselves (about a second on a small MLP).

    Args:
        variables: a function returning the variables (called at each `take`,
            as a model makes some lazily), each a plain or distributed one.
        strategy: the model's distribution strategy.
    """

    def __init__(self, variables, strategy):
        self._list = variables
        self._strategy = strategy
        self._variables = None
        self._read = None

    def take(self):
        """The current values, to give back to `restore`."""
        variables = distribute.local_variables(self._list(), self._strategy)
        if self._variables is None or [id(v) for v in variables] != [
            id(v) for v in self._variables
        ]:
            self._variables = variables
            self._read = tf.function(lambda: [tf.identity(v) for v in variables])
        return self._variables, self._read()

    @staticmethod
    def restore(taken):
        for variable, value in zip(*taken, strict=True):
            variable.assign(value)


class HostCopy:
    """The values of variables copied to host memory (NumPy arrays), and put back.

    Costs host memory and one device-to-host copy of the variables; none on
    the device.
    """

    def __init__(self, variables, strategy):
        self.variables = distribute.local_variables(variables, strategy)
        self.values = [np.array(v, copy=True) for v in self.variables]

    def restore(self):
        for variable, value in zip(self.variables, self.values, strict=True):
            variable.assign(value)


class MadeVariables:
    """The variables made inside `recording()`, put back to their values when made.

    For a step run once eagerly and undone: it may make variables (a tf_keras
    optimizer builds its slots at its first update) and then change them.
    """

    def __init__(self):
        self._made = []

    @contextlib.contextmanager
    def recording(self):
        def creator(next_creator, **kwargs):
            variable = next_creator(**kwargs)
            if tf.executing_eagerly():
                self._made.append((variable, np.array(variable, copy=True)))
            return variable

        with tf.variable_creator_scope(creator):
            yield self

    def restore(self):
        for variable, value in self._made:
            variable.assign(value)
