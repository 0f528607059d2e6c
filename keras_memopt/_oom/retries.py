"""Retrying a step that ran out of memory: attempt; put back what it changed (`_step.rollback`),
ask the policy, attempt the same batch again (nothing retraced). An error is kept as its text, its
tracebacks dropped: nothing of a failed attempt outlives the retry. Several workers agree on each
attempt (`_oom.coordinator`)."""

from __future__ import annotations

import dataclasses
import time

import tensorflow as tf

from keras_memopt import _keras, memory
from keras_memopt._memory.sizes import bytes_if_known, variables_bytes
from keras_memopt._oom import coordinator as _coordinator
from keras_memopt._oom import errors as _oom_errors
from keras_memopt._oom.coordinator import StepStatus
from keras_memopt._step import rollback as _rollback


class Retries:
    """Attempts of one `kind` of step, each put back where it ran out of memory; `own`: the model's
    own step (its update guarded, the loop's state all a failed attempt changes before it)."""

    def __init__(self, model, kind, own, state):
        self.model = model
        self.kind = kind
        self.state = state
        self._own = own
        self.peaks = {}  # device -> the allocator's peak in the last attempt that ran
        # A failed attempt puts back the loop's state (own step, update guarded), else everything.
        kept = _rollback.loop_variables if own else _rollback.state_variables
        self._snapshot = _rollback.Snapshot(lambda: kept(model), model.distribute_strategy)

    def run(self, coordinator, data, spec, policy, in_use):
        """The step's outputs, after as many backoffs as `policy` allows; `in_use(data)` is
        the next attempt's micro-batch size."""
        while True:
            size = in_use(data)
            outputs, failure = self._attempt(coordinator, data, spec, size, policy)
            if failure is None:
                return outputs
            policy.back_off(self.model, failure)  # raises when it cannot

    def _guarded(self):
        """Whether the update of this step runs behind the `UpdateGuard`."""
        model = self.model
        return (
            self.kind == "train"
            and self._own
            and bool(model.trainable_variables)
            and model.devices is None
        )

    def _attempt(self, coordinator, data, spec, size, policy):
        """One attempt: `(outputs, None)`, or `(None, OutOfMemory)` with the state put back.
        Several workers agree after their own parts and after the collective one."""
        model = self.model
        several = isinstance(coordinator, _coordinator.SeveralWorkers)
        attempt = _Attempt(size, _step_devices(model.distribute_strategy))
        taken = self._snapshot.take()
        host = None
        guard = self.state.guard
        if self._guarded() and not guard.arm(size, attempt.devices, check_in_step=not several):
            host = _rollback.HostCopy(_rollback.update_variables(model), model.distribute_strategy)
        attempt.in_use = [memory.reset_step_peak(device) for device in attempt.devices][0]
        status, error, outputs, attempt.seconds = self._run_once(coordinator, data, spec)
        refusal = None
        if several:
            status, error, refusal = self._before_agreeing(status, error, attempt, policy)
        status = coordinator.agree(status)
        collective = status == StepStatus.OK
        if collective:
            outputs, status, error = coordinator.finish_agreed(outputs)
            if status == StepStatus.OK:
                self._ran(attempt)
                return outputs, None
        recovery = time.perf_counter()
        phase = _oom_errors.Phase.UPDATE if collective else self._phase_of(error)
        self._put_back(phase, error, size, host, taken, stopping=status == StepStatus.FAILED)
        partial = collective and host is None  # an update ran that nothing can put back
        del taken, host
        if status == StepStatus.FAILED:
            _stop(error, refusal, partial)
        if error is None:
            error = _oom_errors.ErrorText(
                "ResourceExhaustedError", "OOM on another worker: every worker retries the step."
            )
        return None, self._failure(error, phase, attempt, time.perf_counter() - recovery)

    def _before_agreeing(self, status, error, attempt, policy):
        """Under several workers: `(status, error, refusal)` to agree on, the update's memory
        checked here, a worker whose policy would refuse saying FAILED."""
        if status == StepStatus.OK and self._guarded():
            refused = self.state.guard.refusal_now()
            if refused is not None:
                status = StepStatus.OUT_OF_MEMORY
                error = _oom_errors.ErrorText("ResourceExhaustedError", refused)
        if status != StepStatus.OUT_OF_MEMORY:
            return status, error, None
        refusal = policy.refusal(self._failure(error, self._phase_of(error), attempt, 0.0))
        return (StepStatus.FAILED if refusal else status), error, refusal

    def _ran(self, attempt):
        """After an attempt that ran: its peaks (the loop's and the update's, where
        the guard measured the update in a window of its own); what the update needed."""
        guard = self.state.guard
        self.peaks = {
            device: max(
                (p for p in (guard.loop_peak(device), memory.step_peak(device)) if p is not None),
                default=None,
            )
            for device in attempt.devices
        }
        if self._guarded():
            guard.record_need(attempt.size)

    def _put_back(self, phase, error, size, host, taken, stopping=False):
        """Puts back what the failed attempt changed, or raises where its update may be partial."""
        if phase is _oom_errors.Phase.UPDATE and not self._update_refused(error):
            if host is not None:
                host.restore()
            elif not stopping:
                raise tf.errors.ResourceExhaustedError(
                    None, None, _oom_errors.report(error, phase, micro_batch_size=size, note=(
                        "The update ran out of memory although what it was measured to "
                        "need was free: the weights and optimizer variables may be partly "
                        "updated; restore them from a checkpoint."
                    ))
                )
        self._snapshot.restore(taken)

    def _failure(self, error, phase, attempt, recovery_seconds):
        return _oom_errors.OutOfMemory(
            kind=self.kind,
            phase=phase,
            error=error,
            micro_batch_size=attempt.size,
            memory_in_use=attempt.in_use,
            memory=self._step_memory(attempt.size, attempt.devices[0], attempt.in_use),
            failed_step_seconds=attempt.seconds,
            recovery_seconds=recovery_seconds,
        )

    @staticmethod
    def _run_once(coordinator, data, spec):
        """`(status, error, outputs, seconds)` of this worker's part of the step. An out-of-memory
        error comes back as its text (its frames would keep the batch allocated); another is
        raised, or under several workers comes back as it is."""
        started = time.perf_counter()
        try:
            outputs = coordinator.run(data, spec)
        except tf.errors.OpError as error:
            oom = _oom_errors.is_oom(error)
            if not oom and not isinstance(coordinator, _coordinator.SeveralWorkers):
                raise
            if not oom:
                return StepStatus.FAILED, error, None, time.perf_counter() - started
            _oom_errors.drop_tracebacks(error)
            text = _oom_errors.ErrorText.of(error)
            return StepStatus.OUT_OF_MEMORY, text, None, time.perf_counter() - started
        return StepStatus.OK, None, outputs, time.perf_counter() - started

    def _phase_of(self, error):
        """Where in the step `error` happened (None: on another worker)."""
        if self.kind != "train":
            return _oom_errors.Phase.EVALUATION
        if error is not None and self._update_refused(error):
            return _oom_errors.Phase.UPDATE
        if self._guarded() and self.state.guard.update_began():
            return _oom_errors.Phase.UPDATE
        op = _oom_errors.parse_oom(str(error))["op"] if error is not None else None
        return _oom_errors.scoped_phase(op) or _oom_errors.Phase.MICRO_BATCH

    def _update_refused(self, error) -> bool:
        """Whether the update's check or reservation failed: nothing of it ran."""
        op = _oom_errors.parse_oom(str(error))["op"]
        phase = _oom_errors.scoped_phase(op)
        return self.state.guard.stopped_at_check() or phase is _oom_errors.Phase.UPDATE

    def _step_memory(self, size, device, in_use):
        """What the failed attempt at micro-batch `size` held on `device`, from `in_use` on."""
        model = self.model
        guard = self.state.guard
        # The loop's peak: read when the update began, where measured (a new window started there).
        peak = guard.loop_peak(device) or memory.step_peak(device)
        optimizer = getattr(model, "optimizer", None)
        slots = _keras.optimizer_variables(optimizer) if optimizer else []
        gradients = [bytes_if_known(v.shape, "float32") for v in model.trainable_variables]
        return _oom_errors.StepMemory(
            weights=variables_bytes(model.variables),
            optimizer_state=variables_bytes(slots),
            gradient_sum=sum(gradients),
            largest_gradient=max(gradients, default=0),
            update=guard.need(size),
            step_peak=None if peak is None or in_use is None else peak - in_use,
            micro_batch_size=size,
            device_total=memory.device_total(device),
        )


@dataclasses.dataclass
class _Attempt:
    """What one attempt at a step ran with, for its report."""

    size: int | tuple | None
    devices: list
    in_use: int | None = None
    seconds: float = 0.0


def _stop(error, refusal, partial):
    """Raises what stops every worker: this one's report or error, or word of another's."""
    if refusal is not None:
        raise tf.errors.ResourceExhaustedError(None, None, refusal)
    if isinstance(error, BaseException):  # this worker's own, not out of memory
        raise error
    kept = (
        "with its weights and optimizer variables as its update left them (they may "
        "differ between workers): restore them from a checkpoint"
        if partial else "with the model as it was before the step"
    )
    raise tf.errors.AbortedError(
        None, None,
        "Another worker's step failed (not with an out-of-memory error this worker "
        f"could retry); every worker stops here, {kept}.",
    )


def _step_devices(strategy) -> list[str]:
    """The devices a step of `strategy` runs on (this worker's), as memory readers name them."""
    if not tf.distribute.has_strategy() and strategy is tf.distribute.get_strategy():
        return [memory.default_device()]  # Keras places a model without a strategy there
    devices = [memory.canonical_device(name) for name in strategy.extended.worker_devices]
    return list(dict.fromkeys(devices))
