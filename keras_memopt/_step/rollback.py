"""Putting a failed step back: the state it may have changed, and copies to restore it from.

The micro-batch loop changes small state (`loop_variables`: kept on the device, `Snapshot`); the
update, which starts once every micro-batch has run, the weights and optimizer variables
(`update_variables`): kept on the device they would cost their size again at the update, so where
they must be kept they go to host memory (`HostCopy`). See docs/oom-backoff.md."""

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
    """Every variable a step of `model` may change, each once: weights, optimizer, metric
    variables, step counters, the global seed generator."""
    return _unique([
        model.variables,
        update_variables(model),
        [v for metric in model.metrics for v in metric.variables],
        _keras.step_counters(model),
        _keras.global_random_state(),
    ])


def loop_variables(model) -> list:
    """What a step that failed before its update may have changed: `state_variables` but the
    update's, whose scalars excepted, and the weights a forward pass assigns
    (`SpectralNormalization`'s kernel). (An optimizer may change a scalar before the update waits
    for the other replicas: Keras 3's Nadam its momentum product.)"""
    updated = {id(v) for v in update_variables(model) if tuple(v.shape) != ()}
    updated -= {id(v) for v in _per_update.call_assigned_weights(model)}  # assigned in the loop
    return [v for v in state_variables(model) if id(v) not in updated]


class Snapshot:
    """Takes and puts back the values of a list of variables, on the device.

    Taking copies nothing (tensors are immutable), but a variable rewritten while held is copied by
    the update: for small or unchanged variables. Putting back is eager (tracing it cost about a
    second on a small MLP). `variables` returns them, at each `take` (a model makes some lazily)."""

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
    """The values of variables copied to host memory (NumPy arrays), and put back."""

    def __init__(self, variables, strategy):
        self.variables = distribute.local_variables(variables, strategy)
        self.values = [np.array(v, copy=True) for v in self.variables]

    def restore(self):
        for variable, value in zip(self.variables, self.values, strict=True):
            variable.assign(value)


class MadeVariables:
    """The variables made inside `recording()` (a tf_keras optimizer's slots), put back to
    their values when made: for a step run once eagerly and undone."""

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
