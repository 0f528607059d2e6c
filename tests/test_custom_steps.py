"""Accumulation inside custom train steps: `accumulate_gradients`, and the warning.

Each custom step (keras.io's GAN and knowledge-distillation examples) is written
twice: once as a plain `keras.Model` step on the whole batch (the oracle), once
as an `AccumulatingModel` step that computes its gradients with
`accumulate_gradients`. The randomness the examples draw inside the step comes
with the data instead, so both see the same numbers.
"""

import warnings

import numpy as np
import pytest
import tensorflow as tf
from _faults import OutOfMemoryAbove
from _helpers import (
    FLOAT32,
    IDENTICAL,
    assert_same_logs,
    assert_same_weights,
    classification_data,
    regression_data,
)
from conftest import LEGACY
from test_whole_batch import negative_pairs_loss

from keras_memopt import AccumulatingModel
from keras_memopt._keras import keras
from keras_memopt.callbacks import OOMBackoff

layers = keras.layers
LATENT = 4


def _mlp(units, out, name):
    return keras.Sequential(
        [keras.Input((units,)), layers.Dense(8), layers.LeakyReLU(0.2), layers.Dense(out)],
        name=name,
    )


def _gan_data(n=40, seed=0):
    rng = np.random.RandomState(seed)
    real = rng.normal(2.0, 1.0, size=(n, 6)).astype("float32")
    latent_d = rng.normal(size=(n, LATENT)).astype("float32")
    latent_g = rng.normal(size=(n, LATENT)).astype("float32")
    label_noise = (0.05 * rng.uniform(size=(2 * n, 1))).astype("float32")
    # The noise on the labels of the fake and the real half of each sample.
    noise = np.concatenate([label_noise[:n], label_noise[n:]], axis=1)
    return real, latent_d, latent_g, noise


class PlainGAN(keras.Model):
    """keras.io's GAN step, on the whole batch."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.generator = _mlp(LATENT, 6, "generator")
        self.discriminator = _mlp(6, 1, "discriminator")
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
        # Built here, not in the first step: under a distribution strategy
        # optimizer variables cannot be made inside a replica's step.
        d_optimizer.build(self.discriminator.trainable_variables)
        g_optimizer.build(self.generator.trainable_variables)
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def call(self, data):
        return self.discriminator(self.generator(data["latent_g"]))

    def discriminator_loss(self, data):
        real, latent, noise = data["real"], data["latent_d"], data["noise"]
        fake = self.generator(latent)
        predictions = self.discriminator(tf.concat([fake, real], axis=0))
        labels = tf.concat(
            [tf.ones_like(noise[:, :1]) + noise[:, :1], tf.zeros_like(noise[:, 1:]) + noise[:, 1:]],
            axis=0,
        )
        return self.loss_fn(labels, predictions)

    def generator_loss(self, data):
        latent, noise = data["latent_g"], data["noise"]
        predictions = self.discriminator(self.generator(latent))
        return self.loss_fn(tf.zeros_like(noise[:, :1]), predictions)

    def gradients(self, loss_fn, data, variables, optimizer):
        with tf.GradientTape() as tape:
            loss = loss_fn(data)
        return loss, tape.gradient(loss, variables)

    def train_step(self, data):
        variables = self.discriminator.trainable_variables
        d_loss, grads = self.gradients(self.discriminator_loss, data, variables, self.d_optimizer)
        self.d_optimizer.apply_gradients(zip(grads, variables, strict=True))
        variables = self.generator.trainable_variables
        g_loss, grads = self.gradients(self.generator_loss, data, variables, self.g_optimizer)
        self.g_optimizer.apply_gradients(zip(grads, variables, strict=True))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


class AccumulatingGAN(PlainGAN, AccumulatingModel):
    """The same step, each gradient accumulated over micro-batches."""

    def gradients(self, loss_fn, data, variables, optimizer):
        return self.accumulate_gradients(loss_fn, data, variables, optimizer=optimizer)


def _fit_gan(cls, strategy=None, callbacks=None, **kwargs):
    real, latent_d, latent_g, noise = _gan_data()
    with strategy.scope() if strategy else _nothing():
        keras.utils.set_random_seed(0)
        model = cls(**kwargs)
        model.compile(keras.optimizers.Adam(0.01), keras.optimizers.Adam(0.02))
        dataset = tf.data.Dataset.from_tensor_slices(
            dict(real=real, latent_d=latent_d, latent_g=latent_g, noise=noise)
        )
        history = model.fit(dataset.batch(16), epochs=2, verbose=0, callbacks=callbacks)
    return model, history.history


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *_):
        return False


def _assert_same(plain, accumulating):
    (model_a, logs_a), (model_b, logs_b) = plain, accumulating
    assert_same_weights(model_b, model_a, FLOAT32)
    assert_same_logs(logs_b, logs_a, FLOAT32)


def _teacher_student(seed):
    keras.utils.set_random_seed(seed)
    teacher = _mlp(6, 3, "teacher")
    teacher.trainable = False
    student = _mlp(6, 3, "student")
    return teacher, student


class PlainDistiller(keras.Model):
    """keras.io's knowledge distillation step, on the whole batch."""

    def __init__(self, teacher, student, **kwargs):
        super().__init__(**kwargs)
        self.teacher, self.student = teacher, student
        self.alpha, self.temperature = 0.3, 3.0
        self.student_loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.distillation_loss_fn = keras.losses.KLDivergence()
        self.loss_tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self):
        return [self.loss_tracker]

    def call(self, x, training=False):
        return self.student(x, training=training)

    def distillation_loss(self, data):
        x, y = data
        teacher = self.teacher(x, training=False)
        student = self.student(x, training=True)
        hard = self.student_loss_fn(y, student)
        soft = self.distillation_loss_fn(
            tf.nn.softmax(teacher / self.temperature, axis=1),
            tf.nn.softmax(student / self.temperature, axis=1),
        )
        return self.alpha * hard + (1 - self.alpha) * soft * self.temperature**2

    def gradients(self, data, variables):
        with tf.GradientTape() as tape:
            loss = self.distillation_loss(data)
        return loss, tape.gradient(loss, variables)

    def train_step(self, data):
        variables = self.student.trainable_variables
        loss, grads = self.gradients(data, variables)
        self.optimizer.apply_gradients(zip(grads, variables, strict=True))
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}


class AccumulatingDistiller(PlainDistiller, AccumulatingModel):
    def gradients(self, data, variables):
        return self.accumulate_gradients(self.distillation_loss, data, variables)


def _fit_distiller(cls, strategy=None, **kwargs):
    x, y = classification_data(40, seed=1)
    with strategy.scope() if strategy else _nothing():
        model = cls(*_teacher_student(2), **kwargs)
        model.compile(optimizer=keras.optimizers.Adam(0.01))
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        history = model.fit(dataset, epochs=2, verbose=0)
    return model, history.history


# Batches of 16, 16, 8; micro-batches of 5: 5 + 5 + 5 + 1 and 5 + 3.
MICRO = dict(micro_batch_size=5)


# Plain Keras's runs that several tests compare against, each trained once a module
# (a process): seeded, read and never trained further.
@pytest.fixture(scope="module")
def plain_gan():
    return _fit_gan(PlainGAN)


@pytest.fixture(scope="module")
def plain_distiller():
    return _fit_distiller(PlainDistiller)


class TestAccumulateGradients:
    def test_gan_with_two_optimizers_matches_the_whole_batch(self, plain_gan):
        _assert_same(plain_gan, _fit_gan(AccumulatingGAN, **MICRO))

    def test_distillation_matches_the_whole_batch(self, plain_distiller):
        _assert_same(plain_distiller, _fit_distiller(AccumulatingDistiller, **MICRO))

    @pytest.mark.skipif(
        LEGACY,
        reason="tf_keras refuses a mean-reduced loss in a custom step under a strategy",
    )
    def test_under_mirrored_strategy(self, mirrored_strategy):
        plain = _fit_gan(PlainGAN, mirrored_strategy)
        _assert_same(plain, _fit_gan(AccumulatingGAN, mirrored_strategy, **MICRO))
        plain = _fit_distiller(PlainDistiller, mirrored_strategy)
        _assert_same(plain, _fit_distiller(AccumulatingDistiller, mirrored_strategy, **MICRO))

    def test_a_failed_step_puts_back_every_optimizer_it_updated(self, plain_gan):
        """Out of memory in the generator's pass, after the discriminator's update:
        the retried step starts from the discriminator and its optimizer as they were."""

        class FailingGenerator(AccumulatingGAN):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.fault = OutOfMemoryAbove(limit=3)

            def generator_loss(self, data):
                return super().generator_loss(dict(data, latent_g=self.fault(data["latent_g"])))

        backoff = OOMBackoff(verbose=0)
        model, logs = _fit_gan(FailingGenerator, callbacks=[backoff], **MICRO)
        assert model.fault.raised == 1 and model.micro_batch_size <= 3
        _assert_same(plain_gan, (model, logs))
        for optimizer in ("d_optimizer", "g_optimizer"):
            assert int(getattr(model, optimizer).iterations) == int(
                getattr(plain_gan[0], optimizer).iterations
            )

    def test_an_update_before_the_first_split_is_not_made_twice(self):
        """The loss check runs the step up to its first split of the batch, and
        puts back the update the step made before it (a plain-tape one here)."""

        def plain_update_first(cls):
            class Twice(cls):
                def train_step(self, data):
                    variables = self.student.trainable_variables
                    with tf.GradientTape() as tape:
                        loss = self.distillation_loss(data)
                    grads = tape.gradient(loss, variables)
                    self.optimizer.apply_gradients(zip(grads, variables, strict=True))
                    return super().train_step(data)

            return Twice

        plain = _fit_distiller(plain_update_first(PlainDistiller))
        accumulating = _fit_distiller(plain_update_first(AccumulatingDistiller), **MICRO)
        _assert_same(plain, accumulating)
        assert int(accumulating[0].optimizer.iterations) == int(plain[0].optimizer.iterations)

    def test_one_micro_batch_at_a_time(self):
        """The loss function sees micro-batches of the set size, not the batch."""
        sizes = []

        class Recording(AccumulatingDistiller):
            def distillation_loss(self, data):
                tf.py_function(lambda n: sizes.append(int(n)), [tf.shape(data[0])[0]], [])
                return super().distillation_loss(data)

        _fit_distiller(Recording, **MICRO)
        # First the loss check on two samples, again, repeated and each alone
        # (eagerly, before the first step); then the step's micro-batches.
        assert sizes[:11] == [2, 2, 4, 1, 1, 5, 5, 5, 1, 5, 5]

    def test_sparse_gradients_stay_sparse_with_each_row_once(self):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((3,), dtype="int32")
        outputs = layers.Dense(1)(layers.Flatten()(layers.Embedding(50, 4)(inputs)))
        model = AccumulatingModel(inputs, outputs, micro_batch_size=3)
        ids = tf.constant(np.random.RandomState(0).randint(0, 50, (8, 3)), tf.int32)
        table = model.layers[1].embeddings

        def loss_fn(micro):
            return tf.reduce_mean(tf.square(model(micro)))

        @tf.function
        def accumulated():
            return model.accumulate_gradients(loss_fn, ids, [table])

        with tf.GradientTape() as tape:
            expected_loss = loss_fn(ids)
        expected = tape.gradient(expected_loss, [table])[0]
        loss, (gradient,) = accumulated()
        assert isinstance(gradient, tf.IndexedSlices)
        rows = np.unique(ids.numpy())
        assert expected.values.shape[0] == 24 > len(rows)  # the tape's: one slice per lookup
        np.testing.assert_array_equal(np.sort(gradient.indices.numpy()), rows)
        np.testing.assert_allclose(float(loss), float(expected_loss), rtol=1e-6)
        np.testing.assert_allclose(
            tf.convert_to_tensor(gradient), tf.convert_to_tensor(expected), **FLOAT32
        )


def _coupling_warnings(cls, micro_batch_size, x, y, **fit):
    """The warnings that a `cls` (a one-Dense model) fitted on `x`, `y` gives about
    a `loss_fn` that is not a mean of per-sample terms."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    model = cls(inputs, layers.Dense(4)(inputs), micro_batch_size=micro_batch_size)
    model.compile(keras.optimizers.SGD(0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, verbose=0, **fit)
    return [w for w in caught if "not a mean of per-sample terms" in str(w.message)]


class TestCoupledLoss:
    """A `loss_fn` that couples the samples is warned about once, before the first step."""

    @staticmethod
    def _fit(loss_fn, forward=None):
        class Contrastive(AccumulatingModel):
            def train_step(self, data):
                x, _ = data
                variables = self.trainable_variables
                if forward is None:
                    loss, grads = self.accumulate_gradients(
                        lambda micro: loss_fn(self(micro, training=True)), x, variables
                    )
                else:
                    loss, grads = self.accumulate_gradients(
                        lambda outputs, data: loss_fn(outputs), x, variables,
                        forward=lambda micro: self(micro, training=True),
                    )
                self.optimizer.apply_gradients(zip(grads, variables, strict=True))
                return {"contrastive": loss}

        rng = np.random.RandomState(0)
        x, y = rng.normal(size=(20, 6)).astype("float32"), np.zeros((20, 1), "float32")
        return _coupling_warnings(Contrastive, 5, x, y, batch_size=10, epochs=2)

    def test_a_contrastive_loss_fn_is_warned_about(self):
        def contrastive(outputs):
            logits = tf.matmul(outputs, outputs, transpose_b=True)
            labels = tf.range(tf.shape(logits)[0])
            return tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
            )

        caught = self._fit(contrastive)
        assert len(caught) == 1
        assert "forward=" in str(caught[0].message) and caught[0].filename == __file__
        assert not self._fit(contrastive, forward=True)  # a loss of the whole batch

    def test_a_ratio_of_batch_sums_is_warned_about(self):
        # A Dice-style ratio keeps its value on repeated samples: only the
        # samples one at a time show that micro-batches cannot add it up.
        def dice(outputs):
            p, t = tf.sigmoid(outputs), tf.ones_like(outputs)  # every target 1
            return 1.0 - 2.0 * tf.reduce_sum(p * t) / (tf.reduce_sum(p) + tf.reduce_sum(t))

        caught = self._fit(dice)
        assert len(caught) == 1
        assert "as the sum of each sample's loss weighted by its share" in str(caught[0].message)
        assert not self._fit(dice, forward=True)

    def test_a_loss_of_pairs_zero_on_the_first_two_samples_is_warned_about(self):
        """Zero on two samples of one class and on them repeated: the next pair tells."""

        class Pairs(AccumulatingModel):
            def train_step(self, data):
                def loss_fn(micro):
                    x, y = micro
                    return tf.reduce_mean(negative_pairs_loss(y, self(x, training=True)))

                variables = self.trainable_variables
                loss, grads = self.accumulate_gradients(loss_fn, data, variables)
                self.optimizer.apply_gradients(zip(grads, variables, strict=True))
                return {"loss": loss}

        x = np.random.RandomState(0).normal(size=(24, 6)).astype("float32")
        y = np.array([0, 0, 1, 2, 1, 0] * 4, "int32")  # the first two: one class
        assert len(_coupling_warnings(Pairs, 4, x, y, batch_size=12, epochs=1)) == 1

    def test_a_mean_is_not(self):
        assert not self._fit(lambda outputs: tf.reduce_mean(tf.square(outputs)))

    def test_super_train_step_gets_the_models_own_loss_check(self):
        class Super(AccumulatingModel):
            def train_step(self, data):
                return super().train_step(data)

        def summed(y_true, y_pred):
            return tf.reduce_sum(tf.square(y_true - y_pred))

        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        model = Super(inputs, layers.Dense(2)(inputs), micro_batch_size=5)
        model.compile(keras.optimizers.SGD(0.1), summed)
        before = [w.copy() for w in model.get_weights()]
        x, y = regression_data(20, 6, 2, dtype="float64")
        with pytest.raises(ValueError, match=r"not a mean of per-sample terms|couples its samples"):
            model.fit(x, y, batch_size=10, verbose=0)
        assert_same_weights(before, model, IDENTICAL)
        assert int(model.optimizer.iterations) == 0

    def test_a_step_that_splits_nothing_is_not_run_before_its_first_step(self, plain_distiller):
        """Its updates would not be put back: it is left alone (and warned about)."""

        class Whole(PlainDistiller, AccumulatingModel):
            pass

        _assert_same(plain_distiller, _fit_distiller(Whole, **MICRO))


class TestWarning:
    def test_a_custom_step_that_splits_nothing_warns_once(self):
        class Whole(PlainDistiller, AccumulatingModel):
            pass

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _fit_distiller(Whole, **MICRO)
            _fit_distiller(Whole, **MICRO)
        messages = [str(w.message) for w in caught if "runs the whole batch" in str(w.message)]
        assert len(messages) == 1
        assert "Whole.train_step" in messages[0]
        # Said where the user's `train_step` is written, not in TensorFlow's code.
        located = [w for w in caught if "runs the whole batch" in str(w.message)][0]
        assert located.filename == __file__
        assert "self.accumulate_gradients(loss_fn, data, variables)" in messages[0]
        assert "micro_batch_size=5" in messages[0]

    def test_super_train_step_and_accumulate_gradients_do_not_warn(self):
        class Super(AccumulatingModel):
            def train_step(self, data):
                return super().train_step(data)

        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        model = Super(inputs, layers.Dense(3)(inputs), micro_batch_size=5)
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x, y = classification_data(20, dtype="float64")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, verbose=0)
            _fit_distiller(AccumulatingDistiller, **MICRO)
        assert not [w for w in caught if "runs the whole batch" in str(w.message)]

    @pytest.mark.skipif(LEGACY, reason="Keras 3's compute_loss signature")
    def test_overriding_compute_loss_keeps_accumulation(self):
        def build(cls, **kwargs):
            class Custom(cls):
                def compute_loss(self, x, y, y_pred, sample_weight=None, training=True):
                    return tf.reduce_mean(tf.square(y_pred - y)) + tf.add_n(self.losses)

            keras.utils.set_random_seed(0)
            inputs = keras.Input((6,))
            hidden = layers.Dense(8, activity_regularizer=keras.regularizers.L2(0.01))(inputs)
            model = Custom(inputs, layers.Dense(2)(hidden), **kwargs)
            model.compile(keras.optimizers.Adam(0.01))
            x, y = regression_data(40, 6, 2, dtype="float64")
            history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
            return model, history.history

        _assert_same(build(keras.Model), build(AccumulatingModel, **MICRO))

    @pytest.mark.skipif(LEGACY, reason="Keras 3's compute_loss signature")
    def test_a_compute_loss_that_broadcasts_over_pairs_of_samples_is_refused(self):
        # Targets of shape (batch,) against outputs (batch, 1): every pair of samples.
        class Broadcast(AccumulatingModel):
            def compute_loss(self, x, y, y_pred, sample_weight=None, training=True):
                return tf.reduce_mean(tf.square(y_pred - y))

        inputs = keras.Input((6,))
        model = Broadcast(inputs, layers.Dense(1)(inputs), micro_batch_size=4)
        model.compile("sgd")
        rng = np.random.RandomState(0)
        with pytest.raises(ValueError, match=r"`compute_loss` is not.*weighted by its share"):
            model.fit(rng.normal(size=(16, 6)), rng.normal(size=16), batch_size=16, verbose=0)
        assert int(model.optimizer.iterations) == 0


@pytest.mark.skipif(not LEGACY, reason="Keras 3 converts no layer's `call` with AutoGraph")
class TestAutoGraph:
    """The user's Python control flow on tensors runs in the graph where plain tf_keras's does.

    tf_keras converts a subclassed layer's `call` with AutoGraph, and not the
    `train_step` or `compute_loss` its step functions call; the package's step
    functions convert nothing of their own either.
    """

    @staticmethod
    def _fit(model):
        x, y = regression_data(40, 6, 2, dtype="float64")
        model.compile(keras.optimizers.Adam(0.01), "mse")
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return model, history.history

    def test_a_branch_in_the_call_of_a_subclassed_model_runs_as_in_plain_tf_keras(self):
        # The kernel's mean falls from 0.0965 (0.0956, 0.0936, 0.0923 after the
        # first three steps, plain tf_keras): the branch switches at the fourth of six.
        threshold = 0.093

        def build(cls, **kwargs):
            class Branching(cls):
                def __init__(self, **kwargs):
                    super().__init__(**kwargs)
                    self.hidden, self.head = layers.Dense(8), layers.Dense(2)

                def call(self, inputs):
                    hidden = self.hidden(inputs)
                    # A `tf.cond` by AutoGraph, on the weights (the same for every
                    # micro-batch); it switches within the test's steps.
                    if tf.reduce_mean(self.hidden.kernel) > threshold:
                        hidden = tf.nn.relu(hidden)
                    else:
                        hidden = tf.tanh(hidden)
                    return self.head(hidden)

            keras.utils.set_random_seed(0)
            model = Branching(**kwargs)
            model(np.zeros((1, 6), "float32"))  # built eagerly
            return model

        plain = build(keras.Model)
        assert float(tf.reduce_mean(plain.hidden.kernel)) > threshold
        plain = self._fit(plain)
        assert float(tf.reduce_mean(plain[0].hidden.kernel)) < threshold  # both branches ran
        _assert_same(plain, self._fit(build(AccumulatingModel, **MICRO)))

    @pytest.mark.parametrize("cls", [keras.Model, AccumulatingModel])
    def test_a_branch_in_a_custom_train_step_is_refused_as_in_plain_tf_keras(self, cls):
        class Step(cls):
            def train_step(self, data):
                logs = super().train_step(data)
                if logs["loss"] > 1.0:
                    logs["large"] = logs["loss"]
                return logs

        inputs = keras.Input((6,))
        kwargs = MICRO if cls is AccumulatingModel else {}
        model = Step(inputs, layers.Dense(2)(inputs), **kwargs)
        with pytest.raises(tf.errors.OperatorNotAllowedInGraphError):
            self._fit(model)
