"""Uneven replica shares: replicas of different memory take different parts of each batch."""

import numpy as np
import pytest
import tensorflow as tf
from _helpers import (
    FLOAT32,
    assert_same_logs,
    assert_same_weights,
    classification_data,
    compile_classifier,
)

from keras_memopt import AccumulatingModel
from keras_memopt._keras import keras
from keras_memopt._step import shares as _shares

layers = keras.layers


class Seen(layers.Layer):
    """Records, in training, which replica saw how many samples."""

    def __init__(self, record, **kwargs):
        super().__init__(**kwargs)
        self.note = record.append  # not the list: Keras would track a copy of it

    def call(self, inputs, training=None):
        if not training:
            return inputs

        def note(replica, size):
            self.note((int(replica), int(size)))
            return np.int32(0)

        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        done = tf.numpy_function(note, [replica, tf.shape(inputs)[0]], tf.int32)
        with tf.control_dependencies([done]):
            return tf.identity(inputs)


def _build(cls, record=None, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = inputs if record is None else Seen(record)(inputs)
    hidden = layers.Dense(16, activation="tanh")(hidden)
    model = cls(inputs, layers.Dense(3)(hidden), **kwargs)
    return compile_classifier(model, metrics=["accuracy"])


def test_uneven_shares_train_as_one_device(mirrored_strategy):
    x, y = classification_data(40)
    fit = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
    one_device = _build(keras.Model)
    expected = one_device.fit(x, y, **fit).history
    seen = []
    with mirrored_strategy.scope():
        model = _build(
            AccumulatingModel, seen, replica_shares=[3, 1], micro_batch_size=[5, 2]
        )
    received = model.fit(x, y, **fit).history
    assert_same_weights(model, one_device, FLOAT32)
    assert_same_logs(received, expected, FLOAT32)
    # Batches of 16, 16, 8: replica 0 took 12, 12, 6 samples (micro-batches of
    # at most 5), replica 1 took 4, 4, 2 (micro-batches of at most 2).
    by_replica = {0: [], 1: []}
    for replica, size in seen:
        by_replica[replica].append(size)
    assert by_replica[0] == [5, 5, 2] * 2 + [5, 1] + [5, 5, 2] * 2 + [5, 1]
    assert by_replica[1] == [2, 2] * 2 + [2] + [2, 2] * 2 + [2]
    np.testing.assert_allclose(
        model.evaluate(x, y, batch_size=16, verbose=0),
        one_device.evaluate(x, y, batch_size=16, verbose=0),
        **FLOAT32,
    )


def test_share_sizes_add_up():
    assert _shares.share_sizes(16, (3.0, 1.0)) == [12, 4]
    assert _shares.share_sizes(7, (3.0, 1.0)) == [6, 1]
    assert _shares.share_sizes(1, (1.0, 1.0)) == [1, 0]
    assert sum(_shares.share_sizes(1001, (5.0, 3.0, 2.0))) == 1001


def test_auto_shares_follow_device_memory(mirrored_strategy, monkeypatch):
    monkeypatch.setattr(_shares, "device_memory", lambda strategy: [3 * 2**30, 2**30])
    with mirrored_strategy.scope():
        model = _build(AccumulatingModel, replica_shares="auto")
    assert model.replica_shares == (3 * 2.0**30, 2.0**30)
    monkeypatch.setattr(_shares, "device_memory", lambda strategy: [None, None])
    with mirrored_strategy.scope(), pytest.warns(UserWarning, match="equal shares"):
        model = _build(AccumulatingModel, replica_shares="auto")
    assert model.replica_shares == (1.0, 1.0)


@pytest.mark.parametrize(
    "shares, match",
    [
        ([3], r"one per replica \(2 under this strategy\).*replica_shares=\[3\]"),
        ([3, -1], r"positive numbers.*replica_shares=\[3, -1\]"),
        ("half", r"'auto' or a list.*replica_shares='half'"),
    ],
)
def test_bad_shares_are_refused(mirrored_strategy, shares, match):
    with mirrored_strategy.scope(), pytest.raises(ValueError, match=match):
        _build(AccumulatingModel, replica_shares=shares)


def test_shares_need_a_mirrored_strategy():
    with pytest.raises(ValueError, match=r"MirroredStrategy.*under _DefaultDistributionStrategy"):
        _build(AccumulatingModel, replica_shares=[1, 1])


def test_sizes_per_replica_must_match_the_replicas(mirrored_strategy):
    with mirrored_strategy.scope(), pytest.raises(ValueError, match=r"2 replica\(s\)"):
        _build(AccumulatingModel, micro_batch_size=[4, 4, 4])


def test_after_another_model_under_a_strategy_without_collective_keys():
    """docs/distributed.md, "One strategy per process": a second MirroredStrategy
    that reduces on one device hands out no collective keys to clash with the
    first's, so uneven shares train after another model (of other shapes)."""
    x, y = classification_data(40)
    fit = dict(batch_size=16, epochs=1, shuffle=False, verbose=0)
    strategy = tf.distribute.MirroredStrategy(
        ["CPU:0", "CPU:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    with strategy.scope():
        inputs = keras.Input((6,))
        other = keras.Model(inputs, layers.Dense(7)(inputs))
        other.compile("sgd", "mse")
        other.fit(x, np.zeros((len(x), 7), "float32"), **fit)
        model = _build(AccumulatingModel, replica_shares=[3, 1], micro_batch_size=[5, 2])
    one_device = _build(keras.Model)
    one_device.fit(x, y, **fit)
    model.fit(x, y, **fit)
    assert_same_weights(model, one_device, FLOAT32)
