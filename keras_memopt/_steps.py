"""The train, test and predict steps of `AccumulatingModel`, micro-batch by micro-batch.

Read it as Keras's own `train_step` (keras/src/backend/tensorflow/trainer.py)
with the batch split:

- `train_step` = `_train_gradients` (the micro-batch loop: each micro-batch's
  forward pass, loss and gradients, summed; no collective op) followed by
  `_train_update` (one optimizer update, then the metrics' results);
- `test_step` = `_test_loss` then `_test_logs`; `predict_step` concatenates
  each micro-batch's predictions;
- `accumulate_gradients` is the same loop for custom train steps.

The halves are separate so that several workers can agree between them
whether any ran out of memory (`keras_memopt._coordinator`).
"""

from __future__ import annotations

import inspect
import warnings

import tensorflow as tf

from keras_memopt import _keras, _loop, _losses, _shares, distribute

_WARNED_CUSTOM_STEPS: set[type] = set()


def _update_counters(model):
    """`_loop.update_counters(model)`, refused under a distribution strategy.

    Raises:
        NotImplementedError: under a distribution strategy: the pruning
            wrappers synchronise the replicas in every training call, which
            TensorFlow does not allow inside the loop over micro-batches.
    """
    counters = _loop.update_counters(model)
    if counters and tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
        raise NotImplementedError(
            "An AccumulatingModel with tfmot pruning wrappers cannot train "
            "under a distribution strategy: the wrappers synchronise the "
            "replicas (`merge_call`) in every training call, which TensorFlow "
            "does not allow inside the loop over micro-batches. Train it "
            "without a strategy, or prune a plain `keras.Model`. Received: "
            f"strategy={type(tf.distribute.get_strategy()).__name__}"
        )
    return counters


class MicroBatchSteps:
    """The steps of `AccumulatingModel` (a mixin: see that class)."""

    def _own_step(self, kind) -> bool:
        """Whether the model runs this mixin's `<kind>_step` (not its own override)."""
        name = f"{kind}_step"
        return getattr(type(self), name) is getattr(MicroBatchSteps, name)

    def _step_halves(self, kind):
        """`(local, finish)`: the own `kind` step in two halves, the first
        without collective ops, or None for a custom step."""
        if not self._own_step(kind):
            return None
        if kind == "train":
            return self._train_gradients, lambda outputs: self._train_update(*outputs)
        if kind == "test":
            return self._test_loss, lambda outputs: self._test_logs(*outputs)
        return self.predict_step, None

    def _checked_train_step(self, data):
        """`train_step`, warning once when a custom one splits nothing."""
        self._accumulating = False
        outputs = self.train_step(data)
        cls = type(self)
        if not self._accumulating and self._setting.splits() and cls not in _WARNED_CUSTOM_STEPS:
            _WARNED_CUSTOM_STEPS.add(cls)
            _warn_at(
                cls.train_step,
                f"{cls.__name__}.train_step runs the whole batch at once: it calls "
                "neither `self.accumulate_gradients(...)` nor "
                "`super().train_step(data)`, so the micro-batch setting "
                f"(micro_batch_size={self.micro_batch_size!r}, accumulation_steps="
                f"{self.accumulation_steps!r}) saves no memory. Compute the "
                "gradients with `self.accumulate_gradients(loss_fn, data, variables)`.",
            )
        return outputs

    # -- what every step does first ------------------------------------------------

    def _prepare_step(self, kind, data):
        """Makes, from the first step's own batch, what it would make while traced.

        Keras 3 builds the model, the compiled metrics and losses and the
        optimizer from the batch's shapes (as Keras does under a distribution
        strategy, but without taking a batch from the user's data), so that
        the first step is traced once; a model with no `call()` of its own
        (a GAN whose `train_step` calls its parts) is left to its step, as
        Keras leaves it. The model's own steps also check how their losses
        split over micro-batches (`keras_memopt._losses.LossSplit.check`).
        """
        local = distribute.first_replica_part(data, self.distribute_strategy)
        buildable = isinstance(self, _keras.Functional) or (
            type(self).call is not _keras.keras.Model.call
        )
        if buildable and not _keras.LEGACY and kind != "predict":
            _keras.symbolic_build(self, local)
        if kind != "predict" and self._own_step(kind):
            self._loss_split.check(local)

    def _forward(self, x, training):
        # Recomputed segments matter in training only; placed ones always.
        plan = self._segment_plan
        if plan is not None and (training or plan.placed):
            return plan(x, training=training)
        return self(x, training=training)

    def _build_before_loop(self, x):
        """Builds a model that has not been called yet on a one-sample batch.

        Keras builds such (subclassed) models in their first traced step, but
        TensorFlow cannot create variables inside the micro-batch function,
        and the loop needs the variables to know its gradients.
        """
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
        _loop.check_splittable(data)
        x, y, sample_weight = _keras.unpack_x_y_sample_weight(data)
        self._build_before_loop(x)
        return x, y, sample_weight

    def _micro_batch_pass(self, micro_step, data, batch_size, counted_by):
        """Runs `micro_step((x, y, sample_weight), counts)` over the micro-batches; sums it.

        The pass `train_step` and `test_step` share. `micro_step` returns the
        micro-batch's share of the loss first, and appends to `counted_by` what
        Keras's counts need (`LossSplit.counted_by`, known once it is traced,
        before the loop is built). `counts` are what Keras divides each
        output's loss by, over the whole batch: counted in a first pass when an
        output carries a mask or its loss ignores a class (see
        `keras_memopt._losses`). Returns the summed outputs and the scale that
        turns this replica's loss into its mean.
        """
        replica_batch = _loop.batch_size_of(data)
        size = self._setting.size_tensor(replica_batch)
        jit = self._micro_batch_jit_compile
        no_counts = tf.zeros([0])
        traced = _loop.micro_function(micro_step, data, no_counts, jit_compile=jit)
        trackers = _losses.OutputLossTrackers(self)
        counts = no_counts
        if counted_by[-1] is not None:
            forward = self._forward if counted_by[-1] == "outputs" else None
            counts = self._loss_split.batch_counts(forward, data, size, jit_compile=jit)
        outputs = _loop.accumulate(micro_step, data, size, counts, traced=traced)
        # With uneven replica shares, what the loss shares count against is
        # not this replica's batch: the trackers take this replica's mean.
        scale = tf.cast(batch_size, tf.float32) / tf.cast(replica_batch, tf.float32)
        trackers.apply(_keras.static_batch_dim(data[0]), scale)
        return outputs, scale

    # -- training ------------------------------------------------------------------

    def train_step(self, data):
        self._accumulating = True
        return self._train_update(*self._train_gradients(data))

    def _train_gradients(self, data):
        """The batch's loss, size and summed gradients: the micro-batch loop, no update."""
        x, y, sample_weight = self._unpack(data)
        replica_batch = _loop.batch_size_of((x, y, sample_weight))
        batch_size = _shares.effective_batch_size(replica_batch, self._replica_shares)
        variables = self.trainable_variables
        counters = _update_counters(self)
        starts = [counter.read_value() for counter in counters]
        counted_by = []

        def micro_step(micro, counts):
            micro_x, micro_y, micro_weight = micro
            restarts = [c.assign(s) for c, s in zip(counters, starts, strict=True)]
            with tf.control_dependencies(restarts), tf.GradientTape() as tape:
                y_pred = self._forward(micro_x, training=True)
                counted_by.append(self._loss_split.counted_by(micro_y, y_pred))
                loss = self._loss_split.micro_batch_loss(
                    micro_x, micro_y, y_pred, micro_weight, batch_size, counts, training=True
                )
                scaled = _keras.scale_loss(self.optimizer, loss)
            gradients = tape.gradient(scaled, variables)
            _keras.update_metrics(self, micro_x, micro_y, y_pred, micro_weight)
            return tf.cast(loss, tf.float32), gradients

        (loss, gradients), scale = self._micro_batch_pass(
            micro_step, (x, y, sample_weight), batch_size, counted_by
        )
        return loss * scale, replica_batch, gradients

    def _train_update(self, loss, batch_size, gradients):
        """The step's update (across replicas), once every micro-batch has run, and its logs."""
        _keras.track_loss(self, loss, batch_size)
        variables = self.trainable_variables
        if variables:
            began = self._update_guard.begin(gradients)
            with tf.control_dependencies([began]):
                _keras.apply_gradients(self.optimizer, gradients, variables)
        return self.get_metrics_result()

    # -- evaluation and prediction -------------------------------------------------

    def test_step(self, data):
        return self._test_logs(*self._test_loss(data))

    def _test_loss(self, data):
        """The batch's loss and size, metrics updated; no collective op."""
        x, y, sample_weight = self._unpack(data)
        replica_batch = _loop.batch_size_of((x, y, sample_weight))
        batch_size = _shares.effective_batch_size(replica_batch, self._replica_shares)
        counted_by = []

        def micro_step(micro, counts):
            micro_x, micro_y, micro_weight = micro
            y_pred = self._forward(micro_x, training=False)
            counted_by.append(self._loss_split.counted_by(micro_y, y_pred))
            loss = self._loss_split.micro_batch_loss(
                micro_x, micro_y, y_pred, micro_weight, batch_size, counts, training=False
            )
            _keras.update_metrics(self, micro_x, micro_y, y_pred, micro_weight)
            return tf.cast(loss, tf.float32)

        loss, scale = self._micro_batch_pass(
            micro_step, (x, y, sample_weight), batch_size, counted_by
        )
        return loss * scale, replica_batch

    def _test_logs(self, loss, batch_size):
        _keras.track_loss(self, loss, batch_size)
        return self.get_metrics_result()

    def predict_step(self, data):
        x, _, _ = _keras.unpack_x_y_sample_weight(data)
        _loop.check_splittable(x)
        self._build_before_loop(x)
        if not [t for t in tf.nest.flatten(x) if t is not None]:
            return self._forward(x, training=False)  # Keras says what is missing
        size = self._setting.size_tensor(_loop.batch_size_of(x))
        return _loop.concatenate(lambda micro_x: self._forward(micro_x, training=False), x, size)

    def accumulate_gradients(self, loss_fn, data, variables, optimizer=None):
        """The batch's loss and gradients, computed micro-batch by micro-batch.

        The building block of a custom `train_step`: it runs
        `loss_fn(micro_batch)` over the micro-batches of `data` in the loop
        `train_step` uses (one micro-batch's activations alive at a time),
        weights each micro-batch's loss by its share of the batch (its number
        of samples over the batch's), and returns the batch's loss and the
        summed gradients for `variables`: what one `tf.GradientTape` over the
        whole batch gives when `loss_fn` returns a mean over samples. Call it
        as often as a step needs (a GAN's discriminator and generator).

        Metrics that `loss_fn` updates see each micro-batch in turn, which is
        the whole batch for metrics that accumulate over samples (`Mean`,
        accuracy, AUC). With a loss-scale optimizer (`mixed_float16`), the
        loss is scaled with `optimizer`'s scale: apply the gradients with that
        optimizer, which unscales them (and skips a non-finite update).

        Args:
            loss_fn: a function of one micro-batch (a slice of `data`, same
                structure) returning its mean loss, a scalar tensor.
            data: the batch: a tensor or a nest (tuple, dict) of tensors
                whose first axis is the batch.
            variables: the variables to differentiate.
            optimizer: the optimizer that will apply the gradients, for loss
                scaling. Defaults to the model's.

        Returns:
            `(loss, gradients)`: the batch's loss (float32) and one gradient
            per variable (None where the loss does not depend on it;
            `tf.IndexedSlices` for an Embedding's table).

        Example:

        ```python
        def train_step(self, data):
            real, _ = data

            def discriminator_loss(real):
                fake = self.generator(tf.random.normal([tf.shape(real)[0], 64]))
                ...
                return loss

            variables = self.discriminator.trainable_variables
            loss, grads = self.accumulate_gradients(
                discriminator_loss, real, variables, optimizer=self.d_optimizer
            )
            self.d_optimizer.apply(grads, variables)
        ```
        """
        self._accumulating = True
        _loop.check_splittable(data)
        variables = list(variables)
        optimizer = getattr(self, "optimizer", None) if optimizer is None else optimizer
        batch_size = _loop.batch_size_of(data)

        def micro_step(micro):
            share = tf.cast(_loop.batch_size_of(micro), tf.float32) / tf.cast(
                batch_size, tf.float32
            )
            with tf.GradientTape() as tape:
                loss = loss_fn(micro)
                loss = loss * tf.cast(share, loss.dtype)
                scaled = _keras.scale_loss(optimizer, loss)
            return tf.cast(loss, tf.float32), tape.gradient(scaled, variables)

        size = self._setting.size_tensor(batch_size)
        jit = self._micro_batch_jit_compile
        return _loop.accumulate(micro_step, data, size, jit_compile=jit)


def _warn_at(function, message):
    """A `UserWarning` attributed to where `function` is defined (a user's step)."""
    function = inspect.unwrap(function)
    try:
        filename = inspect.getsourcefile(function) or "<unknown>"
        lineno = inspect.getsourcelines(function)[1]
    except (OSError, TypeError):
        filename, lineno = "<unknown>", 0
    warnings.warn_explicit(message, UserWarning, filename, lineno, module=function.__module__)
