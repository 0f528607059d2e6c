"""Pruning with tensorflow-model-optimization (tf_keras only) and its Keras 3 error."""

import gzip
import importlib.util
import sys

import numpy as np
import pytest
from _helpers import IDENTICAL, assert_same_weights, compile_classifier
from conftest import LEGACY, run_python

from keras_memopt import AccumulatingModel, pruning
from keras_memopt._keras import keras

needs_tfmot = pytest.mark.skipif(
    not LEGACY or importlib.util.find_spec("tensorflow_model_optimization") is None,
    reason="tensorflow-model-optimization works only with tf_keras (TF_USE_LEGACY_KERAS=1)",
)


def _data(n=96, features=16, classes=4, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = (x[:, :classes] @ rng.normal(size=(classes, classes))).argmax(axis=1)
    return x, y


def _mlp(cls=keras.Model, width=64, **kwargs):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((16,))
    x = keras.layers.Dense(width, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(4, name="head")(x)
    return cls(inputs, outputs, **kwargs)


def _kernels(model):
    return [w for w in model.get_weights() if w.ndim == 2]


class TestKeras3:
    @pytest.mark.skipif(LEGACY, reason="the error is for Keras 3")
    @pytest.mark.parametrize("function", [pruning.prune_low_magnitude, pruning.strip_pruning])
    def test_pruning_on_keras_3_explains_the_legacy_switch(self, function):
        model = _mlp(AccumulatingModel, micro_batch_size=8)
        with pytest.raises(RuntimeError, match=r"tf_keras.*TF_USE_LEGACY_KERAS=1.*\[tfmot\]"):
            function(model)

    @pytest.mark.skipif(LEGACY, reason="the error is for Keras 3")
    def test_the_switch_set_too_late_is_named(self, monkeypatch):
        # As `import tensorflow_model_optimization` after keras_memopt does.
        monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
        with pytest.raises(RuntimeError, match=r"TF_USE_LEGACY_KERAS='1' set after keras_memopt"):
            pruning.prune_low_magnitude(_mlp(AccumulatingModel, micro_batch_size=8))

    @pytest.mark.skipif(
        LEGACY or importlib.util.find_spec("tensorflow_model_optimization") is None,
        reason="the error is for Keras 3; needs tfmot",
    )
    def test_importing_tfmot_after_keras_memopt_is_named(self):
        # The real import, which sets the variable in `os.environ` itself.
        result = run_python("""
            import keras
            import keras_memopt as kmo
            import tensorflow_model_optimization
            inputs = keras.Input((4,))
            model = kmo.AccumulatingModel(inputs, keras.layers.Dense(2)(inputs), micro_batch_size=2)
            try:
                kmo.pruning.prune_low_magnitude(model)
            except RuntimeError as error:
                print(error)
        """, env={"TF_USE_LEGACY_KERAS": "0"})
        assert "TF_USE_LEGACY_KERAS='1' set after keras_memopt" in result.stdout

    def test_tfmot_missing_names_the_extra(self, monkeypatch):
        monkeypatch.setitem(sys.modules, "tensorflow_model_optimization", None)
        model = _mlp(AccumulatingModel, micro_batch_size=8)
        # On Keras 3 the switch comes first: tfmot is not imported there.
        error, match = (
            (ImportError, r"which is not installed.*pip install \"keras_memopt\[tfmot\]\"")
            if LEGACY
            else (RuntimeError, r"TF_USE_LEGACY_KERAS=1.*pip install \"keras_memopt\[tfmot\]\"")
        )
        with pytest.raises(error, match=match):
            pruning.prune_low_magnitude(model)

    def test_models_without_pruning_have_no_step_counters(self):
        assert pruning.step_counters(_mlp(AccumulatingModel, micro_batch_size=8)) == []


@needs_tfmot
class TestPruning:
    @pytest.fixture(autouse=True)
    def _tfmot(self):
        import tensorflow_model_optimization as tfmot

        self.sparsity = tfmot.sparsity.keras

    def _schedule(self, final=0.75, end_step=6, frequency=2):
        return self.sparsity.PolynomialDecay(
            0.0, final, begin_step=0, end_step=end_step, frequency=frequency
        )

    def _fit(self, model, x, y, epochs=4):
        model.fit(
            x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0,
            callbacks=[self.sparsity.UpdatePruningStep()],
        )

    def test_pruning_steps_count_updates_and_match_plain_keras(self):
        # 4 micro-batches per update. Were the pruning step advanced per
        # micro-batch, the schedule would run 4x faster: other masks, weights.
        x, y = _data()
        plain = pruning.prune_low_magnitude(_mlp(), pruning_schedule=self._schedule())
        model = pruning.prune_low_magnitude(
            _mlp(AccumulatingModel, micro_batch_size=8), pruning_schedule=self._schedule()
        )
        for m in (plain, model):
            compile_classifier(m)
            self._fit(m, x, y)
        steps = [int(c) for c in pruning.step_counters(model)]
        assert int(model.optimizer.iterations) == 12
        assert steps == [12, 12]
        assert [int(c) for c in pruning.step_counters(plain)] == steps
        assert_same_weights(model, plain, dict(rtol=1e-5, atol=1e-6))

    def test_whole_batch_loss_is_refused_before_any_update(self):
        # Its second forward pass would advance the pruning steps twice.
        x, y = _data()
        model = pruning.prune_low_magnitude(
            _mlp(AccumulatingModel, micro_batch_size=8), pruning_schedule=self._schedule()
        )
        model.whole_batch_loss = True
        compile_classifier(model)
        before = [w.numpy() for w in model.trainable_weights]
        with pytest.raises(NotImplementedError, match="advance tfmot's pruning steps twice"):
            self._fit(model, x, y, epochs=1)
        assert_same_weights(before, [w.numpy() for w in model.trainable_weights], IDENTICAL)
        assert int(model.optimizer.iterations) == 0

    def test_target_sparsity_reached_and_stripped_model_predicts(self, tmp_path):
        x, y = _data()
        model = pruning.prune_low_magnitude(
            _mlp(AccumulatingModel, accumulation_steps=3), pruning_schedule=self._schedule()
        )
        assert isinstance(model, AccumulatingModel) and model.accumulation_steps == 3
        compile_classifier(model)
        before = model.evaluate(x, y, batch_size=32, verbose=0)
        self._fit(model, x, y)
        after = model.evaluate(x, y, batch_size=32, verbose=0)
        assert after < before

        stripped = pruning.strip_pruning(model)
        assert isinstance(stripped, AccumulatingModel) and stripped.accumulation_steps == 3
        assert [layer.name for layer in stripped.layers] == ["input_1", "hidden", "head"]
        for kernel in _kernels(stripped):
            np.testing.assert_allclose(np.mean(kernel == 0), 0.75, atol=0.01)
        np.testing.assert_allclose(
            stripped.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6
        )

        path = str(tmp_path / "pruned.keras")
        stripped.save(path)
        loaded = keras.models.load_model(path, compile=False)
        assert isinstance(loaded, AccumulatingModel) and loaded.accumulation_steps == 3
        np.testing.assert_allclose(
            loaded.predict(x, verbose=0), stripped.predict(x, verbose=0), rtol=1e-6
        )

    def test_exported_pruned_model_compresses_smaller_than_unpruned(self, tmp_path):
        x, y = _data()
        dense = _mlp(AccumulatingModel, width=256, micro_batch_size=8)
        pruned = pruning.prune_low_magnitude(
            _mlp(AccumulatingModel, width=256, micro_batch_size=8),
            pruning_schedule=self._schedule(final=0.8),
        )
        for m in (dense, pruned):
            compile_classifier(m)
            self._fit(m, x, y, epochs=2)
        sizes = {}
        for name, m in (("dense", dense), ("pruned", pruning.strip_pruning(pruned))):
            path = tmp_path / f"{name}.h5"
            m.save(str(path), include_optimizer=False)
            sizes[name] = len(gzip.compress(path.read_bytes()))
        # 80% of ~5k kernel weights are zeros: the compressed file shrinks by
        # well over half (measured: 0.39x with gzip).
        assert sizes["pruned"] < 0.5 * sizes["dense"], sizes

    def test_subclassed_model_with_pruned_layer_counts_updates(self):
        schedule = self._schedule()
        sparsity = self.sparsity

        class Pruned(AccumulatingModel):
            def __init__(self):
                super().__init__(micro_batch_size=4)
                self.hidden = sparsity.prune_low_magnitude(
                    keras.layers.Dense(8), pruning_schedule=schedule
                )
                self.head = keras.layers.Dense(4)

            def call(self, inputs):
                return self.head(self.hidden(inputs))

        x, y = _data(n=64)
        model = Pruned()
        model(x[:1])  # tfmot's callback needs the wrapper built before `fit`
        compile_classifier(model)
        self._fit(model, x, y, epochs=2)
        assert int(model.optimizer.iterations) == 4
        assert [int(c) for c in pruning.step_counters(model)] == [4]

    @pytest.mark.parametrize(
        "kwargs, compile_kwargs",
        [({"remat": "auto"}, {}), ({}, {"jit_compile": True})],
        ids=["remat", "xla"],
    )
    def test_recomputation_and_xla_count_updates(self, kwargs, compile_kwargs):
        x, y = _data(n=64)
        schedule = self.sparsity.ConstantSparsity(0.5, begin_step=0, frequency=1)
        model = pruning.prune_low_magnitude(
            _mlp(AccumulatingModel, micro_batch_size=8, **kwargs), pruning_schedule=schedule
        )
        model.compile("sgd", "sparse_categorical_crossentropy", **compile_kwargs)
        self._fit(model, x, y, epochs=2)
        assert [int(c) for c in pruning.step_counters(model)] == [4, 4]
        for kernel in _kernels(pruning.strip_pruning(model)):
            np.testing.assert_allclose(np.mean(kernel == 0), 0.5, atol=0.01)

    def test_distribution_strategy_is_refused_clearly(self, mirrored_strategy):

        x, y = _data(n=32)
        with mirrored_strategy.scope():
            model = pruning.prune_low_magnitude(
                _mlp(AccumulatingModel, micro_batch_size=8), pruning_schedule=self._schedule()
            )
            compile_classifier(model)
        with pytest.raises(NotImplementedError, match="under a distribution strategy"):
            self._fit(model, x, y, epochs=1)

    def test_prune_keeps_remat_segments_under_their_new_names(self):
        model = _mlp(AccumulatingModel, micro_batch_size=8, remat=["hidden"])
        pruned = pruning.prune_low_magnitude(model, pruning_schedule=self._schedule())
        assert pruned.remat == ["prune_low_magnitude_hidden"]
        assert pruned.micro_batch_size == 8

    def test_plain_model_stays_plain(self):
        pruned = pruning.prune_low_magnitude(_mlp(), pruning_schedule=self._schedule())
        assert not isinstance(pruned, AccumulatingModel)

    def test_refuses_a_keras_3_model(self):
        import keras as keras_3

        layer = keras_3.layers.Dense(4)
        with pytest.raises(TypeError, match=r"must be a tf_keras `Layer`.*Keras 3.*Received"):
            pruning.prune_low_magnitude(layer)
        with pytest.raises(TypeError, match=r"must be a tf_keras `Model`"):
            pruning.strip_pruning(layer)
