"""Custom train steps on JAX: `accumulate_gradients` (keras_memopt._step.jax_custom_steps).

Runs where Keras runs on JAX (CI's JAX pass). The oracle is the same custom step
on a plain `keras.Model`, with `jax.value_and_grad` on the whole batch, from the
same weights, in float64, compared at 1e-9: every weight and every logged figure.
"""

import warnings

import numpy as np
import pytest
from _helpers import FLOAT64
from conftest import JAX_MODULE

from keras_memopt._keras import BACKEND, keras

pytestmark = JAX_MODULE

if BACKEND == "jax":
    import jax

    jax.config.update("jax_enable_x64", True)

    from keras_memopt import AccumulatingModel

TOLERANCE = dict(rtol=1e-9, atol=1e-9)


def _gradients(model, loss_fn, data, variables, state=None):
    """`accumulate_gradients` on an AccumulatingModel; `jax.value_and_grad` of the
    whole batch on a plain model (the oracle), with the same results' structure."""
    if isinstance(model, AccumulatingModel):
        return model.accumulate_gradients(loss_fn, data, variables, state=state)
    if state is None:
        return jax.value_and_grad(loss_fn)(variables, data)
    return jax.value_and_grad(loss_fn, has_aux=True)(variables, data, state)


class _GuideStep:
    """Keras's guide's custom JAX step: one loss over the model's outputs, the
    non-trainable state carried, the loss tracked and the metrics updated from the
    whole batch's outputs."""

    @property
    def metrics(self):
        return [self.loss_tracker, self.accuracy]

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)

        def loss_fn(trainable, micro_batch, non_trainable):
            x, y = micro_batch
            y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x,
                                                        training=True)
            per_sample = keras.losses.sparse_categorical_crossentropy(y, y_pred,
                                                                      from_logits=True)
            return per_sample.mean(), (y_pred, non_trainable)

        (loss, (y_pred, non_trainable)), grads = _gradients(
            self, loss_fn, (x, y), trainable, state=non_trainable
        )
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable
        )
        new_metrics, logs = [], {}
        for metric in self.metrics:
            count = len(metric.variables)
            values, metrics_variables = metrics_variables[:count], metrics_variables[count:]
            if metric.name == "loss":
                values = metric.stateless_update_state(values, loss)
            else:
                values = metric.stateless_update_state(values, y, y_pred)
            logs[metric.name] = metric.stateless_result(values)
            new_metrics += values
        return logs, (trainable, non_trainable, optimizer_variables, new_metrics)


class _TwoUpdates:
    """Two losses, two parts of the model, two optimizers (keras.io's GAN's shape),
    through the form without state."""

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data
        trunk = len(self.trunk_variables)

        def loss_fn(values, micro_batch, head_scale):
            x, y = micro_batch
            y_pred, _ = self.stateless_call(values, non_trainable, x, training=True)
            return (head_scale * (y_pred - y) ** 2).mean()

        first, grads = _gradients(self, lambda v, d: loss_fn(v, d, 1.0), (x, y), trainable)
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable
        )
        # A second loss on the updated weights, for the trunk only.
        second, trunk_grads = _gradients(
            self, lambda v, d: loss_fn(v + trainable[trunk:], d, 0.5), (x, y), trainable[:trunk]
        )
        trunk_values = [v - 0.01 * g for v, g in zip(trainable[:trunk], trunk_grads, strict=True)]
        trainable = trunk_values + trainable[trunk:]
        return ({"first": first, "second": second},
                (trainable, non_trainable, optimizer_variables, metrics_variables))


class _WholeBatch:
    """A custom step that takes its gradients of the whole batch (`jax.value_and_grad`)."""

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data

        def loss_fn(values):
            y_pred, _ = self.stateless_call(values, non_trainable, x, training=True)
            return ((y_pred - y) ** 2).mean()

        loss, grads = jax.value_and_grad(loss_fn)(trainable)
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable
        )
        return {"loss": loss}, (trainable, non_trainable, optimizer_variables, metrics_variables)


class _AroundOwnStep:
    """A custom step around the model's own: `super().train_step(state, data)`."""

    def train_step(self, state, data):
        logs, state = super().train_step(state, data)
        return {**logs, "twice": 2 * logs["loss"]}, state


_CLASSES = {}


def _model(cls, step, outputs=3, **split):
    keras.utils.set_random_seed(1)
    if (cls, step) not in _CLASSES:
        _CLASSES[cls, step] = type(f"Custom{cls.__name__}", (step, cls), {})
    model_class = _CLASSES[cls, step]
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = model_class(inputs, keras.layers.Dense(outputs)(hidden), **split)
    model.trunk_variables = model.layers[1].trainable_variables
    model.loss_tracker = keras.metrics.Mean(name="loss")
    model.accuracy = keras.metrics.SparseCategoricalAccuracy(name="accuracy")
    return model


def _fit(step, optimizer, y, split, epochs=2):
    """Plain Keras and the AccumulatingModel from the same weights, each with its own
    `optimizer()`."""
    x = np.random.default_rng(3).normal(size=(50, 8))
    outputs = y.shape[-1] if y.ndim == 2 else 3
    plain = _model(keras.Model, step, outputs)
    ours = _model(AccumulatingModel, step, outputs, **split)
    ours.set_weights(plain.get_weights())
    results = []
    for model in (plain, ours):
        model.compile(optimizer=optimizer())
        history = model.fit(x, y, batch_size=20, epochs=epochs, shuffle=False, verbose=0)
        results.append((model, history.history))
    return results


class TestAccumulateGradients:
    @pytest.mark.parametrize("split", [{"micro_batch_size": 6}, {"accumulation_steps": 3}])
    def test_keras_guides_step_with_state_and_metrics(self, split):
        y = np.random.default_rng(4).integers(0, 3, 50)
        (plain, expected), (ours, got) = _fit(
            _GuideStep, lambda: keras.optimizers.Adam(0.01), y, split
        )
        assert sorted(got) == sorted(expected) == ["accuracy", "loss"]
        for name in expected:
            np.testing.assert_allclose(got[name], expected[name], err_msg=name, **TOLERANCE)
        for have, want in zip(ours.get_weights(), plain.get_weights(), strict=True):
            np.testing.assert_allclose(have, want, **TOLERANCE)

    def test_two_calls_for_two_sets_of_variables(self):
        y = np.random.default_rng(5).normal(size=(50, 2))
        (plain, expected), (ours, got) = _fit(
            _TwoUpdates, lambda: keras.optimizers.SGD(0.05), y, {"micro_batch_size": 7}
        )
        for name in ("first", "second"):
            np.testing.assert_allclose(got[name], expected[name], err_msg=name, **TOLERANCE)
        for have, want in zip(ours.get_weights(), plain.get_weights(), strict=True):
            np.testing.assert_allclose(have, want, **FLOAT64)


class TestRefusals:
    def _step_calling(self, **kwargs):
        class Step:
            def train_step(self, state, data):
                trainable = state[0]
                self.accumulate_gradients(lambda v, d: v[0].sum(), data, trainable, **kwargs)
                return {}, state

        return Step

    @pytest.mark.parametrize("argument, message", [
        ("forward", r"does not take `forward`.*Received: forward="),
        ("optimizer", r"LossScaleOptimizer.*Received: optimizer=LossScaleOptimizer"),
    ])
    def test_what_jax_does_not_take_yet_is_named_before_any_update(self, argument, message):
        kwargs = {"forward": lambda micro_batch: micro_batch} if argument == "forward" else {
            "optimizer": keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())}
        model = _model(AccumulatingModel, self._step_calling(**kwargs), micro_batch_size=2)
        model.compile(optimizer="sgd")
        before = model.get_weights()
        with pytest.raises(NotImplementedError, match=message):
            model.fit(np.ones((4, 8)), np.zeros(4), batch_size=4, verbose=0)
        for have, want in zip(model.get_weights(), before, strict=True):
            np.testing.assert_array_equal(have, want)


class TestOwnStep:
    def test_super_train_step_splits_and_does_not_warn(self):
        x = np.random.default_rng(6).normal(size=(50, 8))
        y = np.random.default_rng(7).integers(0, 3, 50)
        plain = _model(keras.Model, _AroundOwnStep)
        ours = _model(AccumulatingModel, _AroundOwnStep, micro_batch_size=6)
        ours.set_weights(plain.get_weights())
        histories = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for model in (plain, ours):
                model.compile(optimizer=keras.optimizers.Adam(0.01),
                              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                              metrics=["accuracy"])
                histories.append(model.fit(x, y, batch_size=20, epochs=2, shuffle=False,
                                           verbose=0).history)
        assert not [w for w in caught if "runs the whole batch" in str(w.message)]
        expected, got = histories
        assert sorted(got) == sorted(expected) == ["accuracy", "loss", "twice"]
        for name in expected:
            np.testing.assert_allclose(got[name], expected[name], err_msg=name, **TOLERANCE)
        for have, want in zip(ours.get_weights(), plain.get_weights(), strict=True):
            np.testing.assert_allclose(have, want, **TOLERANCE)


class TestWarning:
    def test_a_custom_step_that_splits_nothing_warns_once(self):
        x, y = np.ones((8, 8)), np.zeros((8, 3))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                model = _model(AccumulatingModel, _WholeBatch, micro_batch_size=4)
                model.compile(optimizer="sgd")
                model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        found = [w for w in caught if "runs the whole batch" in str(w.message)]
        assert len(found) == 1
        message = str(found[0].message)
        assert "Custom" in message and "super().train_step(state, data)" in message
        assert "micro_batch_size=4" in message
        assert found[0].filename == __file__  # where the user's `train_step` is written
