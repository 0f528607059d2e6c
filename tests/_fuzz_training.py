"""The fuzzer's data, losses, metrics and optimizer: how a `Spec`'s model is fed and compiled.

`make_data`, `make_optimizer` and `compile_kwargs` make them for a case drawn by
`_fuzz_cases.draw`, whose model `_fuzz_models.build_model` makes.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from _fuzz_cases import CLASSES, LENGTH, VOCAB, WORDS
from _fuzz_models import MeanPenalty, Monitored, RaggedMean, SumPenalty, output_names

from keras_memopt._keras import BACKEND, LEGACY, keras

# -- the data ------------------------------------------------------------------------


def _tokens(rng, n, mask_zero):
    ids = rng.randint(1, VOCAB, size=(n, LENGTH))
    if mask_zero:
        lengths = rng.randint(2, LENGTH + 1, size=n)
        ids[np.arange(LENGTH)[None, :] >= lengths[:, None]] = 0
    return ids.astype("int32")


def _features(spec, rng, n):
    if spec.family == "dense":
        return rng.normal(size=(n, 6))
    if spec.family == "conv1d":
        return rng.normal(size=(n, 10, 3))
    if spec.family == "conv2d":
        return rng.uniform(size=(n, 6, 6, 2))
    if spec.family == "sparse":
        kept = rng.uniform(size=(n, 10)) < 0.3
        return tf.sparse.from_dense(tf.constant(kept * rng.normal(size=(n, 10))))
    if spec.family == "ragged":
        history = [rng.randint(1, VOCAB, size=rng.randint(1, 6)).tolist() for _ in range(n)]
        return {"features": rng.normal(size=(n, 5)),
                "history": tf.ragged.constant(history, dtype=tf.int32)}
    tokens = _tokens(rng, n, spec.mask_zero)
    if spec.masking:  # id i as row i - 1 of the identity, padding as zeros
        return np.eye(VOCAB)[tokens][..., 1:]
    if spec.family == "two_inputs":
        return {"features": rng.normal(size=(n, 5)), "tokens": tokens}
    return tokens


def _targets(head, rng, n, per_token, tokens):
    shape = (n, LENGTH) if per_token else (n,)
    if head.kind == "sparse":
        y = rng.randint(0, CLASSES, size=shape)
        if head.ignore_class is not None:
            y[tokens == 0] = head.ignore_class  # the padding's targets are ignored
        return y.astype("int32")
    if head.kind == "categorical":
        return np.eye(CLASSES)[rng.randint(0, CLASSES, size=shape)]
    if head.kind == "binary":
        return rng.randint(0, 2, size=(*shape, 1)).astype("float64")
    return rng.normal(size=(*shape, 1))


def make_data(spec):
    """`(x, y, fit_kwargs)`: the case's samples, targets and weights."""
    rng = np.random.RandomState(spec.seed)
    n = spec.samples
    x = _features(spec, rng, n)
    per_token = spec.family == "tagger"
    tokens = x if per_token else None
    if per_token and spec.masking:
        tokens = np.where(x.any(axis=-1), x.argmax(axis=-1) + 1, 0)
    ys = [_targets(h, rng, n, per_token, tokens) for h in spec.heads]
    names = output_names(spec)
    y = ys[0] if spec.outputs == "one" else dict(zip(names, ys, strict=True))
    if spec.outputs == "list":
        y = ys
    kwargs = {}
    shape = (n, LENGTH) if per_token else (n,)
    weights = [rng.uniform(0.1, 2.0, size=shape) for _ in spec.heads]
    per_sample = rng.uniform(0.1, 2.0, size=n) if spec.sample_weight == "sample" else None
    if spec.zero_weights:  # from a generator of their own: the other draws stay
        zeros = np.random.RandomState(spec.seed + 1)
        for w in weights if per_sample is None else [per_sample]:
            w[zeros.uniform(size=w.shape) < 0.4] = 0.0
    if spec.sample_weight == "sample":
        kwargs["sample_weight"] = per_sample
    elif spec.sample_weight == "token":
        kwargs["sample_weight"] = weights[0]
    elif spec.sample_weight == "output_dict":
        kwargs["sample_weight"] = dict(zip(names, weights, strict=True))
    elif spec.sample_weight == "output_list":
        kwargs["sample_weight"] = weights
    if spec.class_weight:
        kwargs["class_weight"] = {c: 0.5 + 0.5 * c for c in range(CLASSES)}
    if spec.strings:
        x = _words(x) if spec.family != "two_inputs" else dict(x, tokens=_words(x["tokens"]))
    if spec.listed:
        x = [x["features"], x["tokens"]]
    return x, y, kwargs


def _words(ids):
    """Token ids as the words `StringLookup(WORDS)` maps back to them ("" for 0)."""
    return tf.constant(np.array([""] + WORDS, dtype=object)[ids], tf.string)


# -- compiling and training ----------------------------------------------------------


def _loss(head, name=None):
    if name in (None, "usual"):
        return _usual_loss(head)
    if name == "none":
        return None
    if name == "string":
        return {"sparse": "sparse_categorical_crossentropy", "binary": "binary_crossentropy",
                "categorical": "categorical_crossentropy"}.get(head.kind, "mse")
    if name == "function":
        usual = _usual_loss(head)
        return lambda y_true, y_pred: usual.call(y_true, y_pred)  # per sample, unreduced
    if name == "focal":
        kind = "Binary" if head.kind == "binary" else "Categorical"
        return getattr(keras.losses, f"{kind}FocalCrossentropy")(
            gamma=2.0, from_logits=head.from_logits
        )
    if name == "dice":
        return keras.losses.Dice() if not LEGACY else soft_dice
    if name == "huber":
        return keras.losses.Huber(delta=0.5)
    classes = {"cosine": "CosineSimilarity", "log_cosh": "LogCosh", "hinge": "Hinge",
               "kl_divergence": "KLDivergence", "mean_squared_logarithmic_error":
               "MeanSquaredLogarithmicError", "mean_absolute_error": "MeanAbsoluteError"}
    return getattr(keras.losses, classes.get(name) or name.title().replace("_", ""))()


def _reduced(loss, reduction):
    """`loss` with another reduction where it is a `keras.losses.Loss` and one is given."""
    if reduction is None or not isinstance(loss, keras.losses.Loss):
        return loss
    config = loss.get_config()
    config.update(reduction=reduction)
    return type(loss).from_config(config)


def custom_objects():
    """What `keras.models.load_model` needs to revive the cases' own parts."""
    return {cls.__name__: cls for cls in (MeanPenalty, SumPenalty, RaggedMean, Monitored)} | {
        "soft_dice": soft_dice
    }


def soft_dice(y_true, y_pred):
    """A Dice loss as tf_keras users write it: one ratio of the batch's sums."""
    y_true = tf.cast(y_true, y_pred.dtype)
    overlap = tf.reduce_sum(y_true * y_pred)
    return 1.0 - 2.0 * overlap / (tf.reduce_sum(y_true) + tf.reduce_sum(y_pred) + 1e-6)


def _usual_loss(head):
    if head.kind == "sparse":
        kwargs = {} if head.ignore_class is None else dict(ignore_class=head.ignore_class)
        return keras.losses.SparseCategoricalCrossentropy(from_logits=head.from_logits, **kwargs)
    if head.kind == "categorical":
        return keras.losses.CategoricalCrossentropy(
            from_logits=head.from_logits, label_smoothing=head.label_smoothing
        )
    if head.kind == "binary":
        return keras.losses.BinaryCrossentropy(
            from_logits=head.from_logits, label_smoothing=head.label_smoothing
        )
    return keras.losses.MeanSquaredError()


@keras.saving.register_keras_serializable(package="fuzz")  # a reloaded case loads it back
def batch_mean(y_true, y_pred):
    """One scalar for the batch's outputs together, which Keras averages over batches."""
    return keras.ops.mean(y_pred) if BACKEND == "jax" else tf.reduce_mean(y_pred)


if BACKEND == "jax":
    import jax.numpy as jnp
    from keras.src.backend import get_keras_mask
    from keras.src.losses.loss import apply_mask
    from keras.src.metrics.reduction_metrics import reduce_to_samplewise_values

    class _SampleMean64:
        """Keras's `MeanMetricWrapper.update_state` (the mask, the sample weights, each
        sample's mean over its other axes, the total and the count), each sample's mean
        in its values' dtype: Keras 3.15's `Mean` takes it with `ops.mean`, which on JAX
        computes float64 in float32. A tagger's per-token cross-entropy was then summed in
        float32, in an order that XLA chooses per compiled step (seed 131 on JAX: plain
        Keras's step added each sample's 8 tokens one after another, the split step's as
        a vectorised tree; 1.6e-8 apart, plain Keras 1.6e-8 and the split step 3.5e-10
        from the float64 mean of the same predictions)."""

        def update_state(self, y_true, y_pred, sample_weight=None):
            mask = get_keras_mask(y_pred)
            values = self._fn(y_true, y_pred, **self._fn_kwargs)
            sample_weight = apply_mask(sample_weight, mask, dtype=self.dtype, reduction="sum")
            values, sample_weight = reduce_to_samplewise_values(
                values, sample_weight, reduce_fn=_mean64, dtype=self.dtype
            )
            self.total.assign_add(jnp.sum(values))
            count = values.shape[0] if values.ndim else 1
            if sample_weight is not None:
                count = jnp.sum(sample_weight)
            self.count.assign_add(jnp.asarray(count, self.dtype))

    def _mean64(x, axis):
        return jnp.mean(x, axis=tuple(axis))

    @keras.saving.register_keras_serializable(package="fuzz")
    class SparseCategoricalCrossentropy64(
        _SampleMean64, keras.metrics.SparseCategoricalCrossentropy
    ):
        """Keras's metric, each sample's mean in float64 (`_SampleMean64`)."""

    @keras.saving.register_keras_serializable(package="fuzz")
    class CategoricalCrossentropy64(_SampleMean64, keras.metrics.CategoricalCrossentropy):
        """Keras's metric, each sample's mean in float64 (`_SampleMean64`)."""

    _CROSSENTROPY = {"sparse": SparseCategoricalCrossentropy64,
                     "categorical": CategoricalCrossentropy64}
else:
    _CROSSENTROPY = {"sparse": keras.metrics.SparseCategoricalCrossentropy,
                     "categorical": keras.metrics.CategoricalCrossentropy}


def _metrics(head, more, batch_metric=False):
    if batch_metric:
        return [*_metrics(head, more), batch_mean]
    first = {"sparse": "sparse_categorical_accuracy", "categorical": "categorical_accuracy",
             "binary": "binary_accuracy"}.get(head.kind, "mae")
    if not more:
        return [first]
    # (Keras 3's top-k accuracies raise in float64: `InTopKV2` takes float32 only.)
    if head.kind in _CROSSENTROPY:
        return [first, _CROSSENTROPY[head.kind](from_logits=head.from_logits, name="crossentropy")]
    if head.kind == "binary":
        return [first, keras.metrics.AUC(
            num_thresholds=20, from_logits=head.from_logits, name="auc")]
    return [first, keras.metrics.RootMeanSquaredError(name="rmse")]


def make_optimizer(spec):
    learning_rate = 0.05
    if spec.schedule == "exponential":
        learning_rate = keras.optimizers.schedules.ExponentialDecay(0.05, 1, 0.8)
    elif spec.schedule == "piecewise":
        learning_rate = keras.optimizers.schedules.PiecewiseConstantDecay([2], [0.05, 0.01])
    return getattr(keras.optimizers, spec.optimizer)(
        learning_rate=learning_rate, **dict(spec.optimizer_options)
    )


def compile_kwargs(spec):
    names = output_names(spec)
    names_of_losses = spec.losses or (None,) * len(spec.heads)
    reductions = spec.reductions or (None,) * len(spec.heads)
    losses = [
        _reduced(_loss(h, name), reduction)
        for h, name, reduction in zip(spec.heads, names_of_losses, reductions, strict=True)
    ]
    metrics = [_metrics(h, spec.metrics, spec.batch_metric) for h in spec.heads]
    weighted = [m[:1] for m in metrics]  # the accuracy or MAE, weighted
    if spec.outputs == "one":
        kwargs = dict(loss=losses[0], metrics=metrics[0], weighted_metrics=weighted[0])
    elif spec.outputs == "dict":
        kwargs = {key: dict(zip(names, value, strict=True)) for key, value in
                  (("loss", losses), ("metrics", metrics), ("weighted_metrics", weighted))}
    else:
        kwargs = dict(loss=losses, metrics=metrics, weighted_metrics=weighted)
    if not spec.metrics:
        kwargs.pop("weighted_metrics")
    if spec.loss_weights:
        weights = [1.0, 0.3]
        kwargs["loss_weights"] = (
            dict(zip(names, weights, strict=True)) if spec.outputs == "dict" else weights
        )
    if spec.steps_per_execution > 1:
        kwargs["steps_per_execution"] = spec.steps_per_execution
    if spec.jit_compile:
        kwargs["jit_compile"] = True
    if spec.run_eagerly:
        kwargs["run_eagerly"] = True
    return kwargs
