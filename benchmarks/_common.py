"""What the benchmarks share: TensorFlow's allocator settings and the model builders.

Importing this module imports neither TensorFlow nor keras_memopt, so that a
script can set the allocator variables first (`use_allocator_env()`), before
TensorFlow starts and reads them.
"""

from __future__ import annotations

import argparse
import os

# The checkout holding these benchmarks (its `keras_memopt` is the one measured
# unless a script is told otherwise).
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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


def transformer_block_class():
    """A post-norm transformer block as one custom `Layer` (attention, feed-forward)."""
    keras = _keras()
    layers = keras.layers

    class TransformerBlock(layers.Layer):
        def __init__(self, width, **kwargs):
            super().__init__(**kwargs)
            self.attention = layers.MultiHeadAttention(4, width // 4)
            self.norm1 = layers.LayerNormalization()
            self.inner = layers.Dense(4 * width, activation="gelu")
            self.outer = layers.Dense(width)
            self.norm2 = layers.LayerNormalization()

        def call(self, x):
            x = self.norm1(x + self.attention(x, x))
            return self.norm2(x + self.outer(self.inner(x)))

    return TransformerBlock


def synthetic_batch(model, size, vocabulary=1000, classes=10):
    """(x, y) for `model`'s first input and output, made on the device (in the
    allocator), the same in every process.

    Integer inputs are tokens 1 to `vocabulary` − 1 (no padding, so a mask is
    all ones); labels take the output's shape without its last axis.
    """
    import tensorflow as tf

    spec, seed = model.inputs[0], (0, 1)
    shape = (size, *spec.shape[1:])
    if spec.dtype in ("int32", tf.int32):
        x = tf.random.stateless_uniform(shape, seed, minval=1, maxval=vocabulary, dtype=tf.int32)
    else:
        x = tf.random.stateless_uniform(shape, seed)
    labels = (size, *model.outputs[0].shape[1:-1])
    return x, tf.random.stateless_uniform(labels, seed, maxval=classes, dtype=tf.int32)


def embedding_classifier(vocabulary, width, length, hidden=256, classes=10):
    """A bag of tokens (or items) through a large Embedding, pooled, and an MLP head.

    The Embedding's gradient is sparse (`tf.IndexedSlices`): the rows of the
    batch's tokens, not the table.
    """
    keras = _keras()
    layers = keras.layers
    inputs = keras.Input((length,), dtype="int32")
    x = layers.Embedding(vocabulary, width)(inputs)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dense(hidden, activation="relu")(x)
    return inputs, layers.Dense(classes)(x)


def tagger(vocabulary, width, length, units, tags, mask_zero=True):
    """A sequence tagger: Embedding, Bidirectional(LSTM), a per-token Dense head.

    With `mask_zero`, token 0 is padding: the output carries a mask and Keras
    averages the per-token loss over the unmasked tokens of the batch.
    """
    keras = _keras()
    layers = keras.layers
    inputs = keras.Input((length,), dtype="int32")
    x = layers.Embedding(vocabulary, width, mask_zero=mask_zero)(inputs)
    x = layers.Bidirectional(layers.LSTM(units, return_sequences=True))(x)
    return inputs, layers.Dense(tags)(x)


def subprocess_module():
    """This repository's `keras_memopt._subprocess`, loaded from its file.

    It needs nothing but the standard library; loading it alone (not through
    the `keras_memopt` package) starts no TensorFlow and leaves `keras_memopt`
    unimported, so a worker process can still import another checkout's
    `keras_memopt` (the one its `PYTHONPATH` names) and send its result back
    the same way.
    """
    import importlib.util
    import sys

    name = "_benchmarks_subprocess"
    if name not in sys.modules:
        path = os.path.join(REPOSITORY, "keras_memopt", "_subprocess.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


# -- worker processes ----------------------------------------------------------------


def start_worker(script, task, checkout=REPOSITORY, limit_mb=None):
    """`python script --worker TASK` in a fresh process on `ALLOCATOR_ENV`.

    The worker imports keras_memopt from `checkout` (its `PYTHONPATH`);
    `limit_mb`, when given, is the allocator's memory limit.
    """
    import json

    env = {**ALLOCATOR_ENV, "PYTHONPATH": checkout}
    if limit_mb is not None:
        env["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(limit_mb)
    return subprocess_module().start(
        [os.path.abspath(script), "--worker", json.dumps(task)],
        env=env,
        name=f"worker {task} (keras_memopt from {checkout}, "
        f"limit {env['TF_CPU_BFC_MEM_LIMIT_IN_MB']} MiB)",
    )


def results(workers):
    """Each worker's result, once all have finished (all are stopped if one fails)."""
    module = subprocess_module()
    outputs = module.wait_all(workers)
    return [module.result_of(o, w.name) for w, o in zip(workers, outputs, strict=True)]


def run_workers(script, tasks, jobs=1, checkout=REPOSITORY):
    """Each task's result from `script --worker TASK`, `jobs` fresh processes at a
    time, with keras_memopt from `checkout`."""
    answers = []
    for start in range(0, len(tasks), jobs):
        chunk = tasks[start:start + jobs]
        answers.extend(results([start_worker(script, t, checkout) for t in chunk]))
    return answers


def parse_or_work(parser, worker, argv=None, jobs=1):
    """`parser`'s arguments with `--jobs`, `--json` and the hidden `--worker` added.

    Run as a worker (`--worker TASK`), it sends `worker(TASK)`'s result back to
    the parent process and returns None.
    """
    import json

    parser.add_argument("--jobs", type=int, default=jobs, help="workers at a time")
    parser.add_argument("--json", action="store_true", help="print the raw figures")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        subprocess_module().send_result(worker(json.loads(args.worker)))
        return None
    return args


def package_file():
    """The file of the keras_memopt this process imported (for the record)."""
    import keras_memopt

    return keras_memopt.__file__


def step_timer():
    """A Keras callback whose `seconds` lists each training step's wall time.

    A step is timed from `on_train_batch_begin` to `on_train_batch_end`; the
    list restarts at each `fit`.
    """
    import time

    keras = _keras()

    class StepTimer(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.seconds = []

        def on_train_batch_begin(self, batch, logs=None):
            self.started = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.seconds.append(time.perf_counter() - self.started)

    return StepTimer()


def median_range(values):
    """(median, min, max) of `values`."""
    import statistics

    values = list(values)
    return statistics.median(values), min(values), max(values)
