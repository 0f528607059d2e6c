"""Layer state that plain Keras advances once per batch, kept so over micro-batches.

Every micro-batch starts from the step's values of what a call sets whatever the batch (tfmot's
`pruning_step`, `SpectralNormalization`'s kernel and `vector_u`) and of QAT's ranges; the step ends
with the lowest minimum and highest maximum the micro-batches left, which (each range's update being
monotonic in the batch's extreme) are the whole batch's, to the bit. See docs/pruning.md."""

from __future__ import annotations

import tensorflow as tf

from keras_memopt import _keras

_TFMOT = "tensorflow_model_optimization"
_SPECTRAL = _keras.keras.layers.SpectralNormalization


def _layers(model):
    return _keras.sublayers(model, include_self=False)


def normalizing_sublayer(layer):
    """The first `SpectralNormalization` in `layer` (itself included), or None."""
    return next((s for s in _keras.sublayers(layer) if isinstance(s, _SPECTRAL)), None)


def call_assigned_weights(model) -> list:
    """The weights layers of `model` assign in every training call: a `SpectralNormalization`'s
    kernel (divided in place by its norm) and `vector_u`."""
    found = []
    for layer in _layers(model):
        if isinstance(layer, _SPECTRAL) and layer.built:
            found += [layer.kernel, layer.vector_u]
    return found


def counters(model) -> list:
    """The tfmot pruning wrappers' `pruning_step` variables of `model`."""
    found = []
    for layer in _layers(model):
        counter = getattr(layer, "pruning_step", None)
        if isinstance(counter, tf.Variable):
            found.append(counter)
    return found


def ranges(model) -> tuple[list, list]:
    """`(minimums, maximums)`: the range variables of tfmot's quantization layers."""
    minimums, maximums, seen = [], [], set()
    for layer in _layers(model):
        if not type(layer).__module__.startswith(_TFMOT):
            continue
        for variable in layer.non_trainable_weights:
            name = variable.name.split(":")[0]
            if id(variable) in seen:
                continue
            seen.add(id(variable))
            if name.endswith("_min"):
                minimums.append(variable)
            elif name.endswith("_max"):
                maximums.append(variable)
    return minimums, maximums


class PerUpdate:
    """The restarted weights and the ranges of a model, in one train step of micro-batches.

    `starts()` before the loop; in each micro-batch, its forward pass under
    `tf.control_dependencies(restart(starts))` and `extremes()` among its outputs, summed with
    `reductions()`; `finish(extremes)` after the loop. Raises `NotImplementedError` for tfmot's
    layers under a strategy (their `merge_call` is not allowed inside the loop)."""

    def __init__(self, model):
        self.minimums, self.maximums = ranges(model)
        tfmot = [*counters(model), *self.minimums, *self.maximums]
        self.variables = [*call_assigned_weights(model), *tfmot]
        in_replica = tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context()
        if tfmot and in_replica:
            raise NotImplementedError(
                "An AccumulatingModel with tfmot pruning or quantization layers cannot "
                "train under a distribution strategy: the layers synchronise the "
                "replicas (`merge_call`) in every training call, which TensorFlow does "
                "not allow inside the loop over micro-batches. Train it without a "
                "strategy, or prune or quantize a plain `keras.Model`. Received: "
                f"strategy={type(tf.distribute.get_strategy()).__name__}"
            )

    def __bool__(self):
        return bool(self.variables)

    def starts(self) -> list:
        return [tf.identity(variable) for variable in self.variables]

    def restart(self, starts) -> list:
        return [v.assign(s) for v, s in zip(self.variables, starts, strict=True)]

    def extremes(self) -> tuple[list, list]:
        """The ranges as the micro-batch's forward pass left them."""
        return (
            [v.read_value() for v in self.minimums],
            [v.read_value() for v in self.maximums],
        )

    def reductions(self) -> tuple[list, list]:
        """How `_loop.accumulate` folds `extremes()` over the micro-batches."""
        return ["min"] * len(self.minimums), ["max"] * len(self.maximums)

    def finish(self, extremes) -> list:
        minimums, maximums = extremes
        pairs = zip([*self.minimums, *self.maximums], [*minimums, *maximums], strict=True)
        return [variable.assign(value) for variable, value in pairs]
