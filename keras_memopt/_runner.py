"""The step runner: `model.<kind>_function` of an `AccumulatingModel`.

Keras's `fit`, `evaluate` and `predict` call `model.train_function(iterator)`
(and the test and predict ones) once per step. For an `AccumulatingModel`
that function is a `StepRunner`: it pulls the batch from the iterator itself,
runs one step on it, and, when an out-of-memory policy is attached
(`OOMBackoff`, or `micro_batch_size="auto"`), takes a snapshot of the state
first and, on an out-of-memory error, puts it back, sets the micro-batch
size the policy says, and runs the *same* batch again. The iterator never
advances for a failed attempt, so no sample is lost or seen twice.

The micro-batch size is run-time state that the step reads, so a new size
needs no new trace: the retry runs the same step function.
"""

from __future__ import annotations

import time

import tensorflow as tf

from keras_memopt import _keras as K
from keras_memopt import _oom, distribute, supervise


def batch_size_of(data):
    """The number of samples per replica in a batch of data, if known here."""
    for leaf in tf.nest.flatten(data, expand_composites=False):
        if isinstance(leaf, tf.distribute.DistributedValues):
            leaf = leaf.values[0]
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape) and shape[0] is not None:
            return int(shape[0])
    return None


def _spec_key(value):
    if value is None:
        return None
    if isinstance(value, tf.TypeSpec):
        return value
    return tf.type_spec_from_value(value)


class StepRunner:
    """`model.<kind>_function`: one step per batch, retried on out-of-memory.

    Args:
        model: the `AccumulatingModel`.
        kind: "train", "test" or "predict".
        step: the step to run on one replica's batch. Defaults to the model's
            `<kind>_step`.
        halves: `(local, finish)`, the step in two halves, the first without
            collective ops (see `distribute.Agreement`), or None: what lets
            several workers retry an out-of-memory error together.
        first_batch: called with the first batch before its step (once per
            runner), or None.
        chose: called with the `micro_batch_size="auto"` search's report.
    """

    def __init__(self, model, kind, step=None, halves=None, first_batch=None, chose=None):
        self.model = model
        self.kind = kind
        self._replica_step = step
        self._halves = halves
        self._agreement = None
        self._first_batch = first_batch
        self._chose = chose
        self._one_step = None
        self._concrete = {}
        self._snapshot = _oom.Snapshot(model)
        self._reporter = supervise.Reporter()

    def reset(self):
        """Forgets the traced step: the next step traces it again."""
        self._one_step = None
        self._concrete = {}
        self._agreement = None

    def __call__(self, arg):
        # Traced for what the iterator yields (its batch axis unknown where the
        # data's is), as Keras's own step functions are: layers and losses see
        # the same static shapes as in plain Keras.
        spec = getattr(arg, "element_spec", None)
        if self.kind == "predict" and not K.LEGACY:
            # Keras 3 pulls the predict data itself: a list of batches.
            outputs = [self.run(data) for data in arg]
            if len(outputs) == 1:
                return outputs[0]
            return tf.nest.map_structure(lambda *t: tf.concat(t, axis=0), *outputs)
        outputs = None
        for index in range(K.steps_per_execution(self.model)):
            try:
                data = next(arg)
            except (StopIteration, tf.errors.OutOfRangeError):
                if index == 0:
                    raise
                break
            outputs = self.run(data, spec)
        return outputs

    def _step(self, data, spec=None):
        """The step function for `data` (traced for `spec` when given)."""
        if self._one_step is None:
            self._one_step = distribute.one_step_function(
                self.model, self.kind, self._replica_step
            )
        if not hasattr(self._one_step, "get_concrete_function"):
            return self._one_step  # run eagerly
        spec = K.strip_optionals(spec) if spec is not None else data
        key = repr(tf.nest.map_structure(_spec_key, spec))
        if key not in self._concrete:
            # Tracing creates the variables Keras makes lazily (optimizer
            # slots, metrics) before a snapshot is taken.
            self._concrete[key] = self._one_step.get_concrete_function(spec)
        return self._concrete[key]

    def _in_use(self, data):
        return self.model.micro_batch_size_for(batch_size_of(data))

    def run(self, data, spec=None):
        """Runs one step on `data`; backs off and retries on out-of-memory."""
        data = K.strip_optionals(data)
        model = self.model
        if model.replica_shares is not None:
            data = distribute.split_by_shares(data, model.distribute_strategy, model.replica_shares)
            spec = None  # the parts' shapes are not the iterator's
        if self._first_batch is not None:
            first, self._first_batch = self._first_batch, None
            with _oom.state_must_fit():
                first(data)
        policy = model.oom_policy
        search = None
        if model.micro_batch_size == "auto":
            search = _oom.AutoSearch(model, batch_size_of(data))
            model.micro_batch_size = search.initial
            policy = policy or _oom.BackoffPolicy()
        if policy is None:
            self._reporter.report(self._in_use(data))
            return self._step(data, spec)(data)
        if distribute.multi_worker(model.distribute_strategy):
            outputs = self._agreeing(data, spec, policy, search)
        else:
            outputs = self._retrying(data, spec, policy, search)
        if search is not None and self._chose is not None:
            self._chose(search.report(self._in_use(data)))
        if self.kind == "train" and isinstance(outputs, dict):
            # Into the step's logs, so that every callback sees it, whatever
            # its place in the list.
            size = self._in_use(data)
            size = max(size) if isinstance(size, tuple) else size  # the largest replica's
            outputs = {**outputs, "micro_batch_size": size}
        return outputs

    def _retrying(self, data, spec, policy, search):
        """The step's outputs, after as many backoffs as `policy` allows."""
        while True:
            current = self._in_use(data)
            self._reporter.report(current)
            step = self._step(data, spec)
            taken = self._snapshot.take()
            started = time.perf_counter()
            try:
                return step(data)
            except tf.errors.OpError as error:
                if not _oom.is_oom(error):
                    raise
                failed = error
            failed_seconds = time.perf_counter() - started
            recovery = time.perf_counter()
            self._snapshot.restore(taken)
            del taken
            self._back_off(current, failed, failed_seconds, recovery, policy, search)
            del failed

    def _back_off(self, current, failed, failed_seconds, recovery, policy, search):
        """After a rolled-back step: the next micro-batch size, and the backoff's record."""
        if search is not None:
            search.failed(current, failed_seconds)
        self.model.micro_batch_size = policy.next_size(current, failed)
        policy.record(
            dict(
                kind=self.kind,
                allocation=_oom.allocation_note(failed),
                failed_micro_batch_size=current,
                micro_batch_size=self.model.micro_batch_size,
                failed_step_seconds=failed_seconds,
                recovery_seconds=time.perf_counter() - recovery,
            )
        )

    def _agreeing(self, data, spec, policy, search):
        """`_retrying` across workers: every worker retries when any runs out of memory."""
        if self._halves is None:
            raise ValueError(
                "Under MultiWorkerMirroredStrategy, OOMBackoff and "
                'micro_batch_size="auto" need AccumulatingModel\'s own '
                f"{self.kind} step, which it splits so that all workers can retry "
                "together; a custom step cannot be split. Remove OOMBackoff, or "
                f"train with the model's own step. Received: a custom {self.kind}_step "
                f"of {type(self.model).__name__}"
            )
        if self._agreement is None:
            self._agreement = distribute.Agreement(self.model, self.kind, *self._halves)
            if hasattr(self._agreement.local, "get_concrete_function"):
                self._agreement.local.get_concrete_function(spec or data)
        agreement = self._agreement
        while True:
            current = self._in_use(data)
            self._reporter.report(current)
            taken = self._snapshot.take()
            started = time.perf_counter()
            status, failed = distribute.OK, None
            try:
                outputs = agreement.local(data)
            except tf.errors.OpError as error:
                failed = error
                status = distribute.OUT_OF_MEMORY if _oom.is_oom(error) else distribute.FAILED
            failed_seconds = time.perf_counter() - started
            total = float(agreement.agree(tf.constant(status, tf.float32)))
            if total == distribute.OK:
                return agreement.finish(outputs)
            recovery = time.perf_counter()
            self._snapshot.restore(taken)
            del taken
            if total >= distribute.FAILED:
                if status == distribute.FAILED:
                    raise failed
                raise tf.errors.AbortedError(
                    None, None,
                    "Another worker's step failed (not with an out-of-memory error "
                    "this worker could retry); every worker stops here, with the "
                    "model as it was before the step.",
                )
            if failed is None:
                failed = tf.errors.ResourceExhaustedError(
                    None, None, "OOM on another worker: every worker retries the step."
                )
            self._back_off(current, failed, failed_seconds, recovery, policy, search)
            del failed
