"""Keras 3's float8 training (`model.quantize("float8")`) in micro-batches.

A float8 `Dense` keeps, per tensor it quantizes, a scale and a history of the
largest magnitudes seen (delayed scaling). They are trainable variables with
`overwrite_with_gradient`: their "gradient" is their new value, computed from
the old one and the batch's largest magnitude, and the optimizer assigns it.
Summed over micro-batches it was several times too large (measured: each scale and
history 160 to 250 times its plain Keras value after four steps, the weights 5%
apart); their maximum is the whole batch's value (`_loop.gradient_folds`).

Compared in float64, where the float8 round trip of values that agree to float64
rounding gives the same float8 numbers: in float32, a matrix product's rows round
differently at another number of rows (a Dense's input gradient, 4 rows against 16:
every row differs in its last bit), and the 2-bit mantissa of the gradients' float8
turns such a difference into a step of a quarter (3.7% on a bias after one SGD step).
"""

import numpy as np
import pytest
from _faults import OutOfMemoryOnce
from _fuzz import float64
from _helpers import FLOAT64, assert_same_logs, classification_data, compile_classifier

from keras_memopt import AccumulatingModel, Remat
from keras_memopt._keras import LEGACY, keras
from keras_memopt.callbacks import OOMBackoff

pytestmark = [
    pytest.mark.skipif(LEGACY, reason="Keras 3's float8 training"),
    pytest.mark.usefixtures("float64_keras"),
]
layers = keras.layers


def _model(cls, activity_regularizer=None, fault=None, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((12,))
    hidden = layers.Dense(16, activation="relu", activity_regularizer=activity_regularizer)(inputs)
    if fault is not None:
        hidden = fault(hidden)
    return _float8_compiled(cls(inputs, layers.Dense(4)(hidden), **kwargs))


def _float8_compiled(model):
    """`model` (built) quantized to float8 and compiled, as every test here trains it."""
    model.quantize("float8")
    return compile_classifier(model, metrics=["accuracy"])


def _fit(model, callbacks=()):
    x, y = classification_data(40, features=12, classes=4, dtype="float64")
    history = model.fit(
        x, y, batch_size=20, epochs=2, shuffle=False, verbose=0, callbacks=list(callbacks)
    ).history
    return model, history, model.evaluate(x, y, batch_size=20, verbose=0, return_dict=True)


def _assert_same_variables(a, b):
    """Every variable of model `b` is model `a`'s, the 12 overwritten ones included
    (per layer: the inputs', the kernel's and the output gradients' scale and history)."""
    overwritten = [v.path for v in a.trainable_variables if v.overwrite_with_gradient]
    assert len(overwritten) == 12
    for va, vb in zip(a.variables, b.variables, strict=True):
        np.testing.assert_allclose(np.asarray(vb), np.asarray(va), **FLOAT64, err_msg=va.path)


def _assert_same(expected, received):
    (a, logs_a, eval_a), (b, logs_b, eval_b) = expected, received
    _assert_same_variables(a, b)
    figures = dict(rtol=FLOAT64["rtol"])
    assert_same_logs(logs_b, logs_a, figures)
    assert_same_logs(eval_b, eval_a, figures)


# Plain Keras's float8 run of `_model`, on one device and under the strategy: what
# several tests compare against, trained once a module (a process). In float64 itself:
# a module's fixture is set up before the tests' `float64_keras`.
@pytest.fixture(scope="module")
def plain():
    with float64():
        return _fit(_model(keras.Model))


@pytest.fixture(scope="module")
def plain_mirrored(mirrored_strategy):
    with float64():
        with mirrored_strategy.scope():
            model = _model(keras.Model)
        return _fit(model)


@pytest.mark.parametrize("options", [{}, {"whole_batch_loss": True}], ids=["micro", "whole"])
def test_float8_training_matches_plain_keras(options, plain):
    """Micro-batches of 6 (6, 6, 6, 2 per batch of 20): every variable, the scales
    and amax histories too, and every logged figure, after four updates."""
    _assert_same(plain, _fit(_model(AccumulatingModel, micro_batch_size=6, **options)))


def test_float8_training_with_an_activity_regularizer_matches_plain_keras():
    """The regulariser's term passes through the float8 layer's gradient: the
    first step's check of `model.losses` takes it in a graph (an eager
    `tape.gradient` through a float8 `Dense` raises, in plain Keras too)."""
    _assert_same(
        _fit(_model(keras.Model, activity_regularizer="l2")),
        _fit(_model(AccumulatingModel, activity_regularizer="l2", micro_batch_size=6)),
    )


class Custom(AccumulatingModel):
    """A custom `train_step` on `accumulate_gradients`, applying the gradients itself."""

    def train_step(self, data):
        x, y = data

        def loss_fn(micro):
            micro_x, micro_y = micro
            return self.compute_loss(micro_x, micro_y, self(micro_x, training=True))

        variables = self.trainable_variables
        loss, grads = self.accumulate_gradients(loss_fn, (x, y), variables)
        self.optimizer.apply_gradients(zip(grads, variables, strict=True))
        return {"loss": loss}


def test_float8_training_in_a_custom_step_matches_plain_keras(plain):
    _assert_same_variables(plain[0], _fit(_model(Custom, micro_batch_size=6))[0])


def test_float8_training_under_mirrored_strategy_matches_plain_keras(
    mirrored_strategy, plain_mirrored
):
    """Each replica folds its micro-batches' values by their maximum; the optimizer
    takes the replicas' values as in plain Keras."""
    with mirrored_strategy.scope():
        accumulating = _model(AccumulatingModel, micro_batch_size=3)
    _assert_same(plain_mirrored, _fit(accumulating))


@pytest.mark.parametrize("cls", [AccumulatingModel, Custom], ids=["usual", "custom"])
def test_float8_training_under_mirrored_strategy_after_one_replica_ran_out_of_memory(
    cls, mirrored_strategy, plain_mirrored
):
    """Replica 1 runs out of memory in its second micro-batch while replica 0 goes on:
    Keras assigns the float8 variables in each replica's context, before the
    all-reduce, so the model's own update waits for every replica's loop. Without
    that, replica 0 assigned them during the failed attempt and the retry rolled each
    amax history twice (found by the fuzzer: 0.99 relative error). A custom step's
    update cannot be held back so: the retry puts back every variable it may change."""
    fault = OutOfMemoryOnce(at=2, replica=1, delay=1.0, training_only=True)
    with mirrored_strategy.scope():
        accumulating = _model(cls, fault=fault, micro_batch_size=3)
    backoff = OOMBackoff(verbose=0)
    expected, received = plain_mirrored, _fit(accumulating, [backoff])
    assert fault.raised == 1
    assert [(b["phase"], b["micro_batch_size"]) for b in backoff.backoffs] == [("micro_batch", 1)]
    if cls is Custom:  # its own logs: the loss
        _assert_same_variables(expected[0], received[0])
    else:
        _assert_same(expected, received)


@pytest.mark.parametrize("passes_training", [True, False], ids=["training", "no-training"])
def test_float8_training_in_remat_matches_plain_keras(passes_training):
    """A float8 Dense in a `Remat`, in a subclassed model whose `call` takes `training`
    and passes it on, or takes none (then Keras calls the layers with `training=None`:
    the Dense's input and kernel scales get no gradient, and stay; the recomputation
    gave them zeros, which the optimizer assigned: found by the fuzzer)."""

    def model(cls, wrap, **kwargs):
        class Subclassed(cls):
            def __init__(self, **kw):
                super().__init__(**kw)
                hidden = layers.Dense(16, activation="relu")
                self.hidden = Remat(hidden) if wrap else hidden
                self.head = layers.Dense(4)

            if passes_training:

                def call(self, x, training=None):
                    return self.head(self.hidden(x, training=training))

            else:  # Keras then calls the layers with `training=None`

                def call(self, x):
                    return self.head(self.hidden(x))

        keras.utils.set_random_seed(0)
        built = Subclassed(**kwargs)
        built(classification_data(40, features=12, classes=4, dtype="float64")[0][:2])
        return _float8_compiled(built)

    plain, recomputed = model(keras.Model, False), model(AccumulatingModel, True,
                                                         micro_batch_size=6)
    _assert_same(_fit(plain), _fit(recomputed))


class _SumPenalty(layers.Layer):
    """An `add_loss` term that sums over the samples."""

    def call(self, inputs):
        self.add_loss(1e-3 * keras.ops.sum(inputs))
        return inputs


def test_float8_training_with_a_summed_term_zero_at_the_start_matches_plain_keras():
    """A term that sums a LayerNormalization's outputs is zero while its offset is:
    the first step's check tells a mean from a sum by the term's gradient norm, which
    doubles on the samples repeated. The float8 scales' "gradients" are new values,
    which stay: counted in, they kept the norm from doubling. Here the term was refused
    (its norm x1.33); in the fuzzer's case it was taken for a mean and trained 0.08
    from plain Keras."""

    def model(cls, **kwargs):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((12,))
        hidden = layers.LayerNormalization()(layers.Dense(16, activation="relu")(inputs))
        return _float8_compiled(cls(inputs, layers.Dense(4)(_SumPenalty()(hidden)), **kwargs))

    _assert_same(_fit(model(keras.Model)), _fit(model(AccumulatingModel, micro_batch_size=6)))


class _SmallMeanPenalty(layers.Layer):
    """An `add_loss` term that averages over the samples, below 1e-6 at the start."""

    def call(self, inputs):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(inputs)))
        return inputs


def test_float8_training_with_a_small_mean_term_matches_plain_keras():
    """A term below 1e-6 tells the first step's check nothing by its value, it
    was thought, so the check decided between mean and sum by the term's gradient
    norm. Through a float8 `Dense` that gradient is quantized, its smallest
    elements to float8's subnormals, and on the samples repeated its norm moved
    by 5%: the term was refused ("neither the same nor twice as large"), though
    its value was the same to the last bit. Where the gradient cannot tell, the
    value, small but not zero, decides."""

    def model(cls, **kwargs):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((12,))
        small = keras.initializers.RandomNormal(stddev=1e-3)
        hidden = layers.Dense(16, activation="relu", kernel_initializer=small)(inputs)
        hidden = _SmallMeanPenalty()(hidden)
        return _float8_compiled(cls(inputs, layers.Dense(4)(hidden), **kwargs))

    _assert_same(_fit(model(keras.Model)), _fit(model(AccumulatingModel, micro_batch_size=6)))
