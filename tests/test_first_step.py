"""The first step has no side effects: data, random state and models are as in plain Keras.

What the first step needs (shapes, the loss check, the optimizer's variables)
comes from the batch `fit` hands to it: no batch is taken from the user's
iterator, no random state advances, and a model that Keras would not build
before its first step (a GAN without `call()`) is not built. Each test runs
the same training on a plain `keras.Model` and on an `AccumulatingModel` and
compares what happened: which batches trained, in which order, and the
weights.
"""

import random

import numpy as np
import pytest
import tensorflow as tf
from _helpers import FLOAT32, assert_same_weights
from conftest import LEGACY

from keras_memopt import AccumulatingModel
from keras_memopt._keras import keras

layers = keras.layers
BATCHES, BATCH = 4, 8


class BatchRecorder(layers.Layer):
    """Records the batch id (the first feature) of every sample it trains on."""

    def __init__(self, seen, **kwargs):
        super().__init__(**kwargs)
        self.record = seen.extend  # a method: Keras would track (and copy) a list

    def call(self, inputs, training=None):
        if training:
            ids = tf.cast(inputs[:, 0], tf.int32)
            tf.py_function(lambda t: self.record(t.numpy().tolist()), [ids], [])
        return inputs


def _recording_model(cls, seen, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    outputs = layers.Dense(2)(BatchRecorder(seen)(inputs))
    model = cls(inputs, outputs, **kwargs)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def _batch_order(seen):
    """The batch ids in the order they trained, one per batch."""
    order = []
    for batch_id in seen:
        if not order or order[-1] != batch_id:
            order.append(int(batch_id))
    return order


def _data():
    x = np.random.RandomState(0).normal(size=(BATCHES * BATCH, 4)).astype("float32")
    x[:, 0] = np.repeat(np.arange(BATCHES), BATCH)  # the batch id
    return x, np.zeros((BATCHES * BATCH, 2), "float32")


def _pydataset(workers, shuffle):
    base = getattr(keras.utils, "PyDataset", None) or keras.utils.Sequence
    x, y = _data()

    class Batches(base):
        def __init__(self):
            if LEGACY:
                super().__init__()
            else:
                super().__init__(workers=workers, use_multiprocessing=False)

        def __len__(self):
            return BATCHES

        def __getitem__(self, index):
            part = slice(index * BATCH, (index + 1) * BATCH)
            return x[part], y[part]

        def on_epoch_end(self):
            # tf_keras's enqueuer thread may shuffle once more after an epoch's
            # last batch, before it is stopped, and so draws from Python's
            # random state before the next epoch's shuffle or not, as the
            # threads race (plain tf_keras too): each epoch starts from one state.
            random.seed(1)

    fit = dict(shuffle=shuffle)
    if LEGACY:
        fit.update(workers=workers, use_multiprocessing=False)
    return Batches(), fit


def _orders(make_input, epochs=2, **fit_kwargs):
    """Batch order per model kind, and the models."""
    orders, models = {}, {}
    for name, cls in (("plain", keras.Model), ("accumulating", AccumulatingModel)):
        seen = []
        model = _recording_model(cls, seen)
        data, extra = make_input()
        keras.utils.set_random_seed(1)  # the same shuffles for both
        model.fit(data, epochs=epochs, verbose=0, **extra, **fit_kwargs)
        orders[name], models[name] = _batch_order(seen), model
    return orders, models


@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize("shuffle", [False, True])
def test_pydataset_trains_the_batches_plain_keras_trains(workers, shuffle):
    orders, models = _orders(lambda: _pydataset(workers, shuffle))
    if not shuffle:
        assert orders["plain"] == [0, 1, 2, 3] * 2
    for epoch in (orders["plain"][:BATCHES], orders["accumulating"][:BATCHES]):
        assert sorted(epoch) == list(range(BATCHES))  # each batch once an epoch
    assert orders["accumulating"] == orders["plain"]
    assert_same_weights(models["accumulating"], models["plain"], FLOAT32)


def test_generator_and_infinite_dataset_lose_no_batch():
    x, y = _data()

    def generator():
        while True:
            for index in range(BATCHES):
                part = slice(index * BATCH, (index + 1) * BATCH)
                yield x[part], y[part]

    orders, models = _orders(lambda: (generator(), {}), steps_per_epoch=3)
    assert orders["plain"] == [0, 1, 2, 3, 0, 1]
    assert orders["accumulating"] == orders["plain"]
    assert_same_weights(models["accumulating"], models["plain"], FLOAT32)

    def infinite():
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat(), {}

    orders, models = _orders(infinite, steps_per_epoch=3)
    assert orders["accumulating"] == orders["plain"] == [0, 1, 2, 3, 0, 1]
    assert_same_weights(models["accumulating"], models["plain"], FLOAT32)


def test_seeded_augmentation_draws_as_in_plain_keras():
    """A tf.data map with seeded random ops runs as often as in plain Keras."""
    x, y = _data()
    calls = {}

    def make_input(name):
        def augment(features, target):
            tf.py_function(lambda: calls.__setitem__(name, calls.get(name, 0) + 1), [], [])
            flip = tf.random.uniform([], seed=3) < 0.5
            return tf.where(flip, -features, features), target

        def make():
            tf.random.set_seed(5)
            dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
            return dataset.map(augment), {}

        return make

    models = {}
    for name, cls in (("plain", keras.Model), ("accumulating", AccumulatingModel)):
        model = _recording_model(cls, [], **({} if cls is keras.Model else {"micro_batch_size": 3}))
        data, _ = make_input(name)()
        model.fit(data, epochs=2, verbose=0)
        models[name] = model
    assert calls["accumulating"] == calls["plain"] == 2 * BATCHES
    assert_same_weights(models["accumulating"], models["plain"], FLOAT32)


def test_distributed_dataset_loses_no_batch(mirrored_strategy):
    x, y = _data()
    orders = {}
    for name, cls in (("plain", keras.Model), ("accumulating", AccumulatingModel)):
        seen = []
        with mirrored_strategy.scope():
            model = _recording_model(cls, seen)
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
        model.fit(dataset, epochs=1, verbose=0)
        orders[name] = sorted(set(seen))
        assert len(seen) == BATCHES * BATCH  # every sample once
    assert orders["accumulating"] == orders["plain"] == list(range(BATCHES))


# -- models Keras does not build before their first step ------------------------------


class Sampling(layers.Layer):
    """keras.io's VAE sampling layer: draws its noise in inference mode too."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if not LEGACY:
            self.seed_generator = keras.random.SeedGenerator(7)

    def call(self, inputs):
        mean, log_var = inputs
        if LEGACY:
            noise = tf.random.normal(tf.shape(mean))
        else:
            noise = keras.random.normal(tf.shape(mean), seed=self.seed_generator)
        return mean + tf.exp(0.5 * log_var) * noise


def _vae(cls, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = layers.Dense(8, activation="relu")(inputs)
    z = Sampling()([layers.Dense(2)(hidden), layers.Dense(2)(hidden)])
    outputs = layers.Dense(6)(layers.Dense(8, activation="relu")(z))
    model = cls(inputs, outputs, **kwargs)
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def test_a_random_layer_does_not_fool_the_loss_check():
    x = np.random.RandomState(0).normal(size=(32, 6)).astype("float32")
    # Split into micro-batches the noise is drawn per micro-batch: it trains.
    history = _vae(AccumulatingModel, micro_batch_size=5).fit(
        x, x, batch_size=16, epochs=2, verbose=0
    )
    assert np.all(np.isfinite(history.history["loss"]))
    if LEGACY:
        return  # tf_keras's stateful random ops cannot be replayed: no oracle
    # One micro-batch per batch draws the noise plain Keras draws: the first
    # step's loss check advanced no seed.
    models = {}
    for name, model in (("plain", _vae(keras.Model)), ("accumulating", _vae(AccumulatingModel))):
        model.fit(x, x, batch_size=16, epochs=2, shuffle=False, verbose=0)
        models[name] = model
    assert_same_weights(models["accumulating"], models["plain"], FLOAT32)


class GAN(keras.Model):
    """keras.io's GAN: a custom `train_step`, no `call()`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.generator = keras.Sequential([keras.Input((3,)), layers.Dense(4)])
        self.discriminator = keras.Sequential([keras.Input((4,)), layers.Dense(1)])
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

    def gradients(self, loss_fn, data, variables):
        with tf.GradientTape() as tape:
            loss = loss_fn(data)
        return loss, tape.gradient(loss, variables)

    def train_step(self, data):
        real, latent = data

        def d_loss(data):
            real, latent = data
            predictions = self.discriminator(tf.concat([self.generator(latent), real], 0))
            half = tf.shape(real)[0]
            labels = tf.concat([tf.ones([half, 1]), tf.zeros([half, 1])], 0)
            return self.loss_fn(labels, predictions)

        variables = self.discriminator.trainable_variables
        loss, grads = self.gradients(d_loss, (real, latent), variables)
        self.d_optimizer.apply_gradients(zip(grads, variables, strict=True))
        return {"d_loss": loss}


class AccumulatingGAN(GAN, AccumulatingModel):
    def __init__(self, **kwargs):
        super().__init__(micro_batch_size=3, **kwargs)

    def gradients(self, loss_fn, data, variables):
        return self.accumulate_gradients(loss_fn, data, variables, optimizer=self.d_optimizer)


def test_a_model_without_call_trains_as_on_keras_model():
    rng = np.random.RandomState(0)
    real = rng.normal(size=(16, 4)).astype("float32")
    latent = rng.normal(size=(16, 3)).astype("float32")
    models = {}
    for name, cls in (("plain", GAN), ("accumulating", AccumulatingGAN)):
        keras.utils.set_random_seed(0)
        model = cls()
        model.compile(keras.optimizers.Adam(0.01), keras.optimizers.Adam(0.01))
        model.fit(tf.data.Dataset.from_tensor_slices((real, latent)).batch(8), epochs=2, verbose=0)
        models[name] = model
    assert_same_weights(models["accumulating"], models["plain"], FLOAT32)
