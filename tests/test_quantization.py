"""Quantization-aware training with tensorflow-model-optimization (tf_keras only).

The oracle is plain QAT: tfmot's own `quantize_model` of the same base model, trained
by plain tf_keras at the whole batch from the same weights.
"""

import importlib.util

import numpy as np
import pytest
from _helpers import IDENTICAL, assert_same_weights, classification_data, compile_classifier
from conftest import LEGACY

from keras_memopt import AccumulatingModel, quantization
from keras_memopt._keras import keras

needs_tfmot = pytest.mark.skipif(
    not LEGACY or importlib.util.find_spec("tensorflow_model_optimization") is None,
    reason="tensorflow-model-optimization works only with tf_keras (TF_USE_LEGACY_KERAS=1)",
)


def _base(cls=keras.Model, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    x = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    return cls(inputs, keras.layers.Dense(3, name="head")(x), **kwargs)


def _train(model, epochs=1):
    x, y = classification_data(48)
    compile_classifier(model)
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return model


def _ranges(model):
    """`[(name, value)]` of the quantizers' range variables, in the model's order."""
    minimums, maximums = quantization.range_variables(model)
    return [(v.name.split("/")[-1], v.numpy()) for v in minimums + maximums]


@pytest.mark.skipif(LEGACY, reason="the error is for Keras 3")
def test_quantization_on_keras_3_explains_the_legacy_switch():
    with pytest.raises(RuntimeError, match=r"Quantization-aware training uses.*LEGACY_KERAS=1"):
        quantization.quantize_model(_base(AccumulatingModel, micro_batch_size=4))


@needs_tfmot
class TestQuantizationAwareTraining:
    @pytest.fixture(autouse=True)
    def _tfmot(self):
        import tensorflow_model_optimization as tfmot

        self.quantize_model = tfmot.quantization.keras.quantize_model

    def test_quantize_model_keeps_the_micro_batch_setting(self):
        model = _base(AccumulatingModel, micro_batch_size=4, remat=["hidden"])
        quantized = quantization.quantize_model(model)
        assert isinstance(quantized, AccumulatingModel)
        assert quantized.micro_batch_size == 4
        assert quantized.remat == ["quant_hidden"]
        # tfmot's own clones it into a plain functional model: no micro-batches.
        assert not isinstance(self.quantize_model(model), AccumulatingModel)

    def test_one_micro_batch_per_batch_is_plain_qat(self):
        plain = _train(self.quantize_model(_base()), epochs=2)
        model = _train(
            AccumulatingModel.from_model(self.quantize_model(_base()), micro_batch_size=16),
            epochs=2,
        )
        assert_same_weights(model, plain, IDENTICAL)

    def test_ranges_advance_once_per_update_from_the_whole_batch(self):
        # Four micro-batches a step, three steps. Advanced once per micro-batch,
        # the input's range would have taken 12 moving-average steps, not 3.
        plain = _train(self.quantize_model(_base()))
        model = _train(
            AccumulatingModel.from_model(self.quantize_model(_base()), micro_batch_size=4)
        )
        expected, received = _ranges(plain), _ranges(model)
        assert len(received) == len(expected) == 10
        for (name, a), (_, b) in zip(expected, received, strict=True):
            if "post_activation" in name:
                # A moving average (decay 0.999) of values quantized with each
                # micro-batch's own input range: within a quantization step of plain
                # QAT's; 12 steps of it instead of 3 would be 2e-3 away.
                np.testing.assert_allclose(b, a, rtol=1e-5, err_msg=name)
            elif "quantize_layer" in name:  # the input's range, the data's: exact
                np.testing.assert_array_equal(b, a, err_msg=name)
            else:  # the weights' ranges, of weights quantized per micro-batch
                np.testing.assert_allclose(b, a, rtol=1e-4, err_msg=name)

    def test_the_input_range_is_the_whole_batch_extremes(self):
        # The oracle from the data: the input's quantizer keeps the lowest and highest
        # values seen (from 0), whichever micro-batch held them.
        x, _ = classification_data(16)
        model = AccumulatingModel.from_model(self.quantize_model(_base()), micro_batch_size=3)
        compile_classifier(model, "sgd")
        model.fit(x, np.zeros(16), batch_size=16, epochs=1, verbose=0)
        minimums, maximums = quantization.range_variables(model)
        assert minimums[0].name.startswith("quantize_layer")
        assert float(minimums[0].numpy()) == min(float(x.min()), 0.0)
        assert float(maximums[0].numpy()) == max(float(x.max()), 0.0)

    def test_whole_batch_loss_and_strategies_are_refused_before_any_update(
        self, mirrored_strategy
    ):
        x, y = classification_data(16)
        model = AccumulatingModel.from_model(
            self.quantize_model(_base()), micro_batch_size=4, whole_batch_loss=True
        )
        compile_classifier(model, "sgd")
        ranges = _ranges(model)
        with pytest.raises(NotImplementedError, match="quantization ranges"):
            model.fit(x, y, batch_size=16, verbose=0)
        assert int(model.optimizer.iterations) == 0
        for (name, a), (_, b) in zip(ranges, _ranges(model), strict=True):
            np.testing.assert_array_equal(b, a, err_msg=name)
        with mirrored_strategy.scope():
            model = AccumulatingModel.from_model(self.quantize_model(_base()), micro_batch_size=4)
            compile_classifier(model, "sgd")
        with pytest.raises(NotImplementedError, match="quantization layers.*distribution strategy"):
            model.fit(x, y, batch_size=16, verbose=0)
