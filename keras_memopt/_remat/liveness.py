"""What a training step holds, counted from its traced gradient graph.

`trace` builds a forward pass and its gradient with the batch axis unknown, running nothing; a
tensor with an unknown dimension grows with the batch (bytes per sample), one without is fixed.
`StepGraph.peak(batch)` replays the ops in dataflow order (TensorFlow's executor with one inter-op
thread), each tensor dropped after its last use. What is counted, the gradient loops' lag
(`_remat.loops.Pile`), the CPU convolution buffers, and what the estimate misses: docs/memory.md."""

from __future__ import annotations

import collections
import contextlib
import os

import numpy as np
import tensorflow as tf

from keras_memopt import _autograph
from keras_memopt._remat import loops as _loops
from keras_memopt._remat.loops import list_bytes, tensor_bytes

# Ops whose output is a view of their first input's buffer.
_VIEWS = frozenset({
    "Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient",
    "PreventGradient", "EnsureShape", "Snapshot", "Bitcast",
})
# Ops that read only their inputs' shapes: using a tensor there does not keep it.
_SHAPE_READERS = frozenset({
    "Shape", "ShapeN", "Size", "Rank", "TensorListLength", "TensorListElementShape",
    "BroadcastGradientArgs",
})
# Ops whose outputs take no memory of the step's: constants, variables, reads (aliases of them).
_NOTHING_NEW = frozenset({
    "Const", "VarHandleOp", "ReadVariableOp", "NoOp", "Shape", "ShapeN", "Size", "Rank",
    "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
})
# Element-wise kernels that write into an input's buffer used for the last time, of the output's
# shape and dtype (TensorFlow's `forward_input_or_allocate_output`).
_IN_PLACE = frozenset({
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum", "Pow",
    "SquaredDifference", "BiasAdd", "Relu", "ReluGrad", "Relu6", "Relu6Grad", "Elu", "EluGrad",
    "Selu", "SeluGrad", "LeakyRelu", "LeakyReluGrad", "Tanh", "TanhGrad", "Sigmoid",
    "SigmoidGrad", "Softplus", "SoftplusGrad", "Softsign", "Neg", "Square", "Sqrt", "SqrtGrad",
    "Rsqrt", "RsqrtGrad", "Exp", "Log", "Log1p", "Expm1", "Abs", "Sign", "Reciprocal", "Erf",
    "Erfc", "Floor", "Ceil", "Round", "Cos", "Sin", "Select", "SelectV2", "AddN",
})
def _known(shape):
    return int(np.prod([d for d in shape.as_list() if d is not None], dtype=np.int64))


class _Elements:
    """Elements per sample of each tensor that grows with the batch: one row per sample along
    the unknown axis, or `time` rows where a dense layer folded (batch, time) into it; followed
    through views, matrix products and the inputs' rows."""

    def __init__(self):
        self.per_sample = {}

    def of(self, tensor):
        return self.per_sample.get(tensor.ref())

    def count(self, op, tensor):
        """Bytes per sample of `tensor` (recorded), 0 if fixed, None if unknown."""
        shape = tensor.shape
        if shape.rank is None:
            return None
        unknown = sum(d is None for d in shape.as_list())
        if not unknown:
            return 0
        same = [t for t in op.inputs if self.of(t) is not None and t.shape.rank is not None
                and t.shape.as_list() == shape.as_list()]
        if op.type in _VIEWS and op.inputs and self.of(op.inputs[0]) is not None:
            elements = self.of(op.inputs[0])
        elif same:  # elementwise: as many elements as its input
            elements = self.of(same[0])
        elif unknown > 1:
            return None
        else:
            elements = _known(shape) * self._rows(op)
        self.per_sample[tensor.ref()] = elements
        return elements * tensor.dtype.size

    def _rows(self, op):
        if op.type == "MatMul":
            rows = self._product_rows(op)
            if rows:
                return rows
        rows = [self.of(t) / _known(t.shape) for t in op.inputs
                if self.of(t) is not None and t.shape.rank is not None
                and sum(d is None for d in t.shape.as_list()) == 1]
        return max(rows, default=1)

    def _product_rows(self, op):
        """Rows per sample of `a @ b` where `a`'s rows grow with the batch."""
        a, b = op.inputs
        if self.of(a) is None or op.get_attr("transpose_a"):
            return None
        contracted = b.shape[1] if op.get_attr("transpose_b") else b.shape[0]
        return self.of(a) / contracted if contracted else None


# TensorFlow's CPU convolution gradient kernels (without oneDNN) work on patches of `shard` images
# at a time, to fill what they take for an L3 cache: 30 MiB (conv_grad_{filter,input}_ops.cc).
_CPU_WORKING_SET = 30 * 2**20


def _inter_op_threads():
    """How many ops TensorFlow's executor runs at once (0 configured: one per core)."""
    return tf.config.threading.get_inter_op_parallelism_threads() or os.cpu_count() or 1


def _cpu_scratch(op):
    """Bytes a CPU convolution gradient kernel allocates for itself while it runs."""
    if op.type == "Conv2DBackpropFilter":
        kernel = op.outputs[0].shape  # the filter's gradient: the filter's shape
    elif op.type == "Conv2DBackpropInput":
        kernel = op.inputs[1].shape
    else:
        return 0
    gradient = op.inputs[2].shape  # the gradient of the convolution's output
    if kernel.rank != 4 or gradient.rank != 4 or None in kernel.as_list():
        return 0
    channels_last = op.get_attr("data_format") == b"NHWC"
    rows, cols = gradient[1:3] if channels_last else gradient[2:4]
    if rows is None or cols is None:
        return 0
    pixels, patch, depth = rows * cols, kernel[0] * kernel[1] * kernel[2], kernel[3]
    itemsize = op.inputs[2].dtype.size
    if op.type == "Conv2DBackpropInput":
        return pixels * patch * itemsize  # one image's patches
    work = pixels * patch + pixels * depth + patch * depth
    shard = -(-(_CPU_WORKING_SET // itemsize) // work)
    return shard * pixels * patch * itemsize


class StepGraph:
    """The tensors of a traced step (`graph`): their sizes, producers and users; `kept` (the
    gradients) live to the end; `cpu`: count CPU convolution gradient kernels' patch buffers.

    Attributes:
        ops: the graph's ops in the order they were made.
        sizes: (n, 2) array, each buffer's bytes per sample and fixed bytes.
        producer: the op index that allocates each buffer.
        users: for each buffer, the op indices that read it (a view of it counts as the buffer).
        kept: buffers alive to the end (the inputs and `kept`).
    """

    def __init__(self, graph, kept, cpu=True):
        self.ops = graph.get_operations()
        self._elements = _Elements()
        self.buffer_of, sizes, self.producer = {}, [], []
        self.kept = set()
        for i, op in enumerate(self.ops):
            for tensor in op.outputs:
                buffer = self._alias(op, tensor)
                if buffer is None and op.type not in _NOTHING_NEW:
                    buffer = len(sizes)
                    sizes.append(self._size(op, tensor))
                    self.producer.append(i)
                    if op.type == "Placeholder":
                        self.kept.add(buffer)
                if buffer is not None:
                    self.buffer_of[tensor.ref()] = buffer
        # A convolution's input and filter gradients read one incoming gradient and run side by
        # side (several inter-op threads, the default): each's patch buffer lives while either runs.
        scratch_users = {}
        for i, op in enumerate(self.ops if cpu else ()):
            scratch = _cpu_scratch(op)
            if scratch:
                sizes.append((0, scratch))
                self.producer.append(i)
                scratch_users.setdefault(op.inputs[2].ref(), []).append((len(sizes) - 1, i))
        self.sizes = np.array(sizes, dtype=np.float64).reshape(-1, 2)
        self.users = [[] for _ in sizes]
        for pair in scratch_users.values():
            for buffer, _ in pair:
                self.producer[buffer] = min(op for _, op in pair)
                self.users[buffer] = [op for _, op in pair]
        self._running_on = {}  # an op that runs on beside later ones: the last of them
        if _inter_op_threads() > 1:
            self._overlap_filter_gradients(scratch_users)
        for i, op in enumerate(self.ops):
            if op.type in _SHAPE_READERS:
                continue
            for tensor in op.inputs:
                buffer = self.buffer_of.get(tensor.ref())
                if buffer is not None:
                    self.users[buffer].extend({i, self._running_on.get(i, i)})
        for tensor in kept:
            buffer = self.buffer_of.get(tensor.ref())
            if buffer is not None:
                self.kept.add(buffer)
        self._forward_in_place()
        self.floored = self._add_piles()

    def _overlap_filter_gradients(self, scratch_users):
        """With several inter-op threads, a filter gradient (nothing waits for it) keeps its
        patch buffer and inputs alive until the next convolution gradients start."""
        starts = sorted(min(op for _, op in pair) for pair in scratch_users.values())
        for pair in scratch_users.values():
            last = max(op for _, op in pair)
            following = [start for start in starts if start > last]
            if not following:
                continue
            for buffer, op in pair:
                if self.ops[op].type == "Conv2DBackpropFilter":
                    self.users[buffer].append(following[0])
                    self._running_on[op] = following[0]

    def _forward_in_place(self):
        """Lets element-wise ops write into an input used for the last time."""
        owner = list(range(len(self.sizes)))  # a merged buffer's owner

        def find(buffer):
            while owner[buffer] != buffer:
                owner[buffer] = owner[owner[buffer]]
                buffer = owner[buffer]
            return buffer

        for i, op in enumerate(self.ops):
            if op.type not in _IN_PLACE or len(op.outputs) != 1:
                continue
            output = self.buffer_of.get(op.outputs[0].ref())
            if output is None or self.producer[output] != i or output in self.kept:
                continue
            for tensor in op.inputs:
                buffer = self.buffer_of.get(tensor.ref())
                buffer = None if buffer is None else find(buffer)
                if (buffer is None or buffer in self.kept or buffer == output
                        or tensor.dtype != op.outputs[0].dtype
                        or max(self.users[buffer], default=-1) != i
                        or not np.array_equal(self.sizes[buffer], self.sizes[output])):
                    continue
                self.users[buffer].extend(self.users[output])
                self.users[output] = []
                self.sizes[output] = 0
                owner[output] = buffer
                break
        for ref, buffer in self.buffer_of.items():
            self.buffer_of[ref] = find(buffer)

    def _add_piles(self):
        """Adds the gradient loops' `Pile`s, alive while the loop (or one beside it) runs, less
        the share of accumulator lists popped meanwhile; returns their buffers (floored at 0)."""
        piles = {i: _loops.pile(op) for i, op in enumerate(self.ops)
                 if op.type in _loops.LOOPS | _loops.CALLS}
        piles = {i: found for i, found in piles.items() if found is not None}
        position = {op: i for i, op in enumerate(self.ops)}
        before = {i: self._ancestors(i, position) for i in piles}
        rows = []
        for i, found in piles.items():
            beside = [j for j in piles if j != i and j not in before[i] and i not in before[j]]
            drained = np.zeros(2)  # a call's caller holds its inputs until it returns
            for tensor in self.ops[i].inputs if self.ops[i].type in _loops.LOOPS else ():
                buffer = self.buffer_of.get(tensor.ref())
                if tensor.dtype == tf.variant and buffer is not None and buffer not in self.kept:
                    drained += self.sizes[buffer]
            in_flight = found.in_flight(alone=not beside)
            share = in_flight / found.iterations
            rows.append((-share * drained[0], in_flight * found.bytes - share * drained[1]))
            self.producer.append(min([i, *beside]))
            self.users.append([i, *beside])
        floored = set(range(len(self.sizes), len(self.sizes) + len(rows)))
        self.sizes = np.vstack([self.sizes, np.reshape(rows, (-1, 2))])
        return floored

    def _ancestors(self, index, position):
        """The indices (`position`: op to index) of the ops that op `index` waits for."""
        found, stack = set(), [self.ops[index]]
        while stack:
            op = stack.pop()
            for source in [t.op for t in op.inputs] + list(op.control_inputs):
                if position[source] not in found:
                    found.add(position[source])
                    stack.append(source)
        return found

    def _alias(self, op, tensor):
        """The buffer `tensor` shares with an input, or None for a new one."""
        if tensor.dtype not in (tf.resource, tf.variant):
            self._elements.count(op, tensor)
        if op.type in _VIEWS and op.inputs:
            return self.buffer_of.get(op.inputs[0].ref())
        if tensor.dtype == tf.variant and op.type in _loops.LOOPS:
            found = list_bytes(tensor)
            if isinstance(found, tuple) and found and found[0] == "input":
                return self.buffer_of.get(op.inputs[found[1]].ref())
        return None

    def _size(self, op, tensor):
        """(per sample, fixed) bytes of a new buffer; (0, 0) where unknown (in the models
        measured: a broadcast gradient's reduction, a kernel's reserved space)."""
        if tensor.dtype == tf.variant:
            size = list_bytes(tensor)
            if size is not None:
                return (0, 0) if size[0] == "input" else size
        elif tensor.dtype == tf.resource:
            return 0, 0
        else:
            per_sample = self._elements.count(op, tensor)
            if per_sample:
                return per_sample, 0
            if per_sample == 0:
                return tensor_bytes(tensor.shape, tensor.dtype)
        return 0, 0

    def leave_out_inputs(self):
        """Counts the step's inputs (placeholders) as nothing."""
        for buffer, producer in enumerate(self.producer):
            if self.ops[producer].type == "Placeholder":
                self.sizes[buffer] = 0

    def dataflow_order(self):
        """The position at which each op runs when each runs as soon as its inputs are ready, first
        ready first run (TensorFlow's executor with one inter-op thread)."""
        index = {op: i for i, op in enumerate(self.ops)}
        waiting = [0] * len(self.ops)
        after = [[] for _ in self.ops]
        for i, op in enumerate(self.ops):
            sources = {index[t.op] for t in op.inputs} | {index[c] for c in op.control_inputs}
            waiting[i] = len(sources)
            for source in sources:
                after[source].append(i)
        ready = collections.deque(i for i, count in enumerate(waiting) if count == 0)
        position, now = np.zeros(len(self.ops), dtype=np.int64), 0
        while ready:
            i = ready.popleft()
            position[i], now = now, now + 1
            for j in after[i]:
                waiting[j] -= 1
                if waiting[j] == 0:
                    ready.append(j)
        return position

    def peak(self, batch):
        """The most bytes alive at once when the ops run in dataflow order."""
        position = self.dataflow_order()
        first = position[np.array(self.producer, dtype=np.int64)]
        last = np.array([max((position[u] for u in users), default=first[b])
                         for b, users in enumerate(self.users)], dtype=np.int64)
        last[list(self.kept)] = len(self.ops)
        floored = np.isin(np.arange(len(self.sizes)), list(self.floored))
        return Profile(first, last, self.sizes, len(self.ops) + 1, floored).peak(batch)


class Profile:
    """Bytes alive over `length` steps, each buffer from `first` to `last` (included) counting
    `per_sample * batch + fixed` bytes, a `floored` one (a mask) at least nothing."""

    def __init__(self, first, last, sizes, length, floored=None):
        first, last = np.asarray(first, dtype=np.int64), np.asarray(last, dtype=np.int64)
        floored = np.zeros(len(sizes), dtype=bool) if floored is None else floored
        plain = sizes * ~floored[:, None]
        per_sample, fixed = np.zeros(length + 1), np.zeros(length + 1)
        np.add.at(per_sample, first, plain[:, 0])
        np.add.at(per_sample, last + 1, -plain[:, 0])
        np.add.at(fixed, first, plain[:, 1])
        np.add.at(fixed, last + 1, -plain[:, 1])
        self.per_sample = np.cumsum(per_sample)[:length]
        self.fixed = np.cumsum(fixed)[:length]
        self._floored = list(zip(first[floored], last[floored], sizes[floored], strict=True))

    def peak(self, batch):
        alive = self.per_sample * batch + self.fixed
        for first, last, (per_sample, fixed) in self._floored:
            alive[first:last + 1] += max(per_sample * batch + fixed, 0.0)
        return float(np.max(alive, initial=0.0))


def trace(call, specs, variables):
    """The `FuncGraph` of `call(*inputs)` (a scalar loss of inputs shaped like `specs`) and its
    gradient to `variables`, and the gradients; built, not run; one replica's under a strategy."""
    kept = []

    def step(*inputs):
        with tf.GradientTape() as tape:
            loss = call(*inputs)
        gradients = tape.gradient(loss, variables)
        for gradient in gradients:
            if isinstance(gradient, tf.IndexedSlices):
                kept.extend([gradient.values, gradient.indices])
            elif gradient is not None:
                kept.append(gradient)
        return gradients

    function = _autograph.function(step, input_signature=specs)
    replica = contextlib.nullcontext()
    if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
        replica = tf.distribute.ReplicaContext(tf.distribute.get_strategy(), 0)
    with replica:
        return function.get_concrete_function().graph, kept
