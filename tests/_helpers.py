"""What many test modules share: synthetic data, how a classifier is compiled, and the
weight and log comparisons with their tolerances.

Each tolerance is named for what is compared, and says why it is as wide as it
is; a test that needs another one writes it out beside its reason. Pass one as
`np.testing.assert_allclose(received, expected, **FLOAT32)`, to
`assert_same_weights` or to `assert_same_logs`. Logged figures, of the order of
one, are often compared with the relative part alone: `dict(rtol=FLOAT64["rtol"])`.
"""

import numpy as np

from keras_memopt._keras import keras

# Bit for bit: the weights a refused step left as they were, or two runs that
# compute the same thing in the same order.
IDENTICAL = dict(rtol=0, atol=0)
# The same micro-batches through the same operations, in another process, after
# a rollback and retry, with segments on other devices or after a save and load:
# float32 rounding at most, with no relative slack.
SAME_COMPUTATION = dict(rtol=0, atol=1e-6)
# float32 sums of the same terms in another order (micro-batches against the
# whole batch). After several Adam updates, which divide by the root of tiny
# second moments, weights agree to about 1e-6, rarely 2e-6.
FLOAT32 = dict(rtol=1e-5, atol=1e-5)
# float64 (the `float64_keras` fixture), micro-batches against the whole batch:
# only rounding differs, far under the effect of a bug that float32's could hide.
FLOAT64 = dict(rtol=1e-10, atol=1e-13)


def _arrays(weights):
    return weights.get_weights() if hasattr(weights, "get_weights") else list(weights)


def compile_classifier(model, optimizer=None, **kwargs):
    """Compiles `model`, whose outputs are logits over classes, as most tests train
    one: `optimizer` (defaults to `Adam(0.01)`) and sparse categorical cross-entropy
    from logits; `kwargs` go to `compile` (`metrics=["accuracy"]`, `jit_compile`, ...).
    Returns `model`."""
    model.compile(
        optimizer=keras.optimizers.Adam(0.01) if optimizer is None else optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **kwargs,
    )
    return model


def assert_same_weights(a, b, tolerance):
    """Asserts that `a` and `b` (models, layers or lists of arrays) hold the same
    weights within `tolerance` (one of the names above, or a dict of `rtol` and
    `atol`), as `np.testing.assert_allclose(a[i], b[i])`: `rtol` is of `b`'s values."""
    a, b = _arrays(a), _arrays(b)
    assert len(a) == len(b), f"{len(a)} weights against {len(b)}"
    for index, (x, y) in enumerate(zip(a, b, strict=True)):
        np.testing.assert_allclose(x, y, **tolerance, err_msg=f"weight {index}")


def assert_same_logs(received, expected, tolerance):
    """Asserts that every figure of `expected` (a `History.history`, or what
    `evaluate(..., return_dict=True)` returns) is in `received`, and close."""
    assert set(expected) <= set(received), f"{sorted(expected)} not all in {sorted(received)}"
    for key, value in expected.items():
        np.testing.assert_allclose(received[key], value, **tolerance, err_msg=key)


def classification_data(n, features=6, classes=3, seed=0, dtype="float32"):
    """`n` samples of standard normal features and uniform integer labels."""
    rng = np.random.RandomState(seed)
    x = rng.normal(size=(n, features)).astype(dtype)
    y = rng.randint(0, classes, size=(n,))
    return x, y


def regression_data(n, features, outputs, seed=0, dtype="float32"):
    """`n` samples of standard normal features and standard normal targets."""
    rng = np.random.RandomState(seed)
    x = rng.normal(size=(n, features)).astype(dtype)
    y = rng.normal(size=(n, outputs)).astype(dtype)
    return x, y


def load_benchmark(name):
    """A module of benchmarks/, loaded from its file (they import each other by their
    bare names, so benchmarks/ goes on the path)."""
    import importlib.util
    import pathlib
    import sys

    folder = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class AddsSquaredSum(keras.layers.Layer):
    """Dense(`units`) that adds the sum of its squared outputs to `model.losses` (a
    term summed over the samples, which a micro-batch cannot take its share of)."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.dense = keras.layers.Dense(self.units)
        self.dense.build(input_shape)

    def call(self, inputs):
        outputs = self.dense(inputs)
        self.add_loss(keras.ops.sum(outputs**2))
        return outputs
