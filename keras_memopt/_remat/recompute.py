"""Recomputation in the backward pass: the custom gradient behind every recomputed segment.

Why not `keras.RematScope` / `keras.remat`: on TensorFlow they fail inside graph-mode `fit()` when a
layer takes keyword arguments (`custom_gradient` takes only positional tensors outside eager mode),
draw new dropout masks and update BatchNormalization's statistics twice. Here keyword arguments are
bound before the gradient is defined, and the recomputation replays the forward pass's random seeds
and discards state updates (`_keras.replay`)."""

from __future__ import annotations

import contextlib

import tensorflow as tf

from keras_memopt import _keras
from keras_memopt._keras import replay as _replay
from keras_memopt._step import per_update as _per_update

try:  # The forward pass of a segment must not be recorded by an outer tape.
    from tensorflow.python.eager.record import stop_recording as _stop_recording
except ImportError:  # pragma: no cover - a TensorFlow without it
    _stop_recording = contextlib.nullcontext


_COMPOSITE = (tf.SparseTensor, tf.RaggedTensor)


def _differentiable(tensor):
    return tensor.dtype.is_floating or tensor.dtype.is_complex


def _after(tensors, upstream):
    """`tensors`, made to depend on the incoming gradient (else TensorFlow may recompute
    during the forward pass, keeping the activations alive as if nothing were recomputed)."""
    probe = next((g for g in upstream if g is not None and _differentiable(g)), None)
    if probe is None:
        return [tf.identity(t) for t in tensors]
    element = tf.cast(tf.reduce_max(tf.reshape(tf.math.real(probe), [-1])[:1]), tf.bool)
    zero = tf.where(tf.equal(element, element), 0.0, float("nan"))
    replayed = []
    for t in tensors:
        if _differentiable(t):
            replayed.append(t + tf.cast(zero, t.dtype))
        else:
            # Integer inputs too (a segment that starts with an Embedding's token ids), or the whole
            # segment is recomputed during the forward pass. A control dependency: a select of `t`
            # or `t` is simplified away.
            with tf.control_dependencies([zero]):
                replayed.append(tf.identity(t))
    return replayed


def on(device):
    return tf.device(device) if device else contextlib.nullcontext()


def recompute(call, layer, args, kwargs=None, device=None):
    """Calls `call(*args, **kwargs)`, keeping only the tensor arguments; its backward pass
    runs it again, `layer`'s random seeds replayed and state updates discarded, on `device`
    where given. Keras masks reach the call and its outputs carry the masks it gave them."""
    return _custom_backward(call, layer, args, kwargs or {}, device, recomputed=True)


def on_device(call, args, device):
    """Calls `call(*args)` on `device`, and its backward pass there too (a tape would put it
    on the default device): the forward pass's own tape is differentiated under `device`."""
    return _custom_backward(call, None, args, {}, device, recomputed=False)


def _custom_backward(call, layer, args, kwargs, device, recomputed):
    structure = (args, kwargs)
    leaves = tf.nest.flatten(structure)
    # Sparse and ragged tensors are bound like other values: `tf.custom_gradient` takes dense
    # tensors only, and nothing differentiates with respect to them.
    positions = [i for i, leaf in enumerate(leaves)
                 if tf.is_tensor(leaf) and not isinstance(leaf, _COMPOSITE)]
    if not positions:
        with on(device):
            return call(*args, **kwargs)

    # The Keras masks of the inputs (an `Embedding(mask_zero=True)`'s) go on
    # the tensors the call gets, which may be new ones (the recomputation's).
    masks = [_keras.get_mask(leaves[i]) for i in positions]

    def bind(tensors):
        bound = list(leaves)
        for position, tensor, mask in zip(positions, tensors, masks, strict=True):
            bound[position] = tensor if mask is None else _keras.set_mask(tensor, mask)
        return tf.nest.pack_sequence_as(structure, bound)

    output_structure = []

    @tf.custom_gradient
    def checkpointed(*inputs):
        if recomputed:
            state = _replay.random_state(layer)
            with on(device), _stop_recording(), _replay.Replay(layer, state, recompute=False):
                call_args, call_kwargs = bind(inputs)
                with _no_added_losses(layer):
                    outputs = call(*call_args, **call_kwargs)
        else:
            with on(device), tf.GradientTape() as forward_tape:
                forward_tape.watch([t for t in inputs if _differentiable(t)])
                call_args, call_kwargs = bind(inputs)
                outputs = call(*call_args, **call_kwargs)
        output_structure.append(outputs)
        flat_outputs = [tf.convert_to_tensor(t) for t in tf.nest.flatten(outputs)]

        def gradient(*upstream, variables=None):
            variables = list(variables or ())
            with on(device):
                if recomputed:
                    replayed = _after(inputs, upstream)
                    sources = [t for t in replayed if _differentiable(t)]
                    with tf.GradientTape(watch_accessed_variables=False) as tape:
                        tape.watch(sources)
                        tape.watch(variables)
                        with _replay.Replay(layer, state, recompute=True):
                            call_args, call_kwargs = bind(replayed)
                            results = tf.nest.flatten(call(*call_args, **call_kwargs))
                else:
                    replayed, tape, results = inputs, forward_tape, flat_outputs
                    sources = [t for t in inputs if _differentiable(t)]
                return _gradients(tape, results, upstream, replayed, sources, variables)

        return flat_outputs, gradient

    flat = checkpointed(*[leaves[i] for i in positions])
    # The custom gradient's outputs are new tensors: they carry the masks the call gave its own.
    outputs = output_structure[-1]
    result = tf.nest.pack_sequence_as(outputs, tf.nest.flatten(flat))
    return _keras.with_masks(result, _keras.masks_of(outputs))


def _gradients(tape, outputs, upstream, inputs, sources, variables):
    """The gradients of `inputs` (and `variables`); None for a variable the outputs do not
    depend on, as from a tape (a zero would move it with weight decay)."""
    targets, target_gradients = [], []
    for output, grad in zip(outputs, upstream, strict=True):
        if grad is not None and _differentiable(output):
            targets.append(output)
            target_gradients.append(grad)
    gradients = tape.gradient(targets, sources + variables, output_gradients=target_gradients)
    source_gradients = iter(
        tf.zeros_like(source) if gradient is None else gradient
        for source, gradient in zip(sources, gradients[: len(sources)], strict=True)
    )
    input_gradients = [next(source_gradients) if _differentiable(t) else None for t in inputs]
    if variables:
        return input_gradients, gradients[len(sources) :]
    return input_gradients


@contextlib.contextmanager
def added_losses(layer):
    """Yields a list that holds, after the block, the names of the layers in
    `layer` (itself included) that added a loss term with `add_loss` in it."""
    layers = list(_keras.sublayers(layer))  # a generator on tf_keras
    # Terms, not counts: tf_keras clears a layer's terms when a call starts.
    # The list keeps the terms alive, so that no new term takes an old one's id.
    terms = [term for s in layers for term in _keras.added_losses(s)]
    before = {id(term) for term in terms}
    grown = []
    yield grown
    grown.extend(s.name for s in layers
                 if any(id(term) not in before for term in _keras.added_losses(s)))


@contextlib.contextmanager
def _no_added_losses(layer):
    """Raises if the call inside adds a loss term to `layer` or a layer in it: recomputed, the term
    would get no gradient (its forward pass is unrecorded), and training goes on silently wrong."""
    with added_losses(layer) as grown:
        yield
    if grown:
        raise ValueError(
            f"Cannot recompute {grown[0]!r}: a loss it adds in `call` with "
            "`add_loss` would get no gradient through the recomputed segment. "
            "Leave that layer out of the recomputed segments (end a segment "
            "before it, or do not wrap it in `Remat`), or add the term to the "
            f"model's loss instead. Received: layers that added losses {grown!r}"
        )


def check_recomputable(layers, where):
    """Raises for a layer not rerun exactly: an activity regulariser, a `SpectralNormalization`."""
    for layer in layers:
        normalizing = _per_update.normalizing_sublayer(layer)
        if normalizing is not None:
            raise ValueError(
                f"{where} cannot recompute layer {normalizing.name!r}: a "
                "`SpectralNormalization` divides its kernel by its spectral norm in "
                "place in every training call, so a recomputation would divide it "
                "again and take the gradient at another kernel. Leave that layer out "
                f"of the segment. Received: layer {normalizing.name!r} of type "
                f"{type(normalizing).__name__}"
            )
        sublayer = _keras.regularised_sublayer(layer)
        if sublayer is not None:
            raise ValueError(
                f"{where} cannot recompute layer {sublayer.name!r}: the loss "
                "its activity regulariser adds would get no gradient through "
                "the recomputed segment. Leave that layer out of the "
                "segment or move the regularisation into the model's loss. "
                f"Received: layer {sublayer.name!r} with "
                f"activity_regularizer={sublayer.activity_regularizer!r}"
            )
