"""AccumulatingModel(devices=..., device_cuts=...): segments on several devices.

The test session splits the CPU into two logical devices, /CPU:0 and /CPU:1
(see conftest.py): placement is checked on the variables, on the optimizer's
slots and on the operations of the traced steps, and results against a plain
`keras.Model` with the same initial weights on one device. Placement changes
where operations run, not which: results agree within `SAME_COMPUTATION`.
"""

import contextlib
import re

import numpy as np
import pytest
import tensorflow as tf
from _helpers import SAME_COMPUTATION, assert_same_weights, compile_classifier
from conftest import LEGACY

from keras_memopt import AccumulatingModel
from keras_memopt._keras import keras, optimizer_variables
from keras_memopt.placement import _partition

layers = keras.layers
DEVICES = ["/CPU:0", "/CPU:1"]
LAYER_NAMES = ["dense0", "norm0", "dense1", "norm1", "dense2", "norm2", "head"]


def _device(variable):
    """The device of the TensorFlow variable behind a layer's weight."""
    variable = variable if LEGACY else variable.value
    spec = tf.DeviceSpec.from_string(variable.device)
    return f"/{spec.device_type}:{spec.device_index}"


def _graph_layers(cls=AccumulatingModel, split_after=None, **kwargs):
    """A functional MLP (Dense and LayerNormalization) on 16 features, 3 classes.

    With `split_after`, the layers up to that one are created under
    `tf.device("/CPU:0")` and the rest under `tf.device("/CPU:1")`: their
    variables are born where the segments run, as tf_keras needs.
    """
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,), name="x")
    x, scope = inputs, DEVICES[0]
    for name in LAYER_NAMES:
        on = tf.device(scope) if split_after else contextlib.nullcontext()
        with on:
            if name == "head":
                x = layers.Dense(3, name=name)(x)
            elif name.startswith("dense"):
                x = layers.Dense(32, activation="relu", name=name)(x)
            else:
                x = layers.LayerNormalization(name=name)(x)
        if name == split_after:
            scope = DEVICES[1]
    return cls(inputs, x, **kwargs)


def _placed(device_cuts=("dense1",), **kwargs):
    """The MLP on both devices, cut after dense1 (which "auto" also chooses)."""
    cuts = list(device_cuts) if device_cuts != "auto" else "auto"
    split_after = "dense1" if LEGACY else None
    return _graph_layers(split_after=split_after, devices=DEVICES, device_cuts=cuts, **kwargs)


def _data(n=46, seed=0):
    rng = np.random.RandomState(seed)
    return rng.rand(n, 16).astype("float32"), rng.randint(0, 3, n)


_REFERENCES = {}


def _train_both(model, batch_size=23, epochs=3, **compile_kwargs):
    """Trains `model`, and a plain `keras.Model` on one device from the same
    initial weights (trained once per initial weights and schedule).

    Returns the plain model's weights after training, and its predictions.
    """
    initial = model.get_weights()
    key = (b"".join(w.tobytes() for w in initial), batch_size, epochs)
    x, y = _data()
    if key not in _REFERENCES:
        plain = compile_classifier(_graph_layers(keras.Model))
        plain.set_weights(initial)
        plain.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
        _REFERENCES[key] = plain.get_weights(), plain.predict(x, verbose=0)
    compile_classifier(model, **compile_kwargs)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return _REFERENCES[key]


def _layer_devices(model):
    """Where each layer with weights keeps them."""
    devices = {}
    for layer in model.layers:
        found = {_device(w) for w in layer.weights}
        if found:
            assert len(found) == 1, (layer.name, found)
            devices[layer.name] = found.pop()
    return devices


def _expected_device(layer_name):
    return DEVICES[0] if layer_name in ("dense0", "norm0", "dense1") else DEVICES[1]


def _layer_of(node_name):
    """The layer whose name scope holds a node ("while/..._segment_1_1/dense2_1/MatMul")."""
    for part in node_name.split("/"):
        name = re.sub(r"_\d+$", "", part)
        if name in LAYER_NAMES:
            return name
    raise AssertionError(f"no layer in {node_name!r}")


def _matmuls(function, *specs):
    """`(name, device)` of every MatMul in `function`'s graph, loop bodies included."""
    graph = tf.function(function).get_concrete_function(*specs).graph.as_graph_def()
    nodes = [*graph.node, *(n for f in graph.library.function for n in f.node_def)]
    found = []
    for node in nodes:
        if node.op == "MatMul":
            spec = tf.DeviceSpec.from_string(node.device)
            found.append((node.name, f"/{spec.device_type}:{spec.device_index}"))
    return found


class TestVariables:
    def test_each_segments_variables_live_on_its_device(self):
        model = _placed()
        assert model.devices == DEVICES and model.device_cuts == ["dense1"]
        for layer in model.layers:
            for weight in layer.weights:
                assert _device(weight) == _expected_device(layer.name), weight.name

    @pytest.mark.skipif(LEGACY, reason="tf_keras variables are not moved (see test below)")
    def test_moved_variables_keep_their_values_and_keras_objects(self):
        base = _graph_layers(keras.Model)
        before = [(w, np.array(w)) for w in base.weights]
        assert {_device(w) for w, _ in before} == {DEVICES[0]}
        model = AccumulatingModel.from_model(base, devices=DEVICES, device_cuts=["dense1"])
        for (weight, value), after in zip(before, model.weights, strict=True):
            assert after is weight  # the layers keep their Keras variables
            np.testing.assert_array_equal(np.array(after), value)
        assert {_device(w) for w in model.weights} == set(DEVICES)

    @pytest.mark.skipif(not LEGACY, reason="Keras 3 moves the variables")
    def test_tf_keras_refuses_variables_created_elsewhere(self):
        with pytest.raises(ValueError, match="tf_keras cannot move.*under `with tf.device"):
            _graph_layers(devices=DEVICES, device_cuts=["dense1"])

    def test_variables_already_in_place_are_kept(self):
        base = _graph_layers(keras.Model, split_after="dense1")
        handles = [w if LEGACY else w.value for w in base.weights]
        model = AccumulatingModel.from_model(base, devices=DEVICES, device_cuts=["dense1"])
        now = [w if LEGACY else w.value for w in model.weights]
        assert all(a is b for a, b in zip(handles, now, strict=True))

    def test_optimizer_slots_live_with_their_variables(self):
        model = compile_classifier(_placed())
        slots = {v.name if LEGACY else v.path: v for v in optimizer_variables(model.optimizer)}
        for layer in model.layers:
            for weight in layer.trainable_weights:
                # Adam's two slots, named after their variable.
                if LEGACY:
                    names = [f"{kind}/{weight.name}" for kind in ("m", "v")]
                else:
                    key = weight.path.replace("/", "_")
                    names = [f"adam/{key}_{kind}" for kind in ("momentum", "velocity")]
                for name in names:
                    assert _device(slots[name]) == _expected_device(layer.name), name


class TestOperations:
    def _specs(self):
        return (tf.TensorSpec([None, 16]), tf.TensorSpec([None], tf.int64))

    @pytest.mark.parametrize("remat", [None, ["norm0", "norm2"]], ids=["placed", "with_remat"])
    def test_train_step_runs_each_segment_on_its_device(self, remat):
        model = compile_classifier(_placed(micro_batch_size=8, remat=remat))
        found = _matmuls(model.train_step, self._specs())
        forward = [n for n, _ in found if not n.startswith("gradient")]
        backward = [n for n, _ in found if n.startswith("gradient")]
        # One MatMul per Dense forward (twice when recomputed), two per Dense backward.
        assert len(forward) == (4 if remat is None else 7), forward
        assert len(backward) == 8, backward
        for name, device in found:
            assert device == _expected_device(_layer_of(name)), (name, device)

    def test_test_and_predict_steps_run_each_segment_on_its_device(self):
        model = compile_classifier(_placed(micro_batch_size=8))
        for step, specs in ((model.test_step, self._specs()), (model.predict_step, self._specs())):
            found = _matmuls(step, specs)
            assert len(found) == 4, found
            for name, device in found:
                assert device == _expected_device(_layer_of(name)), (name, device)

    def test_optimizer_updates_run_on_each_variables_device(self):
        model = compile_classifier(_placed())
        graph = tf.function(model.train_step).get_concrete_function(self._specs()).graph
        updates = [op for op in graph.get_operations() if op.type == "AssignAddVariableOp"]
        devices = [tf.DeviceSpec.from_string(op.device).device_index for op in updates]
        expected = [0, 0]
        for layer in model.layers:
            for _ in layer.trainable_weights:  # Adam: two slot updates per variable
                expected[DEVICES.index(_expected_device(layer.name))] += 2
        assert [devices.count(0), devices.count(1)] == expected, devices


class TestTraining:
    @pytest.mark.parametrize(
        "device_cuts, kwargs",
        [
            (["dense1"], {}),
            ("auto", dict(micro_batch_size=5)),  # 23 = 5+5+5+5+3: an uneven last micro-batch
            (["dense1"], dict(accumulation_steps=3, remat=["norm0", "norm2"])),
            (["dense1"], dict(micro_batch_size=5, run_eagerly=True)),
        ],
        ids=["whole_batch", "auto_uneven", "remat", "eager"],
    )
    def test_weights_equal_one_device(self, device_cuts, kwargs):
        run_eagerly = kwargs.pop("run_eagerly", False)
        model = _placed(device_cuts, **kwargs)
        weights, predictions = _train_both(model, run_eagerly=run_eagerly)
        assert_same_weights(weights, model, SAME_COMPUTATION)
        assert {_device(w) for w in model.weights} == set(DEVICES)
        if run_eagerly or "remat" in kwargs:
            return  # predict and evaluate run the same segments in every case
        x, y = _data()
        np.testing.assert_allclose(
            model.predict(x, batch_size=23, verbose=0), predictions, **SAME_COMPUTATION
        )
        # The loss of the trained weights, computed here on one device.
        logits = model(x, training=False)
        expected = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, logits)
        loss = model.evaluate(x, y, batch_size=23, verbose=0)
        np.testing.assert_allclose(loss, float(expected), rtol=1e-6)

    def test_auto_remat_keeps_a_leading_lookup_beside_placement(self):
        def model(cls, **kwargs):
            keras.utils.set_random_seed(0)
            inputs = keras.Input((8,), dtype="int32")
            x = layers.Embedding(50, 16, name="embed")(inputs)
            for i in range(2):
                x = layers.Dense(256, activation="relu", name=f"block{i}")(x)
            with tf.device(DEVICES[1]):  # tf_keras places variables where they are made
                for i in range(2, 4):
                    x = layers.Dense(256, activation="relu", name=f"block{i}")(x)
                pooled = layers.GlobalAveragePooling1D(name="pool")(x)
                outputs = layers.Dense(3, name="head")(pooled)
            model = cls(inputs, outputs, **kwargs)
            return compile_classifier(model, keras.optimizers.SGD(0.1))

        placed = model(AccumulatingModel, remat="auto", devices=DEVICES, device_cuts=["block1"],
                       micro_batch_size=8)
        # The lookup is a segment of its own, kept; each block is recomputed.
        assert placed.recomputed_segments == [[f"block{i}"] for i in range(4)]
        assert _layer_devices(placed) == {
            "embed": DEVICES[0], "block0": DEVICES[0], "block1": DEVICES[0],
            "block2": DEVICES[1], "block3": DEVICES[1], "head": DEVICES[1],
        }
        plain = model(keras.Model)
        rng = np.random.RandomState(0)
        x, y = rng.randint(0, 50, (46, 8)), rng.randint(0, 3, 46)
        for trained in (plain, placed):
            trained.fit(x, y, batch_size=23, epochs=2, shuffle=False, verbose=0)
        assert_same_weights(plain, placed, SAME_COMPUTATION)

    def test_a_cut_shared_with_remat_is_one_segment_end(self):
        model = _placed(remat=["norm0", "dense1", "norm2"])
        # Up to norm0, dense1 (also the device cut), norm2, and the head.
        assert model.recomputed_segments == [
            ["dense0", "norm0"], ["dense1"], ["norm1", "dense2", "norm2"]
        ]
        assert _layer_devices(model) == {name: _expected_device(name) for name in LAYER_NAMES}

    def test_auto_balances_memory(self):
        assert _layer_devices(_placed("auto")) == _layer_devices(_placed(["dense1"]))
        assert _partition([4, 1, 1, 1, 1], 2) == [0]  # [4] [1 1 1 1]
        assert _partition([1, 1, 1, 1, 4], 2) == [3]
        assert _partition([2, 2, 2, 2, 2, 2], 3) == [1, 3]

    @pytest.mark.skipif(LEGACY, reason="tf_keras needs the layers created on their devices")
    def test_auto_follows_a_big_layer(self):
        """The first layer holds most of the weights: it gets a device to itself."""
        inputs = keras.Input((16,))
        x = layers.Dense(512, name="big")(inputs)
        for i in range(4):
            x = layers.Dense(8, name=f"small{i}")(x)
        model = AccumulatingModel(inputs, x, devices=DEVICES)
        devices = _layer_devices(model)
        assert devices.pop("big") == DEVICES[0]
        assert set(devices.values()) == {DEVICES[1]}


class TestSetting:
    def test_config_and_keras_file_round_trip(self, tmp_path):
        model = compile_classifier(_placed(micro_batch_size=5, remat=["norm0"]))
        config = model.get_config()
        assert config["devices"] == DEVICES and config["device_cuts"] == ["dense1"]
        path = str(tmp_path / "model.keras")
        model.save(path)
        if LEGACY:
            # Loading creates the layers on the default device, and tf_keras
            # cannot move them: the error says how to build the model instead.
            with pytest.raises(ValueError, match="tf_keras cannot move"):
                keras.models.load_model(path)
            return
        loaded = keras.models.load_model(path)
        assert isinstance(loaded, AccumulatingModel)
        assert loaded.devices == DEVICES and loaded.device_cuts == ["dense1"]
        assert loaded.remat == ["norm0"]
        for layer in loaded.layers:
            for weight in layer.weights:
                assert _device(weight) == _expected_device(layer.name), weight.name
        assert_same_weights(model, loaded, SAME_COMPUTATION)

    def test_without_devices_nothing_is_placed(self):
        model = _graph_layers()
        assert model.devices is None and model.device_cuts is None
        assert set(_layer_devices(model).values()) == {DEVICES[0]}
        assert model.get_config()["devices"] is None


class TestBadInput:
    def _layers_untouched(self, **kwargs):
        """Builds with bad `kwargs` from a plain model's layers; they must not move."""
        base = _graph_layers(keras.Model)
        handles = [w if LEGACY else w.value for w in base.weights]
        with pytest.raises(ValueError) as raised:
            AccumulatingModel(base.inputs, base.outputs, **kwargs)
        now = [w if LEGACY else w.value for w in base.weights]
        assert all(a is b for a, b in zip(handles, now, strict=True))
        return str(raised.value)

    def test_unknown_layer_is_named(self):
        message = self._layers_untouched(devices=DEVICES, device_cuts=["nope"])
        assert "`device_cuts` names layer 'nope', which is not in model" in message
        assert "Received: device_cuts=['nope']" in message

    def test_layer_that_does_not_separate_is_named(self):
        message = self._layers_untouched(devices=DEVICES, device_cuts=["head"])
        assert "Layer 'head' does not separate" in message

    @pytest.mark.parametrize(
        "devices, device_cuts, match",
        [
            (["/CPU:0", "/CPU:7"], "auto", "`devices` names '/CPU:7', which is not a device"),
            (["/GPU:0"], None, "`devices` names '/GPU:0', which is not a device"),
            (["nonsense"], None, "`devices` names 'nonsense'"),
            ("/CPU:0", None, "`devices` must be a non-empty list"),
            ([], None, "`devices` must be a non-empty list"),
            (DEVICES, ["norm0", "dense1"], r"len\(devices\) - 1 distinct layer names.*1 for 2"),
            (DEVICES, [], r"len\(devices\) - 1"),
            (DEVICES, "AUTO", r"`device_cuts` must be 'auto'"),
            (None, ["dense1"], "pass `devices` too"),
        ],
    )
    def test_invalid_values_are_refused(self, devices, device_cuts, match):
        message = self._layers_untouched(devices=devices, device_cuts=device_cuts)
        assert "Received: devices=" in message
        with pytest.raises(ValueError, match=match):
            raise ValueError(message)

    def test_too_few_cut_points_for_auto(self):
        inputs = keras.Input((4,))
        model_args = (inputs, layers.Dense(3)(layers.Dense(4)(inputs)))
        with pytest.raises(ValueError, match="needs 2 cut points for 3 devices.*has 1"):
            AccumulatingModel(*model_args, devices=[*DEVICES, "/CPU:0"])

    def test_subclassed_model_is_refused(self):
        class Net(AccumulatingModel):
            def __init__(self):
                super().__init__(devices=DEVICES)

        with pytest.raises(ValueError, match="places the segments of a functional.*for Net"):
            Net()

    def test_distribution_strategy_is_refused(self, mirrored_strategy):
        with mirrored_strategy.scope():
            with pytest.raises(ValueError, match="distribution strategy.*MirroredStrategy"):
                _graph_layers(devices=DEVICES)

    def test_xla_is_refused(self):
        model = _placed()
        with pytest.raises(ValueError, match="jit_compile=True.*Received: jit_compile=True"):
            compile_classifier(model, jit_compile=True)
        compile_classifier(model, jit_compile="auto")
        assert not model.micro_batch_jit_compile
