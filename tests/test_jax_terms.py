"""The terms of `model.losses` on JAX (`keras_memopt._step.jax_terms`).

Each term is found, before the first step that splits a batch, to average over the samples, to
sum over them or to depend on none (as on the TensorFlow line: `keras_memopt._step.seen`); the
micro-batches add a sum as it is and any other with their fraction of the batch. The oracle is plain
Keras on JAX training the same model from the same weights on the whole batch, in float64, compared
at 1e-9 after three epochs of three steps (batches of 20, 20 and 10 samples): every weight and every
figure `fit` logs, the validation's (the test step's) included.
"""

import numpy as np
import pytest
from _helpers import assert_same_logs, assert_same_weights, compile_classifier
from conftest import JAX_MODULE

from keras_memopt._keras import BACKEND, keras

pytestmark = JAX_MODULE

if BACKEND == "jax":
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)

    from keras_memopt import AccumulatingModel

TOLERANCE = dict(rtol=1e-9, atol=1e-9)
SAMPLES, BATCH = 50, 20


class _Penalty(keras.layers.Layer):
    """Passes its inputs on and adds a term of them: their mean square ("mean", in jnp:
    Keras 3.15's `ops.mean` computes float64 in float32 under `jax.jit`), their sum
    ("sum"), the square of their sum, which neither averages nor sums ("square of sum"), the
    square of its own weight, which no sample changes ("weight"), or NaN, its gradient too
    ("not finite")."""

    def __init__(self, kind, only_in_training=False, **kwargs):
        super().__init__(**kwargs)
        self.kind = kind
        self.only_in_training = only_in_training

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

    def call(self, inputs, training=None):
        if self.only_in_training and not training:
            return inputs * self.scale
        term = {
            "mean": lambda: 0.5 * jnp.mean(jnp.square(inputs)),
            "sum": lambda: 1e-2 * keras.ops.sum(inputs),
            "square of sum": lambda: 1e-3 * jnp.square(jnp.sum(inputs)),
            "not finite": lambda: jnp.sqrt(-1.0 - jnp.mean(jnp.square(inputs))),
            "weight": lambda: 0.3 * jnp.square(self.scale - 0.5),
        }[self.kind]()
        self.add_loss(term)
        return inputs * self.scale


def _functional(kind):
    def build(cls, **split):
        keras.utils.set_random_seed(5)
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="relu")(inputs)
        outputs = keras.layers.Dense(3)(_Penalty(kind)(hidden))
        return cls(inputs, outputs, **split)

    return build


class _Regularised(keras.Model):
    """A subclassed model with an activity regulariser (Keras's, and a callable of its own)
    and an `add_loss` term."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu", activity_regularizer="l2")
        self.penalty = _Penalty("sum")
        self.out = keras.layers.Dense(3, activity_regularizer=lambda x: 1e-2 * jnp.sum(x**2))

    def call(self, x):
        return self.out(self.penalty(self.hidden(x)))


def _subclassed(cls, **split):
    keras.utils.set_random_seed(6)
    if cls is keras.Model:
        model = _Regularised()
    else:
        model = type("AccumulatingRegularised", (AccumulatingModel, _Regularised), {})(**split)
    model(np.zeros((1, 8)))
    return model


def _nested_sequential(cls, **split):
    """A functional model around a Sequential whose layers add a mean and a sum term and
    carry an activity regulariser."""
    keras.utils.set_random_seed(7)
    inner = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="relu", activity_regularizer="l1"),
        _Penalty("mean"),
        _Penalty("sum"),
    ])
    inputs = keras.Input((8,))
    return cls(inputs, keras.layers.Dense(3)(inner(inputs)), **split)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(SAMPLES, 8)), rng.integers(0, 3, SAMPLES)


def _fit_both(build, split, epochs=3):
    x, y = _data()
    plain, ours = build(keras.Model), build(AccumulatingModel, **split)
    ours.set_weights(plain.get_weights())
    histories = []
    for model in (plain, ours):
        compile_classifier(model, metrics=["accuracy"])
        history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                            validation_data=(x[:BATCH], y[:BATCH]))
        histories.append(history.history)
    return plain, ours, histories


def _weights_and_iterations(model):
    return [w.copy() for w in model.get_weights()], int(model.optimizer.iterations.numpy())


class TestTermsSplit:
    # micro_batch_size=6: 20 -> 6, 6, 6, 2 and 10 -> 6, 4; 7: 20 -> 7, 7, 6 and 10 -> 7, 3.
    @pytest.mark.parametrize("build, split, terms", [
        (_functional("mean"), {"micro_batch_size": 6}, 1),
        (_functional("sum"), {"micro_batch_size": 6}, 1),
        (_functional("weight"), {"micro_batch_size": 6}, 1),
        (_functional("sum"), {"micro_batch_size": 7}, 1),
        # NaN from the first step, as plain Keras trains it (the fuzzer's seed 303 refitted
        # a model whose weights had become NaN): not refused as neither sum nor mean.
        (_functional("not finite"), {"micro_batch_size": 6}, 1),
        (_subclassed, {"accumulation_steps": 3}, 3),
        (_nested_sequential, {"micro_batch_size": 7}, 3),
    ], ids=["mean", "sum", "independent of the samples", "sum, uneven last micro-batch",
            "not finite",
            "activity regularisers in a subclassed model", "terms in a nested Sequential"])
    def test_matches_the_whole_batch(self, build, split, terms):
        plain, ours, (expected, got) = _fit_both(build, split)
        assert_same_logs(got, expected, TOLERANCE)
        assert_same_weights(ours, plain, TOLERANCE)
        assert len(_terms(ours)) == terms


def _terms(model):
    """The terms of `model.losses` of a call (Keras keeps none of a stateless one)."""
    values = [[v.value for v in vs] for vs in (model.trainable_variables,
                                               model.non_trainable_variables)]
    return model.stateless_call(*values, _data()[0][:2], return_losses=True)[2]


class TestRefusals:
    @pytest.mark.parametrize("ema", [False, True])
    def test_a_term_that_neither_sums_nor_averages_is_refused_before_any_update(self, ema):
        # Keras's JAX `fit` ends, even when it raises, by setting the weights to the
        # optimizer's moving averages where it keeps them (zeros before any update).
        model = _functional("square of sum")(AccumulatingModel, micro_batch_size=2)
        compile_classifier(model, keras.optimizers.Adam(use_ema=ema))
        model.optimizer.build(model.trainable_variables)
        before, iterations = _weights_and_iterations(model)
        # The TensorFlow line's error: the square of a sum is 4 times as large on the
        # samples repeated.
        with pytest.raises(ValueError, match=r"cannot split a loss term over micro-batches "
                           r"exactly: term 0 of `model.losses` went from .* \(x4\) when every "
                           r"sample was repeated.*Received: model.losses\[0\]"):
            model.fit(*_data(), batch_size=4, epochs=1, verbose=0)
        after, iterations_after = _weights_and_iterations(model)
        assert iterations_after == iterations == 0
        for old, new in zip(before, after, strict=True):
            np.testing.assert_array_equal(new, old)

    def test_a_term_added_only_in_training_is_refused_before_any_update(self):
        keras.utils.set_random_seed(2)
        inputs = keras.Input((8,))
        penalty = _Penalty("mean", only_in_training=True)
        model = AccumulatingModel(inputs, keras.layers.Dense(3)(penalty(inputs)),
                                  micro_batch_size=2)
        compile_classifier(model)
        model.optimizer.build(model.trainable_variables)
        before, _ = _weights_and_iterations(model)
        with pytest.raises(NotImplementedError, match=r"term added only in training.*"
                           r"Received: 0 term\(s\) in inference, 1 in this step"):
            model.fit(*_data(), batch_size=4, epochs=1, verbose=0)
        after, iterations = _weights_and_iterations(model)
        assert iterations == 0
        for old, new in zip(before, after, strict=True):
            np.testing.assert_array_equal(new, old)

    def test_a_custom_step_around_the_own_step_takes_no_add_loss(self):
        class AroundOwnStep(AccumulatingModel):
            def train_step(self, state, data):
                return super().train_step(state, data)

        build = _functional("mean")
        model = build(AroundOwnStep, micro_batch_size=6)
        compile_classifier(model)
        with pytest.raises(NotImplementedError, match=r"custom `train_step` or `test_step`.*"
                           r"Received: 1 such term"):
            model.fit(*_data(), batch_size=BATCH, epochs=1, verbose=0)

    def test_a_batch_of_one_micro_batch_is_not_probed(self):
        # Keras's own step: what the split cannot take trains as in plain Keras.
        model = _functional("square of sum")(AccumulatingModel, micro_batch_size=BATCH)
        compile_classifier(model)
        model.fit(*_data(), batch_size=BATCH, epochs=1, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == 3
