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
  the update holds the temporaries of one variable at a time.
- **Known to fit before it starts** (`UpdateGuard`): the first step at each
  micro-batch size measures, with the allocator, what the update allocates
  above its start (the step runner keeps the weights and optimizer variables
  in host memory meanwhile, to put back after a failed update). Every later
  update first checks that the device has that much free (its total less
  the allocator's bytes in use); where it has not, the step stops there with
  an out-of-memory error, before anything of the update has run. Where the
  device's total is not known, the update instead allocates and frees as
  many bytes as it needs before it starts. Checking is preferred: the BFC
  allocator may hand a reservation a chunk of up to twice its size, which
  then counts in the step's peak (docs/oom-backoff.md).
"""

from __future__ import annotations

import contextlib
import math

import tensorflow as tf

from keras_memopt import _keras, memory
from keras_memopt._step import loop as _loop
from keras_memopt._step.scopes import UPDATE_RESERVATION_OP

_KIB = 1024


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


class UpdateGuard:
    """Lets a step's update start only where it fits, and says whether it began.

    Created with the model (under its distribution strategy); the step calls
    `begin` between the loop and the update, the step runner `prepare` before
    an attempt, `learn` after one that ran, and `disarm` where no policy is
    attached (the update then runs unguarded, as in plain Keras).

    At the update's start a `tf.py_function` (`_update_begins`) either
    measures (the first attempt at a micro-batch size: it reads the loop's
    peak and starts a new peak window of the allocator, whose peak is then
    the update's) or checks that the update's measured need is free. Where
    the device's total is not known it does neither, and the step reserves
    the need instead (`update_reservation`).
    """

    # What is added to the update's measured need before it is checked or
    # reserved: the update's ops run in one order (chained), so its memory
    # varies little between steps.
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
            self._watching = tf.Variable(False, trainable=False, name="update_watching")
        self._armed = False
        self._measuring = False
        self._needs = {}  # micro-batch size -> what the update allocated above its start
        self._need = None  # the attempt's, with the margin
        self._devices, self._totals = [], {}  # per replica; device -> bytes it can hand out
        self._loop_peaks = {}  # device -> the allocator's peak when the update began
        self._update_starts = {}  # device -> bytes in use when the update began
        self._refused = False

    # -- in the traced step ------------------------------------------------------------

    def begin(self, gradients, overwrites=False) -> tf.Operation:
        """The op the update's ops wait for: every gradient summed (on every
        replica, where the optimizer `overwrites` a variable with its "gradient",
        which Keras assigns in each replica's context: `_loop.every_replica`), the
        update marked as begun, and its memory checked, reserved or measured."""
        summed = [
            t for t in tf.nest.flatten(gradients, expand_composites=True) if t is not None
        ]
        context = tf.distribute.get_replica_context()
        replica = 0 if context is None else context.replica_id_in_sync_group
        waits = _loop.every_replica(summed) if overwrites else []
        with tf.control_dependencies(summed + waits):
            marked = self._began.assign(1, read_value=False)
            shape = tf.stack([self._reserve_kib.read_value(), _KIB])
            block = tf.raw_ops.Empty(shape=shape, dtype=tf.uint8, name=UPDATE_RESERVATION_OP)
            touched = tf.reduce_max(block[:1, :1])  # used, so that the graph keeps it
            watched = tf.cond(
                self._watching.read_value(),
                lambda: tf.py_function(
                    self._update_begins, [replica], tf.int64, name=UPDATE_RESERVATION_OP
                ),
                lambda: tf.constant(0, tf.int64),
            )
        return tf.group(marked, touched, watched)

    def _update_begins(self, replica):
        device = self._devices[min(int(replica), len(self._devices) - 1)]
        if self._measuring:
            self._loop_peaks[device] = memory.step_peak(device)
            self._update_starts[device] = memory.reset_step_peak(device) or 0
            return 0
        refusal = self._refusal(device)
        if refusal is not None:
            raise tf.errors.ResourceExhaustedError(None, None, refusal)
        return 0

    def _refusal(self, device) -> str | None:
        """The out-of-memory message where the update's need is not free on `device`."""
        info = memory.allocator_memory(device)
        total = self._totals.get(device)
        if info is None or total is None or self._need is None:
            return None
        if info["current"] + self._need <= total:
            return None
        self._refused = True
        return (
            f"OOM when allocating {self._need} bytes for the optimizer update on "
            f"device:{device} (free: {total - info['current']}) [[{{{{node update_reservation}}}}]]"
        )

    def check(self) -> str | None:
        """The check the update makes at its start, made now, on the host.

        For an update that runs after the workers agreed that the step goes
        on (`keras_memopt._oom.coordinator.SeveralWorkers`): an error inside it
        would leave the other workers waiting in its collective ops, so
        `prepare(..., check_in_step=False)` leaves it out of the step and
        the runner calls this before they agree. Returns the out-of-memory
        message where the measured need is not free on a device, else None.
        """
        if self._measuring:
            return None
        for device in self._devices:
            refusal = self._refusal(device)
            if refusal is not None:
                return refusal
        return None

    # -- in the step runner ------------------------------------------------------------

    def prepare(self, key, devices, check_in_step: bool = True) -> bool:
        """Before an attempt at micro-batch `key`: arms the check of its update.

        With `check_in_step=False` the step itself does not check (the
        runner calls `check` instead; it still measures or reserves).
        Returns whether the guard knows what the update needs; when it does
        not, this attempt measures it, and the runner must keep the update's
        variables elsewhere meanwhile (`HostCopy`).
        """
        self._armed = True
        self._began.assign(0)
        if self._devices != list(devices):
            self._devices = list(devices)
            self._totals = {device: memory.device_total(device) for device in devices}
        self._loop_peaks, self._update_starts, self._refused = {}, {}, False
        need = self._needs.get(key)
        self._measuring = need is None
        self._need = None if need is None else math.ceil(need * self._MARGIN + self._MARGIN_BYTES)
        known = all(total is not None for total in self._totals.values())
        reserve = self._need if self._need is not None and not known else 0
        self._reserve_kib.assign(math.ceil(reserve / _KIB))
        self._watching.assign(self._measuring or (known and check_in_step))
        return need is not None

    def disarm(self):
        """Checks, reserves and measures nothing from the next step on (no policy attached)."""
        if self._armed:
            self._armed = False
            self._watching.assign(False)
            self._reserve_kib.assign(0)

    def learn(self, key):
        """After an attempt at micro-batch `key` that ran: what its update needed, once measured."""
        needs = []
        for device, update_start in self._update_starts.items():
            update_peak = memory.step_peak(device)
            if update_peak is not None:
                needs.append(max(0, update_peak - update_start))
        self._loop_peaks, self._update_starts = {}, {}
        if needs and key not in self._needs:
            self._needs[key] = max(needs)

    def need(self, key) -> int | None:
        """What the update at micro-batch `key` allocated above its start, as measured."""
        return self._needs.get(key)

    def loop_peak(self, device) -> int | None:
        """The allocator's peak on `device` when the last attempt's update began, if measured."""
        return self._loop_peaks.get(device)

    def refused(self) -> bool:
        """Whether the last attempt stopped at the check, before its update began."""
        return self._refused

    def forget(self):
        """Drops what was learned (the step is traced anew)."""
        self._needs = {}

    def update_began(self) -> bool:
        """Whether the last attempt's update may have run: every replica got as far as it.

        One replica's mark alone says nothing: the update waits for the sum of
        every replica's gradients, so a replica that ran out of memory in its
        micro-batches stopped the update before anything of it was applied.
        """
        parts = getattr(self._began, "values", None) or (self._began,)
        return all(int(part.numpy()) for part in parts)
