"""Layers whose outputs follow the batch they see are warned about at the first step."""

import warnings

import numpy as np
import tensorflow as tf

from keras_memopt import AccumulatingModel
from keras_memopt._keras import keras

TEXTS = np.array(["a b c d e f", "a b", "c d e", "f", "a a a a a a a", "b c"] * 2)
LABELS = np.arange(12) % 2


class TrimToLongest(keras.layers.Layer):
    """Cuts a zero-padded batch of ids to its longest row (a common speed-up)."""

    def call(self, ids):
        longest = tf.reduce_max(tf.reduce_sum(tf.cast(ids > 0, tf.int32), axis=1))
        return ids[:, :longest]


def _fit(model, x, y, batch_size=6):
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(data, epochs=1, verbose=0)
    return [str(w.message) for w in caught if "follow the batch" in str(w.message)]


def _text_model(length=None):
    vectorize = keras.layers.TextVectorization(
        max_tokens=12, output_mode="int", output_sequence_length=length
    )
    vectorize.adapt(TEXTS)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((1,), dtype="string")
    x = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(12, 4)(vectorize(inputs)))
    return AccumulatingModel(inputs, keras.layers.Dense(2)(x), micro_batch_size=2)


def _tokens():
    ids = np.zeros((12, 8), "int32")
    for row, length in enumerate([7, 2, 3, 1, 8, 2] * 2):
        ids[row, :length] = 1 + np.arange(length) % 11
    return ids


def test_text_vectorization_padding_to_the_batch_is_named():
    (message,) = _fit(_text_model(), TEXTS[:, None], LABELS)
    assert "'text_vectorization" in message and "output_sequence_length=None" in message


def test_a_fixed_length_is_not_warned_about():
    assert _fit(_text_model(length=8), TEXTS[:, None], LABELS) == []


def test_a_layer_whose_output_changes_shape_with_the_batch_is_found_by_its_shape():
    # Any layer, not only the ones known by name. The first sample is 1 token
    # long and the second 7: one sample is cut to 1, two to 7.
    ids = _tokens()[[3, 0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11]]
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(12, 4)(TrimToLongest(name="trim")(inputs))
    outputs = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(x))
    model = AccumulatingModel(inputs, outputs, micro_batch_size=2)
    (message,) = _fit(model, ids, LABELS)
    assert "layer 'trim' gives (1, 1) for one sample and (2, 7) for two" in message


def test_sequences_padded_by_the_pipeline_are_not_warned_about():
    # The outputs' length is unknown, so it is probed: the micro-batches are rows
    # of one padded batch and keep its length.
    assert _fit(_tagger(), _tokens(), np.ones((12, 8), "int32")) == []


def _tagger(*middle):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None,), dtype="int32")
    x = inputs
    for layer in middle:
        x = layer(x)
    x = keras.layers.Embedding(12, 4)(x)
    return AccumulatingModel(inputs, keras.layers.Dense(3)(x), micro_batch_size=2)
