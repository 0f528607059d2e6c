"""The fuzzer's models: the layers and model a `Spec` says, made.

`build_model` makes the model of a case drawn by `_fuzz_cases.draw` (its data,
losses and optimizer: `_fuzz_training`); `arm_fault` and `fit_callbacks` add
what its run needs. `_fuzz` trains and compares it.
"""

from __future__ import annotations

import functools

import tensorflow as tf
from _faults import OutOfMemoryOnce
from _fuzz_cases import CLASSES, LENGTH, VOCAB, WORDS

from keras_memopt import AccumulatingModel, Remat
from keras_memopt._keras import BACKEND, keras

layers = keras.layers
# The cases' own layers in the backend's operations (tf_keras has no `keras.ops`).
if BACKEND == "jax":
    import jax.numpy as jnp

    # jnp's mean in its input's dtype: Keras 3.15's `ops.mean` on JAX computes float64
    # in float32 under `jax.jit` (its result cast back), so a mean `add_loss` term of
    # each micro-batch and plain Keras's of the whole batch were rounded apart (2.2e-8
    # on a loss of 1.6).
    _mean, _sum, _square = jnp.mean, keras.ops.sum, keras.ops.square
else:
    _mean, _sum, _square = tf.reduce_mean, tf.reduce_sum, tf.square
TANH = "tanh"
if BACKEND == "jax":

    @keras.saving.register_keras_serializable(package="fuzz")
    def tanh(x):
        """tanh in its input's dtype: Keras 3.15's `ops.tanh` on JAX computes float64 in
        float32 (its result dtype), which a float64 comparison at 1e-9 cannot tell from
        a float32 cast in the step."""
        return jnp.tanh(x)

    TANH = tanh

    @keras.saving.register_keras_serializable(package="fuzz")
    class LayerNormalization64(layers.LayerNormalization):
        """Keras's LayerNormalization over the last axis, its variance in its input's
        dtype: Keras 3.15's on JAX takes it from `ops.var`, which computes float64 in
        float32, and compiled, plain Keras's own predictions then differ with the batch's
        size by 1.9e-8 (seeds 1105 and 1676 on JAX, 1.2e-7 after the layer)."""

        def call(self, inputs):
            mean, variance = keras.ops.moments(inputs, axes=[-1], keepdims=True)
            outputs = (inputs - mean) * keras.ops.rsqrt(variance + self.epsilon)
            return outputs * self.gamma + self.beta

    @keras.saving.register_keras_serializable(package="fuzz")
    class MultiHeadAttention64(layers.MultiHeadAttention):
        """Keras's MultiHeadAttention through its own einsums and softmax: on JAX its fused
        path (`jax.nn.dot_product_attention`) takes the softmax in float32 whatever the
        inputs' dtype, and plain Keras's kernels then differed with the batch's size by
        5e-8 to 1e-7 (seeds 103 and 286 on JAX)."""

        def _compute_attention(self, query, key, value, attention_mask=None, training=None,
                               return_attention_scores=False, use_causal_mask=False):
            # Asking for the scores is what selects the explicit path; `call` drops them.
            return super()._compute_attention(query, key, value, attention_mask, training,
                                              True, use_causal_mask)


def _layer_normalization():
    """A LayerNormalization over the last axis (on JAX, `LayerNormalization64`)."""
    if BACKEND == "jax":
        return LayerNormalization64()
    return layers.LayerNormalization()

# The penalties' weights, comparable to the data's loss, so that a wrongly weighted
# penalty shows far above the comparison's tolerance: a float32 share of a penalty
# (at most 6e-8 off) showed at 2.6e-9 with weights of 1e-2, at 1e-8 to 3e-7 with 1.0.
# An L2 weight of 1.0 at a learning rate of 0.05 decays a kernel by a tenth per SGD step.
KERNEL_PENALTY, ACTIVITY_PENALTY, EMBEDDING_PENALTY = 1.0, 1e-2, 1.0
MEAN_PENALTY, SUM_PENALTY = 1.0, 1e-3


class MeanPenalty(layers.Layer):
    """An `add_loss` term that averages over the samples."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True

    def call(self, inputs):
        self.add_loss(MEAN_PENALTY * _mean(_square(inputs)))
        return inputs


class Monitored(layers.Layer):
    """Passes its inputs on and updates three metrics of its own with them: their
    mean (one value per call), their sum over the samples (one value) and every
    element (a tensor)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True
        self.mean = keras.metrics.Mean(name="activation_mean")
        self.sum = keras.metrics.Mean(name="activation_sum")
        self.elements = keras.metrics.Mean(name="activation_elements")

    def call(self, inputs):
        self.mean.update_state(_mean(inputs))
        self.sum.update_state(_sum(inputs))
        self.elements.update_state(inputs)
        return inputs


class RaggedMean(layers.Layer):
    """The mean embedding of a ragged row of ids (a user's variable-length history)."""

    def build(self, input_shape):
        self.table = self.add_weight(name="table", shape=(VOCAB, 6))

    def call(self, ids):
        return tf.reduce_mean(tf.ragged.map_flat_values(tf.gather, self.table, ids), axis=1)


class SumPenalty(layers.Layer):
    """An `add_loss` term that sums over the samples."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True

    def call(self, inputs):
        self.add_loss(SUM_PENALTY * _sum(inputs))
        return inputs


def _recurrent(spec, units, sequences):
    # On JAX, its tanh in float64 (`TANH`): in float32, an LSTM's outputs differed with
    # the batch's shape (seed 131's metric was another float32: `_fuzz_training._SampleMean64`).
    kwargs = dict(return_sequences=sequences, **({} if TANH == "tanh" else {"activation": TANH}))
    if spec.recurrent == "BidirectionalGRU":
        return layers.Bidirectional(layers.GRU(units, **kwargs))
    return getattr(layers, spec.recurrent)(units, **kwargs)


def _trunk(spec):
    """The trunk's layers, applied one after another (two-input and attention trunks
    are applied by `_apply`)."""
    regularizers = {}
    if spec.regularize:
        regularizers = dict(
            kernel_regularizer=keras.regularizers.L2(KERNEL_PENALTY),
            activity_regularizer=keras.regularizers.L1(ACTIVITY_PENALTY),
        )
    family = spec.family
    penalty = keras.regularizers.L2(EMBEDDING_PENALTY) if spec.embedding_penalty else None
    embedding = layers.Embedding(VOCAB, 6, mask_zero=spec.mask_zero,
                                 embeddings_regularizer=penalty)
    if spec.masking:
        embedding = layers.Masking(0.0)
    if family == "dense":
        parts = [layers.Dense(8, activation=TANH, **regularizers), _layer_normalization(),
                 layers.Dense(8, activation="relu")]
    elif family == "conv1d":
        parts = [layers.Conv1D(4, 3, activation="relu", **regularizers), layers.MaxPooling1D(2),
                 layers.Conv1D(6, 2, activation=TANH), layers.GlobalAveragePooling1D()]
    elif family == "conv2d":
        parts = [layers.Conv2D(4, 3, activation="relu", **regularizers),
                 layers.BatchNormalization(trainable=False), layers.MaxPooling2D(),
                 layers.Flatten()]
    elif family == "pooled":
        parts = [embedding, layers.GlobalAveragePooling1D(), layers.Dense(8, **regularizers)]
    elif family == "recurrent":
        parts = [embedding, _recurrent(spec, 6, sequences=False)]
    elif family == "tagger":
        parts = [embedding, _recurrent(spec, 6, sequences=True),
                 layers.Dense(8, activation=TANH, **regularizers)]
    elif family == "attention":
        attention = MultiHeadAttention64 if BACKEND == "jax" else layers.MultiHeadAttention
        parts = [embedding, attention(num_heads=2, key_dim=4),
                 _layer_normalization(), layers.GlobalAveragePooling1D()]
    elif family == "sparse":
        parts = [layers.Dense(8, activation=TANH, **regularizers), layers.Dense(8)]
    elif family == "ragged":
        parts = [RaggedMean(), layers.Concatenate(), layers.Dense(8, activation=TANH,
                                                                  **regularizers)]
    else:  # two_inputs
        parts = [embedding, layers.GlobalAveragePooling1D(), layers.Dense(6, **regularizers),
                 layers.Concatenate(), layers.Dense(8, activation=TANH)]
    if spec.add_loss:
        parts.append(MeanPenalty() if spec.add_loss == "mean" else SumPenalty())
    return parts


def _head_layer(spec, head, index):
    units = {"sparse": CLASSES, "categorical": CLASSES}.get(head.kind, 1)
    initializer = keras.initializers.RandomNormal(stddev=4.0 if head.confident else 0.3)
    constraint = {"max_norm": keras.constraints.MaxNorm(1.0),
                  "non_neg": keras.constraints.NonNeg()}.get(spec.constraint)
    return layers.Dense(
        units, activation=head.activation, kernel_initializer=initializer,
        kernel_constraint=constraint, name=output_names(spec)[index],
    )


def _pruned(layer):
    from tensorflow_model_optimization.sparsity import keras as sparsity

    schedule = sparsity.PolynomialDecay(0.0, 0.5, begin_step=0, end_step=3, frequency=1)
    return sparsity.prune_low_magnitude(layer, pruning_schedule=schedule)


def _quantized(layer):
    from tensorflow_model_optimization.quantization.keras import QuantizeWrapperV2

    return QuantizeWrapperV2(layer, _kernel_quantize_config()())


@functools.cache
def _kernel_quantize_config():
    """The fuzzer's `QuantizeConfig` class, made on first use (tfmot imports on tf_keras only)."""
    from tensorflow_model_optimization.quantization.keras import QuantizeConfig, quantizers

    class KernelQuantizer(quantizers.Quantizer):
        """tfmot's `LastValueQuantizer` (symmetric, 8 bits, narrow range) in the
        layer's own dtype: tfmot's fake-quantization ops take float32 only, and
        the fuzzer trains in float64. Training, it sets its `kernel_min` and
        `kernel_max` ranges to the kernel's extremes and rounds to 255 levels
        between them; the gradient passes straight through."""

        def build(self, tensor_shape, name, layer):
            def weight(suffix, value):
                return layer.add_weight(
                    f"{name}_{suffix}", initializer=keras.initializers.Constant(value),
                    trainable=False)

            return {"min_var": weight("min", -6.0), "max_var": weight("max", 6.0)}

        def __call__(self, inputs, training, weights, **kwargs):
            if training:
                bound = tf.maximum(tf.abs(tf.reduce_min(inputs)), tf.abs(tf.reduce_max(inputs)))
                with tf.control_dependencies([weights["min_var"].assign(-bound),
                                              weights["max_var"].assign(bound)]):
                    bound = tf.identity(bound)
            else:
                bound = weights["max_var"]
            scale = tf.maximum(bound, 1e-12) / 127.0
            rounded = tf.clip_by_value(tf.round(inputs / scale), -127.0, 127.0) * scale
            return inputs + tf.stop_gradient(rounded - inputs)

        def get_config(self):
            return {}

    class KernelQuantizeConfig(QuantizeConfig):
        """Quantizes a Dense layer's kernel only: no activation ranges, so a
        micro-batch's forward pass is the whole batch's."""

        def get_weights_and_quantizers(self, layer):
            return [(layer.kernel, KernelQuantizer())]

        def get_activations_and_quantizers(self, layer):
            return []

        def set_quantize_weights(self, layer, quantize_weights):
            layer.kernel = quantize_weights[0]

        def set_quantize_activations(self, layer, quantize_activations):
            pass

        def get_output_quantizers(self, layer):
            return []

        def get_config(self):
            return {}

    return KernelQuantizeConfig


def fit_callbacks(spec) -> list:
    """The callbacks both runs train with (`UpdatePruningStep` for a pruned case)."""
    if not spec.pruned:
        return []
    from tensorflow_model_optimization.sparsity import keras as sparsity

    return [sparsity.UpdatePruningStep()]


def output_names(spec):
    return ["first", "second"][: len(spec.heads)]


def make_layers(spec):
    heads = [_head_layer(spec, head, index) for index, head in enumerate(spec.heads)]
    if spec.pruned:
        heads = [_pruned(head) for head in heads]
    if spec.quantized:
        heads = [_quantized(head) for head in heads]
    if spec.spectral:
        # Named after the head: a list's logged figures carry the output layer's name.
        heads = [layers.SpectralNormalization(head, name=f"normalized_{head.name}")
                 for head in heads]
    trunk = _trunk(spec)
    if spec.frozen is not None:
        trunk[min(spec.frozen, len(trunk) - 1)].trainable = False
    if spec.nested:
        # A layer that adds a loss stays outside, after it (a recomputed segment
        # refuses one: its own tests).
        penalties = [layer for layer in trunk if isinstance(layer, (MeanPenalty, SumPenalty))]
        inner = [layer for layer in trunk if layer not in penalties]
        trunk = [keras.Sequential(inner, name="backbone"), *penalties]
    parts = {"trunk": trunk, "heads": heads}
    if spec.shared:
        parts["shared"] = [layers.Dense(8, activation=TANH), layers.Dense(8, activation=TANH)]
    if spec.monitored:
        parts["monitored"] = Monitored(name="monitored")
    if spec.strings:
        parts["lookup"] = layers.StringLookup(vocabulary=WORDS, mask_token="", num_oov_indices=0)
    if spec.oom_at:
        parts["fault"] = OutOfMemoryOnce(name="fault")  # armed by `arm_fault`
    return parts


def arm_fault(model, spec):
    """Sets the model's fault layer to fail at its `spec.oom_at`-th run from now (in
    training only, for float8 layers: the first step's probes run in a graph there)."""
    for layer in model._flatten_layers():
        if isinstance(layer, OutOfMemoryOnce):
            layer.at, layer.runs, layer.training_only = spec.oom_at, 0, spec.float8
            return layer
    raise ValueError(f"no fault layer in {model.name}")


def _apply(spec, parts, inputs):
    """The model's graph on `inputs` (symbolic or not), with `make_layers`'s layers."""
    trunk = parts["trunk"]
    if spec.listed:
        inputs = dict(zip(("features", "tokens"), inputs, strict=True))
    if "lookup" in parts and spec.family == "two_inputs":
        inputs = dict(inputs, tokens=parts["lookup"](inputs["tokens"]))
    elif "lookup" in parts:
        inputs = parts["lookup"](inputs)
    if spec.family == "attention":
        x = trunk[0](inputs)
        x = trunk[1](x, x)
        rest = trunk[2:]
    elif spec.family == "two_inputs":
        tokens = trunk[2](trunk[1](trunk[0](inputs["tokens"])))
        x = trunk[4](trunk[3]([tokens, inputs["features"]]))
        rest = trunk[5:]
    elif spec.family == "ragged":
        x = trunk[1]([trunk[0](inputs["history"]), inputs["features"]])
        rest = trunk[2:]
    else:
        x, rest = inputs, trunk
    for layer in rest:
        x = layer(x)
    if "shared" in parts:
        project, shared = parts["shared"]
        x = shared(shared(project(x)))
    if "monitored" in parts:
        x = parts["monitored"](x)
    if "fault" in parts:
        x = parts["fault"](x)
    results = [head(x) for head in parts["heads"]]
    if spec.outputs == "one":
        return results[0]
    if spec.outputs == "dict":
        return dict(zip(output_names(spec), results, strict=True))
    return results


def _inputs(spec):
    tokens = dict(shape=(LENGTH,), dtype="string" if spec.strings else "int32")
    if spec.family == "dense":
        return keras.Input((6,))
    if spec.family == "conv1d":
        return keras.Input((10, 3))
    if spec.family == "conv2d":
        return keras.Input((6, 6, 2))
    if spec.family == "two_inputs":
        inputs = {"features": keras.Input((5,), name="features"),
                  "tokens": keras.Input(name="tokens", **tokens)}
        return [inputs["features"], inputs["tokens"]] if spec.listed else inputs
    if spec.family == "ragged":
        return {"features": keras.Input((5,), name="features"),
                "history": keras.Input((None,), dtype="int32", ragged=True, name="history")}
    if spec.family == "sparse":
        return keras.Input((10,), sparse=True)
    if spec.masking:
        return keras.Input((LENGTH, VOCAB - 1))
    return keras.Input(**tokens)


def _subclass(base, spec):
    """A fresh subclass of `base` per model: Keras rewrites the bases of a class
    used functionally, so no class serves twice."""

    def __init__(self, **kwargs):
        base.__init__(self, **kwargs)
        parts = make_layers(spec)
        if spec.remat and base is AccumulatingModel:
            for key in {"trunk", "shared"} & parts.keys():
                parts[key] = [_wrapped(layer) for layer in parts[key]]
        self.parts = parts

    def call(self, inputs):
        return _apply(spec, self.parts, inputs)

    return type(f"Fuzzed{spec.seed}", (base,), {"__init__": __init__, "call": call})


def build_model(spec, accumulating: bool, sample_x):
    """The case's model: an `AccumulatingModel`, or plain Keras (`accumulating=False`)."""
    split = {}
    if accumulating:
        split = dict(spec.split, whole_batch_loss=spec.whole_batch_loss)
    keras.utils.set_random_seed(spec.seed)
    if spec.build == "subclassed":
        model = _subclass(AccumulatingModel if accumulating else keras.Model, spec)(**split)
        model(sample_x)  # built, so that its weights can be set
        return model
    parts = make_layers(spec)
    if spec.build == "sequential":
        before_heads = [parts[key] for key in ("monitored", "fault") if key in parts]
        lookup = [parts["lookup"]] if "lookup" in parts else []
        plain = keras.Sequential(
            [_inputs(spec), *lookup, *parts["trunk"], *before_heads, *parts["heads"]]
        )
    else:
        inputs = _inputs(spec)
        cls = AccumulatingModel if accumulating and spec.build == "functional" else keras.Model
        kwargs = split if cls is AccumulatingModel else {}
        plain = cls(inputs, _apply(spec, parts, inputs), **kwargs)
        if cls is AccumulatingModel:
            return _recomputing(plain, spec)
    if not accumulating:
        return plain
    return _recomputing(AccumulatingModel.from_model(plain, **split), spec)


def _wrapped(layer):
    """`layer` recomputed in the backward pass (`Remat`), but for a layer that adds a
    loss in `call`, which `Remat` refuses (its own tests)."""
    return layer if isinstance(layer, (MeanPenalty, SumPenalty)) else Remat(layer)


def _recomputing(model, spec):
    """`model` with a recomputed segment after every layer that separates its graph
    (the package's own reading of the graph: which cuts exist is not the oracle's
    business, what training with them computes is), or with `remat="auto"`'s."""
    if spec.remat == "auto":
        model.remat = "auto"
    elif spec.remat == "auto4096":
        # Planned at that size (set before `remat`); the case's split set back after.
        # (On JAX "auto" chooses at each setting's first step, at its own micro-batch.)
        model.accumulation_steps, model.micro_batch_size = None, 4096
        model.remat = "auto"
        model.micro_batch_size = None
        for setting, value in spec.split:
            setattr(model, setting, value)
    elif spec.remat:
        from keras_memopt._remat.graph import Graph

        graph = Graph(model)
        layers_in_order = [node[0] for node in graph.nodes]
        # A layer that adds a loss in `call` is refused in a recomputed
        # segment (its own tests): every segment ends before it.
        penalty = next((i for i, layer in enumerate(layers_in_order)
                        if isinstance(layer, (MeanPenalty, SumPenalty))), len(graph.nodes))
        cuts = [layers_in_order[i].name for i in graph.separators() if i < penalty]
        if cuts:
            model.remat = cuts
    return model
