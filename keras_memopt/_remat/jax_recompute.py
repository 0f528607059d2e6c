"""Recomputation on Keras 3's JAX backend: a layer's call under `jax.checkpoint`.

`recompute(layer, args, kwargs)` is `keras_memopt.Remat`'s call on JAX (and so
that of each recomputed segment of `AccumulatingModel(remat=[...])`). The call
is made a pure function of arrays: the values of the layer's variables (its
weights, BatchNormalization's moving statistics, its seed generators' states)
and the array leaves of its arguments; everything else (`training=True`) is
bound before `jax.checkpoint` sees it. Inside, the layer runs in a
`keras.StatelessScope` of those values and returns its outputs and its new
non-trainable values, which are then assigned where the call was made (the
step's own stateless scope, or the variables themselves outside a step).

Exact by construction: JAX keeps only the inputs for the backward pass and
replays the same computation from them there, so the recomputation draws
the same dropout masks (the seed states are inputs) and its state updates
are not seen (they are outputs of the forward pass only, assigned once).
Keras masks cross the checkpoint the same way: Keras attaches a mask to a
traced array by the array's id, and the arrays inside are the checkpoint's
own, so the masks the arguments carry go in as inputs and are attached
inside, and those the call gives its outputs come out as outputs and are
attached to the outputs outside (a segment's `Embedding(mask_zero=True)`,
an `LSTM` that drops its input's mask): what reaches the loss is what the
call without recomputation gives.

Why not `keras.remat` or `keras.RematScope`: on JAX they wrap the layer's
`call` in `jax.checkpoint` as it is, so `training=True` reaches it as a traced
array (a `Dropout` cannot branch on it) and the state a layer assigns inside
(a seed generator's, BatchNormalization's) is an array of the checkpoint's
own trace, which escapes it.
"""

from __future__ import annotations

import jax
import numpy as np

from keras_memopt._keras import jax as _jax
from keras_memopt._keras import keras
from keras_memopt._step.jax_fractions import Refused


class NotRecomputable(Refused, ValueError):
    """A layer that no recomputation runs again exactly, found while the step is
    traced (before any update)."""


def recompute(layer, args, kwargs):
    """Calls `layer(*args, **kwargs)`; its backward pass recomputes the call.

    Reads the values of `layer`'s variables where the call is made: call it
    where no autocast scope is open (`Remat` does not autocast), so that they
    are the variables' own values.
    """
    variables = layer.variables
    state = layer.non_trainable_variables
    leaves, structure = jax.tree_util.tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (jax.Array, np.ndarray))]

    def pure(values, arrays, masks):
        bound = list(leaves)
        for position, array, mask in zip(positions, arrays, masks, strict=True):
            if mask is not None:
                _jax.with_mask(array, mask)
            bound[position] = array
        call_args, call_kwargs = jax.tree_util.tree_unflatten(structure, bound)
        mapping = list(zip(variables, values, strict=True))
        with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
            outputs = layer(*call_args, **call_kwargs)
        if scope.losses:
            raise NotRecomputable(
                f"Cannot recompute {layer.name!r}: a loss added in its `call` with `add_loss` "
                "would get no gradient through the recomputed segment. Leave that layer out "
                "of the recomputed segments (end a segment before it, or do not wrap it in "
                "`Remat`), or add the term to the model's loss instead. Received: "
                f"{len(scope.losses)} loss term(s) added in layer {layer.name!r}"
            )
        masks = [_jax.mask_of(t) for t in jax.tree_util.tree_leaves(outputs)]
        return outputs, masks, [scope.get_current_value(v) for v in state]

    values = [v.value for v in variables]
    arrays = [leaves[i] for i in positions]
    outputs, masks, updated = jax.checkpoint(pure)(
        values, arrays, [_jax.mask_of(array) for array in arrays]
    )
    for variable, value in zip(state, updated, strict=True):
        variable.assign(value)
    for tensor, mask in zip(jax.tree_util.tree_leaves(outputs), masks, strict=True):
        if mask is not None:
            _jax.with_mask(tensor, mask)
    return outputs
