"""Keras 3's newer optimizers: `Muon`, `ScheduleFreeAdamW`, `MultiOptimizer`.

Each trains an `AccumulatingModel` in micro-batches as plain Keras trains at the whole
batch (float64, every weight, optimizer variable, logged and evaluated figure). The
oracle for `ScheduleFreeAdamW` is plain Keras with its optimizer built before `fit`
(`_oracles.build_first`):
the optimizer's `build` sets its `momentum` to the weights (the schedule-free
sequences start at them), but plain Keras's `fit` builds it in a symbolic trace where
that assignment is lost, so the momentum starts at zero and the first step moves every
weight to about `-learning_rate` (measured: a kernel entry from -0.61 to -0.010 in one
step). `AccumulatingModel` builds the optimizer outside any trace, so its momentum
starts at the weights, as the optimizer says.
"""

import numpy as np
import pytest
from _helpers import (
    FLOAT64,
    assert_same_logs,
    assert_same_weights,
    classification_data,
    compile_classifier,
)
from _oracles import build_first

from keras_memopt import AccumulatingModel
from keras_memopt._keras import LEGACY, keras

pytestmark = [
    pytest.mark.skipif(LEGACY, reason="Keras 3's optimizers"),
    pytest.mark.usefixtures("float64_keras"),
]
layers = keras.layers


def _optimizer(name):
    optimizers = keras.optimizers
    if name == "Muon":  # the head on AdamW's step, as Muon's docs advise
        return optimizers.Muon(learning_rate=0.01, exclude_layers=["head"])
    if name == "ScheduleFreeAdamW":
        return optimizers.ScheduleFreeAdamW(learning_rate=0.01, warmup_steps=2)
    per_variable = {".*head.*": optimizers.Adam(0.01)}
    return optimizers.MultiOptimizer(
        optimizers.OptimizerMap(optimizers.SGD(0.1, momentum=0.9), per_variable)
    )


def _train(name, cls=keras.Model, oracle=False, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    x = layers.Dense(8, activation="tanh", name="trunk")(inputs)
    x = layers.Dense(8, activation="relu", name="hidden")(x)
    model = cls(inputs, layers.Dense(3, name="head")(x), **kwargs)
    compile_classifier(model, _optimizer(name), metrics=["accuracy"])
    if oracle:
        build_first(model)
    x, y = classification_data(30, dtype="float64")
    history = model.fit(
        x, y, batch_size=12, epochs=3, shuffle=False, verbose=0, validation_data=(x[:9], y[:9])
    ).history
    evaluated = model.evaluate(x, y, verbose=0, return_dict=True)
    state = [v.numpy() for v in model.optimizer.variables]
    return model.get_weights(), state, history, evaluated


@pytest.mark.parametrize("name", ["Muon", "ScheduleFreeAdamW", "MultiOptimizer"])
def test_micro_batches_train_as_plain_keras_at_the_whole_batch(name):
    expected = _train(name, oracle=True)
    received = _train(name, AccumulatingModel, micro_batch_size=5)
    for ours, theirs in zip(expected[:2], received[:2], strict=True):  # weights, optimizer
        assert_same_weights(theirs, ours, FLOAT64)
    assert received[2].keys() == expected[2].keys()
    figures = dict(rtol=FLOAT64["rtol"])
    assert_same_logs(received[2], expected[2], figures)
    assert_same_logs(received[3], expected[3], figures)


def test_schedule_free_momentum_starts_at_the_weights():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = AccumulatingModel(inputs, layers.Dense(2, name="head")(inputs), micro_batch_size=3)
    model.compile(keras.optimizers.ScheduleFreeAdamW(learning_rate=0.01), "mse")
    kernel = model.get_weights()[0]
    x, y = np.ones((6, 4)), np.zeros((6, 2))
    model.fit(x, y, batch_size=6, epochs=1, verbose=0)
    # One step from momentum = weights: each weight moves by about the learning rate.
    moved = np.abs(model.get_weights()[0] - kernel)
    np.testing.assert_allclose(moved, 0.01, rtol=1e-3)
