"""What an out-of-memory error leaves behind, under real allocator limits.

Each test runs children whose TensorFlow CPU allocator has a limit
(`TF_CPU_BFC_MEM_LIMIT_IN_MB`), so that the out-of-memory errors are
TensorFlow's own (about 10 s each to surface):

- a `fit` that backed off holds, once it returns, what a `fit` that needed
  no backoff holds, and backs off only in its first epoch (the failed
  attempt's exception kept nothing; Keras's cached validation arrays do not
  shrink the later epochs' memory);
- `micro_batch_size="auto"` chooses a size that trains on without an
  out-of-memory error, with the margin it measured free;
- two models on one device, each with its own `OOMBackoff`, trained in
  turns: each backs off alone and ends as a clean run of its own sizes.
"""

import gc
import textwrap

import numpy as np
import pytest
import tensorflow as tf
from _helpers import SAME_COMPUTATION
from conftest import KERAS_LINE, last_json

from keras_memopt import AccumulatingModel, _subprocess
from keras_memopt._keras import keras
from keras_memopt.callbacks import OOMBackoff

MIB = 2**20


def _children(codes, memory_limit_mb, timeout=600):
    """Runs each of `codes` (a script and its arguments) in its own child, side by side,
    under the tests' Keras line; returns what each printed last, as JSON."""
    env = {**_subprocess.tensorflow_env(memory_limit_mb), **KERAS_LINE}
    children = [
        _subprocess.start(["-c", textwrap.dedent(code), *map(str, args)], env=env)
        for code, *args in codes
    ]
    outputs = _subprocess.wait_all(children, timeout=timeout)
    for output in outputs:
        if output.returncode != 0:
            pytest.fail(f"child exited with {output.returncode}\n{output.tail(4000)}")
    return [last_json(output) for output in outputs]


# -- nothing held after an out-of-memory error; a size that trained stays trained -------

# 4 x Dense(512) on batches of 2048 samples of 256 features (2 MiB a batch),
# six an epoch, each made on the device by the data set when it is needed
# (nothing prefetched: the memory in use at each step's start is the same in
# every epoch on both Keras lines); validation arrays of one batch, which
# Keras converts at the first validation. One inter-op thread: TensorFlow's
# executor then runs a step's ops in the same order once it has timed them,
# and the step peaks stay within 0.1 MiB of each other. Under 34 MiB a
# micro-batch of 2048 runs out of memory; 512 fits.
STEADY = """
import gc, json, sys
import numpy as np, tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(1)
from keras_memopt import AccumulatingModel
from keras_memopt._keras import keras
from keras_memopt.callbacks import OOMBackoff

N, D, STEPS, EPOCHS = 2048, 256, 6, 3
start, weights_path = int(sys.argv[1]), sys.argv[2]


def batch(step):
    x = tf.random.stateless_uniform((N, D), (0, step))
    return x, tf.random.stateless_uniform((N,), (1, step), maxval=10, dtype=tf.int32)


class BackoffEpochs(keras.callbacks.Callback):
    # The epoch of each backoff, from the callback's list after each step.
    def __init__(self, backoff):
        super().__init__()
        self.backoff, self.epochs = backoff, []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.epochs += [self.epoch] * (len(self.backoff.backoffs) - len(self.epochs))


def in_use():
    gc.collect()
    return tf.config.experimental.get_memory_info("CPU:0")["current"]


options = tf.data.Options()
options.experimental_optimization.inject_prefetch = False
train = tf.data.Dataset.range(STEPS).map(batch).with_options(options)
validation = tuple(np.array(t) for t in batch(tf.constant(STEPS, tf.int64)))
before = in_use()
keras.utils.set_random_seed(0)
inputs = keras.Input((D,))
hidden = inputs
for _ in range(4):
    hidden = keras.layers.Dense(512, activation="relu")(hidden)
model = AccumulatingModel(inputs, keras.layers.Dense(10)(hidden), micro_batch_size=start)
model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              jit_compile=False)
backoff = OOMBackoff(factor=0.25, verbose=0)
epochs = BackoffEpochs(backoff)
history = model.fit(train, epochs=EPOCHS, verbose=0, shuffle=False, validation_data=validation,
                    callbacks=[backoff, epochs])
held = in_use() - before  # the model, its optimizer, the callbacks: all still referenced
np.savez(weights_path, *model.get_weights())
print(json.dumps(dict(held=held, epochs=epochs.epochs, final=model.micro_batch_size,
                      backoffs=backoff.backoffs)))
"""


@pytest.mark.slow
@pytest.mark.line_independent(
    reason="what a backoff keeps is the policy's own record, plain data on both lines "
    "(test_the_callback_keeps_figures_of_a_backoff_not_the_error); what tf_keras's later "
    "epochs hold: test_later_epochs_start_their_steps_with_the_memory_of_the_first")
def test_a_fit_that_backed_off_holds_no_more_and_backs_off_in_its_first_epoch(tmp_path):
    """Against a run started at the size the first backed off to, in a process of its own."""
    backed_off, clean = _children(
        [(STEADY, 2048, tmp_path / "backed_off.npz"), (STEADY, 512, tmp_path / "clean.npz")],
        memory_limit_mb=34,
    )
    assert [b["failed_micro_batch_size"] for b in backed_off["backoffs"]] == [2048], backed_off
    assert backed_off["final"] == clean["final"] == 512
    assert clean["backoffs"] == [], clean
    # Every backoff in the first epoch: the later epochs, validation included,
    # found the memory the first one had.
    assert backed_off["epochs"] == [0], backed_off
    # The policy keeps figures, not the exception whose frames held the failed
    # batch (2 MiB) and what their callers held (measured before: 2.0 to 3.1 MiB).
    assert abs(backed_off["held"] - clean["held"]) <= MIB, (backed_off["held"], clean["held"])
    with np.load(tmp_path / "backed_off.npz") as a, np.load(tmp_path / "clean.npz") as b:
        assert len(a.files) == len(b.files) > 0
        for name in a.files:
            np.testing.assert_allclose(a[name], b[name], **SAME_COMPUTATION, err_msg=name)


# -- micro_batch_size="auto" keeps headroom --------------------------------------------

# 4 x Dense(512) on batches of 2048 samples made on the device, eight an epoch,
# TensorFlow's default threading (its executor runs a step's ops in an order
# that varies from step to step, and so does the step's peak). Under 40 MiB
# one micro-batch of 2048 runs out of memory; 1024 peaks at about 37 MiB.
AUTO = """
import json
import tensorflow as tf
from keras_memopt import AccumulatingModel
from keras_memopt._keras import keras

N, D, STEPS, EPOCHS = 2048, 256, 8, 5


def batch(step):
    x = tf.random.stateless_uniform((N, D), (0, step))
    return x, tf.random.stateless_uniform((N,), (1, step), maxval=10, dtype=tf.int32)


class AfterTheSearch(keras.callbacks.Callback):
    # The micro-batch size of each step that ran once the search had ended.
    def on_train_begin(self, logs=None):
        self.sizes = []

    def on_train_batch_end(self, batch, logs=None):
        search = getattr(self.model, "micro_batch_search", None)
        if search and search["margin"] is not None:
            self.sizes.append(self.model.micro_batch_size)


options = tf.data.Options()
options.experimental_optimization.inject_prefetch = False
train = tf.data.Dataset.range(STEPS).map(batch).with_options(options)
keras.utils.set_random_seed(0)
inputs = keras.Input((D,))
hidden = inputs
for _ in range(4):
    hidden = keras.layers.Dense(512, activation="relu")(hidden)
model = AccumulatingModel(inputs, keras.layers.Dense(10)(hidden), micro_batch_size="auto")
model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              jit_compile=False)
after = AfterTheSearch()
# No OOMBackoff: an out-of-memory error after the search would end `fit`.
model.fit(train, epochs=EPOCHS, verbose=0, shuffle=False, callbacks=[after])
print(json.dumps(dict(search=model.micro_batch_search, after=after.sizes,
                      iterations=int(model.optimizer.iterations.numpy()))))
"""


@pytest.mark.slow
@pytest.mark.line_independent(
    reason="the search's margin from allocator figures of the same steps; its trials and "
    "rollback on tf_keras: test_oom_backoff.py's TestAuto")
def test_auto_chooses_a_size_that_trains_on_with_the_margin_it_measured():
    (figures,) = _children([(AUTO,)], memory_limit_mb=40)
    search, after = figures["search"], figures["after"]
    assert search["out_of_memory_trials"][:1] == [2048], search  # the whole batch does not fit
    # Kept free: how far the highest of its steps' peaks rose above their median.
    assert search["steps"] == 10 and search["margin"] >= 0, search
    assert search["highest_peak"] + search["margin"] <= 40 * MIB, search
    # Twenty steps and more after the search, at the size it chose, none out of memory.
    assert len(after) >= 20 and set(after) == {search["micro_batch_size"]}, figures
    assert figures["iterations"] == 40  # one update a batch: no failed attempt counted

# -- two models on one device ----------------------------------------------------------

# Two MLPs, each an AccumulatingModel with its own OOMBackoff, trained in turns
# (one epoch of three batches each, twice) in one process under one 52 MiB
# limit. Alone at its whole batch, each would need more than the limit less
# the other's weights, optimizer state and data: each backs off once, in its
# own first `fit`. "replay" trains both without a limit, each at the sizes the
# first run recorded for its steps.
TWO_MODELS = """
import json, sys
import numpy as np, tensorflow as tf
from keras_memopt import AccumulatingModel
from keras_memopt._keras import keras
from keras_memopt.callbacks import OOMBackoff

mode, path = sys.argv[1], sys.argv[2]
SHAPES = {"deep": (2048, 256, 4), "wide": (4096, 64, 3)}  # batch, features, Dense(512)s


def data(name):
    batch, features, _ = SHAPES[name]
    x = tf.random.stateless_uniform((3 * batch, features), (0, len(name)))
    return x, tf.random.stateless_uniform((3 * batch,), (1, len(name)), maxval=10, dtype=tf.int32)


def build(name):
    batch, features, layers = SHAPES[name]
    keras.utils.set_random_seed(len(name))
    inputs = keras.Input((features,))
    hidden = inputs
    for _ in range(layers):
        hidden = keras.layers.Dense(512, activation="relu")(hidden)
    model = AccumulatingModel(inputs, keras.layers.Dense(10)(hidden), micro_batch_size=batch,
                              name=name)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    model.optimizer.build(model.trainable_variables)  # as the guide says
    return model


class Sizes(keras.callbacks.Callback):
    # Records the micro-batch size of each step, or sets it from a record.
    def __init__(self, replay=None):
        super().__init__()
        self.replay, self.sizes = replay, []

    def on_train_batch_begin(self, batch, logs=None):
        if self.replay is not None:
            self.model.micro_batch_size = self.replay[len(self.sizes)]

    def on_train_batch_end(self, batch, logs=None):
        self.sizes.append(self.model.micro_batch_size)


names = list(SHAPES)
datasets = {name: data(name) for name in names}
models = {name: build(name) for name in names}
replay = json.load(open(path + ".json")) if mode == "replay" else None
record = {name: Sizes(replay and replay["sizes"][name]) for name in names}
backoffs = {name: OOMBackoff(factor=0.25, verbose=0) for name in names}
turns = []
for epoch in range(2):
    for name in names:
        other = names[1 - names.index(name)]
        before = models[other].micro_batch_size
        callbacks = [record[name]] + ([backoffs[name]] if mode == "limited" else [])
        models[name].fit(*datasets[name], batch_size=SHAPES[name][0], initial_epoch=epoch,
                         epochs=epoch + 1, shuffle=False, verbose=0, callbacks=callbacks)
        turns.append(dict(model=name, failed=[b["failed_micro_batch_size"]
                                               for b in backoffs[name].backoffs],
                          other_before=before, other_after=models[other].micro_batch_size))
np.savez(path + "." + mode + ".npz",
         **{f"{name}_{i}": w for name in names for i, w in enumerate(models[name].get_weights())})
result = dict(sizes={name: record[name].sizes for name in names}, turns=turns)
if mode == "limited":
    json.dump(result, open(path + ".json", "w"))
print(json.dumps(result))
"""


@pytest.mark.slow
@pytest.mark.line_independent(
    reason="each model's own policy, keras_memopt's code; a real out-of-memory rollback on "
    "tf_keras: test_oom_backoff.py's test_real_oom_in_the_loop_or_the_update_changes_nothing")
def test_two_models_on_one_device_back_off_alone_and_train_as_their_clean_runs(tmp_path):
    path = str(tmp_path / "two")
    (limited,) = _children([(TWO_MODELS, "limited", path)], memory_limit_mb=52)
    (replayed,) = _children([(TWO_MODELS, "replay", path)], memory_limit_mb=None)
    turns = limited["turns"]
    # Each backed off once, in its own first fit, and only its own micro-batch.
    assert [turn["failed"] for turn in turns] == [[2048], [4096], [], []], turns
    assert all(turn["other_before"] == turn["other_after"] for turn in turns), turns
    assert limited["sizes"] == {"deep": [512] * 6, "wide": [1024] * 6}, limited["sizes"]
    assert replayed["sizes"] == limited["sizes"]
    with np.load(path + ".limited.npz") as a, np.load(path + ".replay.npz") as b:
        assert sorted(a.files) == sorted(b.files) and len(a.files) == 18
        for name in a.files:
            np.testing.assert_allclose(a[name], b[name], **SAME_COMPUTATION, err_msg=name)


class StepStarts(keras.callbacks.Callback):
    """The allocator's bytes in use at the start of each training step, per epoch.

    Garbage is collected first: what is held is what live objects hold. Without
    it the figure also had what the worker's earlier tests left for the collector
    (in one CI run a later epoch's step started 1.4 MiB above the first's, where
    alone, or with its own module, it never did).
    """

    def on_train_begin(self, logs=None):
        self.starts = []

    def on_epoch_begin(self, epoch, logs=None):
        self.starts.append([])

    def on_train_batch_begin(self, batch, logs=None):
        gc.collect()
        self.starts[-1].append(tf.config.experimental.get_memory_info("CPU:0")["current"])


def test_later_epochs_start_their_steps_with_the_memory_of_the_first():
    """Validation arrays (4 MiB) that Keras keeps from the first validation on,
    and tf_keras's data iterators of past epochs, would be in use at every
    training step of the later epochs; with `OOMBackoff` attached they are not."""
    n, features = 256, 4096
    rng = np.random.RandomState(0)
    validation = (rng.rand(n, features).astype("float32"), rng.randint(0, 3, n))

    def batch(step):
        x = tf.random.stateless_uniform((n, features), (0, step))
        return x, tf.random.stateless_uniform((n,), (1, step), maxval=3, dtype=tf.int32)

    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False  # nothing held ahead
    train = tf.data.Dataset.range(3).map(batch).with_options(options)
    inputs = keras.Input((features,))
    model = AccumulatingModel(inputs, keras.layers.Dense(3)(inputs), micro_batch_size=64)
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    starts = StepStarts()
    gc.collect()
    model.fit(train, epochs=3, verbose=0, shuffle=False, validation_data=validation,
              callbacks=[OOMBackoff(verbose=0), starts])
    first = starts.starts[0][1:]  # the first step makes the optimizer's variables
    assert len(first) == 2
    for later in starts.starts[1:]:
        # What stayed would be in use at every later step (4 MiB and more).
        # One step's start is not a steady figure: the step after an epoch's
        # first starts with one batch more or not (tf_keras: 8.5 or 12.2 MiB,
        # with no garbage to collect), as TensorFlow's threads run ahead; in
        # one CI run on Keras 3 the first epochs' did and the third's did not
        # (21.25 MB against 17.57): a later epoch may start lower, not higher.
        # Half a MiB: a tf_keras CI run's third epoch started 0.26 MiB above the
        # first with nothing left to collect; what this guards is 4 MiB and more.
        assert min(later[1:]) - min(first) <= MIB / 2, starts.starts


def test_the_callback_keeps_figures_of_a_backoff_not_the_error():
    """What a backoff records is plain data: no exception, traceback or tensor."""
    from _faults import OutOfMemoryAbove

    inputs = keras.Input((4,))
    hidden = OutOfMemoryAbove(8)(keras.layers.Dense(8)(inputs))
    model = AccumulatingModel(inputs, keras.layers.Dense(2)(hidden), micro_batch_size=16)
    model.compile("sgd", "mse")
    backoff = OOMBackoff(verbose=0)
    model.fit(np.ones((16, 4), "float32"), np.ones((16, 2), "float32"), batch_size=16,
              verbose=0, callbacks=[backoff])
    (event,) = backoff.backoffs
    assert "out_of_memory_above" in event["op"], event  # the graph node, from the message
    assert event["shape"] == (16, 16) and event["bytes"] == 16 * 16 * 4, event

    def plain(value):
        if isinstance(value, dict):
            return all(plain(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return all(plain(v) for v in value)
        return value is None or isinstance(value, (str, int, float))

    assert plain(event), event
    assert plain(vars(backoff.policy)), vars(backoff.policy)
