"""The micro-batch loop: a batch run as micro-batches, one after another.

`accumulate(fn, data, size)` runs `fn` on each micro-batch and adds up what it returns: dense
tensors in float32 where narrower (float64 stays float64); `tf.IndexedSlices` per row as they
come (`sum_rows`: Keras 3's optimizers would apply a repeated row slice by slice, Σg² instead of
(Σg)² in Adam; docs/accumulation.md, "Sparse gradients"); None stays None.

- `fn` is traced once for any micro-batch before the loop is built, so that the accumulators
  take the form of its outputs.
- The first micro-batch's outputs start the sums: no `tf.zeros(variable.shape)` for the
  optimiser to fold into a model-sized constant that lives as long as the step function.
- `parallel_iterations=1`: two micro-batches' activations are never alive side by side.
- The micro-batch size is a tensor read at run time: changing it retraces nothing.
"""

from __future__ import annotations

import warnings

import tensorflow as tf

from keras_memopt import _autograph, _dtypes
from keras_memopt._step.scopes import GRADIENT_SUM_SCOPE


def fraction_of(part, whole) -> tf.Tensor:
    """`part / whole` of two sample counts, in float64. Cast to any float dtype at its use, it is
    that dtype's nearest value of the ratio: a float32 quotient would put float32 rounding into a
    float64 model's loss."""
    return tf.cast(part, tf.float64) / tf.cast(whole, tf.float64)


def static_batch_size(data) -> int | None:
    """The number of samples in a batch (per replica), where its shapes say it, else None."""
    for leaf in tf.nest.flatten(data, expand_composites=False):
        if isinstance(leaf, tf.distribute.DistributedValues):
            leaf = leaf.values[0]
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape) and shape[0] is not None:
            return int(shape[0])
    return None


def batch_size_of(data):
    """The (dynamic) number of samples (rows) in a nest of batched tensors."""
    leaves = [t for t in tf.nest.flatten(data) if t is not None]
    if not leaves:
        raise ValueError(
            "AccumulatingModel splits each batch along its first axis, but the "
            "batch holds no tensor. Received: data=" + repr(data)
        )
    dense = [t for t in leaves if not isinstance(t, (tf.RaggedTensor, tf.SparseTensor))]
    leaf = (dense or leaves)[0]
    if isinstance(leaf, tf.RaggedTensor):
        return leaf.nrows(out_type=tf.int32)
    if isinstance(leaf, tf.SparseTensor):
        return tf.cast(leaf.dense_shape[0], tf.int32)
    return tf.shape(leaf, out_type=tf.int32)[0]


def check_splittable(data, name="data"):
    """Refuses, naming it, a composite tensor but ragged and sparse (not split into rows)."""
    for path, leaf in _leaves_with_paths(data, name):
        composite = isinstance(leaf, tf.__internal__.CompositeTensor)
        if composite and not isinstance(leaf, (tf.RaggedTensor, tf.SparseTensor)):
            raise TypeError(
                "AccumulatingModel splits each batch into micro-batches along "
                "its first axis, which it can do for dense, ragged and sparse "
                f"tensors only. Convert `{path}` to one of those in the input "
                f"pipeline. Received: {path} of type {type(leaf).__name__}"
            )


def _leaves_with_paths(data, path):
    if isinstance(data, dict):
        for key in sorted(data):
            yield from _leaves_with_paths(data[key], f"{path}[{key!r}]")
    elif isinstance(data, (list, tuple)):
        for index, value in enumerate(data):
            yield from _leaves_with_paths(value, f"{path}[{index}]")
    else:
        yield path, data


def rows(tensor, start, size):
    """Rows `start` to `start + size` (fewer at the end) of a dense, ragged or sparse tensor."""
    if tensor is None:
        return None
    if isinstance(tensor, tf.SparseTensor):
        shape = tensor.dense_shape
        begin = tf.concat([tf.cast([start], shape.dtype), tf.zeros_like(shape[1:])], 0)
        return tf.sparse.slice(
            tensor, begin, tf.concat([tf.cast([size], shape.dtype), shape[1:]], 0)
        )
    return tensor[start : start + size]


def concat_rows(parts):
    """Batched tensors one after another along the first axis (`rows`'s inverse)."""
    if isinstance(parts[0], tf.SparseTensor):
        return tf.sparse.concat(0, parts)
    return tf.concat(parts, 0)


def micro_slice(data, start, size):
    return tf.nest.map_structure(lambda t: rows(t, start, size), data)


def _micro_spec(t):
    """The type spec of a micro-batch of `t` (a leaf of `data`): the batch axis unknown."""
    if t is None:
        return None
    shape = [None, *t.shape[1:]]
    if isinstance(t, tf.RaggedTensor):
        return tf.RaggedTensorSpec(shape, t.dtype, t.ragged_rank, t.row_splits.dtype)
    if isinstance(t, tf.SparseTensor):
        return tf.SparseTensorSpec(shape, t.dtype)
    return tf.TensorSpec(shape, t.dtype)


def micro_function(fn, data, *args, jit_compile=False):
    """`fn` ready for the loop, and the structure of its outputs. Returns `(function, outputs)`:
    `outputs` the specs of `fn`'s outputs, traced once for any micro-batch. Without XLA, `function`
    is `fn` itself (a nested `tf.function` call in the loop measured +40% peak at two
    micro-batches); with XLA, the compiled `tf.function`."""
    function = _autograph.function(fn, jit_compile=jit_compile)
    # Any length of the extra arguments (per-output counts, say) fits the trace.
    arg_specs = [
        tf.TensorSpec([None] * a.shape.rank, a.dtype) if tf.is_tensor(a) else a for a in args
    ]
    with warnings.catch_warnings():
        # The loop traces `fn` again: Keras's warnings are said there, once.
        warnings.simplefilter("ignore")
        concrete = function.get_concrete_function(
            tf.nest.map_structure(_micro_spec, data), *arg_specs
        )
    outputs = tf.nest.map_structure(
        lambda t: None if t is None else tf.type_spec_from_value(t),
        concrete.structured_outputs,
    )
    return (function if jit_compile else fn), outputs


def sum_rows(slices: tf.IndexedSlices) -> tf.IndexedSlices:
    """`slices` with each row once, its slices summed: the same dense gradient. Outside any
    XLA-compiled function (`tf.unique` has no XLA kernel)."""
    with tf.name_scope(GRADIENT_SUM_SCOPE):
        rows, positions = tf.unique(slices.indices)
        values = tf.math.unsorted_segment_sum(slices.values, positions, tf.shape(rows)[0])
    return tf.IndexedSlices(values, rows, slices.dense_shape)


_FOLDS = {"sum": tf.add, "min": tf.minimum, "max": tf.maximum}


class _RunningSum:
    """The running sum (or minimum, or maximum) of one output of `fn`, as loop variables; a
    sparse sum holds each row once (at most the variable's size)."""

    def __init__(self, spec, reduction="sum"):
        self.spec = spec
        self.fold = _FOLDS[reduction]
        self.sparse = isinstance(spec, tf.IndexedSlicesSpec)
        if self.sparse:
            # `tf.IndexedSlicesSpec` has no public accessors for its parts.
            self.dense_shape = tf.constant(spec._shape.as_list(), spec._dense_shape_dtype)
            row = spec._shape[1:]
            self.state = [
                tf.zeros([0, *row], spec._values_dtype), tf.zeros([0], spec._indices_dtype)
            ]
            self.invariants = [tf.TensorShape([None]).concatenate(row), tf.TensorShape([None])]
        else:
            self.dtype = _dtypes.sum_dtype(spec.dtype)
            self.state = [tf.zeros([0], self.dtype)]  # replaced by the first value
            self.invariants = [tf.TensorShape(None)]

    def add(self, state, index, value):
        # Named, so that an out-of-memory error here says it is the sum's.
        with tf.name_scope(GRADIENT_SUM_SCOPE):
            if self.sparse:
                rows = sum_rows(tf.IndexedSlices(
                    tf.concat([state[0], value.values], 0),
                    tf.concat([state[1], tf.cast(value.indices, state[1].dtype)], 0),
                    self.dense_shape,
                ))
                return [rows.values, rows.indices]
            value = tf.cast(value, self.dtype)
            total = state[0]
            return [tf.cond(index > 0, lambda: self.fold(total, value), lambda: value)]

    def result(self, state):
        if self.sparse:
            return tf.IndexedSlices(state[0], state[1], self.dense_shape)
        return tf.ensure_shape(tf.cast(state[0], self.spec.dtype), self.spec.shape)


def gradient_folds(variables) -> list:
    """`accumulate`'s `reductions` for variables' gradients: summed, but the maximum for one
    the optimizer overwrites with its "gradient" (Keras 3's float8 scales and amax histories,
    from the same old value and each micro-batch's largest magnitude)."""
    return ["max" if overwritten(v) else "sum" for v in variables]


def every_replica(tensors) -> list:
    """Control inputs that hold an op back until every replica has computed `tensors` (an
    all-reduce of one number); none with one replica. Keras assigns the overwritten variables
    in each replica's context: without this, one replica assigned them while another's loop
    still ran, and an out-of-memory error there left them assigned for the retry."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return []
    flat = [t for t in tf.nest.flatten(tensors, expand_composites=True) if t is not None]
    with tf.control_dependencies(flat):
        return [context.all_reduce(tf.distribute.ReduceOp.SUM, tf.ones([]))]


def overwritten(variable) -> bool:
    """Whether the optimizer overwrites `variable` with its "gradient" (float8 scales)."""
    return bool(getattr(variable, "overwrite_with_gradient", False))


def accumulate(fn, data, size, *args, jit_compile=False, reductions=None):
    """Runs `fn(micro_batch, *args)` over `data` in micro-batches of `size`; sums its outputs.

    Args:
        fn: a function of one micro-batch (a slice of `data`) and `args`; returns a nest of
            tensors, `tf.IndexedSlices` and None.
        data: a nest of batched tensors (None leaves allowed).
        size: the micro-batch size, a scalar int32 tensor (the last micro-batch may be smaller).
        *args: tensors passed to every call of `fn` as they are.
        jit_compile: whether `fn` is compiled with XLA (the loop itself never is).
        reductions: a nest like `fn`'s outputs of "sum", "min" or "max": how each dense output folds
            over the micro-batches. Defaults to None (every output summed).

    Returns:
        `fn`'s outputs summed (or folded by `reductions`), in its structure and dtypes.
    """
    function, specs = micro_function(fn, data, *args, jit_compile=jit_compile)
    batch_size = batch_size_of(data)
    size = tf.cast(size, batch_size.dtype)
    count = (batch_size + size - 1) // size
    flat_specs = tf.nest.flatten(specs)
    folds = tf.nest.flatten(reductions) if reductions is not None else ["sum"] * len(flat_specs)
    present = [i for i, spec in enumerate(flat_specs) if spec is not None]
    sums = {i: _RunningSum(flat_specs[i], folds[i]) for i in present}

    def body(index, states):
        outputs = tf.nest.flatten(function(micro_slice(data, index * size, size), *args))
        pairs = zip(present, states, strict=True)
        return index + 1, [sums[i].add(state, index, outputs[i]) for i, state in pairs]

    _, states = tf.while_loop(
        lambda index, _: index < count,
        body,
        (tf.constant(0, batch_size.dtype), [sums[i].state for i in present]),
        shape_invariants=(tf.TensorShape([]), [sums[i].invariants for i in present]),
        parallel_iterations=1,
    )
    flat = [None] * len(flat_specs)
    for i, state in zip(present, states, strict=True):
        flat[i] = sums[i].result(state)
    return tf.nest.pack_sequence_as(specs, flat)


def concatenate(fn, data, size, jit_compile=False):
    """Runs `fn(micro_batch)` over `data` in micro-batches; concatenates its outputs."""
    function, specs = micro_function(fn, data, jit_compile=jit_compile)
    batch_size = batch_size_of(data)
    size = tf.cast(size, batch_size.dtype)
    count = (batch_size + size - 1) // size
    arrays = [
        tf.TensorArray(spec.dtype, size=count, infer_shape=False)
        for spec in tf.nest.flatten(specs)
    ]

    def body(index, arrays):
        outputs = tf.nest.flatten(function(micro_slice(data, index * size, size)))
        return index + 1, [a.write(index, t) for a, t in zip(arrays, outputs, strict=True)]

    _, arrays = tf.while_loop(
        lambda index, _: index < count,
        body,
        (tf.constant(0, batch_size.dtype), arrays),
        parallel_iterations=1,
    )
    return tf.nest.pack_sequence_as(specs, [a.concat() for a in arrays])
