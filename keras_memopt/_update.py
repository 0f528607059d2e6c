"""The optimizer update of a step: after the loop, one variable after another, and guarded.

Three measures keep the update from costing more memory than plain Keras's
and make a failed one leave no trace:

- **After the loop** (`UpdateGuard.begin`): every op of the update waits
  for every summed gradient. Otherwise TensorFlow runs the update's ops that
  need no gradient (SGD's `momentum * m`, the `iterations` counter) as soon as
  it can, during the micro-batch loop, where their results take memory and
  where a failure would leave them done.
- **One variable after another** (`chain_updates`): Keras's optimizers
  update every variable as a separate set of ops, and TensorFlow runs them
  side by side, each holding temporaries the size of its variable. Chained,
  the update holds the temporaries of one variable at a time. (Measured: 4 x
  Dense(1024), SGD with momentum, micro-batch 64: the step's peak above its
  start 2.4 W unchained, 1.5 W chained, W the weights' bytes.)
- **Reserved before it starts** (`UpdateGuard`): before its first op, the
  update allocates and frees as many bytes as it needs (measured by the
  allocator in an earlier step). TensorFlow's allocators hand freed memory
  out again, so the update then fits; when the reservation fails, nothing of
  the update has run. Until the guard knows what the update needs (the first
  step at each micro-batch size), the step runner copies the weights and
  optimizer variables to host memory instead, to put back after a failed
  update.
"""

from __future__ import annotations

import contextlib
import math

import tensorflow as tf

from keras_memopt import _keras, _loop, memory

_KIB = 1024


def chain_updates(optimizer, place_on_variable_device: bool = False):
    """Makes `optimizer` update its variables one after another in a traced step.

    Each variable's update (Keras's `update_step`) waits for the previous
    variable's on the same device; with `place_on_variable_device`, it also
    runs on its variable's device (see `keras_memopt.placement`). A sparse
    gradient reaches `update_step` with each row once (`_loop.sum_rows`):
    the loop sums a replica's rows, but the all-reduce across replicas
    concatenates the replicas' rows again, and Keras 3's optimizers would
    apply a repeated row slice by slice. Optimizers without `update_step`
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


class UpdateGuard:
    """Lets a step's update start only once its memory is reserved, and says whether it began.

    Created with the model (under its distribution strategy); the step calls
    `begin` between the loop and the update, the step runner `prepare` before
    an attempt and `learn` after one that ran.

    What the update needs is measured once per micro-batch size, in an attempt
    that reserves nothing (its variables are in host memory meanwhile): when
    the update begins, the step starts a new peak window of the allocator
    (`tf.py_function`, in that attempt only), and the peak the window reaches
    above its start is the update's own, whatever the micro-batch loop needed.
    """

    # What the reservation adds to the measured need: the update's ops run in
    # one order (chained), so it varies little between steps.
    _MARGIN = 1.01
    _MARGIN_BYTES = 256 * _KIB

    def __init__(self):
        with tf.init_scope():
            # One per replica (any replica's update may be the one that fails).
            self._began = tf.Variable(
                0,
                trainable=False,
                name="update_began",
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )
            self._reserve_kib = tf.Variable(0, trainable=False, name="update_reserve_kib")
            self._measuring = tf.Variable(False, trainable=False, name="update_measuring")
        self._needs = {}  # micro-batch size -> bytes the update needs
        self._devices = []  # per replica
        self._update_starts = {}  # device -> bytes in use when the update began

    # -- in the traced step ------------------------------------------------------------

    def begin(self, gradients) -> tf.Operation:
        """The op the update's ops wait for: every gradient summed, the update
        marked as begun, and its memory reserved (or measured from here)."""
        summed = [
            t for t in tf.nest.flatten(gradients, expand_composites=True) if t is not None
        ]
        context = tf.distribute.get_replica_context()
        replica = 0 if context is None else context.replica_id_in_sync_group
        with tf.control_dependencies(summed):
            marked = self._began.assign(1, read_value=False)
            shape = tf.stack([self._reserve_kib.read_value(), _KIB])
            block = tf.raw_ops.Empty(shape=shape, dtype=tf.uint8, name="update_reservation")
            touched = tf.reduce_max(block[:1, :1])  # used, so that the graph keeps it
            measured = tf.cond(
                self._measuring.read_value(),
                lambda: tf.py_function(self._update_begins, [replica], tf.int64),
                lambda: tf.constant(0, tf.int64),
            )
        return tf.group(marked, touched, measured)

    def _update_begins(self, replica):
        device = self._devices[min(int(replica), len(self._devices) - 1)]
        self._update_starts[device] = memory.reset_step_peak(device) or 0
        return 0

    # -- in the step runner ------------------------------------------------------------

    def prepare(self, key, devices) -> bool:
        """Before an attempt at micro-batch `key`: reserves what its update needs.

        Returns whether the guard knows what that is; when it does not, this
        attempt measures it, and the runner must keep the update's variables
        elsewhere meanwhile (`HostCopy`).
        """
        self._began.assign(0)
        self._devices = list(devices)
        self._update_starts = {}
        need = self._needs.get(key)
        self._measuring.assign(need is None)
        reserve = 0 if need is None else need * self._MARGIN + self._MARGIN_BYTES
        self._reserve_kib.assign(math.ceil(reserve / _KIB))
        return need is not None

    def learn(self, key):
        """After an attempt at micro-batch `key` that ran: what its update needed."""
        needs = []
        for device, start in self._update_starts.items():
            peak = memory.step_peak(device)
            if peak is not None:
                needs.append(max(0, peak - start))
        if needs and key not in self._needs:
            self._needs[key] = max(needs)
        self._update_starts = {}

    def need(self, key) -> int | None:
        """What the update at micro-batch `key` was measured to need, or None."""
        return self._needs.get(key)

    def forget(self):
        """Drops what was learned (the step is traced anew)."""
        self._needs = {}

    def update_began(self) -> bool:
        """Whether the last attempt got as far as its update (on any replica)."""
        parts = getattr(self._began, "values", None) or (self._began,)
        return any(int(part.numpy()) for part in parts)
