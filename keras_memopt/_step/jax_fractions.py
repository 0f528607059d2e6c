"""Each micro-batch's fraction of the batch's loss, on JAX (the step: `jax_step`).

Keras divides each output's loss by what it counts in the batch, so a
micro-batch's loss, run alone, is divided by its own count; times its count
over the batch's, it is its exact part of the batch's loss (as on the
TensorFlow line, `keras_memopt._step.losses`):

- the samples (`"sum_over_batch_size"`, Keras's default: it divides by the
  number of values, not by the sum of the sample weights): `n_i / N`;
- the elements it keeps, where the output carries a Keras mask or its loss
  has `ignore_class` (both: the elements kept by both): the micro-batch's
  count over the batch's, counted before the loop;
- nothing (`reduction="sum"`; a mask or an ignored class only drops
  elements): one.

Which outputs carry a mask is what a call of the model gives them (its trace,
`jax.eval_shape`), and each micro-batch counts the masks its own outputs carry.
The batch's counts come from the targets and, where an output carries a mask,
from a functional model of the inputs alone (a functional model's `Embedding`
mask, `inputs != 0`: `_mask_model`); where none computes it (a subclassed
model, a nested one, a mask that needs weights), from a forward pass over the
micro-batches that only counts, the step's own call (`jax_calls`) with its
state carried as the loop carries it, then discarded: the masks it counts are
the loop's, and Dropout and BatchNormalization advance once per micro-batch.
"""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp

from keras_memopt import _keras
from keras_memopt._keras import jax as _jax
from keras_memopt._keras import keras
from keras_memopt._step.losses import ignore_classes, summed_outputs

tree = keras.tree

_MASK_MODELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Refused(NotImplementedError):
    """What the JAX step cannot do exactly yet, found while it is traced (before
    it runs): `jax_step.restored_on_refusal` puts the model's state back."""


class Fractions(list):
    """Each flat output's fraction of the batch's loss, and `samples`, the
    micro-batch's fraction of the samples (`n_i / N`, also the terms')."""

    def __init__(self, fractions, samples):
        super().__init__(fractions)
        self.samples = samples


class Counter:
    """What Keras divides each flat output of `model` by, for targets shaped as `y`.

    Args:
        model: the `AccumulatingModel`.
        y: the batch's targets (their structure pairs them with the outputs).
    """

    def __init__(self, model, y):
        self.model = model
        outputs = max(len(tree.flatten(y)), 1)
        self.classes = ignore_classes(model, y) or (None,) * outputs
        self.summed = summed_outputs(model, y) or (False,) * outputs

    def counted(self, y, masks) -> list:
        """Per flat output, the elements its loss keeps (booleans): its Keras mask
        (`masks`, one per flat output, None where it has none), and'ed with the
        targets its loss does not ignore; None where it counts samples."""
        counted = []
        for mask, target, ignored in zip(
            masks, _flat_targets(y, len(self.classes)), self.classes, strict=True
        ):
            if ignored is not None:
                kept = target != ignored
                mask = kept if mask is None else mask & jnp.reshape(kept, mask.shape)
            counted.append(mask)
        return counted

    def totals(self, data, call, state, split=None) -> list:
        """The whole batch's counts (`counted`, summed; None where an output counts
        samples), before the loop: from the targets and, where an output carries a
        mask, from a functional model of the inputs alone (`_mask_model`) or, where
        none computes it, from a forward pass over the micro-batches of `split` (the
        gradient loop's `Split`) that only counts: `call(state, xs) -> (y_pred,
        state)`, the step's own call of the model, its state carried from `state` as
        the loop carries it and then discarded. Without `split` (the loss check's
        pair of samples, outside the compiled step), from one call on all of `data`."""
        x, y, _ = data
        if split is None:
            return self._summed(self.counted(y, _masks_of(call(state, x)[0])))
        shapes = jax.eval_shape(lambda s, xs: _masks_of(call(s, xs)[0]), state, x)
        masked = [mask is not None for mask in shapes]
        if not any(masked):
            return self._summed(self.counted(y, [None] * len(masked)))
        masks_model = _mask_model(self.model, masked)
        if masks_model is not None:
            computed, _ = masks_model.stateless_call([], [], x)
            return self._summed(self.counted(y, _with_gaps(masked, tree.flatten(computed))))
        counting = [m or c is not None for m, c in zip(masked, self.classes, strict=True)]
        dtype = jnp.result_type(float)

        def count(state, part):
            xs, ys, _ = part
            y_pred, state = call(state, xs)
            parts = self._summed(self.counted(ys, _masks_of(y_pred)))
            return state, [jnp.zeros([], dtype) if c is None else c for c in parts], ()

        zeros = [jnp.zeros([], dtype) for _ in counting]
        totals, _, _ = split.run(count, zeros, state, data)
        return [t if c else None for t, c in zip(totals, counting, strict=True)]

    @staticmethod
    def _summed(counted) -> list:
        dtype = jnp.result_type(float)
        return [None if c is None else jnp.sum(c).astype(dtype) for c in counted]

    def fractions(self, y, y_pred, samples, totals) -> Fractions:
        """A micro-batch's (targets `y`, outputs `y_pred` with their Keras masks)
        fraction of each output's loss: `samples` (`n_i / N`), its count over the
        batch's `totals`, or one."""
        fractions = []
        kept = self.counted(y, _masks_of(y_pred))
        for counted, sums, total in zip(kept, self.summed, totals, strict=True):
            if sums:
                fractions.append(1.0)
            elif counted is not None:
                count = jnp.sum(counted).astype(total.dtype)
                fractions.append(jnp.where(total > 0, count / jnp.where(total > 0, total, 1), 0))
            else:
                fractions.append(samples)
        return Fractions(fractions, samples)


def masked_outputs(y_pred) -> tuple:
    """`(masks, kept)`: the Keras masks `y_pred`'s flat outputs carry (those that
    carry one) and which flat outputs carry one; `with_masks` attaches them again
    (to the outputs of a loop, which carry none)."""
    masks = _masks_of(y_pred)
    return [mask for mask in masks if mask is not None], [mask is not None for mask in masks]


def with_masks(y_pred, masks, kept):
    """`y_pred` (the whole batch's outputs) with `masks` (`masked_outputs`') attached."""
    masks = _with_gaps(kept, masks)
    flat = [t if mask is None else _MaskAttached()(t, mask=mask)
            for t, mask in zip(tree.flatten(y_pred), masks, strict=True)]
    return tree.pack_sequence_as(y_pred, flat)


def _masks_of(y_pred) -> list:
    """The Keras mask of each flat output (None where it has none)."""
    return [_jax.mask_of(t) for t in tree.flatten(y_pred)]


class _MaskAttached(keras.layers.Layer):
    """Returns its input with the mask it is called with (`mask=`) attached, as
    Keras attaches a layer's output mask (its own `__call__` does)."""

    def __init__(self):
        super().__init__()
        self.supports_masking = True

    def call(self, inputs, mask=None):
        return inputs * 1  # a tensor of its own, which no mask was attached to before


def _mask_model(model, masked):
    """A functional model from `model`'s inputs to the masks of its outputs (those
    that `masked` says carry one), or None where there is none: `model` is not
    functional, its symbolic outputs carry other masks than its calls (a nested
    model's, which Keras does not carry to the outer symbolic outputs), or the
    masks need weights (a `Masking` layer after a trained layer)."""
    key = tuple(masked)
    cached = _MASK_MODELS.setdefault(model, {})
    if key not in cached:
        cached[key] = _built_mask_model(model, masked)
    return cached[key]


def _built_mask_model(model, masked):
    if not isinstance(model, _keras.Functional):
        return None
    # Keras does not carry the masks made inside a nested model to the outer model's
    # symbolic outputs (a nested Sequential holding `Embedding(mask_zero=True)`: the
    # fuzzer's seed 350): its calls carry them, and the counting pass counts them.
    direct = {id(layer) for layer in model.layers}
    if any(_makes_masks(layer) for layer in _keras.sublayers(model, include_self=False)
           if id(layer) not in direct):
        return None
    masks = [getattr(t, "_keras_mask", None) for t in tree.flatten(model.outputs)]
    if [mask is not None for mask in masks] != list(masked):
        return None
    inputs = _keras.nested_inputs_outputs(model)[0]
    masks_model = keras.Model(inputs, [mask for mask in masks if mask is not None])
    return None if masks_model.weights else masks_model


def _makes_masks(layer):
    return getattr(layer, "mask_zero", False) or isinstance(layer, keras.layers.Masking)


def _with_gaps(kept, values):
    """`values` placed where `kept` is True, None elsewhere."""
    values = iter(values)
    return [next(values) if keep else None for keep in kept]


def _flat_targets(y, outputs):
    """The targets of each flat output (as Keras pairs them for the usual structures)."""
    if not tree.is_nested(y):
        return [y] * outputs
    flat = tree.flatten(y)
    return flat if len(flat) == outputs else [None] * outputs


def output_weights(y_pred, sample_weight, fractions):
    """The sample weights that carry each output's fraction of the batch's loss
    (`fractions`): the user's sample weights, one array for every output or one
    per output as Keras pairs them (by the outputs' structure), times the fraction."""
    flat = tree.flatten(y_pred)
    if tree.is_nested(sample_weight):
        user = tree.flatten(sample_weight)
    else:
        user = [sample_weight] * len(flat)
    if len(user) != len(flat) or len(fractions) != len(flat):
        raise ValueError(
            "AccumulatingModel on JAX pairs one sample weight and one loss with each "
            f"output; the model has {len(flat)} output(s). Received: "
            f"{len(user)} sample weight(s) for {len(fractions)} loss(es)"
        )
    weights = [_scaled(w, s) for w, s in zip(user, fractions, strict=True)]
    return tree.pack_sequence_as(y_pred, weights) if tree.is_nested(y_pred) else weights[0]


def _scaled(sample_weight, fraction):
    """`sample_weight * fraction` (Keras's float type or the weight's, the wider), or
    `fraction` where there is no weight: one scalar, which Keras broadcasts onto any
    loss shape (a sequence's, with its mask), as the TensorFlow line does."""
    dtype = jnp.dtype(keras.backend.floatx())
    if sample_weight is None:
        return jnp.asarray(fraction, dtype)
    weight = jnp.asarray(sample_weight)
    if jnp.issubdtype(weight.dtype, jnp.floating) and weight.dtype.itemsize > dtype.itemsize:
        dtype = weight.dtype
    return weight.astype(dtype) * jnp.asarray(fraction, dtype)


def batch_size_of(data) -> int:
    """The static number of samples in a nest of batched arrays."""
    for leaf in tree.flatten(data):
        if leaf is not None and getattr(leaf, "shape", None):
            return int(leaf.shape[0])
    raise ValueError(
        "AccumulatingModel splits each batch along its first axis, but the batch "
        f"holds no array. Received: data={data!r}"
    )
