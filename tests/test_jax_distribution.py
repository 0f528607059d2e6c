"""`AccumulatingModel` on JAX under `keras.distribution` (keras_memopt._step.jax_step).

`DataParallel` over two host devices (`XLA_FLAGS=--xla_force_host_platform_device_count=2`,
which JAX reads once, when it starts): one child process trains the models and
sends back their weights, logs, evaluations, predictions and how the micro-batches
reached the model; the tests compare them in float64 at 1e-9 with plain Keras under
the same `DataParallel` at the whole batch and with the same model on one device.
Other distributions are refused. Runs in CI's JAX pass, like tests/test_jax.py.
"""

import numpy as np
import pytest
from conftest import last_json, run_python

from keras_memopt._keras import BACKEND, keras

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="runs on Keras 3's JAX backend")

TOLERANCE = dict(rtol=1e-9, atol=1e-9)

CHILD = """
import json

import jax
import numpy as np

from keras_memopt import AccumulatingModel
from keras_memopt._keras import keras

jax.config.update("jax_enable_x64", True)
keras.backend.set_floatx("float64")
SEEN = []  # [samples, whether replicated on every device] of each traced batch


class Seen(keras.layers.Layer):
    '''Passes its input on; records, when traced, how the input is placed on the devices.'''

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x):
        rows = int(x.shape[0])
        jax.debug.inspect_array_sharding(
            x, callback=lambda sharding: SEEN.append([rows, sharding.is_fully_replicated]))
        return x


def build(cls, batch_norm, split):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, activation="relu", kernel_regularizer="l2")(Seen()(inputs))
    if batch_norm:
        x = keras.layers.BatchNormalization()(x)
    model = cls(inputs, keras.layers.Dense(3)(x), **split)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy", keras.metrics.SparseCategoricalCrossentropy(from_logits=True)],
    )
    return model


class CustomStep:
    '''Keras's guide's custom step: its gradients through `accumulate_gradients` on an
    AccumulatingModel, `jax.value_and_grad` on a plain model; it logs a figure of the
    whole batch's outputs that depends on their order.'''

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state

        def loss_fn(values, micro_batch, non_trainable):
            x, y, w = micro_batch
            y_pred, non_trainable = self.stateless_call(values, non_trainable, x, training=True)
            per_sample = keras.losses.sparse_categorical_crossentropy(y, y_pred, from_logits=True)
            return (per_sample * w).mean(), (y_pred, non_trainable)

        if isinstance(self, AccumulatingModel):
            (loss, (y_pred, non_trainable)), grads = self.accumulate_gradients(
                loss_fn, data, trainable, state=non_trainable)
        else:
            (loss, (y_pred, non_trainable)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                trainable, data, non_trainable)
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable)
        ordered = (y_pred[:, 0] * np.arange(1, y_pred.shape[0] + 1)).sum()
        return ({"loss": loss, "ordered": ordered},
                (trainable, non_trainable, optimizer_variables, metrics_variables))


def run(cls, devices, batch_norm=False, order=None, **split):
    rng = np.random.default_rng(0)
    x, y, w = rng.normal(size=(40, 8)), rng.integers(0, 3, 40), rng.uniform(0.1, 2.0, 40)
    if order is not None:  # the samples of each batch of 20 in this order
        rows = np.concatenate([start + np.array(order) for start in (0, 20)])
        x, y, w = x[rows], y[rows], w[rows]
    keras.distribution.set_distribution(keras.distribution.DataParallel() if devices == 2 else None)
    try:
        model = build(cls, batch_norm, split)
        del SEEN[:]
        # Batches of 20 samples, 10 on each device (one shape: one compilation a step).
        history = model.fit(x, y, sample_weight=w, batch_size=20, epochs=2, shuffle=False,
                            verbose=0).history
        result = {"history": history, "weights": [w.tolist() for w in model.get_weights()],
                  "seen": list(SEEN)}
        if not (batch_norm or issubclass(cls, CustomStep)):  # without two more compilations
            result["evaluated"] = model.evaluate(x, y, sample_weight=w, batch_size=20, verbose=0)
            result["predicted"] = model.predict(x, batch_size=20, verbose=0).tolist()
    finally:
        keras.distribution.set_distribution(None)
    return result


results = {"devices": jax.device_count(), "plain/2": run(keras.Model, 2)}
# micro_batch_size counts samples per device: each device's 10 samples of a batch
# as 3, 3, 3 and 1 (micro-batches of 6, 6, 6 and 2), or as 5 and 5 (of 10 and 10).
results["rest/1"] = run(AccumulatingModel, 1, micro_batch_size=3)
results["rest/2"] = run(AccumulatingModel, 2, micro_batch_size=3)
results["even/2"] = run(AccumulatingModel, 2, micro_batch_size=5)
# Micro-batches of samples 0-4 and 10-14, then 5-9 and 15-19, of each batch: on one
# device, the same micro-batches are the batch's rows in that order, 10 at a time.
results["batch_norm/2"] = run(AccumulatingModel, 2, True, micro_batch_size=5)
results["batch_norm/1"] = run(AccumulatingModel, 1, True, micro_batch_size=10, order=[
    *range(0, 5), *range(10, 15), *range(5, 10), *range(15, 20)])
results["custom_plain/2"] = run(type("Plain", (CustomStep, keras.Model), {}), 2)
results["custom/2"] = run(type("Custom", (CustomStep, AccumulatingModel), {}), 2,
                          micro_batch_size=3)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def runs():
    output = run_python(CHILD, timeout=300, env={
        "KERAS_BACKEND": "jax", "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    })
    results = last_json(output)
    assert results.pop("devices") == 2
    return results


def _assert_same(received, expected, tolerance=TOLERANCE):
    assert sorted(received["history"]) == sorted(expected["history"])
    for name, values in expected["history"].items():
        np.testing.assert_allclose(received["history"][name], values, err_msg=name, **tolerance)
    for have, want in zip(received["weights"], expected["weights"], strict=True):
        np.testing.assert_allclose(have, want, **tolerance)
    for kind in ("evaluated", "predicted"):
        assert (kind in received) == (kind in expected)
        if kind in expected:
            np.testing.assert_allclose(received[kind], expected[kind], err_msg=kind, **tolerance)


class TestDataParallel:
    @pytest.mark.parametrize("split", ["rest", "even"])
    def test_matches_plain_keras_under_it_at_the_whole_batch(self, runs, split):
        _assert_same(runs[f"{split}/2"], runs["plain/2"])

    def test_a_custom_step_through_accumulate_gradients(self, runs):
        _assert_same(runs["custom/2"], runs["custom_plain/2"])
        assert runs["custom/2"]["seen"] == [[6, False], [2, False]]

    def test_matches_the_same_model_on_one_device(self, runs):
        _assert_same(runs["rest/2"], runs["rest/1"])

    def test_each_micro_batch_holds_a_part_of_each_devices_share(self, runs):
        # BatchNormalization normalises each micro-batch with its statistics, so
        # only the same micro-batches give the same update. Plain Keras 3.15 with
        # this model ends 1.8e-8 apart between two devices and one (its compiled
        # BatchNormalization forward pass holds `f32` reductions in a float64
        # model); these micro-batches 1.4e-8, and on one device in the batch's
        # own order (other micro-batches) 0.06.
        _assert_same(runs["batch_norm/2"], runs["batch_norm/1"], dict(rtol=1e-6, atol=1e-6))

    @pytest.mark.parametrize("split, sizes", [("rest", [6, 2]), ("even", [10])])
    def test_each_micro_batch_is_split_over_both_devices(self, runs, split, sizes):
        # Not gathered onto each device to run whole there (XLA's choice for
        # micro-batches cut as runs of the batch's rows).
        assert runs[f"{split}/2"]["seen"] == [[size, False] for size in sizes]
        assert runs["rest/1"]["seen"] == [[3, True], [2, True]]


def _model_parallel():
    devices = keras.distribution.list_devices()[:1]
    mesh = keras.distribution.DeviceMesh((1, 1), ["batch", "model"], devices)
    return keras.distribution.ModelParallel(layout_map=keras.distribution.LayoutMap(mesh))


class TestOtherDistributions:
    def _model(self):
        from keras_memopt import AccumulatingModel

        keras.utils.set_random_seed(1)
        inputs = keras.Input((4,))
        return AccumulatingModel(inputs, keras.layers.Dense(2)(inputs), micro_batch_size=2)

    def test_model_parallel_is_refused_at_compile(self):
        model = self._model()
        keras.distribution.set_distribution(_model_parallel())
        try:
            with pytest.raises(NotImplementedError, match=(
                r"under `keras.distribution.DataParallel` or without.*"
                r"Received: distribution=<ModelParallel")):
                model.compile(optimizer="sgd", loss="mse")
        finally:
            keras.distribution.set_distribution(None)
        assert not model.compiled

    def test_one_set_after_compile_is_refused_before_any_update(self):
        model = self._model()
        model.compile(optimizer="sgd", loss="mse")
        before = [w.copy() for w in model.get_weights()]
        x, y = np.ones((8, 4)), np.zeros((8, 2))
        keras.distribution.set_distribution(_model_parallel())
        try:
            with pytest.raises(NotImplementedError, match=r"Received: distribution=<ModelParallel"):
                model.fit(x, y, batch_size=8, verbose=0)
        finally:
            keras.distribution.set_distribution(None)
        for have, want in zip(model.get_weights(), before, strict=True):
            np.testing.assert_array_equal(have, want)
        assert int(model.optimizer.iterations.numpy()) == 0
