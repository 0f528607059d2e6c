"""The train, test and predict steps of `AccumulatingModel`, micro-batch by micro-batch.

`MicroBatchSteps` is the part of `AccumulatingModel` that Keras's `fit`,
`evaluate` and `predict` call once per batch (through the step runner): each
step splits the batch into micro-batches and runs them in the loop of
`keras_memopt._loop`, with each micro-batch's share of the loss from
`keras_memopt._losses`. `accumulate_gradients` is the same loop for custom
train steps.
"""

from __future__ import annotations

import warnings

import tensorflow as tf

from keras_memopt import _keras as K
from keras_memopt import _loop, _losses, distribute

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

    def _split_step(self, kind):
        """`(local, finish)`: the built-in `kind` step in two halves, the first
        without collective ops, or None for a custom step or `predict`."""
        own = getattr(type(self), f"{kind}_step") is getattr(MicroBatchSteps, f"{kind}_step")
        if kind == "train" and own:
            return self._local_train_step, lambda outputs: self._update(*outputs)
        if kind == "test" and own:
            return self._local_test_step, lambda outputs: self._test_logs(*outputs)
        if kind == "predict" and own:
            return self.predict_step, None
        return None

    def _checked_train_step(self, data):
        """`train_step`, warning once when a custom one splits nothing."""
        self._accumulating = False
        outputs = self.train_step(data)
        splits = self._micro_batch_size is not None or (self._accumulation_steps or 1) > 1
        cls = type(self)
        if not self._accumulating and splits and cls not in _WARNED_CUSTOM_STEPS:
            _WARNED_CUSTOM_STEPS.add(cls)
            warnings.warn(
                f"{cls.__name__}.train_step runs the whole batch at once: it calls "
                "neither `self.accumulate_gradients(...)` nor "
                "`super().train_step(data)`, so the micro-batch setting "
                f"(micro_batch_size={self._micro_batch_size!r}, accumulation_steps="
                f"{self._accumulation_steps!r}) saves no memory. Compute the "
                "gradients with `self.accumulate_gradients(loss_fn, data, "
                "variables)`.",
                stacklevel=2,
            )
        return outputs

    # -- the steps ----------------------------------------------------------------

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
        x, y, sample_weight = K.unpack_x_y_sample_weight(data)
        self._build_before_loop(x)
        return x, y, sample_weight

    def _valid_counts(self, x, size):
        """Unmasked elements per output over the batch: a forward pass, inference mode."""

        def count(micro_x):
            return _losses.valid_counts(self._forward(micro_x, training=False))

        return _loop.accumulate(count, x, size, jit_compile=self._micro_batch_jit_compile)

    def _accumulate_losses(self, micro_step, data, batch_size, masked):
        """Runs `micro_step((x, y, sample_weight), valid)` over the micro-batches; sums it.

        `micro_step` appends to `masked` whether the outputs carry masks
        (known when it is traced, before the loop is built).
        """
        replica_batch = _loop.batch_size_of(data)
        size = self._setting.micro_batch_size(replica_batch)
        jit = self._micro_batch_jit_compile
        no_counts = tf.zeros([0])  # `valid` when no output carries a mask
        traced = _loop.micro_function(micro_step, data, no_counts, jit_compile=jit)
        valid = self._valid_counts(data[0], size) if masked[-1] else no_counts
        trackers = _losses.TrackerFix(self)
        outputs = _loop.accumulate(micro_step, data, size, valid, traced=traced)
        # With uneven replica shares, what the loss shares count against is
        # not this replica's batch: the trackers take this replica's mean.
        scale = tf.cast(batch_size, tf.float32) / tf.cast(replica_batch, tf.float32)
        trackers.apply(K.static_batch_dim(data[0]), scale)
        return outputs, scale

    def train_step(self, data):
        self._accumulating = True
        return self._update(*self._local_train_step(data))

    def _local_train_step(self, data):
        """The batch's loss, size and summed gradients; no collective op (no update)."""
        x, y, sample_weight = self._unpack(data)
        replica_batch = _loop.batch_size_of((x, y, sample_weight))
        batch_size = distribute.effective_batch_size(replica_batch, self._replica_shares)
        variables = self.trainable_variables
        counters = _update_counters(self)
        starts = [counter.read_value() for counter in counters]
        masked = []

        def micro_step(micro, valid):
            micro_x, micro_y, micro_weight = micro
            restarts = [c.assign(s) for c, s in zip(counters, starts, strict=True)]
            with tf.control_dependencies(restarts), tf.GradientTape() as tape:
                y_pred = self._forward(micro_x, training=True)
                masked.append(any(m is not None for m in _losses.output_masks(y_pred)))
                loss = self._loss_split.micro_batch_loss(
                    micro_x, micro_y, y_pred, micro_weight, batch_size, valid, training=True
                )
                scaled = K.scale_loss(self.optimizer, loss)
            gradients = tape.gradient(scaled, variables)
            K.update_metrics(self, micro_x, micro_y, y_pred, micro_weight)
            return tf.cast(loss, tf.float32), gradients

        (loss, gradients), scale = self._accumulate_losses(
            micro_step, (x, y, sample_weight), batch_size, masked
        )
        return loss * scale, replica_batch, gradients

    def _update(self, loss, batch_size, gradients):
        """The step's update (across replicas) and its logs."""
        K.track_loss(self, loss, batch_size)
        variables = self.trainable_variables
        if variables:
            K.apply_gradients(self.optimizer, gradients, variables)
        return self.get_metrics_result()

    def test_step(self, data):
        return self._test_logs(*self._local_test_step(data))

    def _local_test_step(self, data):
        """The batch's loss and size, metrics updated; no collective op."""
        x, y, sample_weight = self._unpack(data)
        replica_batch = _loop.batch_size_of((x, y, sample_weight))
        batch_size = distribute.effective_batch_size(replica_batch, self._replica_shares)
        masked = []

        def micro_step(micro, valid):
            micro_x, micro_y, micro_weight = micro
            y_pred = self._forward(micro_x, training=False)
            masked.append(any(m is not None for m in _losses.output_masks(y_pred)))
            loss = self._loss_split.micro_batch_loss(
                micro_x, micro_y, y_pred, micro_weight, batch_size, valid, training=False
            )
            K.update_metrics(self, micro_x, micro_y, y_pred, micro_weight)
            return tf.cast(loss, tf.float32)

        loss, scale = self._accumulate_losses(
            micro_step, (x, y, sample_weight), batch_size, masked
        )
        return loss * scale, replica_batch

    def _test_logs(self, loss, batch_size):
        K.track_loss(self, loss, batch_size)
        return self.get_metrics_result()

    def predict_step(self, data):
        x, _, _ = K.unpack_x_y_sample_weight(data)
        _loop.check_splittable(x)
        self._build_before_loop(x)
        if not [t for t in tf.nest.flatten(x) if t is not None]:
            return self._forward(x, training=False)  # Keras says what is missing
        size = self._setting.micro_batch_size(_loop.batch_size_of(x))
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
                scaled = K.scale_loss(optimizer, loss)
            return tf.cast(loss, tf.float32), tape.gradient(scaled, variables)

        size = self._setting.micro_batch_size(batch_size)
        jit = self._micro_batch_jit_compile
        return _loop.accumulate(micro_step, data, size, jit_compile=jit)
