"""`keras.layers.SpectralNormalization`: in every training call it divides its layer's
kernel in place by the kernel's spectral norm and advances its power iteration's
`vector_u`. Every micro-batch of a step starts from the step's kernel and `vector_u`
(`_step/per_update`), so each micro-batch's gradient is taken at the kernel the whole
batch's is; a step that runs out of memory puts them back; recomputation, which would
divide the kernel again, is refused.

The oracle: plain Keras at the whole batch, in float64, from the same weights (found by
the fuzzer's `spectral` axis: 3.6% apart before, in micro-batches of 3).
"""

import warnings

import numpy as np
import pytest
from _faults import OutOfMemoryInBackward
from _fuzz import float64
from _helpers import (
    FLOAT64,
    IDENTICAL,
    assert_same_logs,
    assert_same_weights,
    classification_data,
    compile_classifier,
)

from keras_memopt import AccumulatingModel, Remat
from keras_memopt._keras import LEGACY, keras
from keras_memopt.callbacks import OOMBackoff

layers = keras.layers
pytestmark = pytest.mark.usefixtures("float64_keras")


def _model(cls=keras.Model, fault=None, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    x = layers.Dense(8, activation="tanh", name="first")(inputs)
    if fault is not None:  # at its `fault`-th backward pass (None: never)
        x = OutOfMemoryInBackward(at=fault, name="fault")(x)
    x = layers.SpectralNormalization(layers.Dense(8, activation="tanh"), name="normalized")(x)
    x = layers.Dense(8, activation="relu", name="hidden")(x)
    outputs = layers.SpectralNormalization(layers.Dense(3), name="head")(x)
    return cls(inputs, outputs, **kwargs)


def _fit(model, callbacks=()):
    x, y = classification_data(22, dtype="float64")
    compile_classifier(model, metrics=["accuracy"])
    history = model.fit(
        x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=list(callbacks)
    ).history
    return model.get_weights(), history


def _assert_same(expected, received):
    (weights, history), (their_weights, their_history) = expected, received
    assert_same_weights(their_weights, weights, FLOAT64)
    # OOMBackoff logs its micro-batch size: the figures of `history` are among theirs.
    assert_same_logs(their_history, history, dict(rtol=FLOAT64["rtol"]))


# Plain Keras's run, which three tests compare against: trained once a module (a
# process), in float64 itself (a module's fixture is set up before `float64_keras`).
@pytest.fixture(scope="module")
def plain():
    with float64():
        return _fit(_model())


@pytest.mark.parametrize("split", [{"micro_batch_size": 3}, {"accumulation_steps": 2}])
def test_micro_batches_train_as_the_whole_batch(split, plain):
    _assert_same(plain, _fit(_model(AccumulatingModel, **split)))
    # The kernels were normalised: the test would pass on a layer that does nothing.
    assert not np.allclose(plain[0][2], _model().get_weights()[2])


def test_a_step_that_runs_out_of_memory_puts_the_kernel_back(plain):
    # The second micro-batch divided the kernels in place, then ran out of memory in
    # its backward pass: the retry in smaller micro-batches starts from the step's
    # kernels, to the bit (left divided, they differ by rounding: normalised again
    # from the restored `vector_u`, a divided kernel's norm is 1 but for rounding).
    model = _model(AccumulatingModel, fault=2, micro_batch_size=4)
    received = _fit(model, callbacks=[OOMBackoff(verbose=0)])
    assert model.get_layer("fault").raised == 1
    assert model.micro_batch_size == 2
    _assert_same(plain, received)
    started_there = _fit(_model(AccumulatingModel, fault=0, micro_batch_size=2))
    for mine, theirs in zip(started_there[0], received[0], strict=True):
        np.testing.assert_array_equal(theirs, mine)


def test_a_subclassed_call_without_training_trains_as_plain_keras():
    # Keras 3's `fit` calls a model whose `call` takes no `training` without one, so its
    # layers run at their defaults (here: no normalisation); tf_keras passes it on.
    def subclass(base, **kwargs):
        class Net(base):
            def __init__(self):
                super().__init__(**kwargs)
                self.hidden = layers.Dense(8, activation="tanh")
                self.head = layers.SpectralNormalization(layers.Dense(3))

            def call(self, inputs):
                return self.head(self.hidden(inputs))

        keras.utils.set_random_seed(0)
        model = Net()
        model(np.zeros((1, 6)))
        return model

    plain = subclass(keras.Model)
    before = plain.head.vector_u.numpy().copy()
    expected = _fit(plain)
    assert np.array_equal(plain.head.vector_u.numpy(), before) != LEGACY
    _assert_same(expected, _fit(subclass(AccumulatingModel, micro_batch_size=3)))


class TestRecomputation:
    def test_remat_around_it_is_refused(self):
        with pytest.raises(ValueError, match="Remat cannot recompute layer 'normalized'.*"
                                             "SpectralNormalization"):
            Remat(layers.SpectralNormalization(layers.Dense(4), name="normalized"))

    def test_a_segment_through_it_is_refused(self):
        with pytest.raises(ValueError, match="cannot recompute layer 'normalized'"):
            _model(AccumulatingModel, remat=["hidden"])

    def test_auto_recomputes_nothing_through_it(self):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        x = layers.Dense(64, activation="relu", name="first")(inputs)
        x = layers.Dense(64, activation="relu", name="second")(x)
        x = layers.SpectralNormalization(layers.Dense(64), name="normalized")(x)
        x = layers.Dense(64, activation="relu", name="third")(x)
        outputs = layers.Dense(3)(x)
        model = AccumulatingModel(inputs, outputs, micro_batch_size=4096)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.remat = "auto"
        segments = model.recomputed_segments
        assert segments, "auto recomputed nothing: the test checks nothing"
        assert all("normalized" not in segment for segment in segments), segments


def test_whole_batch_loss_is_refused_before_any_update():
    model = _model(AccumulatingModel, micro_batch_size=3, whole_batch_loss=True)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(NotImplementedError, match="SpectralNormalization"):
        _fit(model)
    assert_same_weights(before, model, IDENTICAL)
