"""The update's guard: an update starts only where it is known to fit.

The first step at each micro-batch size measures, with the allocator, what the
update allocates above its start (the step runner keeps the weights and
optimizer variables in host memory meanwhile, to put back after a failed
update). Every later update first checks that the device has that much free
(its total less the allocator's bytes in use); where it has not, the step
stops there with an out-of-memory error, before anything of the update has
run. Where the device's total is not known, the update instead allocates and
frees as many bytes as it needs before it starts. Checking is preferred: the
BFC allocator may hand a reservation a chunk of up to twice its size, which
then counts in the step's peak (docs/oom-backoff.md).

The step's update waits for `UpdateGuard.begin` (`keras_memopt._step.update`);
the step runner (`keras_memopt._oom.runner`) arms, disarms and reads it.
"""

from __future__ import annotations

import math

import tensorflow as tf

from keras_memopt import memory
from keras_memopt._step.scopes import UPDATE_RESERVATION_OP

_KIB = 1024


class UpdateGuard:
    """Lets a step's update start only where it fits, and says whether it began.

    Created with the model (under its distribution strategy); the step calls
    `begin` between the loop and the update, the step runner `arm` before
    an attempt, `record_need` after one that ran, and `disarm` where no policy is
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

    def begin(self, waits) -> tf.Operation:
        """The op the update's ops wait for: `waits` (`_step.update.after_the_loop`),
        the update marked as begun, and its memory checked, reserved or measured."""
        context = tf.distribute.get_replica_context()
        replica = 0 if context is None else context.replica_id_in_sync_group
        with tf.control_dependencies(waits):
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

    def refusal_now(self) -> str | None:
        """The check the update makes at its start, made now, on the host.

        For an update that runs after the workers agreed that the step goes
        on (`keras_memopt._oom.coordinator.SeveralWorkers`): an error inside it
        would leave the other workers waiting in its collective ops, so
        `arm(..., check_in_step=False)` leaves it out of the step and
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

    def arm(self, key, devices, check_in_step: bool = True) -> bool:
        """Before an attempt at micro-batch `key`: arms the check of its update.

        With `check_in_step=False` the step itself does not check (the
        runner calls `refusal_now` instead; it still measures or reserves).
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

    def record_need(self, key):
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

    def stopped_at_check(self) -> bool:
        """Whether the last attempt stopped at the check, before its update began."""
        return self._refused

    def forget_needs(self):
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
