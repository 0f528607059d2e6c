"""The memory floor: a step of AccumulatingModel holds at most 1.15 W more than plain Keras's.

W is the bytes of the trainable weights. Accumulating over micro-batches
needs one copy of the weights more than plain Keras at the same micro-batch,
the gradient sum; anything beyond it (a rollback's copy of the weights and
slots, an update that runs beside the loop or holds every variable's
temporaries at once) shows here. Measured by TensorFlow's BFC allocator in a
fresh process (its peaks are exact byte counts); `benchmarks/memory_floor.py`
measures the same on larger models.

The figure is each configuration's highest step peak over 8 steps, against
plain Keras's highest: a step runs out of memory at its highest peak. Which
of a step's ops TensorFlow's executor runs first varies from step to step
(it times ops as it goes, and runs the ones it finds cheap at once), and so
do the allocator's chunks (it hands out a free chunk less than twice a
request whole): inter-op threads are set to 1, which keeps the order
steadier. TensorFlow's profiler shows what is alive at the peaks (benchmark
MLP, SGD with momentum, micro-batch 512): at the update's start the gradient
sum and nothing else but the allocator's rounding of its chunks (1.15 W in
chunks for 1.00 W asked), during SGD's update the sum left and one
variable's temporaries (1.31 W); the step's highest peak is the loop's (the
sum, one micro-batch's activations and gradients: 2.07 W asked, 2.38 W in
chunks). Measured above plain Keras's highest here: +0.21 to +0.88 W with
Adam, -1.18 to +0.41 W with SGD (both Keras lines); the rollback's copy of
0.1.0 put back measured 1.93 W. The weights are one large kernel and a small
head, so that no order holds two large gradients of one micro-batch at once.
"""


import pytest
from conftest import last_json, run_python

pytestmark = pytest.mark.slow

# Above plain Keras's step at the same micro-batch, in W.
BOUND = 1.15

HEAD = """
import json
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(1)
from keras_memopt import AccumulatingModel
from keras_memopt._keras import keras
from keras_memopt.callbacks import OOMBackoff
from keras_memopt.memory import MemoryReader
"""

FLOOR = """
MICRO, BATCH, STEPS = 32, 128, 9


class StepPeaks(keras.callbacks.Callback):
    # Each training step's allocator peak above what was in use when it began.
    def __init__(self):
        super().__init__()
        self.reader, self.peaks = MemoryReader(["CPU:0"], host=False, nvml=False), []

    def on_train_batch_begin(self, batch, logs=None):
        self.reader.reset_peaks()
        self.start = self.reader.read()["memory_cpu0_current_mib"]

    def on_train_batch_end(self, batch, logs=None):
        self.peaks.append(self.reader.read()["memory_cpu0_peak_mib"] - self.start)


def step_peak(kind, optimizer):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((128,))
    hidden = keras.layers.Dense(4096, activation="relu")(inputs)
    outputs = keras.layers.Dense(10)(hidden)
    if kind == "plain":
        model = keras.Model(inputs, outputs)
    else:
        model = AccumulatingModel(inputs, outputs, micro_batch_size=MICRO)
    optimizer = {
        "adam": lambda: keras.optimizers.Adam(1e-3),
        "sgd": lambda: keras.optimizers.SGD(1e-2, momentum=0.9),
    }[optimizer]()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer, loss, jit_compile=False)
    size = MICRO if kind == "plain" else BATCH
    x = tf.random.stateless_uniform((STEPS * size, 128), (0, 1))
    y = tf.random.stateless_uniform((STEPS * size,), (0, 2), maxval=10, dtype=tf.int32)
    peaks = StepPeaks()
    callbacks = [peaks] + ([OOMBackoff(verbose=0)] if kind == "backoff" else [])
    model.fit(x, y, batch_size=size, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    weights = sum(v.numpy().nbytes for v in model.trainable_variables) / 2**20
    # The first step traces the step function and makes the optimizer's
    # variables; the first at a micro-batch size also measures its update.
    return [peak / weights for peak in peaks.peaks[1:]]


floor = {
    optimizer: {kind: step_peak(kind, optimizer) for kind in ("plain", "accumulating", "backoff")}
    for optimizer in ("adam", "sgd")
}
"""


@pytest.fixture(scope="module")
def measured():
    """Both measurements in one fresh process (a TensorFlow start fewer): what stays between
    epochs first (after the step peaks' runs, 0.77 W more stayed), then the step peaks, each
    against what was in use when its step began."""
    report = "print(json.dumps(dict(floor=floor, between=between)))"
    return last_json(run_python(HEAD + BETWEEN + FLOOR + report))


def test_a_step_holds_at_most_the_gradient_sum_more_than_plain_keras(measured):
    peaks = measured["floor"]
    for optimizer, figures in peaks.items():
        assert {len(steps) for steps in figures.values()} == {8}, peaks
        # Not vacuous: every step held its gradients, at least.
        assert min(min(steps) for steps in figures.values()) >= 1.0, (optimizer, peaks)
        highest = {kind: max(steps) for kind, steps in figures.items()}
        for kind in ("accumulating", "backoff"):
            assert highest[kind] - highest["plain"] <= BOUND, (optimizer, kind, peaks)


# What stays allocated between epochs: an Embedding and Adam, whose table is
# 8 MiB (a power of two: TensorFlow's BFC allocator grows its regions in powers
# of two and hands a variable a whole region of less than twice its size, so
# other sizes add that rounding; see docs/memory.md).
BETWEEN = """
import gc
import numpy as np
from keras_memopt._keras import optimizer_variables

VOCAB, WIDTH, TOKENS, BATCH = 16384, 128, 16, 256
rng = np.random.RandomState(0)
x = rng.randint(0, VOCAB, (4 * BATCH, TOKENS)).astype("int32")
y = rng.randint(0, 10, 4 * BATCH)


def in_use():
    gc.collect()
    return tf.config.experimental.get_memory_info("CPU:0")["current"]


class BetweenEpochs(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.held = []

    def on_epoch_end(self, epoch, logs=None):
        self.held.append(in_use())


def beyond_the_variables(kind):
    # Bytes in use at each epoch's end, and once the step functions are dropped,
    # above what was in use before the model and beside its variables, in W.
    before = in_use()
    keras.utils.set_random_seed(0)
    inputs = keras.Input((TOKENS,), dtype="int32")
    hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(VOCAB, WIDTH)(inputs))
    outputs = keras.layers.Dense(10)(hidden)
    model = AccumulatingModel(inputs, outputs, micro_batch_size=64)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    between = BetweenEpochs()
    callbacks = [between] + ([OOMBackoff(verbose=0)] if kind == "backoff" else [])
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
    variables = {id(v): v for v in model.variables + list(optimizer_variables(model.optimizer))}
    size = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in variables.values())
    weights = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    epochs = [(held - before - size) / weights for held in between.held]
    after = (in_use() - before - size) / weights
    model.train_function = model.test_function = model.predict_function = None
    return dict(epochs=epochs, after=after, variables=size / weights,
                without_step_functions=(in_use() - before - size) / weights)


between = {kind: beyond_the_variables(kind) for kind in ("accumulating", "backoff")}
"""


def test_between_epochs_the_step_functions_keep_nothing_alive(measured):
    """An Embedding and Adam hold their variables between epochs, and no more.

    Beside the variables (3 W: the weights and Adam's two slots) only small
    state stays: the micro-batch setting, metrics, the update guard. A tensor
    a step function kept alive (a dense gradient of the table, a batch, a
    folded constant) would show as a fraction of W or more.
    """
    figures = measured["between"]
    for kind in ("accumulating", "backoff"):
        kept = figures[kind]
        assert kept["variables"] == pytest.approx(3.0, abs=0.01), figures
        # A tensor a step function keeps shows at every epoch's end; tf_keras
        # sometimes holds a transient one at one epoch's end or after `fit`
        # (0.6 to 0.8 W, plain Keras too: 0.79 W at one epoch in three), so the
        # lowest epoch is the step functions'.
        assert min(kept["epochs"]) <= 0.05, (kind, figures)
        # Dropping the step functions after `fit` frees nothing: they hold no tensor.
        assert abs(kept["without_step_functions"] - kept["after"]) <= 0.002, (kind, figures)
