"""AccumulatingModel behaves as a drop-in `keras.Model` (issue 13).

Each test states what plain Keras does and runs it on a `keras.Model` (the
oracle, which must pass) and on an `AccumulatingModel` whose batches really
split into micro-batches. Known gaps are marked `xfail(strict=True)` on the
AccumulatingModel case only, with the root cause as the reason: a fix turns the
case into an unexpected pass, which fails until its marker is removed. The
cases come from issue 13 and from Keras's own model tests run against
AccumulatingModel (`tests/keras_suite`).
"""

import json
import pickle
import warnings

import numpy as np
import pytest
from _helpers import SAME_COMPUTATION, regression_data
from conftest import LEGACY

from keras_memopt import AccumulatingModel
from keras_memopt._keras import keras

layers = keras.layers
# Keras's functional model class, which it keeps private: what `keras.Model`
# returns, uninitialised, given functional arguments.
Functional = type(keras.Model.__new__(keras.Model, inputs=[], outputs=[]))

MICRO_BATCH_SIZE = 2  # every batch below has 4 or 8 samples: 2 to 4 micro-batches


def _split(cls):
    """Constructor arguments that make `cls` split its batches."""
    return {"micro_batch_size": MICRO_BATCH_SIZE} if issubclass(cls, AccumulatingModel) else {}


def _known_gap(reason, where=True):
    """The AccumulatingModel case, expected to fail (where `where`) until fixed."""
    return pytest.param(
        AccumulatingModel,
        marks=pytest.mark.xfail(where, strict=True, reason=reason),
        id="accumulating",
    )


def _model_classes(reason=None, where=True):
    accumulating = (
        pytest.param(AccumulatingModel, id="accumulating")
        if reason is None
        else _known_gap(reason, where)
    )
    return pytest.mark.parametrize("cls", [pytest.param(keras.Model, id="keras"), accumulating])


@pytest.fixture
def restore_bases():
    """Puts back the bases of `keras.Model` and `AccumulatingModel` after a test
    that may rewrite them, so that later tests are unaffected."""
    before = {cls: cls.__bases__ for cls in (keras.Model, AccumulatingModel)}
    yield before
    for cls, bases in before.items():
        if cls.__bases__ != bases:
            cls.__bases__ = bases


def _comparable(config):
    """A model config as saved (tuples and lists both become lists)."""
    return json.loads(json.dumps(config))


def _dense_model(cls, **kwargs):
    inputs = keras.Input((3,), name="x")
    hidden = layers.Dense(4, activation="tanh", name="hidden")(inputs)
    outputs = layers.Dense(1, name="out")(hidden)
    return cls(inputs, outputs, name="net", **_split(cls), **kwargs)


class TestMissingInput:
    # Keras 3 checks each input against its `optional` flag when the model is
    # called; tf_keras's input spec refuses a None input.
    MESSAGE = "should be tensors" if LEGACY else "not optional"
    ERROR = TypeError if LEGACY else ValueError

    @_model_classes()
    def test_none_for_a_required_input_raises_keras_error_in_fit(self, cls):
        model = _dense_model(cls)
        model.compile(optimizer="sgd", loss="mse")
        with pytest.raises(self.ERROR, match=self.MESSAGE):
            model.fit([None], np.ones((4, 1), "float32"), epochs=1, verbose=0)

    @_model_classes()
    def test_none_for_a_required_input_raises_keras_error_in_evaluate(self, cls):
        model = _dense_model(cls)
        model.compile(optimizer="sgd", loss="mse")
        with pytest.raises(self.ERROR, match=self.MESSAGE):
            model.evaluate([None], np.ones((4, 1), "float32"), verbose=0)


class TestInputStructureWarning:
    """A dict-input model given a list warns (Keras 3) once per traced step."""

    @staticmethod
    def _user_warnings(cls, method):
        first = keras.Input((2,), name="first")
        second = keras.Input((2,), name="second")
        outputs = layers.Dense(1)(layers.Add()([first, second]))
        model = cls({"first": first, "second": second}, outputs, **_split(cls))
        model.compile(optimizer="sgd", loss="mse")
        x = [np.ones((4, 2), "float32"), np.zeros((4, 2), "float32")]
        args = (x,) if method == "predict" else (x, np.ones((4, 1), "float32"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            getattr(model, method)(*args, batch_size=4, verbose=0)
        # The "Received:" line shows the traced shapes, a micro-batch's here.
        return [
            str(w.message).split("\nReceived:")[0]
            for w in caught
            if issubclass(w.category, UserWarning)
        ]

    @pytest.mark.parametrize(
        "method",
        [
            "fit",
            "evaluate",
            "predict",
        ],
    )
    def test_warns_as_often_as_keras(self, method):
        assert self._user_warnings(AccumulatingModel, method) == self._user_warnings(
            keras.Model, method
        )

    @pytest.mark.skipif(LEGACY, reason="tf_keras does not check the input structure")
    def test_keras_warns_once_in_predict(self):
        messages = self._user_warnings(keras.Model, "predict")
        assert [m for m in messages if m.startswith("The structure of `inputs`")] == messages
        assert len(messages) == 1


def _distiller_class(base):
    class Distiller(base):
        def __init__(self, teacher, student):
            super().__init__(**_split(base))
            self.teacher = teacher
            self.student = student

        def call(self, x, training=False):
            return self.student(x, training=training)

    return Distiller


class TestSubclassConstructors:
    @_model_classes()
    def test_two_positional_arguments_of_a_subclass_are_its_own(self, cls):
        teacher = keras.Sequential([keras.Input((3,)), layers.Dense(1)])
        teacher.trainable = False
        student = keras.Sequential([keras.Input((3,)), layers.Dense(1)])
        model = _distiller_class(cls)(teacher, student)
        assert not isinstance(model, Functional)
        assert model.teacher is teacher and model.student is student
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        x, y = regression_data(8, 3, 1)
        before = student.get_weights()
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        assert not np.allclose(before[0], student.get_weights()[0])
        np.testing.assert_allclose(
            model.predict(x, verbose=0), student.predict(x, verbose=0), **SAME_COMPUTATION
        )

    @_model_classes()
    def test_subclass_built_functionally_in_its_constructor(self, cls, restore_bases):
        split = _split(cls)

        class Builder(cls):
            def __init__(self, units):
                inputs = keras.Input((3,))
                super().__init__(inputs, layers.Dense(units)(inputs), **split)

        class Subclassed(cls):
            def __init__(self):
                super().__init__(**split)
                self.dense = layers.Dense(1)

            def call(self, x):
                return self.dense(x)

        model = Builder(2)
        assert isinstance(model, Functional) and isinstance(model, Builder)
        assert cls.__bases__ == restore_bases[cls]
        model.compile(optimizer="sgd", loss="mse")
        x, _ = regression_data(8, 3, 1)
        model.fit(x, np.zeros((8, 2), "float32"), batch_size=8, verbose=0)
        assert not isinstance(Subclassed(), Functional)


class TestCopies:
    @_model_classes()
    def test_pickle_round_trip(self, cls):
        model = _dense_model(cls)
        model.compile(optimizer="sgd", loss="mse")
        restored = pickle.loads(pickle.dumps(model))
        assert type(restored) is type(model)
        assert _comparable(restored.get_config()) == _comparable(model.get_config())
        x, _ = regression_data(8, 3, 1)
        np.testing.assert_allclose(
            restored.predict(x, verbose=0), model.predict(x, verbose=0), **SAME_COMPUTATION
        )

    @pytest.mark.parametrize(
        "how",
        [
            pytest.param("default", id="default"),
            pytest.param("compiled", id="compiled"),
            pytest.param("clone_function", id="clone_function"),
        ],
    )
    @_model_classes()
    def test_clone_model_keeps_class_and_config(self, cls, how, request):
        # Keras 3 builds every functional clone with
        # `model.__class__(inputs, outputs, name=...)` (+ `compile_from_config`
        # when compiled); tf_keras does too given a clone_function, and
        # otherwise uses `from_config(get_config())`.
        # Keras 3 passes only the compile config on to a functional clone, so
        # an uncompiled clone has no way to learn the micro-batch setting.
        lost = (not LEGACY and how != "compiled") or (LEGACY and how == "clone_function")
        if cls is AccumulatingModel and lost:
            request.applymarker(
                pytest.mark.xfail(
                    strict=True,
                    reason="clone_model rebuilds a functional model through its "
                    "constructor (keras/src/models/cloning.py "
                    "`_clone_functional_model`) and passes on only the compile "
                    "config; tf_keras with a clone_function finds no "
                    "Functional-like constructor signature and returns a plain "
                    "Functional",
                )
            )
        kwargs = {"remat": ["hidden"]} if cls is AccumulatingModel else {}
        model = _dense_model(cls, **kwargs)
        if how == "compiled":
            model.compile(optimizer="sgd", loss="mse")
        clone_function = None
        if how == "clone_function":
            clone_function = lambda layer: layer.__class__.from_config(layer.get_config())  # noqa: E731
        clone = keras.models.clone_model(model, clone_function=clone_function)
        assert type(clone) is type(model)
        assert _comparable(clone.get_config()) == _comparable(model.get_config())
