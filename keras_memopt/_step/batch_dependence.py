"""Layers whose outputs depend on which samples share a batch: warned about at the first step.

A micro-batch is a batch of its own to every layer: BatchNormalization's statistics, or a
`TextVectorization` that pads each call to its longest text, follow it (docs/accumulation.md).
`warn` names what it can recognise: such a `TextVectorization`, and any output whose shape differs
between the batch's first sample and its first two. `refuse_stateful` refuses a stateful recurrent
layer (one state per row of a fixed batch)."""

from __future__ import annotations

import warnings

import tensorflow as tf

from keras_memopt import _keras
from keras_memopt._step import loop as _loop
from keras_memopt._step.probe import in_replica


def _padding_to_the_batch(model) -> list[str]:
    names = []
    for layer in _keras.sublayers(model, include_self=False):
        if type(layer).__name__ != "TextVectorization":
            continue
        config = layer.get_config()
        if config.get("output_mode") == "int" and config.get("output_sequence_length") is None:
            names.append(layer.name)
    return names


def _probe(model):
    """`(names, function)`: the outputs to compare (a functional model's layer outputs of
    unknown shape, or a subclassed model's) and a model giving them; or `([], None)`."""
    if not isinstance(model, _keras.Functional):
        return ["its output"], model
    names, tensors = [], []
    for layer, _, outputs in _keras.functional_nodes(model):
        for tensor in outputs:
            if not isinstance(layer, _keras.InputLayer) and None in tuple(tensor.shape)[1:]:
                names.append(f"layer {layer.name!r}")
                tensors.append(tensor)
    if not tensors:
        return [], None
    return names, _keras.Functional(_keras.nested_inputs_outputs(model)[0], tensors)


def _shapes(model, function, x) -> list:
    def shapes(x):
        return [tf.shape(t) for t in tf.nest.flatten(function(x, training=False))]

    return [tuple(shape) for shape in in_replica(model, shapes, x)]


def warn(model, x):
    """Warns when `model`'s outputs follow the samples that share a batch (run in inference
    mode on the first sample and the first two; the caller puts back what that changes)."""
    reasons = [
        f"layer {name!r} is a TextVectorization that pads each call to its longest text "
        "(output_sequence_length=None)"
        for name in _padding_to_the_batch(model)
    ]
    names, function = _probe(model)
    if function is not None:
        one, two = (_shapes(model, function, _loop.micro_slice(x, 0, n)) for n in (1, 2))
        for name, a, b in zip(names, one, two, strict=False):
            if a[1:] != b[1:]:
                reasons.append(f"{name} gives {a} for one sample and {b} for two")
    if reasons:
        warnings.warn(
            "AccumulatingModel runs each micro-batch as a batch of its own, and this "
            f"model's outputs follow the batch they are computed on: {'; '.join(reasons)}. "
            "Each micro-batch is then shaped by its own samples, not the whole batch's, "
            "and unless a mask makes the difference count for nothing, the update "
            "differs from plain Keras's on the whole batch. Fix the length (for "
            "TextVectorization, `output_sequence_length=...`), or pad in the input "
            "pipeline.",
            UserWarning,
            stacklevel=2,
        )


def refuse_stateful(model):
    """Raises for a recurrent layer with `stateful=True` (a state per row of a fixed batch)."""
    names = [
        layer.name for layer in _keras.sublayers(model, include_self=False)
        if isinstance(layer, _keras.keras.layers.RNN) and getattr(layer, "stateful", False)
    ]
    if names:
        raise ValueError(
            "AccumulatingModel splits each batch into micro-batches, and a stateful "
            "recurrent layer keeps one state per row of a fixed batch, carried to the "
            "same row of the next batch: it cannot run on part of the batch. Use "
            "`stateful=False` (pass states between batches with `return_state` and "
            "`initial_state` where you need them), or train this model with "
            f"`keras.Model`. Received: stateful=True in layer(s) {names}"
        )
