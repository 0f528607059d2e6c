"""The terms of `model.losses` on JAX: how each one splits over micro-batches, found once.

A term of `model.losses` (`add_loss`, an activity regulariser, a weight regulariser) that averages
over the samples counts `n_i / N` of itself in each micro-batch of `n_i` of the batch's `N`
samples, as does one that does not depend on them (a weight regulariser); one that sums over the
samples counts as it is (the micro-batches' sums add up to the batch's). Which is which is found as
on the TensorFlow line (`keras_memopt._step.seen`, docs/accumulation.md, "How the fraction is
found"): before the first step of the model's own train or test step that splits its batch, eagerly
on the batch's first two samples, in inference (`model.stateless_call(..., return_losses=True)`,
which changes no variable), each term and its gradient's norm, on the samples, on them a second time
(random draws) and on them repeated; unchanged, a mean; doubled, a sum; a term that tells nothing on
two samples, on the next pairs (a model whose terms are all weight regularisers, counted from an
abstract call, is not evaluated: none depends on the samples). A term that does neither is refused
with the TensorFlow line's `ValueError`, before any update (`UnsplittableTerm`: the step's state is
put back); one whose value and gradient are not finite (weights already NaN) counts as a mean: its
fraction changes nothing.

What is found (`find`) is kept per model (until `compile` or `remat` changes what a step traces:
`forget`) and read where the step is traced (`weighted`), so each micro-batch's call adds its terms
with their fractions.
"""

from __future__ import annotations

import math
import weakref

import jax
import jax.numpy as jnp

from keras_memopt import _keras
from keras_memopt._keras import jax as _jax
from keras_memopt._keras import keras
from keras_memopt._step import loop as _loop
from keras_memopt._step.jax_fractions import Refused, batch_size_of
from keras_memopt._step.seen import MEAN, SUM, pair_starts, seen_terms, silent_terms, term_kind

tree = keras.tree

# Per model, the kind of each term of `model.losses` (`seen.MEAN` or `SUM`), once found.
_KINDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class UnsplittableTerm(Refused, ValueError):
    """A term of `model.losses` that neither averages nor sums over the samples (the TensorFlow
    line's `ValueError`), found before the step runs: its state is put back."""


def find(model, state, data):
    """Finds, once, how each term of `model.losses` splits over micro-batches, on the first two
    samples of `data` (and the next pairs where a term tells nothing there), from `state`
    (the step's: the trainable and non-trainable variables' values first).

    Raises:
        UnsplittableTerm: for a term that neither averages nor sums over the samples.
    """
    if model in _KINDS:
        return
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    count = _count(model, state[0], state[1], x)
    if count == sum(1 for v in model.trainable_weights if v.regularizer is not None):
        # Weight regularisers only (Keras adds one per regularised weight): none depends
        # on the samples, and nothing is evaluated.
        _KINDS[model] = (MEAN,) * count
        return
    evaluate = _evaluator(model, state[0], state[1])
    terms = None
    for start in pair_starts(batch_size_of(x)):
        if terms is not None and not silent_terms(terms):
            break
        pair = rows_of(x, lambda t, start=start: t[start : start + 2])
        once = evaluate(pair)
        if not once:
            terms = []
            break
        again, twice = evaluate(pair), evaluate(rows_of(pair, lambda t: jnp.concatenate([t, t])))
        terms = seen_terms(terms, once, again, twice)
    _KINDS[model] = tuple(
        # A term whose value and gradient are not finite on the batch's first samples
        # (weights already NaN: a refit after plain Keras's own training diverged, the
        # fuzzer's seed 303) makes the batch's loss and update so, and the micro-batches'
        # sum, whatever its fraction; plain Keras trains on. Any other is told.
        MEAN if not (math.isfinite(value.once) or math.isfinite(norm.once))
        else term_kind(index, value, norm, UnsplittableTerm)
        for index, (value, norm) in enumerate(terms)
    )


def forget(model):
    """Forgets what `find` found for `model` (what its steps trace has changed)."""
    _KINDS.pop(model, None)


def weighted(model, losses, fraction) -> list:
    """The terms `losses` of one micro-batch's call of `model` (`fraction`, its `n_i / N`), each
    as it counts in the batch's loss: one that sums over the samples as it is, any other times
    `fraction`. Where `find` did not run (a custom step around the model's own), only the terms
    that average or do not depend on the samples are taken (`refuse_sample_dependent_terms`)."""
    kinds = _KINDS.get(model)
    if kinds is None:
        refuse_sample_dependent_terms(model, losses)
        kinds = ()
    elif len(kinds) != len(losses):
        raise Refused(
            f"AccumulatingModel on JAX found how each of the {len(kinds)} term(s) of "
            "`model.losses` splits over micro-batches from a call of the model in inference, "
            f"before the first step; this step's call added {len(losses)}. A term added only "
            "in training (or only in inference) is not supported on JAX yet: add it in both, "
            "use the TensorFlow backend, or a micro-batch as large as the batch. Received: "
            f"{len(kinds)} term(s) in inference, {len(losses)} in this step"
        )
    return [
        term if index < len(kinds) and kinds[index] == SUM else term * fraction
        for index, term in enumerate(losses)
    ]


def _count(model, trainable, non_trainable, x) -> int:
    """How many terms a call of `model` on `x` adds to `model.losses` (in inference; traced
    for its shapes only, nothing computed)."""
    kwargs = {"training": False} if _keras.calls_with_training(model) else {}

    def terms(x):
        return _jax.stateless_call_with_losses(model, trainable, non_trainable, x, **kwargs)[2]

    return len(jax.eval_shape(terms, rows_of(x, lambda t: t[:2])))


def rows_of(data, rows):
    """`rows(t)` of each array `t` of `data`."""
    return tree.map_structure(lambda t: None if t is None else rows(t), data)


def _evaluator(model, trainable, non_trainable):
    """`evaluate(x)`: each term of `model.losses` of a call on `x` (in inference), summed, and
    its gradient's norm, as Python numbers; each call from the state the last one left (seed
    generators advance, so random draws show)."""
    kwargs = {"training": False} if _keras.calls_with_training(model) else {}
    # Not the variables the optimizer overwrites with their "gradient" (float8's
    # scales): theirs is a new value, which stays when the samples are repeated.
    taken = [i for i, v in enumerate(model.trainable_variables) if not _loop.overwritten(v)]
    dtype = jnp.result_type(float)

    def terms(values, state, x):
        full = list(trainable)
        for index, value in zip(taken, values, strict=True):
            full[index] = value
        _, state, losses = _jax.stateless_call_with_losses(model, full, state, x, **kwargs)
        summed = jnp.stack([jnp.sum(t).astype(dtype) for t in losses] or [jnp.zeros([], dtype)])
        summed = summed[: len(losses)]
        return summed, (summed, state)

    jacobian = jax.jacrev(terms, has_aux=True)
    carried = [non_trainable]

    def evaluate(x):
        grads, (values, carried[0]) = jacobian([trainable[i] for i in taken], carried[0], x)
        squares = jnp.zeros(values.shape, dtype)
        for grad in grads:
            axes = tuple(range(1, grad.ndim))
            squares = squares + jnp.sum(jnp.square(grad.astype(dtype)), axis=axes)
        return list(zip(values.tolist(), jnp.sqrt(squares).tolist(), strict=True))

    return evaluate


def refuse_sample_dependent_terms(model, losses):
    """Refuses, in a step `find` did not run for (a custom `train_step` or `test_step`
    around the model's own), the terms of `model.losses` whose split it cannot tell.

    It takes weight regularisers (the same for every micro-batch) and the
    activity regularisers of Keras's `L1`, `L2` and `L1L2` on the layers of a
    functional model, each called once: a sum over the samples that Keras
    divides by the batch's size, a mean. Both then count `n_i / N` per
    micro-batch. What it takes is counted, and any other term refuses the step.
    """
    regularised = sum(1 for v in model.trainable_weights if v.regularizer is not None)
    activity = _activity_terms(model)
    if len(losses) == regularised + (activity or 0):
        return
    raise Refused(
        "AccumulatingModel on JAX finds how each term of `model.losses` splits over "
        "micro-batches before the first step of the model's own train and test steps; in a "
        "custom `train_step` or `test_step` around them it splits only weight regularisers "
        "and Keras's L1, L2 and L1L2 activity regularisers on the layers of a functional "
        "model, each called once. Other terms (`add_loss`, other activity regularisers) are "
        "not supported there on JAX yet: use the model's own steps, the TensorFlow backend, "
        "or a micro-batch as large as the batch. Received: "
        f"{len(losses) - regularised - (activity or 0)} such term(s)"
    )


def _activity_terms(model) -> int | None:
    """The terms the activity regularisers that `refuse_sample_dependent_terms`
    takes add in one call of `model` (None: one it does not take)."""
    kinds = (keras.regularizers.L1, keras.regularizers.L2, keras.regularizers.L1L2)
    direct = {id(layer) for layer in getattr(model, "layers", [])}
    terms = 0
    for layer in _keras.sublayers(model, include_self=False):
        regulariser = getattr(layer, "activity_regularizer", None)
        if regulariser is None:
            continue
        if (not isinstance(model, _keras.Functional) or type(regulariser) not in kinds
                or id(layer) not in direct or not _jax.called_once(layer)):
            return None
        terms += len(tree.flatten(layer.output))
    return terms
