"""Metrics that layers update in `call` (tf_keras's `add_metric`, a layer's own
`keras.metrics.Mean`): logged as plain Keras logs them at the whole batch."""

import warnings

import numpy as np
import pytest
import tensorflow as tf
from _fuzz_models import Monitored
from _helpers import assert_same_logs, classification_data, compile_classifier
from _oracles import dense_gradients
from conftest import LEGACY

from keras_memopt import AccumulatingModel
from keras_memopt._keras import keras

layers = keras.layers


class AddedMetrics(layers.Layer):
    """tf_keras's `add_metric`: a mean and a sum over the samples."""

    def call(self, inputs):
        self.add_metric(tf.reduce_mean(inputs), name="added_mean")
        self.add_metric(tf.reduce_sum(tf.abs(inputs)), name="added_sum")
        return inputs


def _model(cls, family, **kwargs):
    keras.utils.set_random_seed(0)
    if family == "mlp":
        inputs = keras.Input((6,))
        x = layers.Dense(5, activation="tanh")(inputs)
    elif family == "normalized":  # the sum of its outputs is zero at the initial weights
        inputs = keras.Input((6,))
        x = layers.LayerNormalization()(layers.Dense(5)(inputs))
    else:  # a tagger: Embedding(mask_zero), whose loss counts unmasked tokens
        inputs = keras.Input((7,), dtype="int32")
        x = layers.Embedding(20, 5, mask_zero=True)(inputs)
    x = Monitored(name="monitored")(x)
    if LEGACY:
        x = AddedMetrics(name="added")(x)
    model = cls(inputs, layers.Dense(3)(x), **kwargs)
    optimizer = keras.optimizers.Adam(0.01)
    if cls is not AccumulatingModel:  # the Embedding's oracle (docs/accumulation.md)
        optimizer = dense_gradients(optimizer)
    return compile_classifier(model, optimizer)


def _data(family, n=22):
    if family in ("mlp", "normalized"):
        return classification_data(n)
    rng = np.random.RandomState(0)
    tokens = rng.randint(1, 20, size=(n, 7))
    tokens[np.arange(7)[None, :] >= rng.randint(2, 8, size=n)[:, None]] = 0
    return tokens, rng.randint(0, 3, size=(n, 7))


def _train(model, x, y):
    history = model.fit(
        x, y, batch_size=10, epochs=2, validation_data=(x, y), shuffle=False, verbose=0
    ).history
    return history, model.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)


# A recomputed segment that ends after the metrics' layers: its backward pass runs them again.
SEGMENT = dict(remat=["added" if LEGACY else "monitored"])


@pytest.fixture(scope="module")
def plain_run():
    """Plain Keras's run of a family, trained once a module (a process): four of the
    cases below compare against the same MLP's."""
    runs = {}

    def run(family):
        if family not in runs:
            runs[family] = _train(_model(keras.Model, family), *_data(family))
        return runs[family]

    return run


@pytest.mark.parametrize(
    "family, options",
    [
        ("mlp", {}),
        ("tagger", {}),
        ("normalized", {}),
        ("mlp", dict(whole_batch_loss=True)),
        ("mlp", SEGMENT),
        ("mlp", dict(whole_batch_loss=True, **SEGMENT)),
    ],
    ids=["mlp", "tagger", "normalized", "whole-batch-loss", "remat", "whole-batch-loss-remat"],
)
def test_layer_metrics_are_logged_as_plain_keras_logs_them(family, options, plain_run):
    x, y = _data(family)
    plain = plain_run(family)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # each is a mean, a sum or per element
        model = _model(AccumulatingModel, family, micro_batch_size=3, **options)
        accumulated = _train(model, x, y)
    names = {"activation_mean", "activation_sum", "activation_elements"}
    names |= {"added_mean", "added_sum"} if LEGACY else set()
    assert names <= set(plain[0]), plain[0]
    assert set(plain[0]) == set(accumulated[0])
    assert_same_logs(accumulated[0], plain[0], dict(rtol=2e-5))
    assert set(plain[1]) == set(accumulated[1])
    assert_same_logs(accumulated[1], plain[1], dict(rtol=2e-5))


class Tracked(layers.Layer):
    """Owns a metric that its `call` updates with the inputs' maximum (no mean, sum or
    per-sample value), or does not update at all (`highest=False`: another method does)."""

    def __init__(self, highest=True, **kwargs):
        super().__init__(**kwargs)
        self.highest = highest
        self.metric = keras.metrics.Mean(name="activation_max" if highest else "seen_elsewhere")

    def call(self, inputs):
        if self.highest:
            self.metric.update_state(tf.reduce_max(inputs))
        return inputs


def _fit_tracked(highest):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    model = AccumulatingModel(
        inputs, layers.Dense(3)(Tracked(highest)(inputs)), micro_batch_size=3
    )
    model.compile("sgd", "mse")
    x, _ = _data("mlp")
    model.fit(x, np.zeros((len(x), 3)), batch_size=10, epochs=1, verbose=0)


def test_a_metric_that_is_no_mean_sum_or_per_sample_is_named_in_a_warning():
    with pytest.warns(UserWarning, match="'activation_max', which a layer updates in `call`"):
        _fit_tracked(highest=True)


def test_a_metric_no_forward_pass_updates_is_left_alone_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _fit_tracked(highest=False)
