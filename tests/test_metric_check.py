"""Compiled metrics that do not add up over micro-batches (`keras_memopt._step.probe`).

The step updates the compiled metrics with each micro-batch's outputs. A metric of
per-sample values (a mean, a confusion matrix's counts, `R2Score`'s sums, a running
maximum) then logs plain Keras's figure; one that computes a single value from the
batch's samples together (a correlation over the batch, a metric function returning
one scalar per batch) would log another. Such a metric is refused at the first step,
before any update, unless `whole_batch_loss=True`, where the metrics see the whole
batch's outputs once: then every figure is plain Keras's.
"""

import pytest
import tensorflow as tf
from _helpers import FLOAT32, IDENTICAL, assert_same_logs, assert_same_weights, regression_data

from keras_memopt import AccumulatingModel
from keras_memopt._keras import LEGACY, keras

layers = keras.layers
N, BATCH, MICRO = 40, 16, 4  # the last batch of each epoch has 8 samples: 2 micro-batches


def _model(cls, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = layers.Dense(8, activation="tanh")(inputs)
    return cls(inputs, layers.Dense(2)(hidden), **kwargs)


def batch_mean_error(y_true, y_pred):
    """One scalar for the whole batch, which Keras averages over batches."""
    return tf.reduce_mean(tf.abs(y_true - y_pred))


class LargestError(keras.metrics.Metric):
    """A running maximum: it adds up over micro-batches."""

    def __init__(self, name="largest_error", **kwargs):
        super().__init__(name=name, **kwargs)
        self.largest = self.add_weight(name="largest", initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        error = tf.reduce_max(tf.abs(y_true - y_pred))
        self.largest.assign(tf.maximum(self.largest, error))

    def result(self):
        return self.largest


def _coupled():
    metrics = {"batch_mean_error": lambda: batch_mean_error}
    if not LEGACY:
        metrics["pearson_correlation"] = lambda: keras.metrics.PearsonCorrelation(axis=0)
        metrics["concordance_correlation"] = lambda: keras.metrics.ConcordanceCorrelation(axis=0)
    return metrics


def _additive():
    metrics = {
        "largest_error": LargestError,
        "r2_score": keras.metrics.R2Score,
        "rmse": lambda: keras.metrics.RootMeanSquaredError(name="rmse"),
    }
    if not LEGACY:  # per sample, over its two outputs
        metrics["pearson_correlation"] = keras.metrics.PearsonCorrelation
    return metrics


def _train(cls, metric, **kwargs):
    x, y = regression_data(N, 6, 2)
    model = _model(cls, **kwargs)
    model.compile(keras.optimizers.Adam(0.05), "mse", metrics=[metric()])
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    evaluation = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    return model, history, evaluation


def _assert_plain_keras(metric, **kwargs):
    plain, plain_logs, plain_eval = _train(keras.Model, metric)
    model, logs, evaluation = _train(AccumulatingModel, metric, micro_batch_size=MICRO, **kwargs)
    assert_same_weights(model, plain, FLOAT32)
    assert set(logs) == set(plain_logs)
    assert_same_logs(logs, plain_logs, FLOAT32)
    assert_same_logs(evaluation, plain_eval, FLOAT32)


@pytest.mark.parametrize("name", sorted(_coupled()))
def test_a_metric_of_the_batch_together_is_refused_before_any_update(name):
    x, y = regression_data(N, 6, 2)
    model = _model(AccumulatingModel, micro_batch_size=MICRO)
    model.compile(keras.optimizers.Adam(0.05), "mse", metrics=[_coupled()[name]()])
    weights = model.get_weights()
    match = (r"compiled metrics with each micro-batch.*whole_batch_loss=True.*"
             rf"Received: metrics \['{name}'\], whole_batch_loss=False")
    with pytest.raises(ValueError, match=match):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert_same_weights(weights, model, IDENTICAL)
    assert int(model.optimizer.iterations.numpy()) == 0


@pytest.mark.parametrize("name", sorted(_coupled()))
def test_with_whole_batch_loss_it_logs_plain_keras_figures(name):
    _assert_plain_keras(_coupled()[name], whole_batch_loss=True)


@pytest.mark.parametrize("name", sorted(_additive()))
def test_a_metric_that_adds_up_is_taken_and_logs_plain_keras_figures(name):
    _assert_plain_keras(_additive()[name])
