"""`Remat`, and `AccumulatingModel`'s `remat=` setting: recompute in the backward pass instead
of keeping activations (docs/remat.md). The recomputation itself is `_remat.recompute`'s on
TensorFlow, `_remat.jax_recompute`'s (`jax.checkpoint`) on JAX."""

from __future__ import annotations

import inspect

import tensorflow as tf

from keras_memopt import _keras, placement
from keras_memopt._remat import segments as _segments
from keras_memopt._remat.recompute import check_recomputable, recompute
from keras_memopt._remat.segments import plan_segments

if _keras.BACKEND == "jax":
    from keras_memopt._remat import jax_recompute

__all__ = ["Remat", "plan_segments"]

keras = _keras.keras


def _takes(layer, argument):
    try:
        return argument in inspect.signature(layer.call).parameters
    except (TypeError, ValueError):  # pragma: no cover - an uninspectable call
        return False


@_keras.register_serializable(package="keras_memopt")
class Remat(keras.layers.Wrapper):
    """Recomputes a layer in the backward pass instead of keeping its activations.

    The forward pass keeps only the layer's inputs; the backward pass runs the layer again (one more
    forward pass of it per step), exactly: the same dropout masks, state updated once. Wrap the big
    repeated blocks of a subclassed model; functional models use `remat="auto"`. A layer that adds
    losses in `call` or a `SpectralNormalization` is refused. Details, tf_keras and JAX:
    docs/remat.md.

    Args:
        layer: a `keras.layers.Layer` (a block, a `keras.Model`, ...) to recompute.
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
        ValueError: if `layer` has an activity regulariser or a `SpectralNormalization`.
    """

    def __init__(self, layer: keras.layers.Layer, **kwargs):
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(
                "`Remat` wraps a Keras layer (or model). "
                f"Received: layer={layer!r} of type {type(layer).__name__}"
            )
        check_recomputable([layer], "Remat")
        super().__init__(layer, **kwargs)
        self._layer_takes_training = _takes(layer, "training")
        self._layer_takes_mask = _takes(layer, "mask")
        # A Keras mask reaches the wrapped layer; `call` passes its output masks on.
        self.supports_masking = True
        if _keras.BACKEND == "jax":
            # `jax.checkpoint` gets the variables' own values (uncast); the wrapped layer autocasts.
            self.autocast = False

    def build(self, input_shape=None):
        # The wrapped layer builds itself on its first call, with the real (maybe several) inputs.
        self.built = True

    def call(self, *args, training=None, mask=None, **kwargs):
        if self._layer_takes_training and training is not None:
            kwargs["training"] = training
        if isinstance(mask, tuple) and len(mask) == len(args) == 1:
            mask = mask[0]  # Keras 3 reads one per positional argument
        if self._layer_takes_mask and any(m is not None for m in tf.nest.flatten(mask)):
            kwargs["mask"] = mask
        if not self.layer.built:
            # The first call makes the variables as Keras builds the model: none to differentiate.
            return self.layer(*args, **kwargs)
        if _keras.BACKEND == "jax":
            return jax_recompute.recompute(self.layer, args, kwargs)
        # The inputs' Keras masks reach a layer that passes them on (a
        # Dense), and the outputs carry the layer's: `recompute` sees to both.
        return recompute(self.layer, self.layer, args, kwargs)

    def compute_mask(self, inputs, mask=None):
        if _keras.BACKEND == "jax" and self.layer.built and _symbolic(inputs):
            # A functional model being built: its symbolic outputs take the wrapped layer's
            # masks. Keras hands `call`'s positional arguments as one tuple.
            return self.layer.compute_mask(_single(inputs), _single(mask))
        # `call` attaches the wrapped layer's output masks; where it attached none there are none
        # (on tf_keras, asking a wrapped model would run its forward pass once more; on JAX, a
        # nested model's default passes its input's mask on, where its call gave its own).
        return None


def _symbolic(inputs) -> bool:
    return any(isinstance(t, keras.KerasTensor) for t in tf.nest.flatten(inputs))


def _single(args):
    """The one positional argument of `args` (a tuple or list of one), or `args`."""
    return args[0] if isinstance(args, (tuple, list)) and len(args) == 1 else args


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


class RematMixin:
    """`AccumulatingModel`'s `remat` setting and the segments it chose (a mixin)."""

    @property
    def remat(self) -> str | list[str] | None:
        """The recomputed segments: None, "auto" or the cut layers' names. Setting it
        re-plans the segments; the next training step runs (is traced) with them."""
        return self._remat if not isinstance(self._remat, tuple) else list(self._remat)

    @remat.setter
    def remat(self, value):
        self._plan_segments(value)

    def _plan_segments(self, value):
        # Not `self.remat = ...`: TensorFlow's tracking skips assigning an attribute its own value.
        value = validate_remat(value)
        check_target(value, isinstance(self, _keras.Functional), self)
        plan, note = placement.build_plan(self, value, self._placement)
        # Plain holders: Keras must not track the segments as sublayers.
        self._remat = value if value is None or isinstance(value, str) else tuple(value)
        self._remat_note = note
        self._run.segment_plan = plan
        self._run.retrace()

    @property
    def recomputed_segments(self) -> list[list[str]]:
        """Each recomputed segment's layer names, in order; empty without recomputation."""
        return _segments.recomputed_layer_names(self._run.segment_plan)

    @property
    def remat_choice(self) -> str:
        """What `remat="auto"` chose and why (its estimated step peaks; docs/remat.md), or ""."""
        return self._remat_note
