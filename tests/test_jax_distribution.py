"""`AccumulatingModel` on JAX under `keras.distribution` (keras_memopt._step.jax_step).

`DataParallel` over two host devices (`XLA_FLAGS=--xla_force_host_platform_device_count=2`,
which JAX reads once, when it starts): one child process trains the models and
sends back their weights, logs, evaluations, predictions and how the micro-batches
reached the model; the tests compare them in float64 at 1e-9 with plain Keras under
the same `DataParallel` at the whole batch and with the same model on one device,
alone and with `OOMBackoff` (a real XLA out-of-memory error mid-epoch), `MemoryLogger`,
`whole_batch_loss=True` and `remat` (named and "auto"). Other distributions are refused.
Runs in CI's JAX pass, like tests/test_jax.py.
"""

import os

import numpy as np
import pytest
from conftest import last_json, run_python

from keras_memopt._keras import BACKEND, keras

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="runs on Keras 3's JAX backend")

TOLERANCE = dict(rtol=1e-9, atol=1e-9)

CHILD = """
import json
import warnings

import jax
import numpy as np

from keras_memopt import AccumulatingModel
from keras_memopt._keras import keras
from keras_memopt.callbacks import MemoryLogger, OOMBackoff

jax.config.update("jax_enable_x64", True)
keras.backend.set_floatx("float64")
SEEN = []  # [samples, whether replicated on every device] of each traced batch


class Seen(keras.layers.Layer):
    '''Passes its input on; records, when traced, how the input is placed on the devices.
    Past `limit` rows (read when traced) it also sorts a buffer of 2**50 bytes or more,
    which XLA refuses when the step runs (RESOURCE_EXHAUSTED, tests/test_jax_oom.py).'''

    limit = 10**6

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x):
        rows = int(x.shape[0])
        if isinstance(x, jax.core.Tracer):  # not the eager calls of the first step's checks
            jax.debug.inspect_array_sharding(
                x, callback=lambda sharding: SEEN.append([rows, sharding.is_fully_replicated]))
        if rows <= self.limit:
            return x
        huge = jax.numpy.broadcast_to(x[:, :1, None], (rows, 2**20, 2**24))
        probe = jax.lax.stop_gradient(jax.lax.sort(huge, dimension=2)[:, 0, 0])
        return x + 0.0 * probe[:, None]


def coupled(y_true, y_pred):
    '''Each sample's cross-entropy weighted by a softmax over the batch's rows: a loss
    of the whole batch, not a sum over its samples.'''
    ops = keras.ops
    per_sample = keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
    return per_sample * ops.softmax(y_pred[:, 0], axis=0) * ops.shape(y_pred)[0]


def build(cls, batch_norm, split, loss=None):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, activation="relu", kernel_regularizer="l2", name="hidden")(
        Seen(name="seen")(inputs))
    if batch_norm:
        x = keras.layers.BatchNormalization()(x)
    model = cls(inputs, keras.layers.Dense(3)(x), **split)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy", keras.metrics.SparseCategoricalCrossentropy(from_logits=True)],
    )
    return model


class At(keras.callbacks.Callback):
    '''Before the first epoch's step `step`: sets `micro_batch_size` (and the limit of the
    model's Seen layer, where given).'''

    def __init__(self, step, size, limit=None):
        super().__init__()
        self.step, self.size, self.limit = step, size, limit
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == (0, self.step):
            self.model.micro_batch_size = self.size
            if self.limit is not None:
                self.model.get_layer("seen").limit = self.limit


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


def run(cls, devices, batch_norm=False, order=None, callbacks=(), loss=None, **split):
    rng = np.random.default_rng(0)
    x, y, w = rng.normal(size=(40, 8)), rng.integers(0, 3, 40), rng.uniform(0.1, 2.0, 40)
    if order is not None:  # the samples of each batch of 20 in this order
        rows = np.concatenate([start + np.array(order) for start in (0, 20)])
        x, y, w = x[rows], y[rows], w[rows]
    keras.distribution.set_distribution(keras.distribution.DataParallel() if devices == 2 else None)
    try:
        model = build(cls, batch_norm, split, loss)
        del SEEN[:]
        # Batches of 20 samples, 10 on each device (one shape: one compilation a step).
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            history = model.fit(x, y, sample_weight=w, batch_size=20, epochs=2, shuffle=False,
                                verbose=0, callbacks=list(callbacks)).history
        result = {"history": history, "weights": [w.tolist() for w in model.get_weights()],
                  "seen": list(SEEN), "warned": [str(w.message) for w in warned]}
        if isinstance(model, AccumulatingModel):
            result["micro_batch_size"] = model.micro_batch_size
            result["remat"] = [model.recomputed_segments, model.remat_choice]
        # Two more compilations, where they test something the others do not
        # (recomputation is for training only).
        if not (batch_norm or issubclass(cls, CustomStep) or callbacks or "remat" in split):
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
# OOMBackoff: at the first epoch's second step, micro-batches of 5 per device (10
# samples, over the limit) run out of memory, and the same batch runs again at 2 per
# device (4 samples); the oracle sets 2 there itself.
backoff = OOMBackoff(verbose=0)
results["backoff/2"] = run(AccumulatingModel, 2, micro_batch_size=3, callbacks=[
    backoff, At(1, 5, limit=6), MemoryLogger(devices=["CPU:0", "CPU:1"])])
results["backoff/2"]["backoffs"] = [
    [e["kind"], e["failed_micro_batch_size"], e["micro_batch_size"]] for e in backoff.backoffs]
results["sizes/2"] = run(AccumulatingModel, 2, micro_batch_size=3, callbacks=[At(1, 2)])
# whole_batch_loss=True, with a loss that couples the batch's samples.
results["coupled_plain/2"] = run(keras.Model, 2, loss=coupled)
results["whole_batch/2"] = run(AccumulatingModel, 2, loss=coupled, micro_batch_size=3,
                               whole_batch_loss=True)
# Recomputation: a named segment, and remat="auto"'s choice.
results["named/2"] = run(AccumulatingModel, 2, micro_batch_size=3, remat=["hidden"])
results["auto/2"] = run(AccumulatingModel, 2, micro_batch_size=3, remat="auto")
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def runs():
    # The pass's own XLA flags (CI's compile at -O0) and two host devices.
    flags = [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=2"]
    output = run_python(CHILD, timeout=300, env={
        "KERAS_BACKEND": "jax", "XLA_FLAGS": " ".join(flags).strip(),
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


def _trained(result):
    """`result` without `evaluate`'s and `predict`'s figures."""
    return {kind: value for kind, value in result.items()
            if kind not in ("evaluated", "predicted")}


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


class TestOOMBackoff:
    def test_a_backoff_retries_the_batch_as_a_run_at_the_smaller_size(self, runs):
        # The first epoch's second step, at 5 samples a device, runs out of memory
        # and runs again at 2 a device; the oracle sets 2 there itself.
        ours, oracle = runs["backoff/2"], runs["sizes/2"]
        assert ours["backoffs"] == [["train", 5, 2]]
        history = {name: values for name, values in ours["history"].items()
                   if name != "micro_batch_size" and not name.startswith("memory_")}
        _assert_same({**ours, "history": history}, oracle)
        assert ours["history"]["micro_batch_size"] == [2, 2]
        assert ours["micro_batch_size"] == oracle["micro_batch_size"] == 2
        # Micro-batches of 6 and 2 samples, then 10 (over the limit), then 4, each
        # split over both devices.
        assert ours["seen"] == [[6, False], [2, False], [10, False], [4, False]]
        assert oracle["seen"] == [[6, False], [2, False], [4, False]]


class TestMemoryLogger:
    def test_each_device_named_is_read(self, runs):
        # JAX's CPU devices give no `memory_stats()`: the host's RSS is logged, and
        # each device is named in its own warning.
        history, warned = runs["backoff/2"]["history"], runs["backoff/2"]["warned"]
        assert [name for name in history if name.startswith("memory_")] == [
            "memory_host_rss_mib"]
        assert all(value > 50 for value in history["memory_host_rss_mib"])
        assert [message.split()[7] for message in warned
                if "JAX gives no memory figures" in message] == ["CPU:0", "CPU:1"]

    def test_by_default_every_gpu_gives_its_figures(self, monkeypatch):
        # No GPU here: stand-ins for two of JAX's GPU devices (a DataParallel over
        # both), whose `memory_stats()` are read, each under its own name.
        import jax

        from keras_memopt import memory

        class Device:
            platform = "gpu"

            def __init__(self, mib):
                self.mib = mib

            def memory_stats(self):
                return {"bytes_in_use": self.mib * 2**20, "peak_bytes_in_use": 2 * self.mib * 2**20}

        real = jax.devices
        monkeypatch.setattr(jax, "devices", lambda kind=None: (
            [Device(3), Device(5)] if kind == "gpu" else real(kind)))
        figures = memory.MemoryReader(host=False, nvml=False).read()
        assert figures == {"memory_gpu0_current_mib": 3.0, "memory_gpu0_peak_mib": 6.0,
                           "memory_gpu1_current_mib": 5.0, "memory_gpu1_peak_mib": 10.0}


class TestWholeBatchLoss:
    def test_a_loss_of_the_whole_batch_matches_plain_keras_under_it(self, runs):
        _assert_same(runs["whole_batch/2"], runs["coupled_plain/2"])
        # Each micro-batch forward, then forward and backward, split over both devices.
        assert runs["whole_batch/2"]["seen"] == [[6, False], [6, False], [2, False], [2, False]]


class TestRecomputation:
    def test_a_named_segment_matches_plain_keras_under_it(self, runs):
        _assert_same(runs["named/2"], _trained(runs["plain/2"]))
        assert runs["named/2"]["remat"][0] == [["seen", "hidden"]]

    def test_auto_compiles_its_candidates_on_the_batchs_sharding(self, runs):
        _assert_same(runs["auto/2"], _trained(runs["plain/2"]))
        segments, note = runs["auto/2"]["remat"]
        # Too small to save anything: it chooses none, and warns.
        assert segments == [] and note.startswith("none: "), note
        assert any("found nothing worth recomputing" in m for m in runs["auto/2"]["warned"])
        # Each candidate compiled for the whole step, its micro-batches of each device's
        # 3 samples times the two devices, split over both (the batch's sharding), and
        # the last 2; then the step itself.
        assert "at a micro-batch of 6 (3 on each of 2 devices)" in note
        assert "; 3 candidates compiled in " in note
        assert runs["auto/2"]["seen"] == [[6, False], [2, False]] * 4


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
