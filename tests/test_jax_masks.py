"""Masked outputs on Keras 3's JAX backend whose masks no functional model of the
inputs computes (keras_memopt._step.jax_fractions: the counting pass).

Keras divides a masked output's loss by the unmasked elements of the whole
batch; where a subclassed or nested model makes the mask, or the mask needs
weights, the step counts them in a forward pass over the micro-batches before
the gradient loop. The oracle is plain Keras on JAX at the whole batch, in
float64, at 1e-9: every weight and every figure `fit` logs over two epochs of
batches of 20, 20 and 10 samples in micro-batches of 6 (6, 6, 6, 2 and 6, 4),
token counts uneven over the micro-batches (one holds none), and `evaluate`.
Dropout and BatchNormalization at micro-batches have no plain-Keras oracle: the
subclassed model is compared with its functional twin, whose mask comes from
the inputs (no counting pass), itself tested against plain Keras in
tests/test_jax.py. Masks made or dropped inside recomputed calls (`Remat`,
`remat=`: `jax.checkpoint`) reach the loss as without recomputation.
"""

import numpy as np
import pytest
from _helpers import assert_same_logs, assert_same_weights
from conftest import JAX_MODULE

from keras_memopt._keras import BACKEND, keras

pytestmark = JAX_MODULE

if BACKEND == "jax":
    import jax

    jax.config.update("jax_enable_x64", True)

    from keras_memopt import AccumulatingModel, Remat

layers = keras.layers
TOLERANCE = dict(rtol=1e-9, atol=1e-9)
SAMPLES, BATCH, LENGTH = 50, 20, 6


def _tokens(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, LENGTH + 1, SAMPLES)
    lengths[:6] = 0  # a micro-batch with no token
    tokens = rng.integers(1, 20, (SAMPLES, LENGTH)) * (np.arange(LENGTH) < lengths[:, None])
    return tokens, rng.integers(0, 3, (SAMPLES, LENGTH)), rng.uniform(0.1, 2.0, (SAMPLES, LENGTH))


def _compile(model, ignore_class=None):
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                        ignore_class=ignore_class),
        metrics=["accuracy", keras.metrics.SparseCategoricalCrossentropy(from_logits=True)],
    )
    return model


class _Tagger:
    """A subclassed tagger's layers and call (mixed into `keras.Model` or
    `AccumulatingModel`): `Embedding(mask_zero=True)`, then `middle`, then a head."""

    def __init__(self, middle=(), **kwargs):
        super().__init__(**kwargs)
        self.embedding = layers.Embedding(20, 4, mask_zero=True)
        self.middle = [layer() for layer in middle]
        self.hidden = layers.Dense(5, activation="tanh")
        self.head = layers.Dense(3)

    def call(self, tokens, training=None):
        x = self.embedding(tokens)
        for layer in self.middle:
            x = layer(x, training=training)
        return self.head(self.hidden(x))


def _subclassed(cls, middle=(), **split):
    keras.utils.set_random_seed(3)
    model = type("Tagger", (_Tagger, cls), {})(middle=middle, **split)
    model(np.zeros((1, LENGTH), "int64"))
    return model


def _nested(cls, **split):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((LENGTH,), dtype="int64")
    backbone = keras.Sequential([layers.Embedding(20, 4, mask_zero=True),
                                 layers.Dense(5, activation="tanh")])
    return cls(inputs, layers.Dense(3)(backbone(inputs)), **split)


class _LearnedMask(layers.Layer):
    """Passes its input on, masking each time step whose learned projection is
    negative: a mask that needs the layer's weights, which training moves."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 1), initializer="random_normal")

    def call(self, inputs):
        return inputs

    def compute_mask(self, inputs, mask=None):
        return keras.ops.matmul(inputs, self.kernel)[..., 0] > 0

    def compute_output_shape(self, input_shape):
        return input_shape


def _mask_from_weights(cls, **split):
    keras.utils.set_random_seed(4)
    inputs = keras.Input((LENGTH, 4))
    hidden = layers.Dense(4, activation="tanh")(inputs)
    return cls(inputs, layers.Dense(3)(_LearnedMask()(hidden)), **split)


def _masking_after_dense(cls, **split):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((LENGTH, 4))
    hidden = layers.Dense(4, activation="relu", use_bias=False)(inputs)
    return cls(inputs, layers.Dense(3)(layers.Masking(0.0)(hidden)), **split)


def _fit_and_evaluate(model, x, y, weights, ignore_class=None):
    _compile(model, ignore_class)
    history = model.fit(x, y, sample_weight=weights, batch_size=BATCH, epochs=2,
                        shuffle=False, verbose=0).history
    evaluated = model.evaluate(x, y, sample_weight=weights, batch_size=BATCH, verbose=0,
                               return_dict=True)
    return history, evaluated


def _assert_as_plain_keras(build, x, y, weights, ignore_class=None, **split):
    plain, ours = build(keras.Model), build(AccumulatingModel, micro_batch_size=6, **split)
    ours.set_weights(plain.get_weights())
    expected = _fit_and_evaluate(plain, x, y, weights, ignore_class)
    got = _fit_and_evaluate(ours, x, y, weights, ignore_class)
    for received, wanted in zip(got, expected, strict=True):
        assert sorted(received) == sorted(wanted)
        assert_same_logs(received, wanted, TOLERANCE)
    assert_same_weights(ours, plain, TOLERANCE)
    return plain, ours


class TestCountedInAForwardPass:
    @pytest.mark.parametrize("ignore_class", [None, 2])
    def test_a_subclassed_tagger(self, ignore_class):
        x, y, weights = _tokens(11)
        _assert_as_plain_keras(_subclassed, x, y, weights, ignore_class)

    def test_a_nested_sequential_holding_the_masked_embedding(self):
        # Keras does not carry the nested model's mask to the outer model's symbolic
        # outputs, only to those of its calls.
        x, y, weights = _tokens(12)
        _assert_as_plain_keras(_nested, x, y, weights)

    @pytest.mark.parametrize("build", [_mask_from_weights, _masking_after_dense])
    def test_a_mask_that_needs_weights(self, build):
        rng = np.random.default_rng(13)
        x = rng.normal(size=(SAMPLES, LENGTH, 4)) * (rng.random((SAMPLES, LENGTH, 1)) < 0.7)
        y = rng.integers(0, 3, (SAMPLES, LENGTH))
        _assert_as_plain_keras(build, x, y, rng.uniform(0.1, 2.0, y.shape))

    def test_with_whole_batch_loss(self):
        x, y, weights = _tokens(14)
        _assert_as_plain_keras(_subclassed, x, y, weights, whole_batch_loss=True)


class TestTheCountingPassLeavesTheState:
    def test_dropout_and_batch_normalization_advance_once_per_micro_batch(self):
        # The functional twin's mask is the inputs' (no counting pass): the same
        # seeds drawn and statistics taken once per micro-batch, in the same order.
        middle = (lambda: layers.Dropout(0.3, seed=8), layers.BatchNormalization)
        x, y, weights = _tokens(15)

        def functional(**split):
            keras.utils.set_random_seed(3)
            inputs = keras.Input((LENGTH,), dtype="int64")
            hidden = layers.Embedding(20, 4, mask_zero=True)(inputs)
            for layer in middle:
                hidden = layer()(hidden)
            hidden = layers.Dense(5, activation="tanh")(hidden)
            return AccumulatingModel(inputs, layers.Dense(3)(hidden), **split)

        twin = functional(micro_batch_size=6)
        ours = _subclassed(AccumulatingModel, middle=middle, micro_batch_size=6)
        ours.set_weights(twin.get_weights())
        expected = _fit_and_evaluate(twin, x, y, weights)
        got = _fit_and_evaluate(ours, x, y, weights)
        for received, wanted in zip(got, expected, strict=True):
            assert_same_logs(received, wanted, TOLERANCE)
        # The moving statistics and the Dropout's seed state among them.
        assert_same_weights([v.numpy() for v in ours.non_trainable_variables],
                            [v.numpy() for v in twin.non_trainable_variables], TOLERANCE)
        assert_same_weights(ours, twin, TOLERANCE)
        seeds = [v for v in ours.non_trainable_variables if "seed" in v.path]
        assert seeds and not np.array_equal(seeds[0].numpy(), [8, 0])  # drawn from in training


def _recomputed(cls, **split):
    """A subclassed tagger whose recomputed blocks (`Remat`, in the `AccumulatingModel`
    only) make the mask (a Sequential holding the masked Embedding) and read it (a GRU)."""
    keras.utils.set_random_seed(6)
    wrap = Remat if cls is AccumulatingModel else (lambda layer: layer)

    class Tagger(cls):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.backbone = wrap(keras.Sequential([layers.Embedding(20, 4, mask_zero=True),
                                                   layers.Dense(5, activation="tanh")]))
            self.gru = wrap(layers.GRU(4, return_sequences=True))
            self.head = layers.Dense(3)

        def call(self, tokens):
            return self.head(self.gru(self.backbone(tokens)))

    model = Tagger(**split)
    model(np.zeros((1, LENGTH), "int64"))
    return model


def _segmented(cls, **split):
    """A functional tagger cut (`remat=`, in the `AccumulatingModel` only) after a nested
    Sequential that makes the mask and after a GRU that reads it: both recomputed."""
    keras.utils.set_random_seed(7)
    inputs = keras.Input((LENGTH,), dtype="int64")
    backbone = keras.Sequential([layers.Embedding(20, 4, mask_zero=True),
                                 layers.Dense(5, activation="tanh")], name="backbone")
    hidden = layers.GRU(4, return_sequences=True, name="gru")(backbone(inputs))
    if cls is AccumulatingModel:
        split = dict(split, remat=["backbone", "gru"])
    return cls(inputs, layers.Dense(3)(hidden), **split)


def _mask_dropped(cls, **split):
    """A sequence classifier: a recomputed segment makes the mask (a nested Sequential
    holding the masked Embedding), the next drops it (a GRU's last state), so no mask
    reaches the loss."""
    keras.utils.set_random_seed(8)
    inputs = keras.Input((LENGTH,), dtype="int64")
    backbone = keras.Sequential([layers.Embedding(20, 4, mask_zero=True),
                                 layers.Dense(5, activation="tanh")], name="backbone")
    hidden = layers.GRU(4, name="gru")(backbone(inputs))
    if cls is AccumulatingModel:
        split = dict(split, remat=["backbone", "gru"])
    return cls(inputs, layers.Dense(3)(hidden), **split)


class TestThroughRecomputation:
    # A mask made inside a recomputed segment (`jax.checkpoint`) reaches the loss as
    # without recomputation; plain Keras, without it, is the oracle.
    @pytest.mark.parametrize("build", [_recomputed, _segmented])
    def test_a_mask_made_in_a_recomputed_segment(self, build):
        x, y, weights = _tokens(16)
        _assert_as_plain_keras(build, x, y, weights)

    def test_a_mask_dropped_in_a_recomputed_segment(self):
        x, _, _ = _tokens(17)
        y = np.random.default_rng(17).integers(0, 3, SAMPLES)
        _assert_as_plain_keras(_mask_dropped, x, y, None)

    def test_a_recomputed_masking_layer_of_the_inputs(self):
        # Built symbolically, the output's mask is the wrapped layer's, one per time step:
        # the functional model of the inputs that counts it is built from it.
        rng = np.random.default_rng(18)
        x = rng.normal(size=(SAMPLES, LENGTH, 4)) * (rng.random((SAMPLES, LENGTH, 1)) < 0.7)
        y = rng.integers(0, 3, (SAMPLES, LENGTH))
        _assert_as_plain_keras(_masking_first, x, y, rng.uniform(0.1, 2.0, y.shape))


def _masking_first(cls, **split):
    keras.utils.set_random_seed(9)
    wrap = Remat if cls is AccumulatingModel else (lambda layer: layer)
    inputs = keras.Input((LENGTH, 4))
    hidden = wrap(layers.Masking(0.0))(inputs)
    hidden = wrap(layers.GRU(4, return_sequences=True))(hidden)
    return cls(inputs, layers.Dense(3)(hidden), **split)
