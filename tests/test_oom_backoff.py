"""OOMBackoff: rollback, retry with the same batch, which phases it backs off in, real OOMs.

Unit tests of the control flow put a layer in the model that raises an
out-of-memory error from its own batch (`tests/_faults.py`): the steps before
it run and change state, so a rollback that misses anything shows. The tests
marked slow run real out-of-memory errors in a subprocess whose TensorFlow
CPU allocator has a memory limit. The retried step computes exactly what a run
started at that micro-batch computes (same ops, same order): results agree
within `SAME_COMPUTATION`.
"""

import json
import os
import re

import numpy as np
import pytest
import tensorflow as tf
from _faults import OutOfMemoryAbove, OutOfMemoryAtSample, OutOfMemoryOnce
from _helpers import (
    IDENTICAL,
    SAME_COMPUTATION,
    assert_same_weights,
    classification_data,
    compile_classifier,
)
from conftest import LEGACY, last_json, run_python

from keras_memopt import AccumulatingModel
from keras_memopt._keras import global_random_state, keras
from keras_memopt.callbacks import OOMBackoff
from keras_memopt.memory import format_bytes

layers = keras.layers


class GlobalNoise(layers.Layer):
    """Adds noise drawn without a seed: from Keras 3's global seed generator."""

    def call(self, inputs, training=None):
        if training:
            return inputs + 0.1 * keras.random.normal(tf.shape(inputs))
        return inputs


def _dropout(hidden):
    # tf_keras's default dropout draws with stateful random ops, whose state
    # no variable holds: its stateless kind is the one that can be rolled back.
    if LEGACY:
        return layers.Dropout(0.3, seed=1, rng_type="stateless")(hidden)
    return layers.Dropout(0.3, seed=1)(hidden)


def _model(micro_batch_size=None, limit=None, batch_norm=False, dropout=False, noise=False,
           fault=None, features=6, optimizer=None, **kwargs):
    """A small classifier; `limit`: micro-batches of more rows run out of memory."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((features,))
    hidden = fault(inputs) if fault is not None else inputs
    hidden = layers.Dense(16, activation="tanh")(hidden)
    if batch_norm:
        hidden = layers.BatchNormalization()(hidden)
    if dropout:
        hidden = _dropout(hidden)
    if noise:
        hidden = GlobalNoise()(hidden)
    hidden = OutOfMemoryAbove(limit, name="device")(hidden)
    outputs = layers.Dense(3)(hidden)
    model = AccumulatingModel(inputs, outputs, micro_batch_size=micro_batch_size)
    return compile_classifier(model, optimizer, metrics=["accuracy"], **kwargs)


def _fit(model, x, y, callbacks=(), epochs=1, batch_size=32, **kwargs):
    history = model.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
        callbacks=list(callbacks), **kwargs,
    )
    return history.history


def _values(variables):
    return [np.array(tf.convert_to_tensor(v)) for v in variables]


class TestArguments:
    @pytest.mark.parametrize("factor", [0, 1, 1.5, -0.5, True, "half"])
    def test_factor_must_be_between_zero_and_one(self, factor):
        with pytest.raises(ValueError, match=r"`factor` must be .* Received: factor="):
            OOMBackoff(factor=factor)

    @pytest.mark.parametrize("minimum", [0, -1, 2.0, None])
    def test_minimum_must_be_a_positive_integer(self, minimum):
        with pytest.raises(
            ValueError, match=r"positive integer. Received: min_micro_batch_size="
        ):
            OOMBackoff(min_micro_batch_size=minimum)

    def test_plain_keras_model_is_told_what_to_do(self):
        x, y = classification_data(96)
        inputs = keras.Input((6,))
        model = keras.Model(inputs, layers.Dense(3)(inputs))
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        with pytest.raises(TypeError, match=r"AccumulatingModel.from_model\(model\)"):
            model.fit(x, y, epochs=1, verbose=0, callbacks=[OOMBackoff()])


def test_the_progress_bar_shows_the_micro_batch_only_at_the_epochs_end(capsys):
    x, y = classification_data(96)
    model = _model(micro_batch_size=32, limit=16)
    model.fit(x, y, batch_size=32, epochs=1, verbose=2, callbacks=[OOMBackoff(verbose=0)])
    line = capsys.readouterr().out.strip().splitlines()[-1]  # verbose=2: one line an epoch
    assert "micro_batch_size: 16" in line
    steps = _StepLogs()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[OOMBackoff(verbose=0), steps])
    assert steps.logs and all("micro_batch_size" not in logs for logs in steps.logs)


class _StepLogs(keras.callbacks.Callback):
    """Keeps every training step's logs (`logs`)."""

    def on_train_begin(self, logs=None):
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append(dict(logs or {}))


class TestBackoff:
    def test_oom_keeps_the_training_result(self, capsys):
        x, y = classification_data(96)
        model = _model(micro_batch_size=32, limit=8)
        backoff = OOMBackoff()
        history = _fit(model, x, y, [backoff], epochs=2)
        reference = _model(micro_batch_size=8)
        expected = _fit(reference, x, y, epochs=2)

        assert_same_weights(model, reference, SAME_COMPUTATION)
        for key, values in expected.items():
            np.testing.assert_allclose(history[key], values, rtol=1e-6, err_msg=key)
        assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == 6
        assert model.micro_batch_size == 8
        assert history["micro_batch_size"] == [8, 8]  # once an epoch, from the callback
        steps = [(b["failed_micro_batch_size"], b["micro_batch_size"]) for b in backoff.backoffs]
        assert steps == [(32, 16), (16, 8)]
        assert {b["phase"] for b in backoff.backoffs} == {"micro_batch"}
        out = capsys.readouterr().out
        assert "micro_batch_size=32" in out and "retrying the same batch" in out
        assert "shape [32, 16]" in out

    def test_factor_and_minimum_are_used_quietly(self, capsys):
        x, y = classification_data(32)
        model = _model(micro_batch_size=32, limit=5)
        backoff = OOMBackoff(factor=0.25, min_micro_batch_size=3, verbose=0)
        _fit(model, x, y, [backoff])
        sizes = [b["micro_batch_size"] for b in backoff.backoffs]
        assert sizes == [8, 3] and model.micro_batch_size == 3
        assert "OOMBackoff" not in capsys.readouterr().out

    def test_failed_step_leaves_no_trace(self):
        """Checked against a run that never failed, not against the snapshot's own list.

        The model (Dropout, BatchNorm, noise from the global seed generator)
        runs out of memory in the second micro-batch of its second step, at
        the smallest micro-batch allowed: the first micro-batch has changed
        BatchNorm statistics, seed states and metrics by then. A reference
        trains on the first batch only. Every variable Keras knows of, the
        optimizer's, the metrics' and the global seed generator's must then
        agree, and training on from there must give the same weights (a
        random state that was not put back would draw other masks).
        """
        x, y = classification_data(96)
        index = np.arange(len(x), dtype="float32")[:, None]
        xi = np.concatenate([x, index], axis=1)
        fault = OutOfMemoryAtSample(None)
        options = dict(micro_batch_size=16, batch_norm=True, dropout=True, noise=not LEGACY,
                       features=7)
        model = _model(fault=fault, **options)

        class FailTheSecondStep(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                fault.first = 48 if batch == 1 else None

        with pytest.raises(tf.errors.ResourceExhaustedError) as raised:
            _fit(model, xi, y, [FailTheSecondStep(), OOMBackoff(min_micro_batch_size=16)])
        failed_global = _values(global_random_state())
        fault.first = None
        reference = _model(fault=OutOfMemoryAtSample(None), **options)
        _fit(reference, xi[:32], y[:32])
        assert len(model.variables) == len(reference.variables) > 0
        for name, get in [
            ("variables", lambda m: m.variables),
            ("optimizer", lambda m: m.optimizer.variables),
            ("metrics", lambda m: [v for metric in m.metrics for v in metric.variables]),
        ]:
            for a, b in zip(_values(get(model)), _values(get(reference)), strict=True):
                np.testing.assert_array_equal(a, b, err_msg=name)
        for a, b in zip(failed_global, _values(global_random_state()), strict=True):
            np.testing.assert_array_equal(a, b, err_msg="global seed generator")

        for m in (model, reference):
            m.fit(xi, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        assert_same_weights(model, reference, IDENTICAL)

        report = str(raised.value.message)
        assert "micro_batch_size=16, min_micro_batch_size=16" in report
        assert "a tensor of shape [16, 16] and type float" in report
        assert re.search(r"Device memory: [\d.]+ [KMG]?i?B in use, peak [\d.]+ [KMG]?i?B", report)
        for advice in ("remat", "mixed_float16", "smaller model", "cuda_malloc_async"):
            assert advice in report

    def test_without_backoff_an_oom_stops_training_as_in_plain_keras(self):
        x, y = classification_data(32)
        model = _model(micro_batch_size=32, limit=8)
        with pytest.raises(tf.errors.OpError, match="OOM when allocating"):
            _fit(model, x, y)
        assert model.get_layer("device").raised == 1 and model.micro_batch_size == 32

    def test_evaluate_and_predict_back_off(self):
        x, y = classification_data(96)
        reference = _model(micro_batch_size=16)
        model = _model(micro_batch_size=32, limit=16)
        expected = reference.evaluate(x, y, batch_size=32, verbose=0)
        backoff = OOMBackoff()
        results = model.evaluate(x, y, batch_size=32, verbose=0, callbacks=[backoff])
        np.testing.assert_allclose(results, expected, rtol=1e-6)
        assert model.micro_batch_size == 16
        assert [b["phase"] for b in backoff.backoffs] == ["evaluation"]
        model.micro_batch_size = 32
        backoff = OOMBackoff()
        predictions = model.predict(x, batch_size=32, verbose=0, callbacks=[backoff])
        np.testing.assert_allclose(
            predictions, reference.predict(x, batch_size=32, verbose=0), **SAME_COMPUTATION
        )
        assert [b["kind"] for b in backoff.backoffs] == ["predict"]

    def test_validation_during_fit_backs_off(self):
        x, y = classification_data(96)
        model = _model(micro_batch_size=32, limit=16)
        history = _fit(model, x, y, [OOMBackoff()], validation_data=(x, y))
        reference = _model(micro_batch_size=16)
        expected = _fit(reference, x, y, validation_data=(x, y))
        np.testing.assert_allclose(history["val_loss"], expected["val_loss"], rtol=1e-6)

    def test_custom_train_step_backs_off(self):
        """A custom step built on `accumulate_gradients` is rolled back and retried too."""

        class Custom(AccumulatingModel):
            def train_step(self, data):
                x, y = data

                def loss_fn(micro):
                    micro_x, micro_y = micro
                    return self.compute_loss(y=micro_y, y_pred=self(micro_x, training=True))

                variables = self.trainable_variables
                loss, grads = self.accumulate_gradients(loss_fn, (x, y), variables)
                self.optimizer.apply_gradients(zip(grads, variables, strict=True))
                return {"custom_loss": loss}

        def build(size, limit=None):
            keras.utils.set_random_seed(0)
            inputs = keras.Input((6,))
            hidden = _dropout(layers.Dense(16, activation="tanh")(inputs))
            hidden = OutOfMemoryAbove(limit)(hidden)
            model = Custom(inputs, layers.Dense(3)(hidden), micro_batch_size=size)
            model.compile(keras.optimizers.Adam(0.01), keras.losses.MeanSquaredError())
            return model

        x, y = classification_data(96)
        y = np.eye(3, dtype="float32")[y]
        backoff = OOMBackoff(verbose=0)
        model = build(32, limit=8)
        history = _fit(model, x, y, [backoff], epochs=2)
        reference = build(8)
        expected = _fit(reference, x, y, epochs=2)
        assert [b["micro_batch_size"] for b in backoff.backoffs] == [16, 8]
        assert_same_weights(model, reference, SAME_COMPUTATION)
        np.testing.assert_allclose(history["custom_loss"], expected["custom_loss"], rtol=1e-6)

    def test_steps_per_execution(self):
        x, y = classification_data(96)
        model = _model(micro_batch_size=32, limit=16, steps_per_execution=2)
        _fit(model, x, y, [OOMBackoff(verbose=0)])
        reference = _model(micro_batch_size=16, steps_per_execution=2)
        _fit(reference, x, y)
        assert_same_weights(model, reference, SAME_COMPUTATION)
        assert int(model.optimizer.iterations) == 3

    def test_micro_batch_size_reaches_csv_logger_listed_after_it(self, tmp_path):
        # As `learning_rate` from ReduceLROnPlateau: the epoch's logs, for the
        # callbacks after it (History is always after the user's callbacks).
        x, y = classification_data(96)
        path = tmp_path / "log.csv"
        model = _model(micro_batch_size=32, limit=16)
        callbacks = [OOMBackoff(verbose=0), keras.callbacks.CSVLogger(str(path))]
        _fit(model, x, y, callbacks, epochs=2)
        header, *rows = path.read_text().splitlines()
        column = header.split(",").index("micro_batch_size")
        assert [float(row.split(",")[column]) for row in rows] == [16, 16]

    def test_the_progress_bar_shows_the_size_at_each_epochs_end_only(self, capsys):
        x, y = classification_data(96)
        model = _model(micro_batch_size=32, limit=16)
        batch_logs = []
        record = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: batch_logs.append(dict(logs))
        )
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=1,
                  callbacks=[OOMBackoff(verbose=0), record])
        # Keras formats every figure with four decimals, as `learning_rate`
        # from ReduceLROnPlateau; the per-step bar does not carry the size.
        assert capsys.readouterr().out.count("micro_batch_size: 16.0000") == 2
        assert batch_logs and not any("micro_batch_size" in logs for logs in batch_logs)

    def test_mirrored_strategy(self, mirrored_strategy):
        x, y = classification_data(64)
        with mirrored_strategy.scope():
            model = _model(micro_batch_size=16, limit=4)  # per replica: 16 of the 32 each
            reference = _model(micro_batch_size=4)
        backoff = OOMBackoff(factor=0.25, verbose=0)
        _fit(model, x, y, [backoff])
        _fit(reference, x, y)
        assert_same_weights(model, reference, SAME_COMPUTATION)
        assert [b["micro_batch_size"] for b in backoff.backoffs] == [4]
        assert int(model.optimizer.iterations.numpy()) == 2

    def test_one_replica_out_of_memory_while_the_other_waits_in_the_update(
        self, mirrored_strategy
    ):
        # Found by the fuzzer: replica 0 finished its micro-batches and marked
        # its update begun, then replica 1 ran out of memory in its second
        # one. The step was taken for a failed update and fit stopped; but the
        # update's weights wait for every replica's gradients. Keras 3's Nadam
        # advances its momentum product before that, on the replica alone: it
        # is put back too (retried without it, the result was off by 0.1).
        x, y = classification_data(64)
        fault = OutOfMemoryOnce(at=2, replica=1, delay=1.0)

        def optimizer():  # tf_keras's Nadam counts its traces (docs/accumulation.md)
            return keras.optimizers.Adam(0.01) if LEGACY else keras.optimizers.Nadam(0.01)

        with mirrored_strategy.scope():
            model = _model(micro_batch_size=4, fault=fault, optimizer=optimizer())
            reference = _model(micro_batch_size=2, optimizer=optimizer())
        backoff = OOMBackoff(verbose=0)
        _fit(model, x, y, [backoff])
        _fit(reference, x, y)
        assert fault.raised == 1
        assert [(b["phase"], b["micro_batch_size"]) for b in backoff.backoffs] == [
            ("micro_batch", 2)
        ]
        assert_same_weights(model, reference, SAME_COMPUTATION)
        assert int(model.optimizer.iterations.numpy()) == 2

    def test_the_callback_attaches_its_policy_and_puts_back_the_one_before(self):
        x, y = classification_data(32)
        model = _model(micro_batch_size=32, limit=8)
        before = OOMBackoff(verbose=0).policy
        model.oom_policy = before
        backoff = OOMBackoff(factor=0.25, verbose=0)
        _fit(model, x, y, [backoff])
        assert [b["micro_batch_size"] for b in backoff.backoffs] == [8]  # its factor
        assert model.oom_policy is before and before.backoffs == []

    def test_a_fit_that_raises_leaves_no_policy_behind(self):
        """Keras calls no `on_train_end` when `fit` raises: the model puts its settings back."""
        x, y = classification_data(32)
        model = _model(micro_batch_size=32, limit=8)
        backoff = OOMBackoff(min_micro_batch_size=16, verbose=0)
        with pytest.raises(tf.errors.ResourceExhaustedError, match="smallest micro-batch"):
            _fit(model, x, y, [backoff])
        assert model.oom_policy is None and len(backoff.backoffs) == 1
        with pytest.raises(tf.errors.OpError, match="OOM when allocating"):
            _fit(model, x, y)  # without the callback: no backoff
        assert model.micro_batch_size == 16 and len(backoff.backoffs) == 1
        model.get_layer("device").limit = 16
        model.micro_batch_size = 32
        _fit(model, x, y, [backoff])  # the same callback again: attached, then detached
        assert model.micro_batch_size == 16 and model.oom_policy is None

    def test_accumulation_steps_give_way_to_the_smaller_micro_batch(self):
        x, y = classification_data(32)
        model = _model(limit=8)
        model.accumulation_steps = 2
        _fit(model, x, y, [OOMBackoff(verbose=0)])
        assert model.micro_batch_size == 8 and model.accumulation_steps is None
        reference = _model(micro_batch_size=8)
        _fit(reference, x, y)
        assert_same_weights(model, reference, SAME_COMPUTATION)


class FailingUpdate(keras.optimizers.SGD):
    """Runs out of memory in the update, after its first variable is updated."""

    def __init__(self, **kwargs):
        super().__init__(learning_rate=0.1, momentum=0.9, **kwargs)
        self.fail = True

    def _check(self):
        if self.fail:
            raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor "
                                                   "with shape[16,3] and type float")
        return 0

    def update_step(self, gradient, variable, *args):
        super().update_step(gradient, variable, *args)
        done = tf.py_function(self._check, [], tf.int32)
        with tf.control_dependencies([done]):
            variable.assign_add(tf.zeros_like(variable))


class TestPhases:
    """Where a smaller micro-batch cannot help, OOMBackoff reports at once."""

    def _model(self, optimizer):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        hidden = layers.Dense(16, activation="tanh")(inputs)
        model = AccumulatingModel(inputs, layers.Dense(3)(hidden), micro_batch_size=16)
        return compile_classifier(model, optimizer)

    @pytest.mark.skipif(LEGACY, reason="tf_keras's SGD has another update_step")
    def test_an_update_that_runs_out_of_memory_is_put_back_and_reported(self):
        x, y = classification_data(64)
        optimizer = FailingUpdate()
        model = self._model(optimizer)
        optimizer.fail = False
        _fit(model, x[:32], y[:32], [OOMBackoff()])  # the update's memory is learned...
        before = _values(model.variables) + _values(model.optimizer.variables)
        optimizer.fail = True
        backoff = OOMBackoff()
        with pytest.raises(tf.errors.ResourceExhaustedError) as raised:
            _fit(model, x, y, [backoff])  # ...and it fails after its reservation
        assert "may be partly updated" in raised.value.message
        model.micro_batch_size = 8  # a new size: the update is not known to fit
        before = _values(model.variables) + _values(model.optimizer.variables)
        with pytest.raises(tf.errors.ResourceExhaustedError) as raised:
            _fit(model, x, y, [backoff])
        after = _values(model.variables) + _values(model.optimizer.variables)
        assert_same_weights(before, after, IDENTICAL)
        assert backoff.backoffs == []
        assert raised.value.message.startswith(
            "Out of memory in the optimizer update (micro_batch_size=8)"
        )
        gradient_sum = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
        assert f"gradient sum {format_bytes(gradient_sum)}" in raised.value.message

    def test_the_gradient_sum_that_cannot_fit_is_reported_at_once(self, monkeypatch):
        """A device that cannot hold the gradient sum beside the state: no halving."""
        from keras_memopt import memory

        x, y = classification_data(32)
        model = _model(micro_batch_size=32, limit=4)
        # Less than the model's state alone: nothing more fits.
        monkeypatch.setattr(memory, "device_total", lambda device: 1024)
        backoff = OOMBackoff()
        with pytest.raises(tf.errors.ResourceExhaustedError) as raised:
            _fit(model, x, y, [backoff])
        assert backoff.backoffs == []
        message = raised.value.message
        assert message.startswith("Out of memory in the sum of the micro-batches' gradients")
        assert "Whatever the micro-batch size" in message

    def test_one_trial_halving_where_the_device_total_is_unknown(self, monkeypatch):
        from keras_memopt import memory

        x, y = classification_data(32)
        # A weight-shaped allocation that fails at every micro-batch size.
        model = _model(micro_batch_size=32, limit=4)
        monkeypatch.setattr(memory, "device_total", lambda device: None)
        monkeypatch.setattr(
            "_faults.MESSAGE",
            "OOM when allocating tensor with shape[1024,1024] and type float on CPU:0",
        )
        backoff = OOMBackoff()
        with pytest.raises(tf.errors.ResourceExhaustedError) as raised:
            _fit(model, x, y, [backoff])
        assert [b["micro_batch_size"] for b in backoff.backoffs] == [16]
        assert "the micro-batch size is not what fills the device" in raised.value.message


class TestAuto:
    def test_auto_chooses_the_largest_micro_batch_that_runs(self, capsys):
        x, y = classification_data(96)
        model = _model(micro_batch_size="auto", limit=10)
        assert model.micro_batch_size == "auto"
        _fit(model, x, y)
        reference = _model(micro_batch_size=8)
        _fit(reference, x, y)
        assert model.micro_batch_size == 8
        assert model.micro_batch_search["out_of_memory_trials"] == [32, 16]
        assert_same_weights(model, reference, SAME_COMPUTATION)
        assert int(model.optimizer.iterations) == 3
        out = capsys.readouterr().out
        assert 'micro_batch_size="auto": chose micro_batch_size=8' in out

    def test_auto_without_oom_keeps_the_whole_batch(self):
        x, y = classification_data(32)
        model = _model(micro_batch_size="auto")
        _fit(model, x, y, epochs=1)
        assert model.micro_batch_size == 32
        assert model.micro_batch_search["out_of_memory_trials"] == []

    def test_auto_backs_off_at_a_later_step_of_its_run(self, capsys):
        """A size that ran one step is a candidate; the run of ten steps goes on."""
        x, y = classification_data(96)  # three steps an epoch
        model = _model(micro_batch_size="auto", limit=10)
        fault = model.get_layer("device")

        class Shrink(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                self.seen = getattr(self, "seen", -1) + 1
                if self.seen == 4:  # the fifth step needs a smaller micro-batch
                    fault.limit = 4

        _fit(model, x, y, [Shrink()], epochs=5)
        search = model.micro_batch_search
        assert search["out_of_memory_trials"] == [32, 16, 8], search
        assert model.micro_batch_size == search["micro_batch_size"] == 4
        # Ten steps at 4 from the fifth on: the search ended with the fourteenth.
        assert search["steps"] == 10 and search["margin"] is not None, search
        out = capsys.readouterr().out
        assert 'micro_batch_size="auto": chose micro_batch_size=8' in out
        assert "micro_batch_size=4 trained 10 steps and kept a margin of" in out

    @pytest.mark.line_independent(
        reason="the search's check of its measured margin against the device, keras_memopt's "
        "own logic (its ten steps and margin on tf_keras: "
        "test_auto_backs_off_at_a_later_step_of_its_run)")
    def test_auto_shrinks_a_size_that_leaves_too_little_free(self, monkeypatch, capsys):
        """Without an out-of-memory error, where the device's total is below the
        highest step peak plus the spread: down to the smallest size allowed."""
        from keras_memopt._oom import auto_search as _auto_search

        # What the search checks against (the update's own check is left alone).
        monkeypatch.setattr(_auto_search, "device_total", lambda device: 1)
        x, y = classification_data(96)
        model = _model(micro_batch_size="auto")
        _fit(model, x, y, [OOMBackoff(min_micro_batch_size=8, verbose=0)], epochs=10)
        search = model.micro_batch_search
        assert search["too_close"] == [32, 16] and search["out_of_memory_trials"] == []
        assert model.micro_batch_size == 8 and search["margin"] is not None
        out = capsys.readouterr().out
        assert "micro_batch_size=32 ran 10 steps but leaves less than the spread" in out
        assert "micro_batch_size=8 trained 10 steps and could not keep" in out

    def test_headroom_is_the_rise_of_the_highest_peak_above_the_median(self):
        from keras_memopt._oom.auto_search import headroom

        peaks = [10, 12, 11, 15, 9]  # median 11: 4 above it at the highest
        assert headroom(peaks, 19) == dict(margin=4, highest=15, total=19, fits=True)
        assert not headroom(peaks, 18)["fits"]
        assert headroom(peaks, None)["fits"]
        assert headroom([7, 7, 7], 7) == dict(margin=0, highest=7, total=7, fits=True)


class TestXLA:
    def test_jit_compile_true_is_refused(self):
        x, y = classification_data(32)
        model = _model(micro_batch_size=32, jit_compile=True)
        assert model.micro_batch_jit_compile
        with pytest.raises(ValueError, match=r"inside an XLA-compiled step.*jit_compile=False"):
            _fit(model, x, y, [OOMBackoff()])
        assert int(model.optimizer.iterations.numpy()) == 0

    @pytest.mark.skipif(LEGACY, reason='tf_keras has no jit_compile="auto"')
    def test_auto_xla_is_turned_off_while_attached(self, capsys, monkeypatch):
        x, y = classification_data(96)
        monkeypatch.setattr(_keras_line(), "resolve_jit_compile", lambda model, jit: True)
        model = _model(micro_batch_size=32, limit=16)  # jit_compile="auto", as on a GPU
        assert model.micro_batch_jit_compile
        _fit(model, x, y, [OOMBackoff()])
        assert model.micro_batch_jit_compile  # put back once OOMBackoff is done
        monkeypatch.undo()
        assert "without XLA while attached" in capsys.readouterr().out
        reference = _model(micro_batch_size=16, jit_compile=False)
        _fit(reference, x, y)
        assert_same_weights(model, reference, SAME_COMPUTATION)


def _keras_line():
    from keras_memopt import _keras

    return _keras


@pytest.fixture(scope="module")
def soak_then_state():
    """The figures of the soak and of the state that does not fit, from one child under 20 MiB
    (a fresh TensorFlow costs 3 to 4 CPU-s). The soak's model and data are a few KiB, and
    let go before the other: the weights there (8.3 MiB) fit with more than 11 MiB to
    spare, Adam's slots (16.6 MiB more) do not."""
    code = (SOAK.format(tests=os.path.dirname(os.path.abspath(__file__)))
            + "del model, x, y, backoff, inputs, hidden\ngc.collect()\n"
            + STATE_DOES_NOT_FIT.format(optimizer="adam"))
    output = run_python(code, memory_limit_mb=20)
    soak, state = (json.loads(line) for line in output.stdout.strip().splitlines()[-2:])
    return soak, state


@pytest.mark.slow
def test_soak_repeated_oom_keeps_memory_flat(soak_then_state):
    """Hundreds of steps, an out-of-memory backoff (and retrace) every few."""
    figures = soak_then_state[0]
    assert figures["backoffs"] >= 60, figures
    # Allocator memory returns to the same level; host memory may settle in
    # the first rounds (caches) but must not keep growing with each retrace.
    assert figures["device_growth_bytes"] <= 64 * 1024
    assert figures["rss_growth_mib"] < 10, figures


SOAK = """
import gc, json, os, sys
import numpy as np, psutil, tensorflow as tf
sys.path.insert(0, {tests!r})
from _faults import OutOfMemoryAbove
from keras_memopt._keras import keras
from keras_memopt import AccumulatingModel
from keras_memopt.callbacks import OOMBackoff

class Regrow(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if batch % 5 == 0:
            self.model.micro_batch_size = 16  # too large again: the next step backs off

keras.utils.set_random_seed(0)
inputs = keras.Input((6,))
hidden = OutOfMemoryAbove(8)(keras.layers.Dense(16)(inputs))
model = AccumulatingModel(inputs, keras.layers.Dense(3)(hidden), micro_batch_size=16)
model.compile(optimizer="adam", loss="mse")
x = np.random.rand(16 * 100, 6).astype("float32"); y = np.random.rand(16 * 100, 3)
backoff = OOMBackoff(verbose=0)
process = psutil.Process()
marks, backoffs = [], 0
for round in range(4):
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False,
              callbacks=[Regrow(), backoff])
    backoffs += len(backoff.backoffs)
    gc.collect()
    marks.append((tf.config.experimental.get_memory_info("CPU:0")["current"],
                  process.memory_info().rss))
print(json.dumps(dict(
    backoffs=backoffs,
    iterations=int(model.optimizer.iterations),
    device_growth_bytes=marks[-1][0] - marks[1][0],
    rss_growth_mib=(marks[-1][1] - marks[1][1]) / 2**20,
    marks=marks,
)))
"""


# -- real out-of-memory errors: a subprocess with an 80 MiB allocator limit -------------

REAL_LIMIT_MB = 80

# 8 x Dense(512) on 4096 samples: the whole batch as one micro-batch needs
# more than 80 MiB (so the first step fails); a quarter of it fits (about 56 MiB).
REAL_PRELUDE = """
import gc, json, time
import numpy as np, tensorflow as tf
from keras_memopt._keras import keras
from keras_memopt import AccumulatingModel
from keras_memopt.callbacks import OOMBackoff

N, D = 4096, 32

class Seen(keras.layers.Layer):
    # Counts, per sample index (the last input column), how often a training
    # step used the sample: a lost or repeated sample shows.
    def build(self, input_shape):
        self.seen = self.add_weight(name="seen", shape=(N,), initializer="zeros",
                                    trainable=False)

    def call(self, x, training=None):
        if training:
            index = tf.cast(x[:, -1], tf.int32)
            self.seen.assign_add(tf.math.unsorted_segment_sum(tf.ones_like(x[:, -1]), index, N))
        return x[:, :-1]

def build(micro_batch_size):
    keras.backend.clear_session()
    gc.collect()
    keras.utils.set_random_seed(0)
    inputs = keras.Input((D + 1,))
    hidden = Seen()(inputs)
    for _ in range(8):
        hidden = keras.layers.Dense(512, activation="relu")(hidden)
    model = AccumulatingModel(inputs, keras.layers.Dense(10)(hidden),
                              micro_batch_size=micro_batch_size)
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)
    return model

rng = np.random.RandomState(0)
x = np.concatenate([rng.rand(N, D), np.arange(N)[:, None]], axis=1).astype("float32")
y = rng.randint(0, 10, N)

def fit(model, callbacks=()):
    start = time.perf_counter()
    history = model.fit(x, y, batch_size=N, epochs=2, shuffle=False, verbose=0,
                        callbacks=list(callbacks))
    return history.history, time.perf_counter() - start

def trained(model):
    return [np.array(w) for w in model.get_weights()]
"""

REAL_FIT = """
model = build(N)
backoff = OOMBackoff(factor=0.25)
history, seconds = fit(model, [backoff])
weights, final = trained(model), model.micro_batch_size
iterations = int(model.optimizer.iterations.numpy())
seen = model.layers[1].seen.numpy()
del model, history
reference = build(final)
_, reference_seconds = fit(reference)
out["fit"] = dict(
    backoffs=backoff.backoffs, final=final, iterations=iterations,
    seen=sorted(set(seen.tolist())),
    max_difference=max(float(np.abs(a - b).max())
                       for a, b in zip(weights, trained(reference))),
    seconds=seconds, reference_seconds=reference_seconds,
)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def real():
    """The figures (`fit`, `evaluate`) of the real checks' child, and its output.

    Both checks in one child (a fresh TensorFlow costs about 4 CPU-s): evaluate, then, all
    of it let go, the fit (in the other order, evaluate's step at 4096 did not fit)."""
    result = run_python(REAL_PRELUDE + REAL_EVALUATE + REAL_FIT, memory_limit_mb=REAL_LIMIT_MB)
    return last_json(result), result.stdout


@pytest.mark.slow
@pytest.mark.line_independent(
    reason="a real out-of-memory error's rollback on tf_keras is "
    "test_real_oom_in_the_loop_or_the_update_changes_nothing's; its backoff and retry "
    "there, TestBackoff's")
def test_real_oom_backs_off_to_the_result_of_a_run_started_there(real):
    figures, stdout = real[0]["fit"], real[1]
    assert [b["failed_micro_batch_size"] for b in figures["backoffs"]] == [4096], stdout
    assert figures["final"] == 1024
    assert "OOMBackoff: out of memory in a train step at micro_batch_size=4096" in stdout
    assert figures["max_difference"] <= 1e-5, figures
    assert figures["iterations"] == 2  # one per batch, none for the failed attempt
    assert figures["seen"] == [2.0]  # every sample once per epoch, the retry included


# micro_batch_size="auto" under a real limit: tests/test_oom_memory.py.
REAL_EVALUATE = """
out = dict(evaluate=dict())
figures = out["evaluate"]
# evaluate: 4 x 4096 samples in one micro-batch do not fit; a quarter does.
big_x, big_y = np.concatenate([x] * 4), np.concatenate([y] * 4)
model = build(4 * N)
backoff = OOMBackoff(factor=0.25)
results = model.evaluate(big_x, big_y, batch_size=4 * N, verbose=0, callbacks=[backoff])
figures["evaluate_backoffs"] = [b["failed_micro_batch_size"] for b in backoff.backoffs]
model.micro_batch_size = N
figures["evaluate_difference"] = float(np.abs(
    np.array(results) - np.array(model.evaluate(big_x, big_y, batch_size=4 * N, verbose=0))
).max())
del model, big_x, big_y, backoff  # the callback holds the model it ran
"""


@pytest.mark.slow
@pytest.mark.line_independent(
    reason="a real out-of-memory error's rollback on tf_keras is "
    "test_real_oom_in_the_loop_or_the_update_changes_nothing's; evaluate's backoff there, "
    "TestBackoff's test_evaluate_and_predict_back_off")
def test_real_oom_in_evaluate(real):
    figures, stdout = real[0]["evaluate"], real[1]
    assert figures["evaluate_backoffs"] == [4 * 4096], stdout
    assert figures["evaluate_difference"] <= 1e-5


# -- a failed step changes nothing, wherever it runs out of memory (real limits) ---------

# A model with BatchNormalization, Dropout, noise from Keras 3's global seed
# generator and a metric, trained two steps under a 64 MiB limit; then four
# steps that fail, each compared, variable by variable, with the state when
# it began. A layer and the optimizer allocate real memory on demand: a
# sample asks for 1 GiB in the micro-batch loop, the update for `EXTRA` bytes
# after each variable's update (the first variable is updated when it fails).
REAL_ROLLBACK = """
import json, os
import numpy as np, tensorflow as tf
from keras_memopt import AccumulatingModel
from keras_memopt._keras import LEGACY, global_random_state, keras
from keras_memopt.callbacks import OOMBackoff

MIB = 2**20
LIMIT = int(os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"]) * MIB


class Allocates(keras.layers.Layer):
    # Passes its input on but the last column; allocates that column's largest
    # value in MiB: a sample can ask the allocator for more than it has.
    def call(self, x):
        words = tf.cast(tf.reduce_max(x[:, -1]), tf.int32) * (MIB // 4)
        block = tf.random.stateless_uniform(tf.reshape(words, [1]), [0, 0])
        # Used by the output (a control dependency alone would be pruned).
        return x[:, :-1] + 0.0 * tf.reduce_sum(block)


class GlobalNoise(keras.layers.Layer):
    # Noise drawn without a seed: from Keras 3's global seed generator.
    def call(self, x, training=None):
        return x + 0.1 * keras.random.normal(tf.shape(x)) if training else x


EXTRA = tf.Variable(0)  # bytes the update allocates, after each variable's


def adam_that_allocates():
    class AdamThatAllocates(keras.optimizers.Adam):
        def update_step(self, gradient, variable, *args):
            result = super().update_step(gradient, variable, *args)
            with tf.control_dependencies([result] if result is not None else []):
                block = tf.random.stateless_uniform(tf.reshape(EXTRA // 4, [1]), [0, 0])
            variable.assign_add(tf.fill(tf.shape(variable), 0.0 * tf.reduce_sum(block)))
            return result

    return AdamThatAllocates(0.01)


keras.utils.set_random_seed(0)
inputs = keras.Input((33,))
x = keras.layers.Dense(1024, activation="tanh")(Allocates()(inputs))
x = keras.layers.BatchNormalization()(x)
x = (keras.layers.Dropout(0.3, seed=1, rng_type="stateless") if LEGACY
     else keras.layers.Dropout(0.3, seed=1))(x)
if not LEGACY:
    x = GlobalNoise()(x)
x = keras.layers.Dense(1024, activation="tanh")(x)  # 4 MiB: the gradient sum's bulk
model = AccumulatingModel(inputs, keras.layers.Dense(10)(x), micro_batch_size=16)
model.compile(adam_that_allocates(), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"], jit_compile=False)
rng = np.random.RandomState(0)
x = np.concatenate([rng.rand(64, 32), np.zeros((64, 1))], axis=1).astype("float32")
y = rng.randint(0, 10, 64)


def state():
    metrics = [v for metric in model.metrics for v in metric.variables]
    variables = (model.variables + list(model.optimizer.variables) + metrics
                 + global_random_state())
    return [np.array(tf.convert_to_tensor(v)) for v in variables]


class StateBefore(keras.callbacks.Callback):
    # The state when the step begins (fit has reset the metrics by then).
    def on_train_batch_begin(self, batch, logs=None):
        self.values = state()


def fails(x, **backoff):
    backoff, before = OOMBackoff(verbose=0, **backoff), StateBefore()
    try:
        model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0,
                  callbacks=[before, backoff])
        return dict(message=None)
    except tf.errors.ResourceExhaustedError as error:
        changed = [i for i, (a, b) in enumerate(zip(before.values, state(), strict=True))
                   if not np.array_equal(a, b)]
        return dict(message=error.message, backoffs=len(backoff.backoffs), changed=changed,
                    finite=all(np.isfinite(v).all() for v in before.values),
                    iterations=int(model.optimizer.iterations.numpy()))


def ballast(free):
    # Fills the device but `free` bytes, in blocks of 1 MiB (the allocator
    # cannot hand out one block as large as the rest of its limit).
    left = LIMIT - in_use() - free
    return [tf.fill([min(MIB, left - start) // 4], 1.0) for start in range(0, left, MIB)]


def in_use():
    return tf.config.experimental.get_memory_info("CPU:0")["current"]


out = {}
EXTRA.assign(16 * MIB)  # the update needs more than the loop
model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0,
          callbacks=[OOMBackoff(verbose=0)])  # state to keep; the update's need learned

# 1. Out of memory in the loop, in its third micro-batch, at the minimum.
greedy = x.copy()
greedy[40, -1] = 1024
out["loop"] = fails(greedy, min_micro_batch_size=16)

# 2. In the update, the first at micro-batch 32 (its need not known yet).
model.micro_batch_size = 32
EXTRA.assign(1024 * MIB)
out["update"] = fails(x)

# 3. The update at micro-batch 16 needs more than is free: refused before it starts.
model.micro_batch_size = 16
EXTRA.assign(16 * MIB)
tf.config.experimental.reset_memory_stats("CPU:0")
model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)  # no policy: unguarded
step = tf.config.experimental.get_memory_info("CPU:0")["peak"] - in_use()
held = ballast(step - 4 * MIB)  # the loop fits, its update does not
out["check"] = fails(x)
del held

# 4. The gradient sum does not fit beside the state: no micro-batch size can help.
model.micro_batch_size = 32
held = ballast(2 * MIB)  # less than the gradient sum
out["sum"] = fails(x)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_real_oom_in_the_loop_or_the_update_changes_nothing():
    result = run_python(REAL_ROLLBACK, memory_limit_mb=64)
    figures = last_json(result)
    size = r"[\d.]+ [KMG]?i?B"
    for case, failed in figures.items():
        assert failed["message"] is not None, (case, figures)
        # Every variable as it was, and no backoff: the report came at once.
        assert failed["changed"] == [] and failed["finite"], (case, failed)
        assert failed["backoffs"] == 0, (case, failed["message"])
        assert re.search(
            rf"The step holds: weights {size}, optimizer state {size}, gradient sum {size} "
            rf"\(its largest variable {size}\); the failed attempt at micro_batch_size=\d+ "
            rf"peaked at {size} above its start", failed["message"],
        ), (case, failed["message"])
        assert "the device can hand out 64.00 MiB" in failed["message"]

    loop = figures["loop"]["message"]  # in the third micro-batch of four
    assert loop.startswith(
        "Out of memory in a micro-batch's forward and backward pass at the smallest "
        "micro-batch allowed (micro_batch_size=16, min_micro_batch_size=16)"
    ), loop
    assert re.search(r"Failed to allocate: a tensor of shape \[268435456\] and type float "
                     r"in op \S*allocates\S* on CPU:0", loop), loop
    assert re.search(rf"Device memory: {size} in use, peak {size} on CPU:0", loop)
    assert "remat" in loop

    # Where no smaller micro-batch helps: the update, at a micro-batch size
    # whose update was not measured yet (the weights and slots in host memory)
    # and at one whose measured need is not free (refused before it starts);
    # the gradient sum that does not fit beside the state.
    update, check = figures["update"]["message"], figures["check"]["message"]
    assert update.startswith("Out of memory in the optimizer update (micro_batch_size=32): a "
                             "smaller micro-batch needs no less memory there"), update
    assert check.startswith("Out of memory in the optimizer update (micro_batch_size=16)"), check
    assert re.search(rf"Failed to allocate: {size} \(\d+ bytes\) in op update_reservation",
                     check), check
    assert re.search(rf"the optimizer update's own memory: {size} at micro_batch_size=16",
                     check), check
    total = figures["sum"]["message"]
    assert total.startswith("Out of memory in the sum of the micro-batches' gradients "
                            "(micro_batch_size=32)"), total
    assert "Whatever the micro-batch size" in total
    for message in (update, check, total):
        assert "an optimizer that keeps less state per weight" in message
        assert "remat" not in message
    assert [figures[case]["iterations"] for case in figures] == [2, 2, 3, 3]


# Three Dense(1024) layers: 8.3 MiB of weights, which fit under 20 MiB; Adam's
# two slots per weight do not.
STATE_DOES_NOT_FIT = """
import json
import numpy as np, tensorflow as tf
from keras_memopt import AccumulatingModel
from keras_memopt._keras import keras
from keras_memopt.callbacks import OOMBackoff

inputs = keras.Input((64,))
hidden = inputs
for _ in range(3):
    hidden = keras.layers.Dense(1024)(hidden)
model = AccumulatingModel(inputs, keras.layers.Dense(1)(hidden), micro_batch_size=8)
model.compile(keras.optimizers.get("{optimizer}"), "mse")
x, y = np.ones((16, 64), "float32"), np.ones((16, 1), "float32")
backoff = OOMBackoff(verbose=0)
try:
    model.fit(x, y, batch_size=16, verbose=0, callbacks=[backoff])
    out = dict(iterations=int(model.optimizer.iterations.numpy()))
except tf.errors.ResourceExhaustedError as error:
    out = dict(message=error.message)
out["backoffs"] = len(backoff.backoffs)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_state_that_does_not_fit_is_reported_before_the_first_step(soak_then_state):
    figures = soak_then_state[1]
    assert figures["backoffs"] == 0  # no micro-batch size can help
    message = figures["message"]
    assert message.startswith("Out of memory before the first step, while making the "
                              "optimizer's and metrics' variables"), message
    assert "Failed to allocate: a tensor of shape [1024, 1024] and type float" in message
    assert re.search(r"Device memory: [\d.]+ MiB in use, peak [\d.]+ MiB on CPU:0", message)
    assert "an optimizer that keeps less state per weight" in message
