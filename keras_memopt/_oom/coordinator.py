"""A step's functions on one worker, or in three calls on several that must retry together: `run`
(what may fail on this worker alone), `agree` (every worker's status), `finish` (the collective
rest). A worker that retried alone would wait in collective ops the others never join (measured:
every worker hangs). See docs/distributed.md."""

from __future__ import annotations

import enum

import tensorflow as tf

from keras_memopt import _keras, distribute
from keras_memopt._oom import errors as _oom_errors


class StepStatus(enum.IntEnum):
    """How an attempt ended on one worker; across workers, the largest wins."""

    OK = 0
    OUT_OF_MEMORY = 1
    FAILED = 2


def _spec_key(value):
    if value is None:
        return None
    if isinstance(value, tf.TypeSpec):
        return value
    return tf.type_spec_from_value(value)


class _Traced:
    """A step function, traced once per input signature before it runs, so that the variables
    Keras makes lazily exist before the runner snapshots the state."""

    def __init__(self, function):
        self.function = function
        self._concrete = {}

    def __call__(self, data, spec=None):
        if not hasattr(self.function, "get_concrete_function"):
            return self.function(data)  # run eagerly
        spec = _keras.strip_optionals(spec) if spec is not None else data
        key = repr(tf.nest.map_structure(_spec_key, spec))
        if key not in self._concrete:
            self._concrete[key] = self.function.get_concrete_function(spec)
        return self._concrete[key](data)


class OneWorker:
    """A step on one worker: one function, nothing to agree on."""

    def __init__(self, model, kind, step):
        self.run = _Traced(distribute.step_function(model, kind, step))

    def agree(self, status: StepStatus) -> StepStatus:
        return status

    def finish_agreed(self, outputs):
        """`(outputs, StepStatus.OK, None)`: the whole step ran in `run`."""
        return outputs, StepStatus.OK, None


class SeveralWorkers:
    """A step under several workers in three calls, so that all retry an out-of-memory error.
    `run(data)` has no collective op; `agree(status)` all-reduces every worker's `StepStatus`;
    `finish(outputs)` is the collective part. Functions with collective ops are traced in the same
    order on every worker (their ops are matched by keys handed out when traced): `agree` first,
    then `finish`; `run` may be traced again on one worker alone."""

    def __init__(self, model, kind, local, finish):
        strategy = model.distribute_strategy
        reduction = distribute.reduction_of(model, kind)
        finish = distribute.counted(
            model, kind, distribute.on_replica_device(finish or (lambda outputs: outputs))
        )
        self.run = _Traced(
            distribute.compiled(model, lambda data: strategy.run(local, args=(data,)))
        )
        self.finish = distribute.compiled(
            model,
            lambda outputs: distribute.reduce_per_replica(
                strategy.run(finish, args=(outputs,)), strategy, reduction
            ),
        )
        # Waits for the slowest worker's local pass, a real out-of-memory error
        # (about 10 s on a CPU) included: no timeout, whatever the strategy's.
        options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=0.0)

        @tf.function(input_signature=[tf.TensorSpec([], tf.int32)])
        def count(status):
            """How many replicas ended with each status."""

            def replica(value):
                context = tf.distribute.get_replica_context()
                one_hot = tf.one_hot(value, len(StepStatus))
                return context.all_reduce("SUM", one_hot, options=options)

            return strategy.experimental_local_results(strategy.run(replica, args=(status,)))[0]

        self._count = count

    def agree(self, status: StepStatus) -> StepStatus:
        counts = self._count(tf.constant(int(status), tf.int32)).numpy()
        return max(s for s in StepStatus if s == StepStatus.OK or counts[s] > 0)

    def finish_agreed(self, outputs):
        """`(outputs, status, error)`: the collective part, then every worker's status after it.
        `status` is the agreed one; `error` this worker's (an out-of-memory error's text, another as
        raised, or None)."""
        try:
            outputs = self.finish(outputs)
        except tf.errors.OpError as error:
            if _oom_errors.is_oom(error):
                _oom_errors.drop_tracebacks(error)
                failure, status = _oom_errors.ErrorText.of(error), StepStatus.OUT_OF_MEMORY
            else:
                failure, status = error, StepStatus.FAILED
            return None, self.agree(status), failure
        return outputs, self.agree(StepStatus.OK), None
