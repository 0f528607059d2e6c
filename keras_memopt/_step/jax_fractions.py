"""Each micro-batch's fraction of the batch's loss, on JAX (the step: `jax_step`).

Keras divides each output's loss by what it counts in the batch, so a
micro-batch's loss, run alone, is divided by its own count; times its count
over the batch's, it is its exact part of the batch's loss (as on the
TensorFlow line, `keras_memopt._step.losses`):

- the samples (`"sum_over_batch_size"`, Keras's default: it divides by the
  number of values, not by the sum of the sample weights): `n_i / N`;
- the elements it keeps, where the output carries a Keras mask
  (`Embedding(mask_zero=True)` reaching it) or its loss has `ignore_class`
  (both: the elements kept by both): the micro-batch's count over the
  batch's, counted before the loop;
- nothing (`reduction="sum"`; a mask or an ignored class only drops
  elements): one.

A functional model's outputs say which carry a mask, and the mask is a
function of the inputs (`Embedding`'s `inputs != 0`): `Counter` builds that
function as a functional model of its own from the model's symbolic outputs,
and refuses a mask that needs the model's weights to compute (a `Masking`
layer after a trained layer). A subclassed model's outputs do not say: one
with a layer that makes masks is refused where the batch is split.
"""

from __future__ import annotations

import weakref

import jax.numpy as jnp

from keras_memopt import _keras
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
        outputs = max(len(tree.flatten(y)), 1)
        self.classes = ignore_classes(model, y) or (None,) * outputs
        self.summed = summed_outputs(model, y) or (False,) * outputs
        self.masks = _mask_model(model)

    def counted(self, x, y) -> list:
        """Per flat output, the elements its loss keeps (booleans), or None where
        it counts samples."""
        masks = [None] * len(self.classes)
        if self.masks is not None:
            computed, _ = self.masks.stateless_call([], [], x)
            masks = _with_gaps(self.masks.kept, tree.flatten(computed))
        counted = []
        for mask, target, ignored in zip(
            masks, _flat_targets(y, len(self.classes)), self.classes, strict=True
        ):
            if ignored is not None:
                kept = target != ignored
                mask = kept if mask is None else mask & jnp.reshape(kept, mask.shape)
            counted.append(mask)
        return counted

    def with_masks(self, x, y_pred):
        """`y_pred` (the whole batch's outputs) with the masks Keras gives them."""
        if self.masks is None:
            return y_pred
        computed, _ = self.masks.stateless_call([], [], x)
        masks = _with_gaps(self.masks.kept, tree.flatten(computed))
        flat = [t if mask is None else _MaskAttached()(t, mask=mask)
                for t, mask in zip(tree.flatten(y_pred), masks, strict=True)]
        return tree.pack_sequence_as(y_pred, flat)

    def totals(self, x, y) -> list:
        """The whole batch's counts (`counted`, summed)."""
        dtype = jnp.result_type(float)
        return [None if c is None else jnp.sum(c).astype(dtype) for c in self.counted(x, y)]

    def fractions(self, x, y, samples, totals) -> Fractions:
        """A micro-batch's (inputs `x`, targets `y`) fraction of each output's loss:
        `samples` (`n_i / N`), its count over the batch's `totals`, or one."""
        fractions = []
        for counted, sums, total in zip(self.counted(x, y), self.summed, totals, strict=True):
            if sums:
                fractions.append(1.0)
            elif counted is not None:
                count = jnp.sum(counted).astype(total.dtype)
                fractions.append(jnp.where(total > 0, count / jnp.where(total > 0, total, 1), 0))
            else:
                fractions.append(samples)
        return Fractions(fractions, samples)


class _MaskAttached(keras.layers.Layer):
    """Returns its input with the mask it is called with (`mask=`) attached, as
    Keras attaches a layer's output mask (its own `__call__` does)."""

    def __init__(self):
        super().__init__()
        self.supports_masking = True

    def call(self, inputs, mask=None):
        return inputs * 1  # a tensor of its own, which no mask was attached to before


def _mask_model(model):
    """A functional model from `model`'s inputs to the masks of its outputs
    (`kept`: which flat outputs have one), or None where none has one."""
    if model in _MASK_MODELS:
        return _MASK_MODELS[model]
    if not isinstance(model, _keras.Functional):
        makers = [layer.name for layer in _keras.sublayers(model) if _makes_masks(layer)]
        if makers:
            raise Refused(_masks_refused(f"layer(s) {makers} make masks in a subclassed model"))
        return None
    # Keras does not carry a nested model's masks to the outer model's outputs: what a
    # nested model masks would be counted as samples (a nested Sequential holding
    # `Embedding(mask_zero=True)` logged 1.7% from plain Keras; the fuzzer's seed 350).
    nested = [layer.name for inner in model.layers if isinstance(inner, keras.Model)
              for layer in _keras.sublayers(inner) if _makes_masks(layer)]
    if nested:
        raise Refused(_masks_refused(f"layer(s) {nested} make masks in a nested model"))
    masks = [getattr(t, "_keras_mask", None) for t in tree.flatten(model.outputs)]
    if all(mask is None for mask in masks):
        _MASK_MODELS[model] = None
        return None
    inputs = _keras.nested_inputs_outputs(model)[0]
    masks_model = keras.Model(inputs, [mask for mask in masks if mask is not None])
    if masks_model.weights:
        raise Refused(_masks_refused(
            f"the masks of the outputs need the weights of layer(s) "
            f"{[layer.name for layer in masks_model.layers if layer.weights]}"
        ))
    masks_model.kept = [mask is not None for mask in masks]
    _MASK_MODELS[model] = masks_model
    return masks_model


def _masks_refused(found):
    return (
        "AccumulatingModel on JAX cannot yet split the loss of this output's mask: Keras "
        "divides the loss by the unmasked elements of the whole batch, which the step "
        "counts before the loop from a functional model's inputs. Build the model "
        "functionally with the mask made from the inputs (`Embedding(mask_zero=True)`), "
        "use the TensorFlow backend, or a micro-batch as large as the batch. "
        f"Received: {found}"
    )


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
