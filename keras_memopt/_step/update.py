"""The optimizer update of a step: after the loop, one variable after another.

Two measures keep the update from costing more memory than plain Keras's:

- **After the loop** (`after_the_loop`): every op of the update waits
  for every summed gradient. Otherwise TensorFlow runs the update's ops that
  need no gradient (SGD's `momentum * m`, the `iterations` counter) as soon as
  it can, during the micro-batch loop, where their results take memory and
  where a failure would leave them done.
- **One variable after another** (`chain_updates`): Keras's optimizers
  update every variable as a separate set of ops, and TensorFlow runs them
  side by side, each holding temporaries the size of its variable. Chained,
  the update holds the temporaries of one variable at a time.

The step's run-time state holds a guard (`RunState.guard`) that the update's ops
wait for: it marks the update as begun, and where an out-of-memory policy is
attached it checks or reserves the update's memory first
(`keras_memopt._oom.update_guard`).
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from keras_memopt import _keras
from keras_memopt._step import loop as _loop


def chain_updates(optimizer, place_on_variable_device: bool = False):
    """Makes `optimizer` update its variables one after another in a traced step.

    Each variable's update (Keras's `update_step`) waits for the previous
    variable's on the same device; with `place_on_variable_device`, it also
    runs on its variable's device (see `keras_memopt.placement`). A sparse
    gradient reaches `update_step` with each row once (`_loop.sum_rows`):
    the loop sums a replica's rows, but the all-reduce across replicas
    concatenates the replicas' rows again, and Keras 3's optimizers would
    apply a repeated row slice by slice (tf_keras's get them summed after
    its all-reduce, before it clips them). Optimizers without `update_step`
    (tf_keras's legacy ones, which sum rows themselves) are left as they are.
    Idempotent.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # a loss-scale optimizer's
    update_step = getattr(inner, "update_step", None)
    if update_step is None or getattr(update_step, "chained", False):
        return
    last_update = {}  # device -> (graph, the op that reads the variable once updated)

    def chained_update_step(gradient, variable, *args, **kwargs):
        device = _keras.variable_device(variable)
        graph = tf.compat.v1.get_default_graph()
        previous = last_update.get(device)
        waits = [previous[1]] if previous is not None and previous[0] is graph else []
        placement = tf.device(device) if place_on_variable_device else contextlib.nullcontext()
        if isinstance(gradient, tf.IndexedSlices):
            gradient = _loop.sum_rows(gradient)
        with placement, tf.control_dependencies(waits):
            result = update_step(gradient, variable, *args, **kwargs)
        if not tf.executing_eagerly():
            # Read after the variable's own update (automatic control
            # dependencies order it so): no copy, and done when the update is.
            last_update[device] = (graph, tf.convert_to_tensor(variable).op)
        return result

    chained_update_step.chained = True
    inner.update_step = chained_update_step
    aggregate = getattr(inner, "aggregate_gradients", None)
    if aggregate is not None:
        # tf_keras sums the replicas' gradients here and clips them next,
        # before its own row sums: `global_clipnorm` would read the norm of
        # the concatenated rows, not of the batch's gradient.
        def summed_aggregate(grads_and_vars):
            return [(_loop.sum_rows(g) if isinstance(g, tf.IndexedSlices) else g, v)
                    for g, v in aggregate(grads_and_vars)]

        inner.aggregate_gradients = summed_aggregate


def after_the_loop(gradients, overwrites=False) -> list:
    """What the update's ops wait for: every gradient summed, and on every replica
    where the optimizer `overwrites` a variable with its "gradient", which Keras
    assigns in each replica's context (`_loop.every_replica`)."""
    summed = [t for t in tf.nest.flatten(gradients, expand_composites=True) if t is not None]
    return summed + (_loop.every_replica(summed) if overwrites else [])


class Unguarded:
    """The guard of a step without an out-of-memory policy: the update waits for the
    loop, and nothing else (`keras_memopt._oom.update_guard.UpdateGuard` checks its memory)."""

    def begin(self, waits) -> tf.Operation:
        with tf.control_dependencies(waits):
            return tf.no_op()
