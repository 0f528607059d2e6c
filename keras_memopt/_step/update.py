"""The optimizer update of a step: after the loop, one variable after another.

After the loop (`after_the_loop`): else TensorFlow runs the update's ops that need no gradient
(SGD's `momentum * m`, `iterations`) during the loop, where they take memory and a failure leaves
them done. One variable after another (`chain_updates`): else the variables' updates run side by
side, each holding temporaries its size. The ops also wait for `RunState.guard`."""

from __future__ import annotations

import contextlib

import tensorflow as tf

from keras_memopt import _keras
from keras_memopt._step import loop as _loop


def chain_updates(optimizer, place_on_variable_device: bool = False):
    """Makes `optimizer` update its variables one after another in a traced step. Each variable's
    `update_step` waits for the previous one's on its device (and with `place_on_variable_device`
    runs there). A sparse gradient reaches it with each row once (`_loop.sum_rows`: the all-reduce
    concatenates the replicas' rows, which Keras 3 would apply slice by slice). Optimizers without
    `update_step` (tf_keras's legacy ones) are left as they are. Idempotent."""
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
        # tf_keras sums the replicas' gradients here and clips them next, before its own row sums:
        # `global_clipnorm` would read the norm of the concatenated rows, not the batch gradient's.
        def summed_aggregate(grads_and_vars):
            return [(_loop.sum_rows(g) if isinstance(g, tf.IndexedSlices) else g, v)
                    for g, v in aggregate(grads_and_vars)]

        inner.aggregate_gradients = summed_aggregate


def after_the_loop(gradients, overwrites=False) -> list:
    """What the update's ops wait for: every gradient summed, and on every replica where the
    optimizer `overwrites` a variable (Keras assigns it per replica: `_loop.every_replica`)."""
    summed = [t for t in tf.nest.flatten(gradients, expand_composites=True) if t is not None]
    return summed + (_loop.every_replica(summed) if overwrites else [])


class Unguarded:
    """The guard of a step without an OOM policy: the update waits for the loop, nothing else."""

    def begin(self, waits) -> tf.Operation:
        with tf.control_dependencies(waits):
            return tf.no_op()
