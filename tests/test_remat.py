"""Remat and AccumulatingModel(remat=...): exact recomputation, segment choice, bad input."""

import functools
import re
import warnings

import numpy as np
import pytest
import tensorflow as tf
from conftest import LEGACY, last_json, peak_bytes_of_fit, run_python

from keras_memopt import AccumulatingModel, Remat
from keras_memopt._keras import keras
from keras_memopt._remat.segments import estimated_candidates
from keras_memopt.planning import MemoryPlanner
from keras_memopt.remat import plan_segments

layers = keras.layers

# Recomputation runs the same operations on the same values in the same
# order, so results agree to the last bit; 1e-6 leaves room for nothing else.
EXACT = dict(rtol=0, atol=1e-6)
# The allocator's step peaks of one configuration spread by this much over
# op orders (measured over processes: up to 15% on these small models).
MARGIN = 1.15


def _dropout(rate, seed, name=None):
    """A Dropout whose masks a plain (not recomputed) model reproduces.

    Keras 3 draws masks from a seed-generator variable that the tests reset;
    tf_keras's default dropout uses stateful random ops that no second model
    can reproduce, so its comparisons use its stateless dropout (the default
    kind is covered by `test_recomputation_replays_the_dropout_mask`).
    """
    if LEGACY:
        return layers.Dropout(rate, seed=seed, rng_type="stateless", name=name)
    return layers.Dropout(rate, seed=seed, name=name)


def _chain(remat=None, micro_batch_size=None, depth=4, width=32, dropout=0.3, bn=True, **kwargs):
    """A functional MLP with Dropout and BatchNormalization after each layer."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,), name="x")
    x = inputs
    for i in range(depth):
        x = layers.Dense(width, activation="relu", name=f"dense{i}")(x)
        if dropout:
            x = _dropout(dropout, seed=i, name=f"drop{i}")(x)
        if bn:
            x = layers.BatchNormalization(name=f"bn{i}")(x)
    outputs = layers.Dense(3, name="head")(x)
    return AccumulatingModel(
        inputs, outputs, remat=remat, micro_batch_size=micro_batch_size, **kwargs
    )


def _residual(blocks=4, width=16):
    """A functional model of residual blocks: only block outputs separate it."""
    inputs = keras.Input((width,))
    x = layers.Dense(width, name="stem")(inputs)
    for i in range(blocks):
        h = layers.Dense(width, activation="relu", name=f"block{i}_a")(x)
        h = layers.Dense(width, name=f"block{i}_b")(h)
        x = layers.Add(name=f"block{i}_out")([x, h])
    return AccumulatingModel(inputs, layers.Dense(3, name="head")(x), remat=None)


def _shared_chain(cls, **kwargs):
    """A chain of Dense layers in which one layer is called twice (tied weights)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    shared = layers.Dense(64, activation="tanh", name="shared")
    x = inputs
    for i in range(8):
        x = layers.Dense(64, activation="relu", name=f"dense{i}")(x)
        if i in (2, 5):
            x = shared(x)
    return cls(inputs, layers.Dense(3, name="head")(x), **kwargs)


def _data(n=64, features=16, classes=3, seed=0):
    rng = np.random.RandomState(seed)
    return rng.rand(n, features).astype("float32"), rng.randint(0, classes, n)


def _fit(model, x, y, batch_size=64, epochs=2, **compile_kwargs):
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **compile_kwargs,
    )
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model


def _assert_same_state(a, b, **tolerance):
    # `weights` include BatchNormalization's moving statistics. A list is weights.
    wa, wb = (m.get_weights() if hasattr(m, "get_weights") else m for m in (a, b))
    assert len(wa) == len(wb)
    for x, y in zip(wa, wb, strict=True):
        np.testing.assert_allclose(x, y, **(tolerance or EXACT))


class TestRemat:
    @pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
    def test_recomputation_replays_the_dropout_mask(self, graph):
        # Default Dropout on both Keras lines. The input gradient of
        # sum(c * dropout(x)) is c / (1 - rate) where the forward pass kept an
        # element and 0 where it dropped it; a recomputation that drew a new
        # mask would put gradient on dropped elements.
        layer = Remat(layers.Dropout(0.5))
        x = tf.ones((64, 32))
        c = tf.constant(np.random.RandomState(0).rand(64, 32).astype("float32") + 0.5)

        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x, training=True)
                loss = tf.reduce_sum(c * y)
            return y, tape.gradient(loss, x)

        if graph:
            step = tf.function(step)
        for _ in range(2):  # a second step draws a different mask
            y, gradient = step(x)
            kept = y.numpy() != 0
            assert 0.3 < kept.mean() < 0.7
            np.testing.assert_allclose(gradient, np.where(kept, c / 0.5, 0.0), rtol=1e-6)

    def test_a_variable_the_outputs_do_not_depend_on_gets_no_gradient(self):
        """None, as from a tape over the layer unwrapped, which the optimizer skips. A
        zero moved it with AdamW's weight decay, and overwrote Keras 3's float8 scales,
        which a float8 Dense reads in inference mode, with zero (tests/test_float8.py)."""

        class Gated(layers.Layer):  # reads a variable its output does not depend on
            def build(self, input_shape):
                self.unused = self.add_weight(name="unused", shape=(), initializer="ones")

            def call(self, x):
                return x * tf.stop_gradient(self.unused)

        def model(cls, wrap, **kwargs):
            keras.utils.set_random_seed(0)
            inputs = keras.Input((16,))
            gated = Gated()
            hidden = (Remat(gated) if wrap else gated)(layers.Dense(8)(inputs))
            model = cls(inputs, layers.Dense(3)(hidden), **kwargs)
            model.compile(
                keras.optimizers.AdamW(0.01, weight_decay=0.5),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
            return model

        x, y = _data()
        plain, recomputed = model(keras.Model, False), model(AccumulatingModel, True,
                                                                 micro_batch_size=16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # plain Keras: "Gradients do not exist for ..."
            for each in (plain, recomputed):
                each.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
        unused = [v for v in recomputed.trainable_variables if "unused" in v.name]
        assert [float(v.numpy()) for v in unused] == [1.0]
        _assert_same_state(plain, recomputed, rtol=1e-5, atol=1e-6)

    def test_gradients_equal_the_unwrapped_block(self):
        keras.utils.set_random_seed(0)
        block = keras.Sequential(
            [
                layers.Dense(32, activation="relu"),
                _dropout(0.5, seed=1),
                layers.BatchNormalization(),
                layers.Dense(8),
            ]
        )
        block.build((None, 16))
        x = tf.constant(np.random.RandomState(0).rand(32, 16).astype("float32"))
        state = [v.numpy() for v in block.variables]  # seed states included (Keras 3)

        def gradients(layer):
            for variable, value in zip(block.variables, state, strict=True):
                variable.assign(value)

            @tf.function
            def step():
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    loss = tf.reduce_sum(layer(x, training=True) ** 2)
                return tape.gradient(loss, [x, *block.trainable_variables])

            return step(), [v.numpy() for v in block.non_trainable_weights]

        (plain, plain_stats), (remat, remat_stats) = gradients(block), gradients(Remat(block))
        assert np.abs(plain[0].numpy()).max() > 0
        for a, b in zip(plain + plain_stats, remat + remat_stats, strict=True):
            np.testing.assert_allclose(a, b, **EXACT)

    def test_batchnorm_moving_statistics_update_once(self):
        layer = Remat(layers.BatchNormalization(momentum=0.5))
        x = tf.constant(np.random.RandomState(0).rand(32, 4).astype("float32") + 1.0)

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(layer(x, training=True) ** 2)
            return tape.gradient(loss, x)

        step()
        # One update from 0 with momentum 0.5 lands halfway to the batch mean;
        # a second (recomputed) update would land three quarters of the way.
        np.testing.assert_allclose(
            layer.layer.moving_mean.numpy(), 0.5 * x.numpy().mean(axis=0), rtol=1e-6
        )

    @pytest.mark.parametrize("run_eagerly", [
        pytest.param(False, id="graph"),
        # The package's recomputation has no eager path of its own: on tf_keras the
        # graph case runs the line's (replayed dropout, moving statistics updated once)
        # and `test_recomputation_replays_the_dropout_mask[eager]` a `Remat` called eagerly.
        pytest.param(True, id="eager", marks=pytest.mark.line_independent(
            reason="on tf_keras [graph] and test_recomputation_replays_the_dropout_mask[eager] "
                   "run the line's recomputation")),
    ])
    def test_subclassed_model_trains_exactly_like_unwrapped(self, run_eagerly):
        class Net(AccumulatingModel):
            def __init__(self, wrap):
                super().__init__(micro_batch_size=16)
                self.blocks = []
                for i in range(3):
                    block = keras.Sequential(
                        [
                            layers.Dense(32, activation="relu"),
                            _dropout(0.3, seed=i),
                            layers.BatchNormalization(),
                        ]
                    )
                    self.blocks.append(Remat(block) if wrap else block)
                self.head = layers.Dense(3)

            def call(self, x, training=None):
                for block in self.blocks:
                    x = block(x, training=training)
                return self.head(x)

        x, y = _data()
        models = []
        for wrap in (False, True):
            keras.utils.set_random_seed(0)
            model = Net(wrap)
            model(x[:1])
            models.append(_fit(model, x, y, run_eagerly=run_eagerly))
        _assert_same_state(*models)

    def test_peak_memory_falls(self):
        def net(wrap):
            keras.utils.set_random_seed(0)
            inputs = keras.Input((256,))
            x = inputs
            for _ in range(8):
                block = keras.Sequential(
                    [layers.Dense(256, activation="relu"), layers.Dense(256, activation="relu")]
                )
                x = (Remat(block) if wrap else block)(x)
            return AccumulatingModel(inputs, layers.Dense(1)(x))

        x = np.random.RandomState(0).rand(1024, 256).astype("float32")
        y = np.zeros((1024, 1), "float32")
        peaks = {}
        for wrap in (False, True):
            model = net(wrap)
            model.compile("sgd", "mse")
            peaks[wrap] = peak_bytes_of_fit(model, x, y, 1024, lowest_of=3)
        # 16 activations of 1 MiB each: recomputed blocks keep 8 of them.
        # TensorFlow's parallel scheduling moves the peak by up to ~15% from
        # run to run; a recomputation that saved nothing would give >= 1.
        assert peaks[True] < 0.85 * peaks[False], peaks

    def test_unbuilt_layers_in_plain_keras_fit(self):
        # The wrapped layers build on their first call (Keras builds the model
        # symbolically first); a multi-input layer gets all its arguments.
        class Attend(keras.Model):
            def __init__(self):
                super().__init__()
                self.embed = layers.Dense(8)
                self.attention = Remat(layers.MultiHeadAttention(2, 4))
                self.head = Remat(layers.Dense(3))

            def call(self, x, training=None):
                h = self.embed(x)
                h = self.attention(h, h, training=training)
                return self.head(tf.reduce_mean(h, axis=1))

        x = np.random.RandomState(0).rand(8, 5, 4).astype("float32")
        model = Attend()
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        before = None
        for _ in range(2):
            model.fit(x, np.zeros(8, "int64"), batch_size=4, verbose=0)
            after = [w.copy() for w in model.attention.get_weights()]
            if before is not None:
                assert any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))
            before = after

    def test_keras_file_round_trip(self, tmp_path):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        block = keras.Sequential([layers.Dense(8, activation="relu"), layers.Dense(8)])
        model = keras.Model(inputs, layers.Dense(2)(Remat(block, name="remat")(inputs)))
        path = str(tmp_path / "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        assert isinstance(loaded.get_layer("remat"), Remat)
        x = np.random.RandomState(0).rand(4, 8).astype("float32")
        np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))

    def test_a_keras_mask_reaches_the_wrapped_layer_and_passes_on(self):
        # Without the mask the wrapped GRU ran over the padding and the loss
        # counted it: weights 0.017 from the unwrapped model's after two steps.
        # A Dense takes no mask but passes it on. A SimpleRNN reads the mask as a
        # GRU does (Keras's `RNN`), with less to trace on tf_keras, whose GRU
        # builds a CPU and a cuDNN implementation in every traced step.
        def tagger(wrap):
            keras.utils.set_random_seed(0)
            inputs = keras.Input((10,), dtype="int32")
            x = layers.Embedding(30, 6, mask_zero=True)(inputs)
            dense = layers.Dense(6, activation="tanh")
            rnn = layers.SimpleRNN(5, return_sequences=True)
            x = (Remat(dense) if wrap else dense)(x)
            x = (Remat(rnn) if wrap else rnn)(x)
            return AccumulatingModel(inputs, layers.Dense(3)(x), micro_batch_size=4)

        rng = np.random.RandomState(0)
        x, y = rng.randint(1, 30, (8, 10)), rng.randint(0, 3, (8, 10))
        x[:, 6:] = 0
        plain, wrapped = tagger(False), tagger(True)
        wrapped.set_weights(plain.get_weights())
        losses = [_fit(m, x, y, batch_size=8).history.history["loss"] for m in (plain, wrapped)]
        np.testing.assert_allclose(losses[0], losses[1], **EXACT)
        _assert_same_state(plain, wrapped)

    @pytest.mark.parametrize("form", ["remat", "segments"])
    def test_the_recomputation_reads_the_keras_mask_of_its_inputs(self, form):
        # The backward pass recomputes from new tensors, which need the mask
        # of the forward pass's: a bidirectional RNN reads it from both ends,
        # so without it the padding counts. Here the RNN is inside a block
        # whose `call` takes no mask (`Remat`), or starts a segment.
        if form == "segments" and not LEGACY:
            pytest.skip("Keras 3's graph computes the mask from the input: no cut after it")
        initial, plain_losses, plain_weights = _plain_mask_tagger()
        recomputed = _mask_tagger(form)
        recomputed.set_weights(initial)
        losses = _fit(recomputed, *_mask_data(), batch_size=8).history.history["loss"]
        np.testing.assert_allclose(plain_losses, losses, **EXACT)
        _assert_same_state(plain_weights, recomputed)

    @pytest.mark.skipif(LEGACY, reason="the warning is Keras 3's")
    def test_segments_of_a_masked_model_raise_no_mask_warning(self):
        # Keras 3 warned at every segment that the mask "will therefore be destroyed",
        # which the segments' own layers read and pass on (the taggers' exactness).
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,), dtype="int32")
        x = layers.Embedding(20, 16, mask_zero=True)(inputs)
        x = layers.GRU(16, return_sequences=True, name="gru")(x)
        x = layers.Dense(16, name="d1")(layers.Dense(16)(x))
        model = AccumulatingModel(
            inputs, layers.Dense(3)(x), micro_batch_size=4, remat=["gru", "d1"]
        )
        model.compile("adam", "sparse_categorical_crossentropy")
        rng = np.random.RandomState(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(rng.randint(0, 20, (16, 8)), rng.randint(0, 3, (16, 8)), batch_size=8,
                      verbose=0)
        lost = [str(w.message) for w in caught if "destroy the mask" in str(w.message)]
        assert not lost, lost

    def test_refuses_what_it_cannot_recompute(self):
        with pytest.raises(TypeError, match="wraps a Keras layer.*Received: layer="):
            Remat(lambda x: x)
        regularised = layers.Dense(4, activity_regularizer="l2", name="noisy")
        with pytest.raises(ValueError, match="cannot recompute layer 'noisy'"):
            Remat(regularised)


def _mask_tagger(form=None):
    """A tagger whose `_MaskReadingBlock` is in a `Remat` (`form="remat"`), starts a
    segment (`"segments"`) or, by default, is not recomputed."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((10,), dtype="int32")
    x = layers.Embedding(30, 6, mask_zero=True, name="embedding")(inputs)
    block = _MaskReadingBlock(name="block")
    x = (Remat(block) if form == "remat" else block)(x)
    x = layers.Dense(6, activation="tanh", name="hidden")(x)
    outputs = layers.Dense(3, name="head")(x)
    remat = ["embedding", "block"] if form == "segments" else None
    return AccumulatingModel(inputs, outputs, micro_batch_size=4, remat=remat)


def _mask_data():
    rng = np.random.RandomState(0)
    x, y = rng.randint(1, 30, (8, 10)), rng.randint(0, 3, (8, 10))
    x[:, 6:] = 0
    return x, y


@functools.cache
def _plain_mask_tagger():
    """`_mask_tagger()`'s initial weights, logged losses and trained weights: what
    both recomputed forms are compared with, trained once a module (a process)."""
    plain = _mask_tagger()
    initial = plain.get_weights()
    losses = _fit(plain, *_mask_data(), batch_size=8).history.history["loss"]
    return initial, losses, plain.get_weights()


@functools.cache
def _plain_chain(micro_batch_size, run_eagerly, depth):
    """The weights of `_chain(None, micro_batch_size, depth)` after `_fit` on `_data()`:
    the recomputing chains' oracle, trained once a module (a process) for each setting."""
    model = _chain(None, micro_batch_size, depth=depth)
    return _fit(model, *_data(), run_eagerly=run_eagerly).get_weights()


class _MaskReadingBlock(layers.Layer):
    """A bidirectional RNN inside a layer whose `call` takes no mask: the RNN
    reads the Keras mask its input tensor carries (a SimpleRNN: see
    `test_a_keras_mask_reaches_the_wrapped_layer_and_passes_on`)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.rnn = layers.Bidirectional(layers.SimpleRNN(5, return_sequences=True))
        self.supports_masking = True

    def call(self, inputs):
        return self.rnn(inputs)


def _residual_auto(micro_batch_size):
    model = _residual(blocks=6)
    model.micro_batch_size = micro_batch_size
    model.remat = "auto"
    return model


class TestSegmentChoice:
    def test_auto_recomputes_segments_of_several_layers_on_a_uniform_chain(self):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((64,))
        x = inputs
        for _ in range(16):
            x = layers.Dense(64, activation="relu")(x)
        # 4096 samples: 1 MiB of activations a layer against 16 KiB of weights.
        model = AccumulatingModel(inputs, layers.Dense(64)(x), micro_batch_size=4096)
        cuts = plan_segments(model, "auto").indices
        assert 2 <= len(cuts) <= 8, cuts  # neither one segment a layer nor none
        model.remat = "auto"
        assert all(len(segment) >= 2 for segment in model.recomputed_segments)
        # The estimate it chose by is said: lower than without recomputation.
        numbers = re.findall(r"([\d.]+) MiB", model.remat_choice)
        assert float(numbers[0]) < float(numbers[1]), model.remat_choice

    def test_auto_cuts_only_where_one_tensor_separates_the_graph(self):
        model = _residual_auto(4096)
        names = [segment[-1] for segment in model.recomputed_segments]
        assert names, names
        # Inside a block the skip connection bypasses every layer.
        assert all(n == "stem" or n.endswith("_out") for n in names), names

    def test_auto_leaves_alone_a_model_whose_weights_dominate(self):
        # 8 samples through Dense(64) layers: the activations are 2 KiB each,
        # the weights and their gradient sum 200 KiB each; recomputing saves
        # 3% of the estimated step with the weights. (At width 16 the weights
        # do not dominate: they are 14 KiB and a segment per block saves 8%.)
        model = _residual(blocks=6, width=64)
        model.micro_batch_size = 8
        with pytest.warns(UserWarning, match="found nothing worth recomputing"):
            model.remat = "auto"
        assert model.recomputed_segments == []
        assert model.remat_choice.startswith("none: estimated")

    def test_auto_recomputes_nothing_where_the_step_cannot_be_traced(self, monkeypatch):
        # The trace failing is faked (a model that trains traces): the model
        # trains without recomputation, and the warning says why.
        def fail(*args, **kwargs):
            raise TypeError("a layer needs a known batch size")

        monkeypatch.setattr("keras_memopt._remat.liveness.trace", fail)
        with pytest.warns(UserWarning, match="could not be traced .*TypeError: a layer needs"):
            model = _residual_auto(4096)
        assert model.recomputed_segments == []

    def test_auto_cuts_around_a_layer_called_twice(self):
        # A shared layer's output is no cut point: Keras 3 builds no model that
        # starts at it and calls the layer again (before, the trace failed and
        # nothing was recomputed).
        model = _shared_chain(AccumulatingModel, micro_batch_size=4096)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model.remat = "auto"
        ends = [segment[-1] for segment in model.recomputed_segments]
        assert ends and "shared" not in ends, ends
        assert any(segment.count("shared") for segment in model.recomputed_segments)
        x, y = _data()
        model.micro_batch_size = 16
        plain = _fit(_shared_chain(keras.Model), x, y)
        _fit(model, x, y)
        _assert_same_state(plain, model)

    def test_summary_says_what_auto_chose_and_why(self):
        model = _residual_auto(4096)
        lines = []
        model.summary(print_fn=lambda line, *args, **kwargs: lines.append(line))
        text = "\n".join(lines)
        assert "recomputed segment(s) (remat='auto')" in text, text
        assert "remat='auto' chose a segment" in text and "without recomputation" in text, text

    @pytest.mark.slow
    def test_auto_on_keras_application_resnet(self):
        base = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
        model = AccumulatingModel.from_model(base, remat="auto")
        names = [segment[-1] for segment in model.recomputed_segments]
        assert len(names) >= 3, names
        # Block outputs (the addition or the activation after it), the stem
        # and the pooling before the head: never inside a residual block.
        assert all(
            n.endswith(("_out", "_add")) or n.startswith(("pool1", "conv1")) or n == "avg_pool"
            for n in names
        ), names


class TestSegments:
    # Several segments in a chain of four layers, where the cuts are named and at
    # auto's cuts in micro-batches; elsewhere (without micro-batches, eagerly, under
    # XLA, a strategy or mixed precision) chains of two: auto recomputes the first as
    # a segment of its own (Dense, Dropout, BatchNormalization), as each of a deeper
    # chain's, with half as much to trace.
    @pytest.mark.parametrize(
        "remat, micro_batch_size, run_eagerly, depth",
        [
            ("auto", None, False, 2),
            ("auto", 16, False, 4),
            (["bn1", "bn3"], 16, False, 4),
            ("auto", 16, True, 2),
        ],
    )
    def test_training_matches_no_recomputation(self, remat, micro_batch_size, run_eagerly, depth):
        model = _chain(remat, micro_batch_size, depth=depth)
        assert model.recomputed_segments
        _fit(model, *_data(), run_eagerly=run_eagerly)
        _assert_same_state(_plain_chain(micro_batch_size, run_eagerly, depth), model)

    def test_xla_micro_batches_match_no_recomputation(self):
        x, y = _data()
        plain = _fit(_chain(None, 16, depth=2, dropout=0), x, y, epochs=1, jit_compile=True)
        model = _fit(_chain("auto", 16, depth=2, dropout=0), x, y, epochs=1, jit_compile=True)
        assert model.micro_batch_jit_compile and model.recomputed_segments
        _assert_same_state(plain, model, rtol=1e-5, atol=1e-6)

    def test_mirrored_strategy_matches_no_recomputation(self, mirrored_strategy):
        x, y = _data()
        strategy = mirrored_strategy
        models = []
        for remat in (None, "auto"):
            with strategy.scope():
                models.append(_fit(_chain(remat, 8, depth=2), x, y, epochs=1))
        assert models[1].recomputed_segments
        _assert_same_state(*models)

    def test_auto_estimates_one_replica_under_a_strategy_as_without_one(self, mirrored_strategy):
        # tf_keras's mirrored variables have no handle outside a replica
        # context: the step was not traced there, and auto chose blind.
        def chain():
            keras.utils.set_random_seed(0)
            inputs = keras.Input((16,))
            x = inputs
            for _ in range(8):
                x = layers.Dense(256, activation="relu")(x)
            return keras.Model(inputs, layers.Dense(3)(x))

        with mirrored_strategy.scope():
            mirrored = chain()
            estimated = estimated_candidates(mirrored, 2048)
            planned = MemoryPlanner(mirrored, optimizer="sgd").estimate(2048, 512).activations
        plain = chain()
        def figures(candidates):  # the layers' names differ
            return [(description, peak) for description, _, peak in candidates]

        assert figures(estimated) == figures(estimated_candidates(plain, 2048))
        assert planned == MemoryPlanner(plain, optimizer="sgd").estimate(2048, 512).activations
        assert estimated[0][1], estimated  # the lowest estimate recomputes

    def test_mixed_precision_matches_no_recomputation(self):
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            x, y = _data()
            plain = _fit(_chain(None, 16, depth=2), x, y, epochs=1)
            model = _fit(_chain("auto", 16, depth=2), x, y, epochs=1)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        assert model.recomputed_segments
        _assert_same_state(plain, model)

    def test_peak_memory_falls_under_xla(self):
        # Without XLA: `test_setter_takes_effect_at_the_next_step`, built with it.
        x = np.random.RandomState(0).rand(2048, 16).astype("float32")
        y = np.zeros(2048, "int64")
        peaks = {}
        for remat in (None, "auto"):
            # Eight 2048x256 float32 activations (2 MiB each) dominate.
            model = _chain(remat, depth=8, width=256, dropout=0, bn=False)
            model.compile(
                "sgd",
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                jit_compile=True,
            )
            peaks[remat] = peak_bytes_of_fit(model, x, y, 2048, lowest_of=3)
        # Measured 0.24-0.85 over runs (the peak moves with TensorFlow's
        # parallel scheduling, most under XLA on tf_keras), and once 0.93 of
        # one step each in a loaded CI run (tf_keras, graph): the lowest of
        # three steps each compares the two schedules at their best. A
        # recomputation that saved nothing would give >= 1.
        assert peaks["auto"] < 0.9 * peaks[None], peaks

    def test_setting_survives_config_and_keras_file(self, tmp_path):
        model = _chain(["bn1", "bn3"], 16)
        assert model.get_config()["remat"] == ["bn1", "bn3"]
        path = str(tmp_path / "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        assert isinstance(loaded, AccumulatingModel)
        assert loaded.remat == ["bn1", "bn3"]
        assert [segment[-1] for segment in loaded.recomputed_segments] == ["bn1", "bn3"]
        auto = AccumulatingModel.from_config(_chain("auto").get_config())
        assert auto.remat == "auto"
        assert auto.recomputed_segments == _chain("auto").recomputed_segments != []

    @pytest.mark.slow
    def test_setter_takes_effect_at_the_next_step(self):
        """Built with `remat="auto"` or set on a model that has trained, the step's peak falls."""
        # In a fresh process: in the tests' shared one, what earlier tests left
        # in the allocator moved these peaks (one CI run on tf_keras: 18.38 MiB
        # after the change against 19.99 without). The lowest of three steps
        # each: the peak moves with TensorFlow's parallel scheduling.
        output = run_python(
            """
            import json, sys
            sys.path.insert(0, "tests")
            import numpy as np
            from conftest import peak_bytes_of_fit
            from test_remat import _chain
            from keras_memopt._keras import keras

            x = np.random.RandomState(0).rand(2048, 16).astype("float32")
            y = np.zeros(2048, "int64")

            def build(remat):
                model = _chain(remat, depth=8, width=256, dropout=0, bn=False)
                model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
                return model

            peaks = dict(built_with=peak_bytes_of_fit(build("auto"), x, y, 2048, lowest_of=3))
            model = build(None)
            peaks["without"] = peak_bytes_of_fit(model, x, y, 2048, lowest_of=3)
            model.remat = "auto"
            peaks["segments"] = len(model.recomputed_segments)
            peaks["set_after"] = peak_bytes_of_fit(model, x, y, 2048, lowest_of=3)
            model.remat = None
            peaks["segments_unset"] = len(model.recomputed_segments)
            peaks["unset"] = peak_bytes_of_fit(model, x, y, 2048, lowest_of=3)
            print(json.dumps(peaks))
            """
        )
        peaks = last_json(output)
        assert peaks["segments"] and not peaks["segments_unset"], peaks
        # The step traced before the change kept the old forward pass (measured
        # on the code that did: 61 MiB after the change, 56 without, 40 built
        # with it); now the change is the same as building with it (fresh
        # processes: 14.4 to 17.9 MB after the change, 13.9 to 16.9 built with
        # it, 19.8 to 23.9 without, on both Keras lines).
        assert peaks["built_with"] < 0.9 * peaks["without"], peaks
        assert peaks["set_after"] < 0.9 * peaks["without"], peaks
        assert peaks["unset"] > 1.1 * peaks["set_after"], peaks

    def test_a_segment_that_starts_with_integer_inputs_waits_for_its_gradient(self):
        """The recomputation of a segment whose only input is an Embedding's
        token ids runs after the incoming gradient exists, not during the
        forward pass (where it would keep its activations as if nothing were
        recomputed): read from the traced step, whatever the op order."""
        embedding = keras.layers.Embedding(100, 8)
        embedding.build((None, 4))

        @tf.function(autograph=False)
        def step(ids):
            with tf.GradientTape() as tape:
                outputs = Remat(embedding)(ids)
                loss = tf.reduce_sum(outputs * outputs)
            return tape.gradient(loss, embedding.trainable_variables)

        graph = step.get_concrete_function(tf.TensorSpec((None, 4), tf.int32)).graph
        lookups = [op for op in graph.get_operations()
                   if op.type in ("GatherV2", "ResourceGather")]
        assert len(lookups) == 2, lookups  # the forward pass's and the recomputation's
        waits = [any(a.type in ("Mul", "AddV2", "Fill", "OnesLike")
                     and "gradient" in a.name.lower() for a in _ancestors(op))
                 for op in lookups]
        assert waits == [False, True], [(op.name, w) for op, w in zip(lookups, waits, strict=True)]

    @pytest.mark.slow
    @pytest.mark.skipif(LEGACY, reason="tf_keras's peaks show no difference to assert (below); "
                        "the traced step's order above is checked on both lines")
    def test_a_segment_that_starts_with_integer_inputs_is_not_kept_from_the_forward_pass(self):
        # The same, measured: when the recomputation ran during the forward
        # pass, the step peaked at 50.7 MiB against 42.8 without recomputation
        # on Keras 3 (on tf_keras 51.9 against 52.2: no difference to read, so
        # there it asserted nothing and is not run). In a fresh process: what
        # earlier tests left in the allocator moves its peaks.
        output = run_python(
            """
            import numpy as np
            import tensorflow as tf
            from keras_memopt import AccumulatingModel
            from keras_memopt._keras import keras
            layers = keras.layers

            tokens = np.random.RandomState(0).randint(1, 100, (256, 32)).astype("int32")
            labels = np.zeros(256, "int64")
            for remat in (None, ["dense1", "dense3"]):
                keras.utils.set_random_seed(0)
                inputs = keras.Input((32,), dtype="int32")
                x = layers.Embedding(100, 64)(inputs)
                for i in range(4):
                    x = layers.Dense(256, activation="relu", name=f"dense{i}")(x)
                outputs = layers.Dense(3)(layers.GlobalAveragePooling1D()(x))
                model = AccumulatingModel(inputs, outputs, remat=remat)
                model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(True))
                model.fit(tokens, labels, batch_size=256, verbose=0)
                peaks = []
                for _ in range(4):  # the executor's op order varies from step to step
                    tf.config.experimental.reset_memory_stats("CPU:0")
                    start = tf.config.experimental.get_memory_info("CPU:0")["current"]
                    model.fit(tokens, labels, batch_size=256, verbose=0)
                    peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - start)
                print(min(peaks))
            """
        )
        without, cut = (int(line) for line in output.stdout.split()[-2:])
        # What recomputation saves here follows the executor's op order, which
        # moves between processes (measured with one inter-op thread: 32.4 to
        # 44.3 MiB recomputed against 43.0 without on Keras 3, 35.9 to 51.9
        # against 45.0 on tf_keras): below the forward-pass figure, not below none.
        assert cut < 1.1 * without, (cut, without)


class PostNormBlock(layers.Layer):
    """A post-norm transformer block as one custom layer (the memory floor's kind)."""

    def __init__(self, width, **kwargs):
        super().__init__(**kwargs)
        self.attention = layers.MultiHeadAttention(2, width // 2)
        self.norm1 = layers.LayerNormalization()
        self.inner = layers.Dense(4 * width, activation="gelu")
        self.outer = layers.Dense(width)
        self.norm2 = layers.LayerNormalization()

    def call(self, x):
        x = self.norm1(x + self.attention(x, x))
        return self.norm2(x + self.outer(self.inner(x)))


def _conv_block():
    return [layers.Conv2D(16, 3, padding="same", use_bias=False),
            layers.BatchNormalization(), layers.Activation("relu")]


def _family(name, form, micro_batch_size=64, transformer_blocks=3):
    """A small model of `name` with its blocks inline, each in a `Remat`, or `remat="auto"`."""
    keras.utils.set_random_seed(0)
    if name == "transformer":
        inputs = keras.Input((32,), dtype="int32")
        x = layers.Embedding(100, 32)(inputs)
        blocks = [[PostNormBlock(32)] for _ in range(transformer_blocks)]
        head = [layers.GlobalAveragePooling1D(), layers.Dense(3)]
    elif name.endswith("_stack"):  # a transformer's feed-forward half
        inputs = keras.Input((64,))
        activation = name[:-len("_stack")]
        x, blocks = inputs, [[layers.Dense(256, activation=activation)] for _ in range(6)]
        head = [layers.Dense(3)]
    else:
        inputs = keras.Input((16, 16, 3))
        x, blocks = inputs, [_conv_block() for _ in range(4)]
        head = [layers.GlobalAveragePooling2D(), layers.Dense(3)]
    for block in blocks:
        if form == "per block":
            x = Remat(block[0] if len(block) == 1 else keras.Sequential(block))(x)
        else:
            for layer in block:
                x = layer(x)
    for layer in head:
        x = layer(x)
    remat = "auto" if form == "auto" else None
    model = AccumulatingModel(inputs, x, micro_batch_size=micro_batch_size, remat=remat)
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _assert_auto_follows_the_measured_peaks(activation, found):
    """The dense stack's checks on what its child measured for `activation`."""
    measured, estimates, choice = found["measured"], found["estimates"], found["choice"]
    chosen = [name for name in estimates if choice.startswith((f"{name} (", f"{name}:"))]
    assert len(chosen) == 1, (activation, found)
    estimated = {"none": estimates["none"], "per block": estimates["a segment per block"],
                 "auto": estimates[chosen[0]]}
    for form, peak in measured.items():  # the goal
        assert 1 / 1.3 <= estimated[form] / peak <= 1.3, (activation, form, found)
    # Auto recomputes the layers a `Remat` per layer does (before: nothing).
    assert chosen == ["a segment per block"], (activation, found)
    # Their peaks differ by op order: on this 2 MiB step auto measured 1.06
    # of per block in one run and 1.18 (2.53 MB against 2.15) in a CI run.
    # The goal, 1.05 of the lower plus 1 MiB, holds both.
    lower = min(measured["none"], measured["per block"])
    assert measured["auto"] <= 1.05 * lower + 2**20, (activation, found)


class TestAutoAgainstTheObviousChoices:
    @pytest.mark.slow
    def test_auto_is_no_worse_than_none_or_a_remat_per_block(self):
        # One op at a time, the order the estimate plays, in a fresh process:
        # with TensorFlow's default threading, filter gradients run beside
        # the next layer's gradients as they come, and in one CI run auto
        # (its cuts inside blocks) peaked at 1.28 of per block in the tests'
        # shared process (benchmarks: 1.12 on a larger CNN; issue 33). Both
        # families in one process (its TensorFlow started once), each measured
        # after the last's models are gone, as each form after the one before.
        # On tf_keras auto's cuts of the transformer are checked to be those of
        # one `Remat` per block, its lookup kept (below): the measurement, 12 CPU-s
        # there, would compare nearly the same step. Keras 3 measures it.
        families = ["cnn"] if LEGACY else ["cnn", "transformer"]
        output = run_python(
            f"""
            import gc, json, sys
            sys.path.insert(0, "tests")
            import numpy as np
            import tensorflow as tf
            tf.config.threading.set_inter_op_parallelism_threads(1)
            from conftest import peak_bytes_of_fit
            from test_remat import _family

            def peaks(family):
                rng = np.random.RandomState(0)
                if family == "cnn":
                    x = rng.rand(64, 16, 16, 3).astype("float32")
                else:
                    x = rng.randint(0, 100, (64, 32))
                y = rng.randint(0, 3, 64)
                # Two transformer blocks (three elsewhere), as telling (measured: auto 0.99
                # of per block, which peaked at 0.56 of none) with a third less to trace.
                found = {{}}
                for form in ("none", "per block", "auto"):
                    found[form] = peak_bytes_of_fit(_family(family, form, transformer_blocks=2),
                                                    x, y, 64)
                    gc.collect()
                return found

            print(json.dumps({{family: peaks(family) for family in {families!r}}}))
            """
        )
        measured = last_json(output)
        assert sorted(measured) == sorted(families), measured
        for family, peaks in measured.items():
            # Same step, other op orders: the allocator's peaks of one
            # configuration spread by up to MARGIN here.
            assert peaks["auto"] <= MARGIN * min(peaks["none"], peaks["per block"]), (
                family, peaks)

    @pytest.mark.slow
    def test_auto_follows_the_measured_step_peaks_of_a_dense_stack(self):
        # Issue 55: on a GELU stack auto estimated none at half its measured
        # peak (it counted every gradient kept to the end of the step, where
        # the micro-batch loop adds each to the running sum at once), saw
        # almost no saving in a `Remat` per layer and recomputed nothing.
        # Here, before (both lines): none estimated at 0.50 to 0.52 of its
        # peak (gelu) and 0.57 to 0.59 (silu); auto, recomputing nothing,
        # 1.53 to 1.54 of per block (gelu) and 1.17 to 1.26 (silu). Four
        # micro-batches, so that the sum is there; the lowest of 3 steps'
        # peaks, one op at a time (a tf_keras CI run's highest of 3 for per
        # block, 3.09 MB, stood 0.6 MB above every step of two runs alone, 2.21
        # to 2.46 MB: something else of the process allocated in that step).
        # One activation per line past the first, in the same process: the
        # estimate reads the traced step of the line in use, which the GELU
        # stack exercises on both.
        activations = ["gelu"] if LEGACY else ["gelu", "silu"]
        output = run_python(
            f"""
            import gc, json, sys, warnings
            sys.path.insert(0, "tests")
            import numpy as np
            import tensorflow as tf
            tf.config.threading.set_inter_op_parallelism_threads(1)
            from test_remat import _family
            from keras_memopt._remat.segments import estimated_candidates

            def step_peak(model, x, y):
                model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)  # trace, warm up
                peaks = []
                for _ in range(3):
                    tf.config.experimental.reset_memory_stats("CPU:0")
                    start = tf.config.experimental.get_memory_info("CPU:0")["current"]
                    model.train_on_batch(x, y)
                    peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - start)
                return min(peaks)

            def found(activation):
                rng = np.random.RandomState(0)
                x, y = rng.rand(256, 64).astype("float32"), rng.randint(0, 3, 256)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "found nothing worth recomputing"
                    models = {{form: _family(activation + "_stack", form)
                               for form in ("none", "per block", "auto")}}
                result = dict(
                    measured={{form: step_peak(model, x, y) for form, model in models.items()}},
                    estimates={{row[0]: row[2]
                                for row in estimated_candidates(models["none"], 64)}},
                    choice=models["auto"].remat_choice)
                del models
                gc.collect()
                return result

            print(json.dumps({{activation: found(activation) for activation in {activations!r}}}))
            """
        )
        results = last_json(output)
        assert sorted(results) == sorted(activations), results
        for activation, found in results.items():
            _assert_auto_follows_the_measured_peaks(activation, found)

    def test_blocks_are_the_longest_run_of_repeated_units_before_the_head(self):
        from keras_memopt._remat.candidates import blocks

        block = [("MultiHeadAttention", "Add"), ("LayerNormalization",),
                 ("Dense", "Dense", "Add"), ("LayerNormalization",)]
        units = [("Embedding",), *block * 3, ("GlobalAveragePooling1D",), ("Dense",)]
        assert blocks(units) == (4, 8, 12)
        assert blocks([("Dense",)] * 3) == (0, 1)  # the last unit is the head
        conv = [("Conv2D",), ("BatchNormalization",), ("Activation",)]
        stages = [*conv * 2, ("MaxPooling2D",), *conv * 2, ("GlobalAveragePooling2D",), ("Dense",)]
        assert blocks(stages) == (2, 5, 9, 12)
        assert blocks([("Conv2D",), ("Dense",), ("Dense",)]) == ()
        assert blocks([("Dense",)]) == ()

    def test_auto_recomputes_each_block_of_layers_as_a_remat_would(self):
        # The blocks are repeats of the same layers; auto's cuts used to fall
        # inside them where the estimate put them a few percent lower. At
        # micro-batches of 256, where recomputing is worth its time: at 64 the
        # convolution gradients' patch buffers (two at once, with several
        # inter-op threads) outweigh the activations, and auto rightly keeps
        # them (measured: per block 70.9 MiB against none's 74.9).
        model = _family("cnn", "auto", micro_batch_size=256)
        ends = [names[-1] for names in model.recomputed_segments]
        assert ends == [layer.name for layer in model.layers
                        if isinstance(layer, layers.Activation)], model.recomputed_segments
        assert model.remat_choice.startswith("a segment per block (5 segments"), model.remat_choice

    def test_auto_recomputes_each_transformer_block_on_its_own(self):
        # What one `Remat` per block does, which no coarser cut matches: a
        # block's attention scores and feed-forward activations are far
        # larger than the tensor between blocks.
        model = _family("transformer", "auto")
        segments = model.recomputed_segments
        assert [names[-1] for names in segments if "post_norm_block" in names[-1]] == [
            layer.name for layer in model.layers if isinstance(layer, PostNormBlock)
        ], segments

    def test_auto_keeps_a_leading_embedding_lookup(self):
        # Recomputing the lookup saves one micro-batch's embedded tokens and
        # cost more: tf_keras, the benchmarks' transformer_layer at 32 with
        # one inter-op thread, peaked at 39.1 to 42.5 MiB with it in the first
        # recomputed segment, 36.1 to 37.5 with it kept (as per block).
        model = _family("transformer", "auto")
        embedding = model.layers[1]
        assert isinstance(embedding, layers.Embedding), model.layers
        segments = model.recomputed_segments
        assert segments and all(embedding.name not in names for names in segments), segments
        assert f"the lookup of layer {embedding.name!r}, a segment of its own, kept" in (
            model.remat_choice
        )

    def test_auto_with_a_kept_lookup_trains_as_plain_keras(self):
        rng = np.random.RandomState(0)
        x, y = rng.randint(0, 100, (128, 32)), rng.randint(0, 3, 128)
        model = _family("transformer", "auto", micro_batch_size=32)
        reference = _family("transformer", "none")
        plain = keras.Model(reference.inputs, reference.outputs)
        assert len(model.recomputed_segments) == 3, model.recomputed_segments
        _fit(plain, x, y, batch_size=128)
        _fit(model, x, y, batch_size=128)
        _assert_same_state(plain, model)


class TestBadInput:
    def test_unknown_layer_is_named(self):
        with pytest.raises(ValueError, match="names layer 'nope', which is not in model"):
            _chain(["bn1", "nope"])

    def test_layer_that_does_not_separate_the_graph_is_named(self):
        model = _residual()
        message = "Layer 'block1_a' does not separate.*output of layer 'block0_out' skips past"
        with pytest.raises(ValueError, match=message):
            model.remat = ["block1_a"]
        assert model.remat is None and model.recomputed_segments == []

    def test_a_layer_called_twice_is_refused(self):
        with pytest.raises(ValueError, match="'shared' is called 2 times .*remat=\\['shared'\\]"):
            _shared_chain(AccumulatingModel, remat=["shared"])

    def test_input_layer_and_output_layer_are_refused(self):
        with pytest.raises(ValueError, match="'x' is an input.*nothing before it"):
            _chain(["x"])
        with pytest.raises(ValueError, match="'head' does not separate"):
            _chain(["head"])

    @pytest.mark.parametrize("remat", ["full", [], ["bn1", "bn1"], [3], "AUTO"])
    def test_invalid_values_are_refused(self, remat):
        with pytest.raises(ValueError, match="`remat`.*Received: remat="):
            _chain(remat)

    def test_subclassed_model_is_pointed_to_the_wrapper(self):
        class Net(AccumulatingModel):
            def __init__(self):
                super().__init__(remat="auto")

        with pytest.raises(ValueError, match="wraps its blocks in `keras_memopt.Remat`"):
            Net()

    def test_nothing_to_recompute_warns_and_trains(self):
        inputs = keras.Input((4,))
        with pytest.warns(UserWarning, match="found nothing worth recomputing"):
            model = AccumulatingModel(inputs, layers.Dense(3)(inputs), remat="auto")
        assert model.recomputed_segments == []
        _fit(model, *_data(features=4))

    def test_activity_regulariser_in_a_segment_is_refused(self):
        inputs = keras.Input((4,))
        x = layers.Dense(4, activity_regularizer="l2", name="noisy")(inputs)
        x = layers.Dense(4, name="cut")(x)
        outputs = layers.Dense(2)(x)
        with pytest.raises(ValueError, match="cannot recompute layer 'noisy'"):
            AccumulatingModel(inputs, outputs, remat=["cut"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AccumulatingModel(inputs, outputs, remat="auto")
        assert model.recomputed_segments == []


    @pytest.mark.parametrize("form", ["cut", "Remat"])
    def test_a_layer_that_adds_a_loss_in_a_segment_is_refused(self, form):
        # Recomputed, the term got no gradient: training went on silently wrong.
        class Penalty(layers.Layer):
            def call(self, x):
                self.add_loss(1e-2 * tf.reduce_mean(tf.square(x)))
                return x

        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        penalty = Penalty(name="penalty")
        x = layers.Dense(4, name="first")(inputs)
        x = (Remat(penalty) if form == "Remat" else penalty)(x)
        x = layers.Dense(4, name="cut")(x)
        remat = ["cut"] if form == "cut" else None
        model = AccumulatingModel(inputs, layers.Dense(2)(x), micro_batch_size=4, remat=remat)
        model.compile("adam", "mse")
        before = [w.copy() for w in model.get_weights()]
        with pytest.raises(ValueError, match="Cannot recompute 'penalty'.*add_loss.*Received"):
            model.fit(np.ones((8, 4), "float32"), np.ones((8, 2), "float32"), verbose=0)
        for old, new in zip(before, model.get_weights(), strict=True):
            np.testing.assert_array_equal(old, new)
        assert int(model.optimizer.iterations.numpy()) == 0

    def test_auto_ends_its_segments_before_a_layer_that_adds_a_loss(self):
        # `remat="auto"` chose segments through such a layer, which the step then
        # refused: the choice must leave it (and what follows) to the last segment.
        class Penalty(layers.Layer):
            def call(self, x):
                self.add_loss(1e-2 * tf.reduce_mean(tf.square(x)))
                return x

        def chain(remat, prefix=""):
            keras.utils.set_random_seed(0)
            inputs = keras.Input((64,))
            x = inputs
            for index in range(12):
                x = layers.Dense(64, activation="relu", name=f"{prefix}dense_{index}")(x)
                if index == 7:
                    x = Penalty(name=f"{prefix}penalty")(x)
            # 4096 samples: 1 MiB of activations a layer against 16 KiB of weights.
            return AccumulatingModel(inputs, layers.Dense(2)(x), micro_batch_size=4096,
                                     remat=remat)

        model = chain("auto")
        names = [name for segment in model.recomputed_segments for name in segment]
        assert names and "penalty" not in names, model.recomputed_segments
        assert "dense_8" not in names, model.recomputed_segments
        plain = chain(None, prefix="plain_")
        x, y = np.random.RandomState(0).rand(16, 64), np.random.RandomState(1).rand(16, 2)
        for m in (plain, model):
            m.micro_batch_size = 4
            m.compile(keras.optimizers.Adam(1e-2), "mse")
            m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        _assert_same_state(plain, model)

    def test_auto_recomputes_nothing_where_the_first_layer_adds_a_loss(self):
        class Penalty(layers.Layer):
            def call(self, x):
                self.add_loss(1e-2 * tf.reduce_mean(tf.square(x)))
                return x

        inputs = keras.Input((64,))
        x = Penalty(name="penalty")(inputs)
        for index in range(6):
            x = layers.Dense(64, activation="relu", name=f"dense_{index}")(x)
        model = AccumulatingModel(inputs, layers.Dense(2)(x), micro_batch_size=4096)
        with pytest.warns(UserWarning, match="adds a loss in `call` comes before any tensor"):
            model.remat = "auto"
        assert model.recomputed_segments == []
        with pytest.raises(ValueError, match="adds a loss in `call` before its first tensor"):
            estimated_candidates(model, 4096)


def _ancestors(op):
    """Every op that `op` waits for, through data and control inputs."""
    found, stack = set(), [op]
    while stack:
        current = stack.pop()
        for source in [t.op for t in current.inputs] + list(current.control_inputs):
            if source not in found:
                found.add(source)
                stack.append(source)
    return found
