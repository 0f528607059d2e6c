"""`whole_batch_loss=True`: losses that couple the batch, exact against plain Keras.

The model is a two-tower CLIP-style encoder whose loss uses every other row
of the batch as negatives. Plain Keras on the whole batch is the oracle:
weights after two epochs of Adam, every logged figure and `evaluate`, with
uneven micro-batches (48 samples a batch, micro-batches of 20, 20 and 8). That
losses of the outputs alone stay exact with the option too (masks, ignored classes,
several outputs, sample weights) tests/test_exactness.py checks on four of its cases,
against the plain Keras run it trains for them anyway.
"""

import dataclasses
import functools

import numpy as np
import pytest
import tensorflow as tf
from _faults import OutOfMemoryAbove
from _helpers import FLOAT32, IDENTICAL, assert_same_logs, assert_same_weights
from conftest import LEGACY, last_json, run_python
from test_exactness import CASES, _train, assert_same_training

from keras_memopt import AccumulatingModel
from keras_memopt._keras import keras
from keras_memopt.callbacks import OOMBackoff

layers = keras.layers
WIDTH = 8


def clip_loss(y_true, y_pred):
    """Symmetric InfoNCE over the batch: row i of each tower matches row i of the other."""
    images = tf.math.l2_normalize(y_pred[:, :WIDTH], axis=1)
    texts = tf.math.l2_normalize(y_pred[:, WIDTH:], axis=1)
    logits = 10.0 * tf.matmul(images, texts, transpose_b=True)
    labels = tf.range(tf.shape(logits)[0])
    cross_entropy = tf.nn.sparse_softmax_cross_entropy_with_logits
    return 0.5 * (cross_entropy(labels, logits) + cross_entropy(labels, tf.transpose(logits)))


def two_towers(cls, dropout=0.0, batch_norm=False, regularized=True, **kwargs):
    keras.utils.set_random_seed(0)
    image, text = keras.Input((6,), name="image"), keras.Input((5,), name="text")
    a = layers.Dense(16, activation="relu")(image)
    if batch_norm:
        a = layers.BatchNormalization()(a)
    if dropout:
        # tf_keras's default dropout draws with stateful ops, which nothing can replay.
        extra = dict(rng_type="stateless") if LEGACY else {}
        a = layers.Dropout(dropout, seed=3, **extra)(a)
    regularizer = keras.regularizers.L2(1e-3) if regularized else None
    b = layers.Dense(16, activation="relu", activity_regularizer=regularizer)(text)
    # The embeddings in float32, as mixed-precision models keep their outputs.
    towers = [layers.Dense(WIDTH, dtype="float32")(t) for t in (a, b)]
    return cls([image, text], layers.Concatenate(dtype="float32")(towers), **kwargs)


def _data(n=96, seed=0):
    rng = np.random.RandomState(seed)
    x = [rng.normal(size=(n, 6)).astype("float32"), rng.normal(size=(n, 5)).astype("float32")]
    return x, np.zeros((n, 1), "float32")


def _fit(model, loss=clip_loss, metrics=(), epochs=2, **fit):
    x, y = _data()
    model.compile(keras.optimizers.Adam(0.01), loss, metrics=list(metrics))
    history = model.fit(x, y, batch_size=48, epochs=epochs, shuffle=False, verbose=0, **fit)
    evaluation = model.evaluate(x, y, batch_size=48, verbose=0, return_dict=True)
    return model, history.history, evaluation


def _assert_same(expected, received, tolerance=FLOAT32):
    (a, logs_a, eval_a), (b, logs_b, eval_b) = expected, received
    assert_same_weights(b, a, tolerance)
    assert_same_logs(logs_b, logs_a, tolerance)
    assert_same_logs(eval_b, eval_a, tolerance)


WHOLE = dict(micro_batch_size=20, whole_batch_loss=True)


def _mse():
    return keras.metrics.MeanSquaredError(name="mse")


@functools.cache
def _plain():
    """Plain Keras's `_fit` of `two_towers` with the MSE as a metric: weights, logs and
    evaluation, which several tests compare with, trained once a module (a process)."""
    model, logs, evaluation = _fit(two_towers(keras.Model), metrics=[_mse()])
    return model.get_weights(), logs, evaluation


def test_compiled_clip_loss_matches_plain_keras():
    _assert_same(_plain(), _fit(two_towers(AccumulatingModel, **WHOLE), metrics=[_mse()]))


@pytest.mark.parametrize("optimizer", ["Ftrl", "AdamW"])
def test_an_output_without_a_loss_gets_no_gradient(optimizer):
    # Its head's weights got a zero gradient, which Ftrl turns into zero weights and
    # AdamW's decay moves; plain Keras leaves a variable without a gradient as it is.
    def model(cls, **kwargs):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        hidden = layers.Dense(8, activation="relu")(inputs)
        outputs = {"pair": layers.Dense(2 * WIDTH, name="pair")(hidden),
                   "extra": layers.Dense(3, name="extra")(hidden)}
        return cls(inputs, outputs, **kwargs)

    x = _data()[0][0]
    y = {"pair": np.zeros((len(x), 1), "float32"), "extra": np.zeros((len(x), 3), "float32")}
    runs = []
    for cls, kwargs in ((keras.Model, {}), (AccumulatingModel, WHOLE)):
        trained = model(cls, **kwargs)
        trained.compile(getattr(keras.optimizers, optimizer)(0.05), loss={"pair": clip_loss})
        history = trained.fit(x, y, batch_size=48, epochs=2, shuffle=False, verbose=0)
        runs.append((trained, history.history, {}))
    _assert_same(*runs)


def test_without_the_option_the_coupled_loss_is_refused_before_any_update():
    model = two_towers(AccumulatingModel, micro_batch_size=20)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"couples its samples.*whole_batch_loss=True"):
        _fit(model)
    assert_same_weights(before, model, IDENTICAL)
    assert int(model.optimizer.iterations) == 0
    # Switched on between fits, it trains: the loss is checked again.
    model.whole_batch_loss = True
    _fit(model, epochs=1)
    assert int(model.optimizer.iterations) == 2


@pytest.mark.skipif(LEGACY, reason="Keras 3's compute_loss (tf_keras: refused, tested below)")
def test_clip_loss_in_compute_loss_matches_plain_keras():
    def build(cls, **kwargs):
        class Clip(cls):
            def compute_loss(self, x, y, y_pred, sample_weight=None, training=True):
                return tf.reduce_mean(clip_loss(y, y_pred)) + tf.add_n(self.losses)

        return two_towers(Clip, **kwargs)

    _assert_same(_fit(build(keras.Model), loss=None), _fit(build(AccumulatingModel, **WHOLE), None))
    with pytest.raises(ValueError, match="`compute_loss` is not.*whole_batch_loss=True"):
        _fit(build(AccumulatingModel, micro_batch_size=20), loss=None)


@pytest.mark.skipif(not LEGACY, reason="tf_keras only")
def test_compute_loss_override_is_refused_on_tf_keras():
    class Clip(AccumulatingModel):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
            return tf.reduce_mean(clip_loss(y, y_pred))

    with pytest.raises(ValueError, match="overridden `compute_loss` needs Keras 3"):
        _fit(two_towers(Clip, **WHOLE), loss=None)


def test_dropout_at_one_micro_batch_matches_plain_keras():
    expected = _fit(two_towers(keras.Model, dropout=0.3))
    received = _fit(two_towers(AccumulatingModel, dropout=0.3, micro_batch_size=48,
                               whole_batch_loss=True))
    _assert_same(expected, received)


def test_the_second_pass_replays_the_first_passs_randomness():
    """With a per-sample loss, whole-batch training equals micro-batch training
    only if each micro-batch's second pass draws the first pass's dropout masks
    and leaves BatchNormalization's statistics updated once."""

    def mse(y_true, y_pred):
        return tf.reduce_mean(tf.square(y_pred), axis=-1)

    def build(**kwargs):
        return two_towers(
            AccumulatingModel, dropout=0.3, batch_norm=True, micro_batch_size=20, **kwargs
        )

    _assert_same(_fit(build(), loss=mse), _fit(build(whole_batch_loss=True), loss=mse))


@pytest.mark.skipif(LEGACY, reason="tf_keras has no 'mean_with_sample_weight' reduction")
def test_a_ratio_of_the_weighted_sums_is_exact_with_the_option():
    # Σ w·loss / Σ w over the batch: refused without the option (test_models.py).
    weights = np.random.RandomState(2).uniform(0.0, 2.0, 96).astype("float32")

    def fit(model):
        loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
        return _fit(model, loss=loss, sample_weight=weights)

    _assert_same(fit(two_towers(keras.Model)), fit(two_towers(AccumulatingModel, **WHOLE)))


def test_under_mirrored_strategy(mirrored_strategy):
    with mirrored_strategy.scope():
        expected = _fit(two_towers(keras.Model))
        received = _fit(two_towers(AccumulatingModel, micro_batch_size=10, whole_batch_loss=True))
    _assert_same(expected, received)


def test_with_mixed_precision():
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        # Keras 3 cannot add a float16 activity regulariser to a float32 loss.
        expected = _fit(two_towers(keras.Model, regularized=False))
        received = _fit(two_towers(AccumulatingModel, regularized=False, **WHOLE))
    finally:
        keras.mixed_precision.set_global_policy(policy)
    # float16 activations of other batch sizes round differently (seen: 2e-5).
    _assert_same(expected, received, dict(rtol=1e-4, atol=1e-4))


def test_with_remat():
    received = _fit(two_towers(AccumulatingModel, remat="auto", **WHOLE), metrics=[_mse()])
    _assert_same(_plain(), received)


def test_oom_backoff_retries_to_the_same_result():
    # The fault passes its input through: plain Keras's run without it is the oracle.
    options = dict(micro_batch_size=48, whole_batch_loss=True)
    model = two_towers(AccumulatingModel, **options)
    keras.utils.set_random_seed(0)
    image, text = model.inputs
    faulty = OutOfMemoryAbove(24)(image)
    wrapped = keras.Model([image, text], model([faulty, text]))
    backoff = OOMBackoff(verbose=0)
    received = _fit(
        AccumulatingModel.from_model(wrapped, **options), metrics=[_mse()], callbacks=[backoff]
    )
    assert [e["micro_batch_size"] for e in backoff.backoffs] == [24]
    _assert_same(_plain(), received)


# A loss of [4096, 4096] similarities (64 MiB) under a 40 MiB limit: no
# micro-batch size changes it, so nothing is retried.
LOSS_DOES_NOT_FIT = """
import json
import numpy as np, tensorflow as tf
from keras_memopt import AccumulatingModel
from keras_memopt._keras import keras
from keras_memopt.callbacks import OOMBackoff

def coupled(y_true, y_pred):
    logits = tf.matmul(y_pred, y_pred, transpose_b=True)
    labels = tf.range(tf.shape(logits)[0])
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)

inputs = keras.Input((4,))
model = AccumulatingModel(inputs, keras.layers.Dense(4)(inputs), micro_batch_size=1024,
                          whole_batch_loss=True)
model.compile(keras.optimizers.Adam(0.01), coupled)
rng = np.random.RandomState(0)
x, y = rng.normal(size=(4096, 4)).astype("float32"), np.zeros((4096, 1), "float32")
before = [w.copy() for w in model.get_weights()]
backoff = OOMBackoff(verbose=0)
try:
    model.fit(x, y, batch_size=4096, verbose=0, callbacks=[backoff])
    out = dict(message=None)
except tf.errors.ResourceExhaustedError as error:
    out = dict(message=error.message)
out["backoffs"] = len(backoff.backoffs)
out["unchanged"] = all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
out["iterations"] = int(model.optimizer.iterations.numpy())
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_loss_that_does_not_fit_is_reported_at_once():
    result = run_python(LOSS_DOES_NOT_FIT, memory_limit_mb=40)
    out = last_json(result)
    message = out["message"]
    assert message is not None and message.startswith(
        "Out of memory in the loss over the whole batch's outputs (whole_batch_loss=True) "
        "(micro_batch_size=1024): a smaller micro-batch needs no less memory there"
    ), message
    assert "a tensor of shape [4096, 4096]" in message and "a smaller batch" in message
    assert out["backoffs"] == 0 and out["unchanged"] and out["iterations"] == 0, out


def soft_dice(y_true, y_pred):
    """A segmentation loss as users write it: one ratio of the batch's sums."""
    overlap = tf.reduce_sum(y_true * y_pred)
    return 1.0 - 2.0 * overlap / (tf.reduce_sum(y_true) + tf.reduce_sum(y_pred) + 1e-6)


def _segmenter(cls, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 2))
    x = layers.Conv2D(4, 3, padding="same", activation="relu")(inputs)
    return cls(inputs, layers.Conv2D(1, 1, activation="sigmoid")(x), **kwargs)


def _fit_segmenter(model, loss):
    rng = np.random.RandomState(1)
    x = rng.normal(size=(40, 8, 8, 2)).astype("float32")
    y = (rng.uniform(size=(40, 8, 8, 1)) < 0.3).astype("float32")
    model.compile(keras.optimizers.Adam(0.01), loss)
    history = model.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0)
    return model, history.history, model.evaluate(x, y, batch_size=20, verbose=0, return_dict=True)


# Keras 3's own Dice and Tversky losses reduce over the whole batch (`axis=None`).
RATIO_LOSSES = ["soft_dice"] + ([] if LEGACY else ["dice", "tversky"])


@pytest.mark.parametrize("loss", RATIO_LOSSES)
def test_a_ratio_of_the_batchs_sums_is_refused_and_exact_with_the_option(loss):
    """A Dice loss keeps its value on repeated samples, so only the samples one at
    a time show it is no mean of per-sample terms; silently, the micro-batches'
    weighted Dice losses would train another model."""
    fresh = {"soft_dice": lambda: soft_dice}.get(loss) or getattr(keras.losses, loss.title())
    refused = r"as the sum of each sample's loss weighted by its share.*a Dice loss"
    _assert_refused_and_exact_with_the_option(_segmenter, _fit_segmenter, fresh, refused, 8)


def _assert_refused_and_exact_with_the_option(build, fit, fresh, refused, micro_batch_size):
    """The loss `fresh()` is refused at the first step, before any update, with a
    message matching `refused` that points to the option; with the option, weights
    and every figure are plain Keras's at the whole batch."""
    model = build(AccumulatingModel, micro_batch_size=micro_batch_size)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=refused + ".*whole_batch_loss=True"):
        fit(model, fresh())
    assert_same_weights(before, model, IDENTICAL)
    assert int(model.optimizer.iterations) == 0
    option = build(AccumulatingModel, micro_batch_size=micro_batch_size, whole_batch_loss=True)
    _assert_same(fit(build(keras.Model), fresh()), fit(option, fresh()))


@pytest.mark.skipif(LEGACY, reason="Keras 3's Dice loss")
def test_a_per_sample_dice_loss_needs_no_option():
    expected = _fit_segmenter(_segmenter(keras.Model), keras.losses.Dice(axis=(1, 2, 3)))
    received = _fit_segmenter(
        _segmenter(AccumulatingModel, micro_batch_size=8), keras.losses.Dice(axis=(1, 2, 3))
    )
    _assert_same(expected, received)


def negative_pairs_loss(y_true, y_pred):
    """Per sample, the mean softplus of its similarity to the batch's samples of
    another class: zero on samples of one class, which make no negative pair."""
    labels = tf.reshape(tf.cast(y_true, tf.int32), [-1])
    embeddings = tf.math.l2_normalize(y_pred, axis=1)
    similarity = tf.matmul(embeddings, embeddings, transpose_b=True)
    negative = tf.cast(labels[:, None] != labels[None, :], similarity.dtype)
    total = tf.reduce_sum(negative * tf.nn.softplus(5.0 * similarity), axis=1)
    return total / tf.maximum(tf.reduce_sum(negative, axis=1), 1.0)


def _fit_embedder(model, loss):
    rng = np.random.RandomState(2)
    x = rng.normal(size=(36, 6)).astype("float32")
    # The first two samples share a class: on them alone the loss is zero.
    y = np.array([0, 0, 1, 2, 1, 0] * 6, "int32")
    model.compile(keras.optimizers.Adam(0.01), loss)
    history = model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    return model, history.history, model.evaluate(x, y, batch_size=12, verbose=0, return_dict=True)


def _embedder(cls, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    return cls(inputs, layers.Dense(4)(layers.Dense(8, activation="relu")(inputs)), **kwargs)


@pytest.mark.parametrize("loss", ["negative_pairs"] + ([] if LEGACY else ["circle"]))
def test_a_loss_of_pairs_zero_on_the_first_two_samples_is_refused_and_exact_with_the_option(loss):
    """A loss of pairs of the batch's samples is zero on two samples of one class,
    and on them repeated: the first two samples tell nothing, the next pairs do.
    Before, Keras 3's `Circle` trained silently to other weights (relative error 1.2
    after two epochs of this model)."""
    fresh = {"negative_pairs": lambda: negative_pairs_loss,
             "circle": lambda: keras.losses.Circle()}[loss]
    refused = r"this compiled loss is not: on the same outputs it .*a contrastive loss"
    _assert_refused_and_exact_with_the_option(_embedder, _fit_embedder, fresh, refused, 4)


def test_a_loss_function_that_ignores_a_class_itself_is_refused_and_exact_with_the_option():
    """Keras divides such a loss by the elements its values' mask keeps, which only
    the loss's own `ignore_class` setting says before the loop: a plain function
    that ignores a class is caught by the parts check, not trained to other weights."""
    keep = CASES["tagger-ignore-class-sgd"]
    usual = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)

    def ignoring(y_true, y_pred):
        return usual.call(y_true, y_pred)

    case = dataclasses.replace(keep, compile=lambda: dict(loss=ignoring, metrics=["accuracy"]))
    refused = "weighted by its share, as (micro-batches add|a micro-batch adds) it up"
    with pytest.raises(ValueError, match=refused):
        _train(case, AccumulatingModel, **case.micro)
    received = _train(case, AccumulatingModel, whole_batch_loss=True, **case.micro)
    assert_same_training(_train(case, keras.Model), received)


def test_custom_step_with_a_forward_function():
    class Plain(keras.Model):
        def train_step(self, data):
            x, _ = data
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(clip_loss(None, self(x, training=True)))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
            return {"loss": loss}

    class Accumulating(AccumulatingModel):
        def train_step(self, data):
            x, _ = data
            loss, grads = self.accumulate_gradients(
                lambda outputs, data: tf.reduce_mean(clip_loss(None, outputs)),
                x, self.trainable_variables,
                forward=lambda micro: self(micro, training=True),
            )
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
            return {"loss": loss}

    def fit(model):
        x, y = _data()
        model.compile(keras.optimizers.Adam(0.01))
        history = model.fit(x, y, batch_size=48, epochs=2, shuffle=False, verbose=0)
        return model, history.history, {}

    _assert_same(fit(two_towers(Plain)), fit(two_towers(Accumulating, micro_batch_size=20)))


class TestSetting:
    def test_config_round_trip(self):
        model = two_towers(AccumulatingModel, **WHOLE)
        assert model.get_config()["whole_batch_loss"] is True
        assert AccumulatingModel.from_config(model.get_config()).whole_batch_loss is True

    def test_uneven_replica_shares_are_refused(self, mirrored_strategy):
        with mirrored_strategy.scope():
            with pytest.raises(ValueError, match=r"Use one of the two. Received: "
                               r"whole_batch_loss=True, replica_shares=\[3.0, 1.0\]"):
                two_towers(AccumulatingModel, replica_shares=[3, 1], **WHOLE)
            model = two_towers(AccumulatingModel, replica_shares=[3, 1], micro_batch_size=20)
            with pytest.raises(ValueError, match="Use one of the two"):
                model.whole_batch_loss = True
        assert model.whole_batch_loss is False

    @pytest.mark.parametrize("value", [1, "yes", None])
    def test_not_a_bool_is_refused(self, value):
        with pytest.raises(ValueError, match=r"`whole_batch_loss` must be True or False"):
            two_towers(AccumulatingModel, whole_batch_loss=value)
        model = two_towers(AccumulatingModel)
        with pytest.raises(ValueError, match=r"Received: whole_batch_loss="):
            model.whole_batch_loss = value
        assert model.whole_batch_loss is False
