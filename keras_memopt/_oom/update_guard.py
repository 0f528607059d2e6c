"""The update's guard: an update starts only where it is known to fit. The first attempt at each
micro-batch size measures what the update allocates (its variables kept in host memory meanwhile);
later updates first check that much is free (else stop before any of it ran), or, where the device's
total is not known, reserve it. Why: docs/oom-backoff.md. The update waits for `begin`; the runner
arms, disarms and reads."""

from __future__ import annotations

import math

import tensorflow as tf

from keras_memopt import memory
from keras_memopt._step.scopes import UPDATE_RESERVATION_OP

_KIB = 1024


class UpdateGuard:
    """Lets a step's update start only where it fits, and says whether it began. At the update's
    start a `tf.py_function` (`_update_begins`) either measures (a new peak window, whose peak is
    then the update's) or checks that the measured need is free. Without a policy attached
    (`disarm`) the update runs unguarded, as in plain Keras."""

    # What is added to the update's measured need before it is checked or reserved: the update's ops
    # run in one order (chained), so its memory varies little between steps.
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
        """The update's check made now, on the host: the out-of-memory message or None. For
        several workers (`arm(check_in_step=False)`), checked before they agree, since an
        error inside the update would leave the others waiting in its collective ops."""
        if self._measuring:
            return None
        for device in self._devices:
            refusal = self._refusal(device)
            if refusal is not None:
                return refusal
        return None

    # -- in the step runner ------------------------------------------------------------

    def arm(self, key, devices, check_in_step: bool = True) -> bool:
        """Before an attempt at micro-batch `key`: arms the update's check (not in the step
        with `check_in_step=False`). Returns whether the need is known; where not, this
        attempt measures it and the runner keeps the update's variables (`HostCopy`)."""
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
        """Whether the last attempt's update may have run: every replica got as far as it
        (the update waits for every replica's gradients)."""
        parts = getattr(self._began, "values", None) or (self._began,)
        return all(int(part.numpy()) for part in parts)
