"""What the benchmarks share: TensorFlow's allocator settings and the model builders.

Importing this module imports neither TensorFlow nor keras_memopt, so that a
script can set the allocator variables first (`use_allocator_env()`), before
TensorFlow starts and reads them.
"""

from __future__ import annotations

import os

# TensorFlow's BFC allocator on the CPU gives real, deterministic peaks
# (`tf.config.experimental.get_memory_info("CPU:0")`); oneDNN allocates around
# it, so it is off. The variables of
# `keras_memopt._subprocess.tensorflow_env(cpu_memory_limit_mb=8192)`, written
# out because importing keras_memopt starts TensorFlow
# (tests/test_subprocess.py checks that the two agree).
ALLOCATOR_ENV = {
    "TF_ENABLE_ONEDNN_OPTS": "0",
    "TF_CPU_ALLOCATOR_USE_BFC": "true",
    "TF_CPU_BFC_MEM_LIMIT_IN_MB": "8192",
    "TF_CPP_MIN_LOG_LEVEL": "3",
}


def use_allocator_env():
    """Sets `ALLOCATOR_ENV` in this process; call it before TensorFlow is imported.

    The allocator itself is forced; the limit and the log level only where
    not set already.
    """
    for name, value in ALLOCATOR_ENV.items():
        if name in ("TF_ENABLE_ONEDNN_OPTS", "TF_CPU_ALLOCATOR_USE_BFC"):
            os.environ[name] = value
        else:
            os.environ.setdefault(name, value)


def _keras():
    from keras_memopt._keras import keras

    return keras


def mlp(features, depth, width, classes=10, name="mlp"):
    """`depth` Dense(`width`, relu) layers and a Dense(`classes`) head: (inputs, outputs)."""
    keras = _keras()
    inputs = keras.Input((features,))
    x = inputs
    for _ in range(depth):
        x = keras.layers.Dense(width, activation="relu")(x)
    return inputs, keras.layers.Dense(classes)(x)


def cnn(layout, padding="valid", classes=10):
    """Conv2D(3x3, relu) layers on 32x32x3 images, global pooling and a head.

    Args:
        layout: list of filter counts (a convolution each) and `"pool"`
            (a 2x2 max pooling), in order.
        padding: the convolutions' padding.
    """
    keras = _keras()
    layers = keras.layers
    inputs = keras.Input((32, 32, 3))
    x = inputs
    for item in layout:
        if item == "pool":
            x = layers.MaxPooling2D()(x)
        else:
            x = layers.Conv2D(item, 3, padding=padding, activation="relu")(x)
    x = layers.GlobalAveragePooling2D()(x)
    return inputs, layers.Dense(classes)(x)


def transformer(length, blocks, width=128, heads=4, hidden=None, dropout=0.0,
                add_layers=False, vocabulary=1000, classes=10):
    """Token embedding, `blocks` post-norm transformer blocks, pooling and a head.

    Args:
        length: int, tokens per sample.
        blocks: int, transformer blocks.
        hidden: int, the feed-forward width. Defaults to 4 * `width`.
        dropout: float, attention and feed-forward dropout (0: none).
        add_layers: bool, residuals as `layers.Add()` instead of `+`.
    """
    keras = _keras()
    layers = keras.layers

    def add(a, b):
        return layers.Add()([a, b]) if add_layers else a + b

    inputs = keras.Input((length,), dtype="int32")
    x = layers.Embedding(vocabulary, width)(inputs)
    for _ in range(blocks):
        attention = layers.MultiHeadAttention(heads, width // heads, dropout=dropout)(x, x)
        x = layers.LayerNormalization()(add(x, attention))
        inner = layers.Dense(hidden or 4 * width, activation="gelu")(x)
        if dropout:
            inner = layers.Dropout(dropout)(layers.Dense(width)(inner))
        else:
            inner = layers.Dense(width)(inner)
        x = layers.LayerNormalization()(add(x, inner))
    x = layers.GlobalAveragePooling1D()(x)
    return inputs, layers.Dense(classes)(x)
