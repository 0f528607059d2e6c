"""The train, test and predict steps of `AccumulatingModel`, micro-batch by micro-batch.

Read it as Keras's own `train_step` (keras/src/backend/tensorflow/trainer.py) with the batch
split: `train_step` = `_train_gradients` (the micro-batch loop, no collective op) then
`_train_update` (one update, the metrics' results); `test_step` = `_test_loss` then `_test_logs`
(separate parts, so that several workers can agree between them); with `whole_batch_loss=True`
the loop is `_whole_batch_pass`; `predict_step` concatenates the micro-batches' predictions."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import tensorflow as tf

from keras_memopt import _dtypes, _keras, distribute
from keras_memopt._keras import losses as _keras_losses
from keras_memopt._step import layer_metrics as _layer_metrics
from keras_memopt._step import loop as _loop
from keras_memopt._step import losses as _losses
from keras_memopt._step import per_update as _per_update
from keras_memopt._step import shares as _shares
from keras_memopt._step import update as _update
from keras_memopt._step import whole_batch as _whole_batch
from keras_memopt._step.probe.loss import loss_form


@dataclasses.dataclass(frozen=True)
class StepFunctions:
    """What the model hands its step runner for one kind of step.

    Attributes:
        kind: "train", "test" or "predict".
        step: the whole step, `step(data) -> outputs` (`model.train_step`).
        prepare: `prepare(data)`, run once before the first step, on its batch.
        parts: `(local, collective)`: the model's own step in two, the first
            without collective ops; None for a custom step.
        builtin: whether `step` is AccumulatingModel's own, not a user's.
    """

    kind: str
    step: Callable
    prepare: Callable
    parts: tuple | None
    builtin: bool


class MicroBatchSteps:
    """The steps of `AccumulatingModel` (a mixin: see that class)."""

    def _step_functions(self, kind) -> StepFunctions:
        """What the step runner of `kind` runs: the step, its preparation, its parts."""
        builtin = getattr(type(self), f"{kind}_step") is getattr(MicroBatchSteps, f"{kind}_step")
        parts = None  # a custom step cannot be split
        if builtin and kind == "train":
            parts = self._train_gradients, lambda outputs: self._train_update(*outputs)
        elif builtin and kind == "test":
            parts = self._test_loss, lambda outputs: self._test_logs(*outputs)
        elif builtin:
            parts = self.predict_step, None
        step = self._checked_train_step if kind == "train" else getattr(self, f"{kind}_step")
        prepare = functools.partial(self._prepare_step, kind, builtin=builtin)
        return StepFunctions(kind, step, prepare, parts, builtin)

    # -- what every step does first ------------------------------------------------

    def _prepare_step(self, kind, data, builtin):
        """Makes from the first step's batch what it would make while traced (traced once; a model
        without its own `call()` left to its step, as Keras does); probes the loss's split."""
        local = distribute.first_replica_part(data, self.distribute_strategy)
        buildable = isinstance(self, _keras.Functional) or (
            type(self).call is not _keras.keras.Model.call
        )
        if buildable and kind != "predict":
            _keras.symbolic_build(self, local)
        if kind != "predict" and builtin:
            self._probe_loss_split(local)
        elif kind == "train":
            self._check_custom_loss(local)

    def _probe_loss_split(self, data):
        """Finds once how the loss splits (`_step.probe`); raises for a loss or metric it cannot."""
        split = self._run.loss_split
        if split.form is None:
            split.form = loss_form(self, split, data, self._run.whole_batch_loss)

    def _forward(self, x, training):
        # Recomputed segments matter in training only; placed ones always.
        plan = self._run.segment_plan
        if plan is not None and (training or plan.placed):
            return plan(x, training=training)
        if _keras.calls_with_training(self):
            return self(x, training=training)
        return self(x)

    def _build_before_loop(self, x):
        """Builds a model not called yet on a one-sample batch: TensorFlow cannot create
        variables inside the micro-batch function, and the loop needs them."""
        if self.built:
            return

        def one_sample(t):
            if t is None:
                return None
            shape = [1, *t.shape[1:]]
            if None in shape:
                raise ValueError(
                    "AccumulatingModel could not build the model from the "
                    "input's shape, which has unknown dimensions. Build it "
                    "first by calling it once on a batch. Received: an input "
                    f"of shape {t.shape}"
                )
            return tf.zeros(shape, t.dtype)

        with tf.init_scope():
            self(tf.nest.map_structure(one_sample, x), training=False)

    def _unpack(self, data):
        x, y, sample_weight = _keras.unpack_x_y_sample_weight(data)
        for name, value in (("x", x), ("y", y), ("sample_weight", sample_weight)):
            _loop.check_splittable(value, name)
        self._build_before_loop(x)
        return x, y, sample_weight

    def _micro_batch_pass(self, micro_pass, data, batch_size, reductions=None):
        """Runs `micro_pass((x, y, sample_weight), counts)` over the micro-batches, the layers' own
        metrics weighted; sums it. `micro_pass` returns the micro-batch's fraction of the loss
        first; `counts` are `LossSplit.batch_counts`'. Returns the summed outputs and the scale that
        turns this replica's loss into its mean."""
        replica_batch = _loop.batch_size_of(data)

        def micro_step(micro, counts):
            step = functools.partial(micro_pass, micro, counts)
            return self._layer_metrics_weighted(micro, replica_batch, step)

        size = self._run.setting.size_tensor(replica_batch)
        jit = self._run.jit_compile
        counts = self._run.loss_split.batch_counts(
            self._forward_uncounted, data, size, jit_compile=jit
        )
        trackers = _losses.OutputLossTrackers(self)
        outputs = _loop.accumulate(
            micro_step, data, size, counts, jit_compile=jit, reductions=reductions
        )
        # With uneven replica shares, what the loss fractions count against is
        # not this replica's batch: the trackers take this replica's mean.
        scale = _loop.fraction_of(batch_size, replica_batch)
        trackers.apply(_loop.static_batch_size(data[0]), scale, tf.nest.flatten(outputs)[0])
        return outputs, scale

    # -- training ------------------------------------------------------------------

    def train_step(self, data):
        self._run.accumulating = True
        if self._run.probing:  # a custom step's `super().train_step`, checked before the first step
            self._probe_own_step(data)
        return self._train_update(*self._train_gradients(data))

    def _train_gradients(self, data):
        """The batch's loss, size and summed gradients: the micro-batch loop, no update."""
        if self._run.whole_batch_loss:
            return self._whole_batch_pass(data, training=True)
        x, y, sample_weight = self._unpack(data)
        replica_batch = _loop.batch_size_of((x, y, sample_weight))
        batch_size = _shares.effective_batch_size(replica_batch, self._run.replica_shares)
        variables = self.trainable_variables
        per_update = _per_update.PerUpdate(self)  # advanced once per update
        starts = per_update.starts()

        def micro_pass(micro, counts):
            micro_x, micro_y, micro_weight = micro
            restarts = per_update.restart(starts)
            with tf.control_dependencies(restarts), tf.GradientTape() as tape:
                y_pred = self._forward(micro_x, training=True)
                loss = self._run.loss_split.micro_batch_loss(
                    micro_x, micro_y, y_pred, micro_weight, batch_size, counts, training=True
                )
                scaled = _keras.scale_loss(self.optimizer, loss)
            gradients = tape.gradient(scaled, variables)
            _keras.update_metrics(self, micro_x, micro_y, y_pred, micro_weight)
            return _dtypes.widened(loss), gradients, per_update.extremes()

        reductions = ("sum", _loop.gradient_folds(variables), per_update.reductions())
        (loss, gradients, extremes), scale = self._micro_batch_pass(
            micro_pass, (x, y, sample_weight), batch_size, reductions
        )
        per_update.finish(extremes)
        return loss * tf.cast(scale, loss.dtype), replica_batch, gradients

    def _train_update(self, loss, batch_size, gradients):
        """The step's update (across replicas), once every micro-batch has run, and its logs."""
        _keras_losses.track_loss(self, loss, batch_size)
        variables = self.trainable_variables
        if variables:
            overwrites = any(_loop.overwritten(v) for v in variables)
            began = self._run.guard.begin(_update.after_the_loop(gradients, overwrites))
            with tf.control_dependencies([began]):
                _keras.apply_gradients(self.optimizer, gradients, variables)
        return self.get_metrics_result()

    def _whole_batch_pass(self, data, training):
        """`whole_batch_loss=True`: `(loss, size, gradients)` of the whole batch's outputs
        (`_step.whole_batch`); metrics see those outputs once."""
        if _per_update.PerUpdate(self):
            raise NotImplementedError(
                "`whole_batch_loss=True` runs each micro-batch forward twice, which "
                "would advance tfmot's pruning steps twice (and its quantization "
                "ranges), or divide a `SpectralNormalization`'s kernel twice. Train "
                "such a model without it. Received: whole_batch_loss=True"
            )
        x, y, sample_weight = self._unpack(data)
        replica_batch = _loop.batch_size_of((x, y, sample_weight))
        size = self._run.setting.size_tensor(replica_batch)

        def forward(micro):
            fraction = _loop.fraction_of(_loop.batch_size_of(micro), replica_batch)
            y_pred = self._layer_metrics_weighted(
                micro, replica_batch, lambda: self._forward(micro[0], training=training)
            )
            return y_pred, self._run.loss_split.penalty(fraction)

        def loss_fn(y_pred, penalty):
            split = self._run.loss_split
            return split.whole_batch_loss(x, y, y_pred, sample_weight, penalty, training)

        whole = _whole_batch.WholeBatch(self, forward, self._run.jit_compile, self._uncounted)
        gradients = None
        if training:
            loss, gradients, y_pred = whole.gradients(
                loss_fn, (x, y, sample_weight), size, self.trainable_variables, self.optimizer
            )
        else:
            y_pred, penalty, _ = whole.outputs((x, y, sample_weight), size)
            loss = loss_fn(y_pred, penalty)
        _keras.update_metrics(self, x, y, y_pred, sample_weight)
        return _dtypes.widened(loss), replica_batch, gradients

    def _layer_metrics_weighted(self, micro, batch_size, fn):
        """`fn()`, what it adds to layers' own metrics weighted by its fraction of `batch_size`."""
        fraction = _loop.fraction_of(_loop.batch_size_of(micro), batch_size)
        kinds = (self._run.loss_split.form or _losses.LossForm()).metrics
        return _layer_metrics.weighted(self, kinds, fraction, fn)

    def _uncounted(self, fn):
        """`fn()`, leaving the layers' own metrics as they were: a pass that is not the
        step's own (the counts of a masked output's loss, `whole_batch_loss`'s rerun)."""
        return _layer_metrics.weighted(self, (), None, fn)

    def _forward_uncounted(self, x, training):
        return self._uncounted(lambda: self._forward(x, training=training))

    # -- evaluation and prediction -------------------------------------------------

    def test_step(self, data):
        return self._test_logs(*self._test_loss(data))

    def _test_loss(self, data):
        """The batch's loss and size, metrics updated; no collective op."""
        if self._run.whole_batch_loss:
            return self._whole_batch_pass(data, training=False)[:2]
        x, y, sample_weight = self._unpack(data)
        replica_batch = _loop.batch_size_of((x, y, sample_weight))
        batch_size = _shares.effective_batch_size(replica_batch, self._run.replica_shares)

        def micro_pass(micro, counts):
            micro_x, micro_y, micro_weight = micro
            y_pred = self._forward(micro_x, training=False)
            loss = self._run.loss_split.micro_batch_loss(
                micro_x, micro_y, y_pred, micro_weight, batch_size, counts, training=False
            )
            _keras.update_metrics(self, micro_x, micro_y, y_pred, micro_weight)
            return _dtypes.widened(loss)

        loss, scale = self._micro_batch_pass(micro_pass, (x, y, sample_weight), batch_size)
        return loss * tf.cast(scale, loss.dtype), replica_batch

    def _test_logs(self, loss, batch_size):
        _keras_losses.track_loss(self, loss, batch_size)
        return self.get_metrics_result()

    def predict_step(self, data):
        x, _, _ = _keras.unpack_x_y_sample_weight(data)
        _loop.check_splittable(x, "x")
        self._build_before_loop(x)
        if not [t for t in tf.nest.flatten(x) if t is not None]:
            return self._forward(x, training=False)  # Keras says what is missing
        size = self._run.setting.size_tensor(_loop.batch_size_of(x))
        return _loop.concatenate(lambda micro_x: self._forward(micro_x, training=False), x, size)
