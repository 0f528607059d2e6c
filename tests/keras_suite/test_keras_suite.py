"""Keras's own model tests, run against AccumulatingModel (issue 13).

AccumulatingModel is meant as a drop-in replacement for `keras.Model`. This
module runs the installed Keras 3's `keras/src/models/model_test.py` and
`functional_test.py` twice, each test class once per stand-in:

- `...Plain`: `keras.Model` replaced by `Plain`, a trivial registered subclass
  (`class Plain(keras.Model): pass`). This is the control: what a test needs
  from a model class that is not `keras.Model` itself. A test that fails here
  is about Keras or this environment, not about keras_memopt.
- `...Accumulating`: `keras.Model` replaced by `AccumulatingModel`, with
  `micro_batch_size=1` unless a test gives a micro-batch setting itself. Most
  of the tests train on batches of 2 samples (`fit(x, y, batch_size=2)`), so
  with 1 every batch of 44 of the 47 tests that fit, evaluate or predict
  really splits (with 2, only 12 would); the other 3 give no tensor or one
  sample.

The substitution is done per test, on the names the test modules look up when
a test runs: `Model` in both modules (bound by
`from keras.src.models.model import Model` / `from keras.src.models import
Model`), and `Functional` in `functional_test.py`, where it is called as the
functional constructor (there it becomes the class that `Model(inputs,
outputs)` returns). `model_test.py` uses `Functional` only in `isinstance`
checks, which a functional AccumulatingModel passes as Keras's own class. The
micro-batch default is a wrapper around `AccumulatingModel.__init__`, so the
class under test is the real one, with its real registration for saving.
Everything is put back after each test. Keras rewrites the bases of a subclass
that is given (inputs, outputs); `Plain`'s are restored after each test, and
an Accumulating test that leaves `AccumulatingModel.__bases__` changed fails.

Tests that fail for AccumulatingModel and pass for `Plain` are listed in
`KNOWN_GAPS` with their root cause and marked `xfail(strict=True)`: fixing one
makes it an unexpected pass, which fails until it is taken off the list.
`tests/test_fidelity.py` has a small test for each.

Measured on Keras 3.15.1 / TensorFlow 2.21 CPU: 114 tests per stand-in; `Plain`
passes all 114, and so does AccumulatingModel.
Each stand-in costs about 80 s of CPU time. The `Plain` control runs only
with `KERAS_MEMOPT_SUITE_CONTROL=1` (it tests Keras, not this package): run it
when an Accumulating test fails, to tell the two apart. The Accumulating half
runs in CI. Skipped under tf_keras (`TF_USE_LEGACY_KERAS=1`):
these are Keras 3's tests.

Run both halves alone:

```
KERAS_MEMOPT_SUITE_CONTROL=1 python -m pytest tests/keras_suite -rxX
```
"""

import functools
import os
import unittest

import pytest
from conftest import LEGACY

if LEGACY:
    pytest.skip(
        "Keras 3's own model tests; AccumulatingModel is on tf_keras here",
        allow_module_level=True,
    )

import keras  # noqa: E402
from keras.src.models import functional_test, model_test  # noqa: E402

from keras_memopt import AccumulatingModel  # noqa: E402

MICRO_BATCH_SIZE = 1
MODULES = (model_test, functional_test)

# Test method (or parameterised family) -> why it fails for AccumulatingModel.
# Empty: every test that passes with `Plain` passes with AccumulatingModel.
KNOWN_GAPS: dict[str, str] = {}


@keras.saving.register_keras_serializable(package="keras_suite")
class Plain(keras.Model):
    pass


def _functional_form(cls):
    """The class of `cls(inputs, outputs)` (uninitialised, as Keras does)."""
    return type(cls.__new__(cls, inputs=[], outputs=[]))


def _replace(test, target, name, value):
    old = getattr(target, name)
    setattr(target, name, value)
    test.addCleanup(setattr, target, name, old)


def _use_plain(test, module):
    test.addCleanup(setattr, Plain, "__bases__", Plain.__bases__)
    _replace(test, module, "Model", Plain)
    if module is functional_test:
        _replace(test, module, "Functional", Plain)


def _use_accumulating(test, module):
    bases = AccumulatingModel.__bases__

    def check_bases():
        changed = AccumulatingModel.__bases__
        if changed != bases:
            AccumulatingModel.__bases__ = bases
            raise AssertionError(f"the test changed AccumulatingModel.__bases__ to {changed}")

    test.addCleanup(check_bases)
    init = AccumulatingModel.__init__

    @functools.wraps(init)
    def micro_batched_init(self, *args, **kwargs):
        if "micro_batch_size" not in kwargs and "accumulation_steps" not in kwargs:
            kwargs["micro_batch_size"] = MICRO_BATCH_SIZE
        init(self, *args, **kwargs)

    _replace(test, AccumulatingModel, "__init__", micro_batched_init)
    _replace(test, module, "Model", AccumulatingModel)
    if module is functional_test:
        _replace(test, module, "Functional", _functional_form(AccumulatingModel))


def _known_gap(test_class, name):
    for key, reason in KNOWN_GAPS.items():
        class_name, method = key.split(".")
        if class_name == test_class.__name__ and (
            name == method or name.startswith(method + "_")
        ):
            return reason
    return None


def _expected_to_fail(method, reason):
    @functools.wraps(method)
    def test(self, *args, **kwargs):
        return method(self, *args, **kwargs)

    return pytest.mark.xfail(strict=True, reason=reason)(test)


def _substituted(test_class, module, use, suffix):
    """`test_class` with the model class replaced (by `use`) in each test."""

    def setUp(self):  # noqa: N802 (unittest's name)
        use(self, module)
        test_class.setUp(self)

    namespace = {"setUp": setUp, "__module__": __name__}
    if use is _use_accumulating:
        for name in dir(test_class):
            reason = _known_gap(test_class, name) if name.startswith("test") else None
            if reason is not None:
                namespace[name] = _expected_to_fail(getattr(test_class, name), reason)
    return type(test_class.__name__ + suffix, (test_class,), namespace)


# The control half runs on request (it tests Keras, not keras_memopt): when
# an Accumulating test fails, run it to tell the two apart.
CONTROL = os.environ.get("KERAS_MEMOPT_SUITE_CONTROL", "") == "1"


def _test_classes():
    for module in MODULES:
        for obj in list(vars(module).values()):
            if (
                isinstance(obj, type)
                and issubclass(obj, unittest.TestCase)
                and obj.__module__ == module.__name__
            ):
                if CONTROL:
                    yield _substituted(obj, module, _use_plain, "Plain")
                yield _substituted(obj, module, _use_accumulating, "Accumulating")


globals().update((cls.__name__, cls) for cls in _test_classes())
