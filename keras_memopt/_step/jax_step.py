"""The JAX steps: a batch's micro-batches inside one compiled, stateless step.

Keras's JAX trainer compiles `train_step(state, data)` with `jax.jit`; this
one takes the same state and returns the same. The batch of `N` samples is
split at trace time (shapes are static on JAX) into `k` equal micro-batches
of `m` samples, run by `jax.lax.scan`, and a last micro-batch of the `r`
samples left over, run once more by the same function at its own static
shape: nothing is padded into the loss (`Split`; under
`keras.distribution.DataParallel` each device's share of the batch is split
so, and micro-batch `j` is the `j`-th part of every share, each device
running its own rows). Each micro-batch's gradient
is taken of its exact fraction of the batch's loss; the fractions add up, in the
gradients' own dtype, to the whole batch's gradient, which
`optimizer.stateless_apply` applies once. `test_step` and `predict_step`
split the same way, without gradients.

Each micro-batch's fraction of the batch's loss (`keras_memopt._step.jax_fractions`)
reaches Keras's own loss container as sample weights (the user's, times the
fraction), so `loss_weights`, class and sample weights, masks and ignored
classes stay Keras's. Each term of `model.losses` of a micro-batch's call
counts as it is where it sums over the samples, `n_i / N` of itself
otherwise (`keras_memopt._step.jax_terms`, which finds which before the
first step).

Where a masked output's counts need it (`Counter.totals`), a forward pass over
the micro-batches counts the batch's unmasked elements before the loop.

What the loop changes besides the gradient: layers' non-trainable state
(BatchNormalization's moving statistics, seed generators) is carried from
one micro-batch to the next, so it advances once per micro-batch, in order,
as on the TensorFlow line. The loss tracker, the per-output loss trackers and
the compiled metrics are updated once, after the loop, with the batch's loss
and the whole batch's outputs, by Keras's own metrics update (`_keras.jax`):
the figures are plain Keras's at the whole batch. The outputs of the whole
batch are kept for that (as plain Keras keeps them).
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import jax
import jax.numpy as jnp
from jax.experimental import sparse as jax_sparse

from keras_memopt import _keras
from keras_memopt._keras import jax as _jax
from keras_memopt._keras import keras
from keras_memopt._step import jax_terms
from keras_memopt._step import loop as _loop
from keras_memopt._step.jax_calls import call_of, restarting
from keras_memopt._step.jax_fractions import (
    Counter,
    Refused,
    batch_size_of,
    masked_outputs,
    output_weights,
    with_masks,
)
from keras_memopt._step.seen import (
    NEGLIGIBLE,
    Seen,
    coupled_loss_message,
    pair_starts,
    tolerance_of,
)

tree = keras.tree


_STATE_NAMES = {
    4: ("trainable_variables", "non_trainable_variables", "optimizer_variables",
        "metrics_variables"),
    3: ("trainable_variables", "non_trainable_variables", "metrics_variables"),
    2: ("trainable_variables", "non_trainable_variables"),
}


def restored_on_refusal(model, step_function):
    """`step_function(state, iterator)` that, when the step is refused while traced,
    puts `state` (the model's, taken from its variables by Keras's `fit`,
    `evaluate` or `predict`) back into the variables before raising: the model
    and optimizer stay as they were. The error's `put_back()` does it again (after
    Keras's JAX `fit` changed the weights on its way out: `AccumulatingModel.fit`)."""

    def checked(state, iterator):
        try:
            return step_function(state, iterator)
        except Refused as error:
            error.put_back = functools.partial(put_back, model, state)
            error.put_back()
            raise

    return checked


def refuse_other_distributions():
    """Refuses a `keras.distribution` other than `DataParallel` (whose batch
    axis `batch_sharded` splits each micro-batch over)."""
    distribution = keras.distribution.distribution()
    if distribution is None or type(distribution) is keras.distribution.DataParallel:
        return
    raise Refused(
        "AccumulatingModel on JAX splits batches under `keras.distribution.DataParallel` "
        "or without a `keras.distribution`; other distributions (ModelParallel, which "
        "shards the weights) are not supported on JAX yet. Use DataParallel, or the "
        f"TensorFlow backend's strategies. Received: distribution={distribution!r}"
    )


def put_back(model, state):
    """Puts a step's `state` (Keras's JAX loops take it out of the variables) back
    into the model's variables."""
    _jax.put_state_back(model, _STATE_NAMES[len(state)], state)


def splits(micro_batch_size, data) -> bool:
    """Whether a batch `data` is split into several micro-batches. Where it is not,
    the model runs Keras's own step: a micro-batch is the whole batch, and what
    the split cannot do yet is not refused."""
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    split = Split(micro_batch_size, batch_size_of(x))
    if split.steps + bool(split.rest) <= 1:
        return False
    _refuse_sparse(data)
    return True


def _refuse_sparse(data):
    """Refuses a sparse array (a `jax.experimental.sparse` BCOO, which Keras makes of a
    sparse input) in a batch to split: `jax.lax.scan` would split its stored values,
    not its rows (seed 0 of the differential fuzzer: "scan got values with different
    leading axis sizes")."""
    sparse = [leaf for leaf in tree.flatten(data) if isinstance(leaf, jax_sparse.JAXSparse)]
    if sparse:
        raise Refused(
            "AccumulatingModel on JAX cannot yet split a batch with a sparse input into "
            "micro-batches. Feed it dense, use the TensorFlow backend, or a micro-batch as "
            f"large as the batch. Received: {len(sparse)} sparse array(s) of shape(s) "
            f"{[tuple(leaf.shape) for leaf in sparse]}"
        )


class Split:
    """A batch of `size` samples as micro-batches: each device's share of it
    (the whole batch on one device; under `DataParallel`, the rows Keras placed
    on each device of its batch axis) as `steps` runs of `m` rows, then `rest`.
    Micro-batch `j` holds the `j`-th run of every device's share, in device
    order: on one device, a run of the batch's rows.

    So `m` counts samples per device, as `micro_batch_size` counts them per
    replica on the TensorFlow line, and each device runs its own rows of each
    micro-batch: nothing is moved between the devices to slice the batch.
    """

    def __init__(self, micro_batch_size, size):
        self.size = size
        self.devices = batch_devices()
        share = size // self.devices  # Keras places equal shares (it refuses others)
        self.m = max(1, min(micro_batch_size(share), share))
        self.steps, self.rest = divmod(share, self.m)

    def run(self, micro, totals, carried, whole, fold=None):
        """Runs `micro(carried, part) -> (carried, parts, outputs)` on each
        micro-batch of `whole` in order (`jax.lax.scan` over the equal ones, then
        the rest at its own shape); returns `parts` folded into `totals` (by
        `fold(totals, parts)`; summed where none is given), what is carried, and
        the outputs of the whole batch, in order."""
        fold = fold or _summed

        def body(carry, part):
            totals, carried = carry
            carried, parts, outputs = micro(carried, part)
            return (fold(totals, parts), carried), outputs

        refuse_other_distributions()
        devices, run = self.devices, self.steps * self.m
        stacked = batch_sharded(_stacked(whole, devices, self.steps, self.m), axis=1)
        (totals, carried), outputs = jax.lax.scan(body, (totals, carried), stacked)
        last = None
        if self.rest:
            carried, parts, last = micro(carried, batch_sharded(_rest(whole, devices, run)))
            totals = fold(totals, parts)
        return totals, carried, batch_sharded(_in_order(outputs, last, devices))


def train_step(model, micro_batch_size, state, data):
    """Keras's JAX `train_step(state, data)` for `model`, in micro-batches of
    `micro_batch_size(batch_size)` samples."""
    trainable, non_trainable, optimizer_variables, metrics_variables = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    split = Split(micro_batch_size, batch_size_of(x))
    restart = restarting(model, non_trainable)
    counter = Counter(model, y)
    counts = counter.totals((x, y, sample_weight), call_of(model, trainable, True, restart),
                            non_trainable, split)
    grad_fn = jax.value_and_grad(_micro_loss, argnums=1, has_aux=True)

    def micro(non_trainable, part):
        xs, ys, ws = part
        non_trainable = restart(non_trainable)
        fractions = functools.partial(
            counter.fractions, ys, samples=batch_size_of(xs) / split.size, totals=counts)
        (_, aux), grads = grad_fn(
            model, trainable, non_trainable, metrics_variables, optimizer_variables,
            xs, ys, ws, fractions,
        )
        unscaled, y_pred, non_trainable, trackers = aux
        return non_trainable, (grads, unscaled, trackers), y_pred

    zeros = zero_parts(model, trainable)
    (grads, loss, trackers), non_trainable, y_pred = split.run(
        micro, zeros, non_trainable, (x, y, sample_weight), fold=gradient_fold(model)
    )
    trainable, optimizer_variables = model.optimizer.stateless_apply(
        optimizer_variables, grads, trainable
    )
    metrics_variables = _set_loss_trackers(model, metrics_variables, trackers, split.size)
    logs, metrics_variables = _jax.update_metrics(
        model, metrics_variables, loss, x, y, y_pred, sample_weight
    )
    return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)


def test_step(model, micro_batch_size, state, data):
    """Keras's JAX `test_step(state, data)` for `model`, in micro-batches: the
    whole batch's loss and metrics, one micro-batch's activations at a time."""
    trainable, non_trainable, metrics_variables = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    split = Split(micro_batch_size, batch_size_of(x))
    counter = Counter(model, y)
    counts = counter.totals((x, y, sample_weight), call_of(model, trainable, False),
                            non_trainable, split)
    kept = []

    def micro(non_trainable, part):
        xs, ys, ws = part
        fractions = functools.partial(
            counter.fractions, ys, samples=batch_size_of(xs) / split.size, totals=counts)
        _, (loss, y_pred, non_trainable, trackers) = _micro_loss(
            model, trainable, non_trainable, metrics_variables, None,
            xs, ys, ws, fractions,
        )
        masks, kept[:] = masked_outputs(y_pred)
        return non_trainable, (loss, trackers), (y_pred, masks)

    zeros = zero_parts(model, trainable)[1:]
    (loss, trackers), non_trainable, (y_pred, masks) = split.run(
        micro, zeros, non_trainable, (x, y, sample_weight)
    )
    metrics_variables = _set_loss_trackers(model, metrics_variables, trackers, split.size)
    # Keras's own test step hands the metrics the outputs with their masks (its
    # train step, through `jax.value_and_grad`'s outputs, without).
    logs, metrics_variables = _jax.update_metrics(
        model, metrics_variables, loss, x, y, with_masks(y_pred, masks, kept), sample_weight
    )
    return logs, (trainable, non_trainable, metrics_variables)


def predict_step(model, micro_batch_size, state, data):
    """Keras's JAX `predict_step(state, data)` for `model`, in micro-batches."""
    trainable, non_trainable = state
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    split = Split(micro_batch_size, batch_size_of(x))
    call = call_of(model, trainable, False)

    def micro(non_trainable, xs):
        outputs, non_trainable = call(non_trainable, xs)
        return non_trainable, (), outputs

    _, non_trainable, outputs = split.run(micro, (), non_trainable, x)
    return outputs, non_trainable


class UnsplittableLoss(Refused, ValueError):
    """A loss of the outputs that the micro-batches' fractions do not add up to (the
    TensorFlow line's `ValueError`), found before the step runs."""


# The models whose loss `check_loss_split` found to split.
_SPLITS = weakref.WeakSet()


def check_loss_split(model, state, data):
    """Refuses, once, before the first step that splits a batch, a loss of the outputs that
    the step's fractions do not add up to: one that sums over the batch or couples its
    samples, unless `whole_batch_loss`. In inference, on the batch's first two samples (the
    next pairs while the loss tells nothing there), the loss of both against the sum of each
    sample's fraction of it, as this step computes a micro-batch's (the TensorFlow line's
    check; docs/accumulation.md, "How the fraction is found").

    Raises:
        UnsplittableLoss: where the two differ (nothing has changed).
    """
    if model in _SPLITS or getattr(model, "whole_batch_loss", False):
        return
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    trainable, non_trainable, metrics_variables = state[0], state[1], state[-1]
    rtol = tolerance_of(keras.backend.floatx())
    for start in pair_starts(batch_size_of(x)) if y is not None else ():
        pair = jax_terms.rows_of((x, y, sample_weight), lambda t, at=start: t[at : at + 2])
        counter = Counter(model, pair[1])
        counts = counter.totals(pair, call_of(model, trainable, False), non_trainable)

        def loss(part, samples, counter=counter, counts=counts):
            fractions = functools.partial(counter.fractions, part[1], samples=samples,
                                          totals=counts)
            return float(_micro_loss(model, trainable, non_trainable, metrics_variables, None,
                                     *part, fractions)[0])

        alone = [jax_terms.rows_of(pair, lambda t, i=i: t[i : i + 1]) for i in (0, 1)]
        seen = Seen(loss(pair, 1.0), parts=sum(loss(one, 0.5) for one in alone), rtol=rtol)
        if max(abs(seen.once), abs(seen.parts)) >= NEGLIGIBLE:
            if not seen.adds_up():
                raise UnsplittableLoss(coupled_loss_message(model, seen.split(), False))
            break
    _SPLITS.add(model)


def forget_loss_split(model):
    """Forgets that `check_loss_split` found `model`'s loss to split (a new `compile`)."""
    _SPLITS.discard(model)


def _micro_loss(model, trainable, non_trainable, metrics_variables, optimizer_variables,
                x, y, sample_weight, fractions):
    """A micro-batch's fraction of the batch's loss (scaled as the optimizer scales it)
    and `(unscaled, y_pred, non_trainable, trackers)`: Keras's
    `compute_loss_and_updates` with the fraction (`fractions(y_pred)`: a `Fractions`
    from the outputs, which carry their masks) in the sample weights and the terms."""
    training = optimizer_variables is not None  # None: `evaluate`'s step
    kwargs = {"training": training} if _keras.calls_with_training(model) else {}
    y_pred, non_trainable, losses = _jax.stateless_call_with_losses(
        model, trainable, non_trainable, x, **kwargs
    )
    fractions = fractions(y_pred)
    weights = output_weights(y_pred, sample_weight, fractions)
    terms = jax_terms.weighted(model, losses, fractions.samples)
    with _jax.losses_replaced(model, terms) if terms else contextlib.nullcontext():
        loss, (_, non_trainable, metrics_after) = model.stateless_compute_loss(
            trainable, non_trainable, metrics_variables,
            x=x, y=y, y_pred=y_pred, sample_weight=weights, training=training,
        )
    trackers = _tracker_parts(model, metrics_variables, metrics_after)
    unscaled = loss
    if training:
        mapping = list(zip(model.optimizer.variables, optimizer_variables, strict=True))
        with keras.StatelessScope(state_mapping=mapping):
            loss = model.optimizer.scale_loss(loss)
    return loss, (unscaled, y_pred, non_trainable, trackers)


def _stacked(data, devices, steps, m):
    """The first `steps * m` rows of each device's share of each array, as `steps`
    micro-batches of `devices * m` rows (`Split`'s order)."""

    def stacked(t):
        t = _by_device(t, devices)[:, : steps * m]
        t = t.reshape((devices, steps, m, *t.shape[2:]))
        return jnp.swapaxes(t, 0, 1).reshape((steps, devices * m, *t.shape[3:]))

    return tree.map_structure(lambda t: None if t is None else stacked(t), data)


def _rest(data, devices, start):
    """The rows of each device's share of each array from `start` on, in device order."""

    def rest(t):
        t = _by_device(t, devices)[:, start:]
        return t.reshape((-1, *t.shape[2:]))

    return tree.map_structure(lambda t: None if t is None else rest(t), data)


def _in_order(stacked, last, devices):
    """The outputs of the micro-batches (`stacked` by `jax.lax.scan`, then those of
    the `last` one, or None) as the batch's rows, in order."""

    def ordered(runs, rest=None):
        runs = runs.reshape((runs.shape[0], devices, -1, *runs.shape[2:]))
        rows = jnp.swapaxes(runs, 0, 1).reshape((devices, -1, *runs.shape[3:]))
        if rest is not None:
            rows = jnp.concatenate([rows, _by_device(rest, devices)], axis=1)
        return rows.reshape((-1, *rows.shape[2:]))

    if last is None:
        return tree.map_structure(ordered, stacked)
    return tree.map_structure(ordered, stacked, last)


def _by_device(t, devices):
    """`t` as `devices` shares of its rows (axis 0: the device)."""
    return t.reshape((devices, t.shape[0] // devices, *t.shape[1:]))


def batch_devices() -> int:
    """The number of devices the `keras.distribution` splits the batch over (1 without one)."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return 1
    mesh = distribution.device_mesh
    return mesh.shape[mesh.axis_names.index(distribution.batch_dim_name)]


def batch_sharded(data, axis=0):
    """`data` with `axis` of each array split over the devices of the
    `keras.distribution`'s batch axis, as Keras splits the batch (unchanged
    without one).

    Placed so (the stacked micro-batches along their second axis, the last
    one and the outputs along their first), each device holds its own rows
    of each micro-batch (`Split`'s order). XLA finds the same placement from
    the batch's for these reshapes; the constraint keeps it so. (Micro-batches
    cut as runs of the whole batch's rows were gathered onto every device, an
    `all-gather` of the rows, and each device ran every micro-batch whole.)
    """
    distribution = keras.distribution.distribution()
    if distribution is None:
        return data

    def place(t):
        if t is None:
            return None
        axes = [None] * t.ndim
        axes[axis] = distribution.batch_dim_name
        layout = keras.distribution.TensorLayout(axes, distribution.device_mesh)
        return keras.distribution.distribute_tensor(t, layout)

    return tree.map_structure(place, data)


def _summed(totals, parts):
    return tree.map_structure(jnp.add, totals, parts)


def gradient_fold(model):
    """`fold(totals, parts)` for the train step's `(gradients, loss, trackers)`: sums
    them, but takes the maximum of the "gradients" of variables the optimizer
    overwrites with them (`loop.overwritten`: Keras 3's float8 scales and amax
    histories, which each micro-batch computes from the same old value and its own
    samples' largest magnitude; their maximum is the whole batch's, as on the
    TensorFlow line). Summed, they were 12 times plain Keras's (the fuzzer's seed 9)."""
    overwritten = [_loop.overwritten(v) for v in model.trainable_variables]
    if not any(overwritten):
        return _summed

    def fold(totals, parts):
        (grads, loss, trackers), (more, more_loss, more_trackers) = totals, parts
        grads = [jnp.maximum(g, h) if over else g + h
                 for g, h, over in zip(grads, more, overwritten, strict=True)]
        return grads, loss + more_loss, _summed(trackers, more_trackers)

    return fold


def zero_parts(model, trainable):
    """What each micro-batch's gradients, loss and loss-tracker parts are folded into:
    zeros, but `-inf` for a "gradient" folded by its maximum (`gradient_fold`)."""
    grads = [jnp.full_like(t, -jnp.inf) if _loop.overwritten(v) else jnp.zeros_like(t)
             for v, t in zip(model.trainable_variables, trainable, strict=True)]
    dtype = jnp.dtype(keras.backend.floatx())
    trackers = [jnp.zeros([], t.total.dtype) for t in _loss_trackers(model)]
    return grads, jnp.zeros([], dtype), trackers


def _loss_trackers(model):
    """Keras's per-output loss trackers (`Mean` metrics of the compiled loss)."""
    container = getattr(model, "_compile_loss", None)
    return list(container.metrics) if container is not None else []


def _tracker_parts(model, before, after):
    """What each per-output loss tracker took from one call, as the mean it added."""
    index = {id(v): i for i, v in enumerate(model.metrics_variables)}
    parts = []
    for tracker in _loss_trackers(model):
        total, count = index[id(tracker.total)], index[id(tracker.count)]
        added = after[count] - before[count]
        parts.append(jnp.where(added > 0, (after[total] - before[total]) / added, 0))
    return parts


def _set_loss_trackers(model, metrics_variables, parts, size):
    """Each per-output loss tracker as one update with the batch's loss of that
    output gives it (Keras weighs it by the batch's size)."""
    metrics_variables = list(metrics_variables)
    index = {id(v): i for i, v in enumerate(model.metrics_variables)}
    for tracker, value in zip(_loss_trackers(model), parts, strict=True):
        total, count = index[id(tracker.total)], index[id(tracker.count)]
        weight = jnp.asarray(size, metrics_variables[count].dtype)
        metrics_variables[total] = metrics_variables[total] + value * weight
        metrics_variables[count] = metrics_variables[count] + weight
    return metrics_variables
