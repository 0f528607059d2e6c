"""What a step's loops and function calls hold: read from their bodies.

A recurrent layer runs as a `While` loop (in tf_keras inside a function call). Its forward loop
keeps one item per time step in accumulator lists for the gradient (`list_bytes`); its gradient
loop, with TensorFlow's `parallel_iterations` iterations in flight, makes each time step's weight
gradient before the loop-carried sum takes it in, so that up to that many of them are alive at once
while the lists drain (`Pile`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

LOOPS = frozenset({"While", "StatelessWhile"})
CALLS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
# How far a gradient loop runs ahead of its sum, as a share of the iterations it may have in flight.
# Beside another loop (a bidirectional layer's two directions): about half of them with one inter-op
# thread or busy cores, all of them on idle cores (a bidirectional LSTM tagger, both Keras lines);
# counting seven tenths puts the estimate near the geometric middle of the step peaks of the two,
# within 1.3x of each. Alone, its sum mostly keeps up: 2 to 16 of 32 time steps' weight gradients
# alive at a step's peak (GRU taggers at batch 16 in fresh processes, tf_keras; 2 to 5 on Keras 3);
# an eighth is counted.
RUN_AHEAD = 0.7
RUN_AHEAD_ALONE = 0.125
# Ops in a loop's body that make nothing of an iteration's own.
_NOT_MADE = frozenset({"Placeholder", "Const", "Identity", "ReadVariableOp"})


def tensor_bytes(shape, dtype):
    """(bytes per sample, fixed bytes) of a tensor whose unknown dimension, if
    any, is the batch's; None for two unknown dimensions or an unknown rank."""
    dtype = tf.as_dtype(dtype)
    if dtype in (tf.resource, tf.variant):
        return 0, 0
    if shape.rank is None:
        return None
    dims = shape.as_list()
    unknown = sum(d is None for d in dims)
    known = int(np.prod([d for d in dims if d is not None], dtype=np.int64)) * dtype.size
    if unknown > 1:
        return None
    return (known, 0) if unknown else (0, known)


def _static(tensor, depth=0):
    """The value of a small integer tensor computed from constants, or None."""
    value = tf.get_static_value(tensor)
    if value is not None or depth > 6:
        return value
    op = tensor.op
    inputs = [_static(t, depth + 1) for t in op.inputs]
    if any(v is None for v in inputs):
        return None
    if op.type in ("Max", "Min"):
        axes = tuple(np.atleast_1d(inputs[1]).tolist())
        return (np.max if op.type == "Max" else np.min)(inputs[0], axis=axes)
    if op.type == "Range":
        return np.arange(*inputs)
    if op.type in ("Identity", "Cast"):
        return inputs[0]
    return None


def function_graph(op, attribute):
    return op.graph._get_function(op.get_attr(attribute).name).graph


def iterations(loop):
    """How many times a `While` op runs its body: its bound, or the length it unstacks."""
    bound = _static(loop.inputs[1])
    if bound is not None and not np.ndim(bound) and int(bound) >= 0:
        return int(bound)
    lengths = [
        t.op.inputs[0].shape[0]
        for t in loop.inputs
        if t.op.type == "TensorListFromTensor" and t.op.inputs[0].shape.rank
    ]
    lengths = [n for n in lengths if n]
    return max(lengths) if lengths else None


def _source(tensor):
    while tensor.op.type == "Identity":
        tensor = tensor.op.inputs[0]
    return tensor


def list_bytes(tensor, depth=0):
    """(per sample, fixed) bytes of a `TensorList` (a variant tensor), or an input index `("input",
    i)` where it is its op's i-th input passed on. A loop's accumulator holds one item per iteration
    (what the loop's gradient reads back: a recurrent layer's gates and states per time step); a
    function call's output is looked up in the function's body."""
    op = tensor.op
    if depth > 8:
        return None
    if op.type in LOOPS:
        produced = _source(function_graph(op, "body").outputs[tensor.value_index]).op
        if produced.type not in ("TensorListPushBack", "TensorListSetItem"):
            return ("input", tensor.value_index)
        item = produced.inputs[1 if produced.type == "TensorListPushBack" else 2]
        if _source(item).op.type == "ReadVariableOp":
            return 0, 0  # a variable's value: its own buffer, once
        size, count = tensor_bytes(item.shape, item.dtype), iterations(op)
        if size is None or count is None:
            return None
        return size[0] * count, size[1] * count
    if op.type in CALLS:
        body = function_graph(op, "f")
        inner = body.outputs[tensor.value_index]
        found = list_bytes(inner, depth + 1)
        if found is None and inner.op.type == "Placeholder" and inner in body.inputs:
            return ("input", body.inputs.index(inner))
        return (0, 0) if isinstance(found, tuple) and found[0] == "input" else found
    if op.type == "Identity":
        return list_bytes(op.inputs[0], depth + 1)
    if op.type == "TensorListFromTensor":
        return tensor_bytes(op.inputs[0].shape, op.inputs[0].dtype)
    return 0, 0


@dataclasses.dataclass
class Pile:
    """Fixed-size tensors (`bytes`: a time step's weight gradients) a loop makes per iteration
    for a loop-carried sum, with `parallel` of its `iterations` in flight."""

    parallel: int
    iterations: int
    bytes: int

    def in_flight(self, alone):
        """Iterations counted as alive at once, the loop `alone` or beside another."""
        return (RUN_AHEAD_ALONE if alone else RUN_AHEAD) * self.parallel


def pile(op, depth=0):
    """The largest `Pile` of a loop that `op` runs (itself, or in a call), or None."""
    if depth > 8:
        return None
    if op.type in CALLS:
        found = [pile(inner, depth + 1) for inner in function_graph(op, "f").get_operations()]
        found = [p for p in found if p is not None]
        return max(found, key=lambda p: p.parallel * p.bytes, default=None)
    if op.type not in LOOPS:
        return None
    count = iterations(op)
    body = function_graph(op, "body")
    # The loop-carried sums: what the body returns, but the lists (counted in `list_bytes`).
    carried = {_source(t).op for t in body.outputs if t.dtype != tf.variant}
    made = 0
    for inner in body.get_operations():
        if inner.type in _NOT_MADE or inner in carried:
            continue
        for tensor in inner.outputs:
            size = tensor_bytes(tensor.shape, tensor.dtype)
            if size and not size[0] and any(user in carried for user in tensor.consumers()):
                made += size[1]
    if not count or not made:
        return None
    return Pile(min(op.get_attr("parallel_iterations"), count), count, made)
