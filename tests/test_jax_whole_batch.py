"""`whole_batch_loss=True` on Keras 3's JAX backend (keras_memopt._step.jax_whole_batch).

The oracle is plain Keras on JAX at the whole batch, in float64, at 1e-9: every
weight, every figure `fit` logs over two epochs and `evaluate`, with losses that
couple the batch's samples (a contrastive loss whose negatives are the batch's
other rows, a Dice loss over the batch, a ratio of the batch's weighted sums)
and uneven micro-batches (batches of 24 and 12 samples in micro-batches of 10:
10, 10, 4 and 10, 2). Dropout and BatchNormalization at micro-batches have no
plain-Keras oracle (other masks, other statistics): with a per-sample loss the
option is compared with the same split without it, itself tested against plain
Keras in tests/test_jax.py.
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

    from keras_memopt import AccumulatingModel

ops = getattr(keras, "ops", None)  # Keras 3 (tf_keras, which collects the module, has none)
layers = keras.layers
TOLERANCE = dict(rtol=1e-9, atol=1e-9)
SAMPLES, BATCH = 60, 24
WHOLE = dict(micro_batch_size=10, whole_batch_loss=True)
WIDTH = 8


def clip_loss(y_true, y_pred):
    """Symmetric InfoNCE over the batch: row i of each tower matches row i of the other."""
    images, texts = y_pred[:, :WIDTH], y_pred[:, WIDTH:]
    images = images / ops.norm(images, axis=1, keepdims=True)
    texts = texts / ops.norm(texts, axis=1, keepdims=True)
    logits = 10.0 * ops.matmul(images, ops.transpose(texts))
    labels = ops.arange(ops.shape(logits)[0])
    cross_entropy = keras.losses.sparse_categorical_crossentropy
    return 0.5 * (cross_entropy(labels, logits, from_logits=True)
                  + cross_entropy(labels, ops.transpose(logits), from_logits=True))


def two_towers(cls, **kwargs):
    keras.utils.set_random_seed(0)
    image, text = keras.Input((6,), name="image"), keras.Input((5,), name="text")
    a = layers.Dense(16, activation="relu", kernel_regularizer="l2")(image)
    b = layers.Dense(16, activation="relu", activity_regularizer=keras.regularizers.L2(1e-3))(text)
    towers = [layers.Dense(WIDTH)(t) for t in (a, b)]
    return cls([image, text], layers.Concatenate()(towers), **kwargs)


def two_heads(cls, **kwargs):
    """A softmax head and a sigmoid head, whose cross-entropy and Dice loss Keras
    computes from the probabilities on JAX."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    hidden = layers.Dense(16, activation="tanh")(inputs)
    classes = layers.Dense(3, activation="softmax", name="classes")(hidden)
    masks = layers.Dense(4, activation="sigmoid", name="masks")(hidden)
    return cls(inputs, {"classes": classes, "masks": masks}, **kwargs)


def _towers_data():
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(SAMPLES, 6)), rng.normal(size=(SAMPLES, 5))]
    return x, np.zeros((SAMPLES, 1)), None


def _heads_data():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(SAMPLES, 6))
    y = {"classes": np.eye(3)[rng.integers(0, 3, SAMPLES)],
         "masks": (rng.uniform(size=(SAMPLES, 4)) < 0.4).astype("float64")}
    return x, y, rng.uniform(0.1, 2.0, SAMPLES)


def _compile_towers(model):
    model.compile(keras.optimizers.Adam(0.01), clip_loss, metrics=["mse"])


def _compile_heads(model):
    model.compile(
        keras.optimizers.Adam(0.02),
        loss={"classes": keras.losses.CategoricalCrossentropy(
                  reduction="mean_with_sample_weight"),
              "masks": keras.losses.Dice()},
        metrics={"classes": ["accuracy"], "masks": ["binary_accuracy"]},
    )


def _trained(model, compile_model, data):
    x, y, weights = data
    compile_model(model)
    history = model.fit(x, y, sample_weight=weights, batch_size=BATCH, epochs=2, shuffle=False,
                        verbose=0)
    evaluation = model.evaluate(x, y, sample_weight=weights, batch_size=BATCH, verbose=0,
                                return_dict=True)
    return model, history.history, evaluation


def _assert_same(expected, received):
    (plain, logs, evaluation), (ours, got_logs, got_evaluation) = expected, received
    assert_same_weights(ours, plain, TOLERANCE)
    assert sorted(got_logs) == sorted(logs)
    assert_same_logs(got_logs, logs, TOLERANCE)
    assert_same_logs(got_evaluation, evaluation, TOLERANCE)


@pytest.mark.parametrize("build, compile_model, data", [
    (two_towers, _compile_towers, _towers_data),
    (two_heads, _compile_heads, _heads_data),
], ids=["contrastive", "softmax_and_sigmoid_heads"])
def test_a_loss_that_couples_the_batch_matches_plain_keras(build, compile_model, data):
    # The towers: kernel and activity regularisers, their terms counted once per
    # update. The heads: sample weights in a ratio of the batch's weighted sums
    # and a Dice loss over the batch, per-output losses and metrics logged.
    plain = build(keras.Model)
    ours = build(AccumulatingModel, **WHOLE)
    ours.set_weights(plain.get_weights())
    expected = _trained(plain, compile_model, data())
    _assert_same(expected, _trained(ours, compile_model, data()))
    assert expected[1]["loss"][0] != expected[1]["loss"][1]  # it trained


def _regularised(cls, **kwargs):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    hidden = layers.Dense(16)(inputs)
    hidden = layers.BatchNormalization()(hidden)
    hidden = layers.Dropout(0.3, seed=5)(layers.Activation("relu")(hidden))
    return cls(inputs, layers.Dense(3)(hidden), **kwargs)


def test_dropout_and_batch_normalization_replay_the_first_pass():
    # Each micro-batch's second pass draws the masks of its first (a pass from
    # the step's seed would draw the first micro-batch's masks for every one),
    # and the moving statistics advance once per micro-batch, as without the option.
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(SAMPLES, 6)) * 2 + 1, rng.integers(0, 3, SAMPLES)

    def compile_model(model):
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])

    without = _regularised(AccumulatingModel, micro_batch_size=10)
    ours = _regularised(AccumulatingModel, **WHOLE)
    _assert_same(_trained(without, compile_model, (x, y, None)),
                 _trained(ours, compile_model, (x, y, None)))


def test_the_option_is_kept_by_the_config_and_settable():
    model = two_heads(AccumulatingModel, **WHOLE)
    assert model.get_config()["whole_batch_loss"] is True
    assert AccumulatingModel.from_config(model.get_config()).whole_batch_loss is True
    with pytest.raises(ValueError, match=r"Received: whole_batch_loss=1"):
        model.whole_batch_loss = 1
    _compile_heads(model)
    # The ratio of the batch's weighted sums is taken with the option only.
    with pytest.raises(ValueError, match=r"reduction='mean_with_sample_weight'"):
        model.whole_batch_loss = False
    assert model.whole_batch_loss is True


def test_a_layer_assigned_in_every_call_is_refused_before_any_update():
    keras.utils.set_random_seed(6)
    inputs = keras.Input((6,))
    outputs = layers.SpectralNormalization(layers.Dense(3))(inputs)
    model = AccumulatingModel(inputs, outputs, **WHOLE)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    before = [w.copy() for w in model.get_weights()]
    rng = np.random.default_rng(7)
    with pytest.raises(NotImplementedError, match=r"SpectralNormalization.*whole_batch_loss=True"):
        model.fit(rng.normal(size=(20, 6)), rng.normal(size=(20, 3)), batch_size=20, verbose=0)
    assert_same_weights(model, before, dict(rtol=0, atol=0))
    assert int(model.optimizer.iterations.numpy()) == 0


@pytest.mark.parametrize("loss", ["contrastive", "summed over the batch"])
def test_without_the_option_a_loss_that_couples_the_batch_is_refused_before_any_update(loss):
    # Split, the micro-batches' fractions of a loss that is no mean of per-sample
    # terms add up to another loss: before the check, a loss summed over the
    # batch trained silently 6.5 away from plain Keras's weights in two steps.
    if loss == "contrastive":
        model, (x, y, _) = two_towers(AccumulatingModel, micro_batch_size=10), _towers_data()
        _compile_towers(model)
    else:
        inputs = keras.Input((6,))
        model = AccumulatingModel(inputs, layers.Dense(2)(inputs), micro_batch_size=10)
        model.compile(keras.optimizers.SGD(0.1), lambda y, p: ops.sum(ops.square(y - p)))
        x, y = _heads_data()[0], np.ones((SAMPLES, 2))
    model.optimizer.build(model.trainable_variables)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"this compiled loss is not: on the same outputs it was "
                                         r".* on two samples but .*whole_batch_loss=False"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert_same_weights(model, before, dict(rtol=0, atol=0))
    assert int(model.optimizer.iterations.numpy()) == 0
    model.whole_batch_loss = True  # the same model trains with the option
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 3
