"""The step runner: `model.<kind>_function` of an `AccumulatingModel`.

A `StepRunner` pulls the batch from the iterator itself (so that a failed attempt can run again on
the same batch) and runs the step on it, through the retry loop (`_oom.retries`) where an
out-of-memory policy is attached."""

from __future__ import annotations

import tensorflow as tf

from keras_memopt import _keras, distribute
from keras_memopt._oom import coordinator as _coordinator
from keras_memopt._oom import errors as _oom_errors
from keras_memopt._oom.auto_search import AutoSearch
from keras_memopt._oom.retries import Retries
from keras_memopt._oom.supervised import SizeFile
from keras_memopt._step import loop as _loop
from keras_memopt._step import shares as _shares
from keras_memopt._step.steps import StepFunctions


class StepRunner:
    """`model.<kind>_function`: one step per batch of the `StepFunctions`, retried on OOM."""

    def __init__(self, model, functions: StepFunctions, state):
        self.model = model
        self.functions = functions
        self.state = state
        self.kind = functions.kind
        self._own = functions.builtin
        self._generation = state.generation
        self._one_worker = None
        self._several_workers = None
        self._prepared = False
        self._search = None  # micro_batch_size="auto", until its run of steps ends
        self._size_file = SizeFile()
        self._retries = Retries(model, self.kind, self._own, state)

    def reset(self):
        """Forgets the traced step: the next step prepares and traces it again."""
        self._prepared = False
        self._one_worker = self._several_workers = None
        self.state.guard.forget_needs()

    def __call__(self, iterator):
        # Traced for what the iterator yields (batch axis unknown where the data's is), as Keras's
        # own step functions are: layers and losses see the same static shapes as in plain Keras.
        spec = getattr(iterator, "element_spec", None)
        if self.kind == "predict" and _keras.PREDICT_HANDS_A_LIST:
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
        """The micro-batch size the next attempt on `data` uses, written for a supervisor."""
        size = self.state.setting.in_use(_loop.static_batch_size(data))
        self._size_file.write(size)
        return size

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
            self._in_use(data)
            return self._coordinator(retrying=False).run(data, spec)
        coordinator = self._coordinator(retrying=True)
        outputs = self._retries.run(coordinator, data, spec, policy, self._in_use)
        size = self._in_use(data)
        peaks = self._retries.peaks
        if search is not None and search.stepped(_loop.static_batch_size(data), peaks):
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
        """The step's functions: whole on one worker, in three calls under several workers."""
        model = self.model
        several = retrying and distribute.multi_worker(model.distribute_strategy)
        if not several:
            if self._one_worker is None:
                step = self.functions.step
                self._one_worker = _coordinator.OneWorker(model, self.kind, step)
            coordinator = self._one_worker
        else:
            parts = self.functions.parts
            if parts is None:
                raise ValueError(
                    "Under MultiWorkerMirroredStrategy, OOMBackoff and "
                    'micro_batch_size="auto" need AccumulatingModel\'s own '
                    f"{self.kind} step, which it splits so that all workers can retry "
                    "together; a custom step cannot be split. Remove OOMBackoff, or "
                    f"train with the model's own step. Received: a custom {self.kind}_step "
                    f"of {type(model).__name__}"
                )
            if self._several_workers is None:
                self._several_workers = _coordinator.SeveralWorkers(model, self.kind, *parts)
            coordinator = self._several_workers
        return coordinator


def _joined(predictions):
    """The predictions of several batches, one after another."""
    if len(predictions) == 1:
        return predictions[0]
    return tf.nest.map_structure(lambda *t: tf.concat(t, axis=0), *predictions)
