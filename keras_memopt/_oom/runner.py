"""The step runner: `model.<kind>_function` of an `AccumulatingModel`.

Keras's `fit`, `evaluate` and `predict` call `model.train_function(iterator)`
(and the test and predict ones) once per step. For an `AccumulatingModel`
that function is a `StepRunner`. It pulls the batch from the iterator itself
(so the first step is prepared from the batch it trains on, and a failed
attempt can run again on the same batch) and runs the model's step on it.

With an out-of-memory policy attached (`OOMBackoff`, or
`micro_batch_size="auto"`), `run` is one retry loop: attempt the step; on an
out-of-memory error put back what the attempt changed
(`keras_memopt._step.rollback`), ask the policy (which sets a smaller
micro-batch, or raises its report), and attempt the same batch again.
Under several workers all agree on each attempt, before its collective part
and after it
(`keras_memopt._oom.coordinator`). The micro-batch size is run-time state of
the step, so a retry traces nothing. An out-of-memory error is kept as its
text, its tracebacks dropped: nothing of a failed attempt outlives the retry.
"""

from __future__ import annotations

import dataclasses
import time

import tensorflow as tf

from keras_memopt import _keras, distribute, memory
from keras_memopt._memory.sizes import bytes_if_known, variables_bytes
from keras_memopt._oom import coordinator as _coordinator
from keras_memopt._oom import errors as _oom_errors
from keras_memopt._oom.auto_search import AutoSearch
from keras_memopt._oom.coordinator import StepStatus
from keras_memopt._oom.supervised import SizeFile
from keras_memopt._step import loop as _loop
from keras_memopt._step import rollback as _rollback
from keras_memopt._step import shares as _shares
from keras_memopt._step.steps import StepFunctions


class StepRunner:
    """`model.<kind>_function`: one step per batch, retried on out-of-memory.

    Args:
        model: the `AccumulatingModel`, read through its public members.
        functions: the `StepFunctions` to run.
        state: the model's `RunState` (its setting and update guard).
    """

    def __init__(self, model, functions: StepFunctions, state):
        self.model = model
        self.functions = functions
        self.state = state
        self.kind = functions.kind
        self._own = functions.own
        self._generation = state.generation
        self._one_worker = None
        self._several_workers = None
        self._prepared = False
        self._search = None  # micro_batch_size="auto", until its run of steps ends
        self._peaks = {}  # device -> the allocator's peak in the last attempt that ran
        self._size_file = SizeFile()
        # What a failed attempt must put back: the loop's state for the
        # model's own step (its update is guarded), everything for a custom one.
        kept = _rollback.loop_variables if self._own else _rollback.state_variables
        self._snapshot = _rollback.Snapshot(lambda: kept(model), model.distribute_strategy)

    def reset(self):
        """Forgets the traced step: the next step prepares and traces it again."""
        self._prepared = False
        self._one_worker = self._several_workers = None
        self.state.guard.forget()

    def __call__(self, iterator):
        # Traced for what the iterator yields (its batch axis unknown where the
        # data's is), as Keras's own step functions are: layers and losses see
        # the same static shapes as in plain Keras.
        spec = getattr(iterator, "element_spec", None)
        if self.kind == "predict" and not _keras.LEGACY:
            # Keras 3 pulls the predict data itself: a list of batches.
            return _joined([self.run(data) for data in iterator])
        predictions = []
        for index in range(_keras.steps_per_execution(self.model)):
            try:
                data = next(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                if index == 0:
                    raise
                break
            outputs = self.run(data, spec)
            if self.kind == "predict":  # every step's, as Keras's own function returns
                predictions.append(outputs)
        return _joined(predictions) if self.kind == "predict" else outputs

    def _in_use(self, data):
        return self.state.setting.in_use(_loop.static_batch_size(data))

    def run(self, data, spec=None):
        """Runs one step on `data`; backs off and retries on out-of-memory."""
        data = _keras.strip_optionals(data)
        model = self.model
        if self._generation != self.state.generation:  # a setting that needs a new trace
            self.reset()
            self._generation = self.state.generation
        if model.replica_shares is not None:
            data = _shares.split_by_shares(data, model.distribute_strategy, model.replica_shares)
            spec = None  # the parts' shapes are not the iterator's
        if not self._prepared:
            self._prepare(data)
        if model.micro_batch_size == "auto":
            self._search = AutoSearch(model, _loop.static_batch_size(data))
        search = self._search
        policy = search.policy if search is not None else model.oom_policy
        if policy is None:
            self.state.guard.disarm()
            self._size_file.write(self._in_use(data))
            return self._coordinator(retrying=False).run(data, spec)
        outputs = self._with_retries(data, spec, policy)
        size = self._in_use(data)
        if search is not None and search.stepped(_loop.static_batch_size(data), self._peaks):
            self._search = None
        if self.kind == "train":
            policy.trained(size)
        return outputs

    def _prepare(self, data):
        """What the first step needs, made from its own batch (no other is taken)."""
        self._prepared = True
        with _oom_errors.state_must_fit():
            self.functions.prepare(data)

    def _coordinator(self, retrying):
        """The step's functions: whole on one worker, or in three calls under several
        workers that retry together."""
        model = self.model
        several = retrying and distribute.multi_worker(model.distribute_strategy)
        if not several:
            if self._one_worker is None:
                step = self.functions.step
                self._one_worker = _coordinator.OneWorker(model, self.kind, step)
            coordinator = self._one_worker
        else:
            halves = self.functions.halves
            if halves is None:
                raise ValueError(
                    "Under MultiWorkerMirroredStrategy, OOMBackoff and "
                    'micro_batch_size="auto" need AccumulatingModel\'s own '
                    f"{self.kind} step, which it splits so that all workers can retry "
                    "together; a custom step cannot be split. Remove OOMBackoff, or "
                    f"train with the model's own step. Received: a custom {self.kind}_step "
                    f"of {type(model).__name__}"
                )
            if self._several_workers is None:
                self._several_workers = _coordinator.SeveralWorkers(model, self.kind, *halves)
            coordinator = self._several_workers
        return coordinator

    # -- the retry loop ------------------------------------------------------------------

    def _with_retries(self, data, spec, policy):
        """The step's outputs, after as many backoffs as `policy` allows."""
        coordinator = self._coordinator(retrying=True)
        while True:
            size = self._in_use(data)
            self._size_file.write(size)
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

        Under several workers they agree twice: after each one's own part
        (whether any ran out of memory; a worker whose policy would refuse
        stops them all, so that none retries alone) and after the
        collective part, whose failure on one worker puts every worker's
        step back (`_coordinator.SeveralWorkers.finish_agreed`).
        """
        model = self.model
        several = isinstance(coordinator, _coordinator.SeveralWorkers)
        attempt = _Attempt(size, _step_devices(model.distribute_strategy))
        taken = self._snapshot.take()
        host = None
        guard = self.state.guard
        if self._guarded() and not guard.prepare(size, attempt.devices, check_in_step=not several):
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
        """Under several workers: `(status, error, refusal)` to agree on.

        The update's memory is checked here (not in the step: the other
        workers would wait in its collective ops), and a worker out of
        memory whose policy would refuse says FAILED, with the report.
        """
        if status == StepStatus.OK and self._guarded():
            refused = self.state.guard.check()
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
        self._peaks = {
            device: max(
                (p for p in (guard.loop_peak(device), memory.step_peak(device)) if p is not None),
                default=None,
            )
            for device in attempt.devices
        }
        if self._guarded():
            guard.learn(attempt.size)

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
        """`(status, error, outputs, seconds)` of this worker's part of the step.

        An out-of-memory error comes back as its text (`_oom_errors.ErrorText`),
        its tracebacks dropped: their frames would keep the failed attempt's
        batch allocated. Another error is raised at once on one worker; under
        several, the others must learn of it first, and it comes back as it is.
        """
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
        return self.state.guard.refused() or phase is _oom_errors.Phase.UPDATE

    def _step_memory(self, size, device, in_use):
        """What the failed attempt at micro-batch `size` held on `device`, from `in_use` on."""
        model = self.model
        guard = self.state.guard
        # The loop's peak: read when the update began, in an attempt that
        # measured it (a new window started there); else the attempt's peak.
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


def _joined(predictions):
    """The predictions of several batches, one after another."""
    if len(predictions) == 1:
        return predictions[0]
    return tf.nest.map_structure(lambda *t: tf.concat(t, axis=0), *predictions)


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
