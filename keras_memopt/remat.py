"""Rematerialised ("checkpointed") segments that work inside graph-mode `fit()`.

A rematerialised segment keeps only its inputs from the forward pass and
recomputes everything inside it when the backward pass reaches it, trading
compute for activation memory. Two ways in:

- `Remat(layer)`, a wrapper layer for subclassed models (and anywhere a layer
  goes);
- `AccumulatingModel(inputs, outputs, remat="auto" | [layer names])` for
  functional models, which splits the model's graph into segments (see
  `plan_segments`).

Why not `keras.RematScope` / `keras.remat`: on the TensorFlow backend they
fail inside graph-mode `fit()` when a layer takes keyword arguments such as
`training` (TensorFlow's `custom_gradient` accepts only positional tensors
outside eager mode), their recomputation draws new dropout masks and applies
BatchNormalization's moving-statistics update a second time. Here the segment
is a function of positional tensors only (keyword arguments are bound before
the gradient is defined), the recomputation replays the forward pass's random
seeds (google-research/bigbird's seeded stateless dropout is the same idea)
and discards state updates, so gradients equal those without recomputation.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings

import tensorflow as tf

from keras_memopt import _graph
from keras_memopt import _keras as K

keras = K.keras

try:  # The forward pass of a segment must not be recorded by an outer tape.
    from tensorflow.python.eager.record import stop_recording as _stop_recording
except ImportError:  # pragma: no cover - a TensorFlow without it
    _stop_recording = contextlib.nullcontext


# -- the recomputation ------------------------------------------------------------


def _differentiable(tensor):
    return tensor.dtype.is_floating or tensor.dtype.is_complex


def _after(tensors, upstream):
    """`tensors`, made to depend on the incoming gradient.

    Without the dependency TensorFlow may run the recomputation as soon as the
    segment's inputs exist, during the forward pass, which would keep its
    activations alive exactly as if nothing were recomputed.
    """
    probe = next((g for g in upstream if g is not None and _differentiable(g)), None)
    if probe is None:
        return [tf.identity(t) for t in tensors]
    element = tf.cast(tf.reduce_max(tf.reshape(tf.math.real(probe), [-1])[:1]), tf.bool)
    zero = tf.where(tf.equal(element, element), 0.0, float("nan"))
    return [
        t + tf.cast(zero, t.dtype) if _differentiable(t) else tf.identity(t) for t in tensors
    ]


def _on(device):
    return tf.device(device) if device else contextlib.nullcontext()


def recompute(call, layer, args, kwargs=None, device=None):
    """Calls `call(*args, **kwargs)`; its backward pass recomputes the call.

    Only the tensors in `args` and `kwargs` are kept for the backward pass;
    other values (`training=True`, masks given as Python values) are bound
    before the gradient is defined. `layer` is the layer (or model) that
    `call` runs: its random seeds are replayed and its state updates discarded
    during the recomputation. With `device`, the call, its recomputation and
    its backward pass run there.
    """
    return _custom_backward(call, layer, args, kwargs or {}, device, recomputed=True)


def on_device(call, args, device):
    """Calls `call(*args)` on `device`, and runs its backward pass there too.

    A gradient tape places the backward pass's ops on no device (they would
    run on the default one); here the forward pass is recorded on its own tape,
    whose gradient is taken under `tf.device(device)`. Nothing is recomputed.
    """
    return _custom_backward(call, None, args, {}, device, recomputed=False)


def _custom_backward(call, layer, args, kwargs, device, recomputed):
    structure = (args, kwargs)
    leaves = tf.nest.flatten(structure)
    positions = [i for i, leaf in enumerate(leaves) if tf.is_tensor(leaf)]
    if not positions:
        with _on(device):
            return call(*args, **kwargs)

    def bind(tensors):
        bound = list(leaves)
        for position, tensor in zip(positions, tensors, strict=True):
            bound[position] = tensor
        return tf.nest.pack_sequence_as(structure, bound)

    output_structure = []

    @tf.custom_gradient
    def checkpointed(*inputs):
        if recomputed:
            state = K.random_state(layer)
            with _on(device), _stop_recording(), K.replaying(layer, state, recompute=False):
                call_args, call_kwargs = bind(inputs)
                outputs = call(*call_args, **call_kwargs)
        else:
            with _on(device), tf.GradientTape() as forward_tape:
                forward_tape.watch([t for t in inputs if _differentiable(t)])
                call_args, call_kwargs = bind(inputs)
                outputs = call(*call_args, **call_kwargs)
        output_structure.append(outputs)
        flat_outputs = [tf.convert_to_tensor(t) for t in tf.nest.flatten(outputs)]

        def gradient(*upstream, variables=None):
            variables = list(variables or ())
            with _on(device):
                if recomputed:
                    replayed = _after(inputs, upstream)
                    sources = [t for t in replayed if _differentiable(t)]
                    with tf.GradientTape(watch_accessed_variables=False) as tape:
                        tape.watch(sources)
                        tape.watch(variables)
                        with K.replaying(layer, state, recompute=True):
                            call_args, call_kwargs = bind(replayed)
                            results = tf.nest.flatten(call(*call_args, **call_kwargs))
                else:
                    replayed, tape, results = inputs, forward_tape, flat_outputs
                    sources = [t for t in inputs if _differentiable(t)]
                return _gradients(tape, results, upstream, replayed, sources, variables)

        return flat_outputs, gradient

    flat = checkpointed(*[leaves[i] for i in positions])
    return tf.nest.pack_sequence_as(output_structure[-1], tf.nest.flatten(flat))


def _gradients(tape, outputs, upstream, inputs, sources, variables):
    """What a custom gradient returns: the gradients of `inputs` (and `variables`)."""
    targets, target_gradients = [], []
    for output, grad in zip(outputs, upstream, strict=True):
        if grad is not None and _differentiable(output):
            targets.append(output)
            target_gradients.append(grad)
    gradients = tape.gradient(
        targets,
        sources + variables,
        output_gradients=target_gradients,
        unconnected_gradients=tf.UnconnectedGradients.ZERO,
    )
    source_gradients = iter(gradients[: len(sources)])
    input_gradients = [next(source_gradients) if _differentiable(t) else None for t in inputs]
    if variables:
        return input_gradients, gradients[len(sources) :]
    return input_gradients


# -- the wrapper layer --------------------------------------------------------------


def _takes_training(layer):
    try:
        return "training" in inspect.signature(layer.call).parameters
    except (TypeError, ValueError):  # pragma: no cover - an uninspectable call
        return False


@K.register_serializable(package="keras_memopt")
class Remat(keras.layers.Wrapper):
    """Recomputes a layer in the backward pass instead of keeping its activations.

    The wrapped layer's forward pass keeps only its inputs; when the backward
    pass reaches it, the layer runs again under a gradient tape. Activation
    memory inside the layer is freed after the forward pass, at the cost of one
    more forward pass of the layer per training step. Wrap the big repeated
    blocks of a subclassed model (transformer blocks, residual stages); for
    functional models, `AccumulatingModel(..., remat="auto")` picks segments
    by itself.

    The result is exact: the recomputation replays the random numbers of the
    forward pass (the same dropout masks) and discards state updates (a
    `BatchNormalization` inside updates its moving statistics once per forward
    pass, not twice), so gradients equal those of the unwrapped layer. It works
    in graph-mode `fit()`, with `run_eagerly=True`, under XLA, under
    `tf.distribute` strategies and with mixed precision; keyword arguments such
    as `training` or `mask` are passed through.

    Limits: losses that the wrapped layer adds in `call` (activity
    regularisers, `add_loss`) see no gradient through the wrapper, so wrapping
    such a layer is refused. On tf_keras (`TF_USE_LEGACY_KERAS=1`), random
    layers inside the wrapper draw a fresh seed per call and use stateless
    random ops, so two calls of one random layer within a single wrapped call
    share a mask.

    Args:
        layer: a `keras.layers.Layer` (a block, a `keras.Model`, ...) to
            recompute in the backward pass.
        **kwargs: passed on to `keras.layers.Layer` (`name`, ...).

    Example:

    ```python
    class Net(keras_memopt.AccumulatingModel):
        def __init__(self):
            super().__init__(micro_batch_size=32)
            self.blocks = [
                keras_memopt.Remat(TransformerBlock(256, heads=4))
                for _ in range(12)
            ]
            self.head = keras.layers.Dense(10)

        def call(self, x, training=None):
            for block in self.blocks:
                x = block(x, training=training)
            return self.head(x)
    ```

    Raises:
        TypeError: if `layer` is not a Keras layer.
        ValueError: if `layer` has an activity regulariser.
    """

    def __init__(self, layer: keras.layers.Layer, **kwargs):
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(
                "`Remat` wraps a Keras layer (or model). "
                f"Received: layer={layer!r} of type {type(layer).__name__}"
            )
        _check_no_activity_regularizer([layer], "Remat")
        super().__init__(layer, **kwargs)
        self._layer_takes_training = _takes_training(layer)

    def build(self, input_shape=None):
        # The wrapped layer builds itself on its first call, with the real
        # arguments (a block may take several inputs).
        self.built = True

    def call(self, *args, training=None, **kwargs):
        if self._layer_takes_training and training is not None:
            kwargs["training"] = training
        if not self.layer.built:
            # The first call creates the layer's variables; it happens while
            # Keras builds the model, where there is nothing to differentiate.
            return self.layer(*args, **kwargs)
        return recompute(self.layer, self.layer, args, kwargs)


def _check_no_activity_regularizer(layers, where):
    for layer in layers:
        for sublayer in layer._flatten_layers(include_self=True, recursive=True):
            if getattr(sublayer, "activity_regularizer", None) is not None:
                raise ValueError(
                    f"{where} cannot recompute layer {sublayer.name!r}: the loss "
                    "its activity regulariser adds would get no gradient through "
                    "the recomputed segment. Leave that layer out of the "
                    "segment or move the regularisation into the model's loss. "
                    f"Received: layer {sublayer.name!r} with "
                    f"activity_regularizer={sublayer.activity_regularizer!r}"
                )


# -- segments of functional models ---------------------------------------------


def validate_remat(remat):
    """Checks `AccumulatingModel`'s `remat` argument; returns it normalised."""
    if remat is None or (isinstance(remat, str) and remat == "auto"):
        return remat
    if isinstance(remat, (list, tuple)) and remat and all(isinstance(n, str) for n in remat):
        if len(set(remat)) != len(remat):
            raise ValueError(
                "`remat` names each layer at most once. "
                f"Received: remat={list(remat)!r}"
            )
        return list(remat)
    raise ValueError(
        "`remat` must be None, 'auto', or a non-empty list of layer names "
        "whose outputs end the recomputed segments. "
        f"Received: remat={remat!r}"
    )


def check_target(remat, functional, model):
    """Refuses `remat` (segments of a graph) for a subclassed model."""
    if remat is not None and not functional:
        raise ValueError(
            "`remat` picks segments in a functional model's graph; a "
            "subclassed model wraps its blocks in `keras_memopt.Remat` "
            f"instead. Received: remat={remat!r} for {type(model).__name__}"
        )


def _estimate_peak(blocks, boundaries, cuts):
    """Estimated activation peak (bytes) when cutting after the given blocks.

    Segments before the last are recomputed: during the backward pass of
    segment k the stored boundary tensors up to k and the segment's own
    activations are alive. The last segment is not recomputed.
    """
    peak, stored, start = 0, 0, 0
    for end in [*cuts, len(blocks) - 1]:
        peak = max(peak, stored + sum(blocks[start : end + 1]))
        if end < len(blocks) - 1:
            stored += boundaries[end]
        start = end + 1
    return peak


def _choose_cuts(blocks, boundaries):
    """Cuts minimising the estimated peak over a range of segment budgets."""
    total = sum(blocks)
    best_cuts, best_peak = [], total
    low = max(max(blocks), 1)
    steps = 64
    for step in range(steps + 1):
        budget = low * (max(total, low) / low) ** (step / steps)
        cuts, running = [], 0
        for index, size in enumerate(blocks[:-1]):
            running += size
            if running + blocks[index + 1] > budget:
                cuts.append(index)
                running = 0
        peak = _estimate_peak(blocks, boundaries, cuts)
        if peak < best_peak or (peak == best_peak and len(cuts) < len(best_cuts)):
            best_cuts, best_peak = cuts, peak
    return best_cuts, best_peak


def plan_segments(model, remat):
    """The node indices after which `model`'s recomputed segments end.

    With `remat="auto"`: the candidate cut points are the tensors that
    separate the graph (every path from the inputs to the outputs passes
    through them: the output of a block in a chain, a residual block's output
    after its addition). Consecutive cut points delimit blocks whose activation
    sizes are read from the model's static shapes (bytes per sample). Segments
    are made by merging blocks up to a budget; the budget is chosen among 65
    values between the largest block and the whole model so that the estimated
    peak, the stored boundary tensors plus the largest segment's activations,
    is smallest. For n equal layers this gives the classic about-√n segments.
    The last segment (the head, whose backward pass starts right after its
    forward pass) is never recomputed. Only the model's own graph is
    searched: a nested model is one node.

    Returns:
        A list of node indices (the cut points) and the `keras_memopt._graph.Graph`.
    """
    graph = _graph.Graph(model)
    if remat == "auto":
        separators = graph.separators()
        regularised = [i for i in range(len(graph.nodes)) if graph.regularised(i)]
        if regularised:  # Everything up to the last cut is recomputed.
            separators = [i for i in separators if i < regularised[0]]
        blocks, start = [], 0
        for end in [*separators, len(graph.nodes) - 1]:
            blocks.append(sum(graph.sizes[start : end + 1]))
            start = end + 1
        boundaries = [graph.sizes[i] for i in separators]
        chosen, peak = _choose_cuts(blocks, boundaries)
        cuts = [separators[i] for i in chosen]
        if not cuts or peak >= 0.9 * sum(blocks):
            warnings.warn(
                f"remat='auto' found nothing worth recomputing in model "
                f"{model.name!r}: no tensor that separates its graph splits it "
                "into segments that lower its activation memory. Training "
                "goes on without recomputation; wrap blocks in "
                "`keras_memopt.Remat` or name cut layers in `remat=[...]`.",
                stacklevel=3,
            )
            return [], graph
        return cuts, graph
    cuts = _graph.named_cuts(graph, model, remat, "remat")
    _check_no_activity_regularizer(
        [graph.nodes[i][0] for i in range(cuts[-1] + 1)], f"remat in model {model.name!r}"
    )
    return cuts, graph


class SegmentPlan:
    """A functional model's forward pass run as a chain of segments.

    Each segment is a functional model over the original layers (weights
    shared) from one cut tensor to the next. In training, the segments marked
    in `recomputed` (by default all but the last) are recomputed in the
    backward pass. A segment given a device in `devices` runs there, its
    backward pass included (see `keras_memopt.placement`).
    """

    def __init__(self, model, cuts, graph, recomputed=None, devices=None):
        inputs, outputs = K.nested_inputs_outputs(model)
        ends = [graph.nodes[i][2][0] for i in cuts]
        boundaries = [inputs, *ends, outputs]
        self.segments = []
        for index in range(len(boundaries) - 1):
            segment = keras.Model(
                boundaries[index],
                boundaries[index + 1],
                name=f"{model.name}_segment_{index}",
            )
            self.segments.append(segment)
        count = len(self.segments)
        self.recomputed = recomputed or [True] * (count - 1) + [False]
        self.devices = devices or [None] * count
        self.placed = any(self.devices)

    def __call__(self, inputs, training):
        x = inputs
        for segment, recomputed, device in zip(
            self.segments, self.recomputed, self.devices, strict=True
        ):
            def call(t, segment=segment):
                return segment(t, training=training)

            if training and recomputed:
                x = recompute(call, segment, (x,), device=device)
            elif training and device:
                x = on_device(call, (x,), device)
            else:
                with _on(device):
                    x = call(x)
        return x


def build_plan(model, remat):
    """The `SegmentPlan` for `AccumulatingModel(..., remat=remat)`, or None."""
    if remat is None:
        return None
    cuts, graph = plan_segments(model, remat)
    if not cuts:
        return None
    return SegmentPlan(model, cuts, graph)
