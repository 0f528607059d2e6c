"""The fuzzer's cases: a model, its data and how it is compiled, drawn from a seed.

`draw(seed)` draws every choice of a case (`Spec`) from Keras's own parts, each
valid for plain Keras on the Keras line in use; `build_model`, `make_data`,
`make_optimizer` and `compile_kwargs` make what it says. `_fuzz` trains and
compares it.
"""

from __future__ import annotations

import dataclasses
import functools
import random

import numpy as np
import tensorflow as tf
from _faults import OutOfMemoryOnce

from keras_memopt import AccumulatingModel, Remat
from keras_memopt._keras import LEGACY, keras

layers = keras.layers

VOCAB, LENGTH, CLASSES = 12, 8, 4

LINEAR_FAMILIES = ("dense", "conv1d", "conv2d", "pooled", "recurrent", "tagger", "sparse")
FAMILIES = (*LINEAR_FAMILIES, "attention", "two_inputs", "ragged")
# Drawn with `jit_compile` sometimes: XLA compiles each micro-batch shape, which takes
# seconds for these small models and a minute for recurrent and attention ones.
JIT_FAMILIES = ("dense", "conv1d", "conv2d", "pooled")
# The families whose token ids may come as words instead (`Spec.strings`).
TOKEN_FAMILIES = ("pooled", "recurrent", "tagger", "attention", "two_inputs")
# The families whose trunk is a chain of layers, which may come as a nested model.
NESTABLE_FAMILIES = ("dense", "conv1d", "conv2d", "pooled", "recurrent", "tagger")
WORDS = [f"w{i}" for i in range(1, VOCAB)]  # id i is word `WORDS[i - 1]`; "" pads
OPTIMIZERS = [
    name
    for name in (
        "SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad", "Adadelta",
        "Adafactor", "Ftrl", "Lion", "Lamb",
    )
    # tf_keras's Nadam counts its updates in a Python integer that each trace of
    # its update advances: plain tf_keras's result depends on how often its step
    # was traced, so it is no oracle (docs/accumulation.md).
    if hasattr(keras.optimizers, name) and not (LEGACY and name == "Nadam")
]


@dataclasses.dataclass(frozen=True)
class Head:
    """One output: what it predicts and how its loss reads it."""

    kind: str  # "sparse", "categorical", "binary" or "regression"
    activation: str | None  # "softmax", "sigmoid" or None (logits)
    from_logits: bool
    confident: bool  # a large kernel: a saturated softmax or sigmoid
    ignore_class: int | None = None
    label_smoothing: float = 0.0

    def describe(self):
        text = self.kind
        if self.activation:
            text += f"+{self.activation}"
        text += "/logits" if self.from_logits else "/probs"
        if self.confident:
            text += "/confident"
        if self.ignore_class is not None:
            text += f"/ignore{self.ignore_class}"
        if self.label_smoothing:
            text += f"/smooth{self.label_smoothing}"
        return text


@dataclasses.dataclass(frozen=True)
class Spec:
    """One drawn case; `describe()` says it in a line."""

    seed: int
    family: str
    build: str  # "functional", "sequential", "subclassed" or "from_model"
    outputs: str  # "one", "dict" or "list"
    heads: tuple
    mask_zero: bool
    recurrent: str
    regularize: bool
    add_loss: str | None  # "mean" or "sum"
    sample_weight: str | None  # "sample", "token", "output_dict" or "output_list"
    class_weight: bool
    loss_weights: bool
    optimizer: str
    optimizer_options: tuple
    schedule: str | None
    samples: int
    batch_size: int
    split: tuple  # (("micro_batch_size", 4),) or (("accumulation_steps", 3),)
    whole_batch_loss: bool
    steps_per_execution: int
    jit_compile: bool
    # Recomputation: "each", a segment after every layer that separates the
    # graph, or in a subclassed model a `keras_memopt.Remat` around every trunk
    # layer; "auto", `remat="auto"`'s own choice (functional graphs); "auto4096",
    # its choice planned at a micro-batch of 4096 samples, where the activations
    # outweigh these small models' weights (at the case's own it rarely recomputes).
    remat: str | None = None
    # An out-of-memory error at the fault layer's `oom_at`-th run on more than one
    # row (before the heads), with `OOMBackoff` attached: the AccumulatingModel's
    # run backs off and retries wherever it falls (plain Keras runs no fault).
    oom_at: int | None = None
    # Both runs under `MirroredStrategy` over two logical CPUs (the oracle: plain
    # Keras at the whole batch under the same strategy).
    mirrored: bool = False
    validation: bool = False  # `fit(validation_data=...)`: its figures are compared too
    # Batches from a `tf.data.Dataset` of (x, y[, sample_weight]) instead of arrays.
    dataset: bool = False
    # The trunk layer at this index (the last where it has fewer) frozen:
    # `trainable=False` (fine-tuning's frozen embedding or feature layer).
    frozen: int | None = None
    # `keras.callbacks.LearningRateScheduler` halving the learning rate each epoch.
    lr_callback: bool = False
    # More metrics than accuracy or MAE (AUC, cross-entropy, RMSE), and `weighted_metrics`.
    metrics: bool = False
    # A second `fit` (one epoch more, `initial_epoch`) at a batch two samples
    # larger, the `AccumulatingModel`'s split changed in between.
    refit: bool = False
    # Per head, another of Keras's losses for its kind (`_loss_choices`; None or
    # "usual": the kind's usual cross-entropy or mean squared error).
    losses: tuple | None = None
    # tf_keras: the heads wrapped for magnitude pruning (tfmot's
    # `prune_low_magnitude`, 0 to 50% sparsity over three updates), trained
    # with `UpdatePruningStep`; the oracle is plain tfmot pruning.
    pruned: bool = False
    # Both runs' steps run eagerly (`compile(run_eagerly=True)`).
    run_eagerly: bool = False
    # The tokens come as words (a `tf.string` tensor, "" for padding) that a
    # `StringLookup` in the model turns into the same ids.
    strings: bool = False
    # Both models saved to a `.keras` file after their first `fit` and loaded back
    # (`keras.models.load_model`), which then go on training (a `refit`), evaluate
    # and predict: a checkpoint's resumption. The oracle is plain Keras's own round
    # trip: Keras 3.15's `Huber` saves no `delta`, so a reloaded one has another loss.
    reload: bool = False
    # Fine-tuning's second phase: before the `refit`, the frozen layer is made
    # trainable and the model compiled again with a fresh optimizer.
    unfreeze: bool = False
    # A `kernel_constraint` on the heads ("max_norm" or "non_neg"), which the
    # optimizer applies after each update.
    constraint: str | None = None
    # The Embedding with an `embeddings_regularizer`: its gradient is the
    # lookup's sparse rows plus the penalty's dense table.
    embedding_penalty: bool = False
    # Two Dense layers after the trunk, the second applied twice: shared weights,
    # whose gradient sums two uses.
    shared: bool = False
    # The trunk's layers in a `keras.Sequential` nested in the model (a backbone).
    nested: bool = False
    # A layer before the heads that updates metrics of its own in `call` (a mean, a
    # sum over the samples and every element), which `fit` and `evaluate` log.
    monitored: bool = False
    # tf_keras: the heads' kernels quantized to 8 bits in the forward pass (a tfmot
    # `QuantizeWrapperV2` with `_kernel_quantize_config`'s; the oracle is plain tf_keras
    # with the same wrappers).
    quantized: bool = False
    # A recurrent model or tagger fed float features (one-hot rows, padding all
    # zeros) through a `keras.layers.Masking` layer instead of token ids through
    # an Embedding with `mask_zero`: the same mask from another layer.
    masking: bool = False
    # About 40% of the sample weights exactly zero (samples or tokens left out of
    # the loss by weight): a micro-batch may weigh nothing at all.
    zero_weights: bool = False
    # Two inputs as a list (`[features, tokens]`; a tuple in a `tf.data.Dataset`),
    # not a dict.
    listed: bool = False
    # Each head in a `keras.layers.SpectralNormalization`, which divides its kernel
    # by its spectral norm in place in every training call.
    spectral: bool = False
    # Per head, the reduction of its loss where the loss is a `keras.losses.Loss`
    # (None: Keras's default): "sum", or on Keras 3 with `whole_batch_loss`
    # "mean_with_sample_weight" (a ratio of the batch's sums, refused without it).
    reductions: tuple | None = None
    # With `whole_batch_loss`: a metric of the batch's outputs together on every head
    # (`batch_mean`, one scalar per batch, which Keras averages over batches; refused
    # without the option: `keras_memopt._step.metric_check`).
    batch_metric: bool = False
    # Keras 3: the model's Dense layers trained in float8 (`model.quantize("float8")`),
    # whose scales and amax histories the optimizer overwrites with their "gradient".
    float8: bool = False

    def describe(self):
        parts = [
            f"seed={self.seed}", self.family, self.build, f"outputs={self.outputs}",
            "heads=" + ",".join(h.describe() for h in self.heads),
        ]
        if self.family in ("pooled", "recurrent", "tagger", "attention", "two_inputs", "ragged"):
            parts.append(f"mask_zero={self.mask_zero}")
        if self.family in ("recurrent", "tagger"):
            parts.append(self.recurrent)
        if self.remat:
            parts.append(f"remat={self.remat}")
        flags = ("regularize", "class_weight", "loss_weights", "whole_batch_loss", "jit_compile",
                 "mirrored", "validation", "dataset", "lr_callback", "metrics", "refit",
                 "pruned", "run_eagerly", "strings", "reload", "unfreeze",
                 "embedding_penalty", "shared", "nested", "monitored", "quantized",
                 "masking", "zero_weights", "listed", "spectral", "batch_metric", "float8")
        if self.oom_at:
            parts.append(f"oom_at={self.oom_at}")
        if self.frozen is not None:
            parts.append(f"frozen={self.frozen}")
        if self.constraint:
            parts.append(f"constraint={self.constraint}")
        for flag in flags:
            if getattr(self, flag):
                parts.append(flag)
        if self.add_loss:
            parts.append(f"add_loss={self.add_loss}")
        if self.sample_weight:
            parts.append(f"sample_weight={self.sample_weight}")
        if self.losses:
            parts.append("losses=" + ",".join(self.losses))
        if self.reductions:
            parts.append("reductions=" + ",".join(str(r) for r in self.reductions))
        options = ",".join(f"{k}={v}" for k, v in self.optimizer_options)
        schedule = f"+{self.schedule}" if self.schedule else ""
        parts.append(f"{self.optimizer}({options}){schedule}")
        split = ",".join(f"{k}={v}" for k, v in self.split)
        parts.append(f"n={self.samples},batch={self.batch_size},{split}")
        if self.steps_per_execution > 1:
            parts.append(f"steps_per_execution={self.steps_per_execution}")
        return " ".join(parts)


# -- drawing a case ------------------------------------------------------------------


def _draw_head(r, family):
    per_token = family == "tagger"
    kind = r.choice(["sparse", "sparse", "categorical", "binary", "regression"])
    if kind == "regression":
        return Head(kind, None, True, False)
    activation = r.choice([None, "softmax" if kind != "binary" else "sigmoid"])
    from_logits = True if activation is None else r.random() < 0.3
    ignore_class = 0 if kind == "sparse" and per_token and r.random() < 0.5 else None
    smoothing = 0.1 if kind in ("categorical", "binary") and r.random() < 0.3 else 0.0
    return Head(kind, activation, from_logits, r.random() < 0.3, ignore_class, smoothing)


PIECEWISE_LOSSES = frozenset({"hinge", "categorical_hinge", "mean_absolute_error", "huber"})
# Drawn last, on Keras 3 (see `draw`).
NEWER_OPTIMIZERS = ("Muon", "ScheduleFreeAdamW")


def _loss_choices(head, spec):
    """The other losses a head of its kind can train with (`_loss` makes them):
    "string" is the usual loss by its name (which reads probabilities),
    "function" a plain function of `(y_true, y_pred)` that calls Keras's."""
    choices = _losses_for(head, spec)
    if spec.optimizer in ("Lion", "Adafactor"):
        # Piecewise-linear losses give gradients that are sums of equal terms of
        # either sign: where they cancel to an exact zero, the rounding left is what
        # Lion's sign and Adafactor's normalisation turn into full steps, in both
        # runs differently (seed 80538: a bias 8.8e-4 apart after Keras 3's own
        # `gradient_accumulation_steps` summed two opposite batches' hinge gradients).
        choices = [c for c in choices if c not in PIECEWISE_LOSSES]
    return choices


def _losses_for(head, spec):
    probabilities = head.activation is not None and not head.from_logits
    named = ["string"] if probabilities else []
    if head.kind == "sparse":
        # A function that ignores a class itself is refused (Keras divides it by
        # the elements not ignored, which only the loss's own setting tells).
        return [*named, *([] if head.ignore_class is not None else ["function"])] or ["usual"]
    if head.kind == "categorical":
        divergences = ["kl_divergence", "poisson"] if probabilities else []
        return [*named, *divergences, "function", "focal", "categorical_hinge", "cosine"]
    if head.kind == "binary":
        # A ratio of the batch's sums: only with the loss of the whole batch.
        coupled = ["dice"] if spec.whole_batch_loss and probabilities else []
        return [*named, *coupled, "function", "focal", "hinge", "squared_hinge"]
    return ["string", "function", "mean_absolute_error", "huber", "log_cosh",
            "mean_squared_logarithmic_error"]


def _draw_optimizer(r):
    name = r.choice(OPTIMIZERS)
    options = {}
    clip = r.choice([None, None, "clipnorm", "clipvalue", "global_clipnorm"])
    if clip:
        options[clip] = 0.5
    if r.random() < 0.15:
        options["use_ema"] = True
        options["ema_momentum"] = 0.5
    schedule = r.choice([None, None, None, "exponential", "piecewise"])
    return name, tuple(sorted(options.items())), schedule


def draw(seed: int) -> Spec:
    """The case of `seed`: every choice valid for plain Keras on this Keras line."""
    r = random.Random(seed)
    family = r.choice(FAMILIES)
    outputs = r.choice(["one", "one", "dict", "list"])
    if family in ("two_inputs", "ragged") and outputs == "list":
        outputs = "dict"
    linear = family in LINEAR_FAMILIES and outputs == "one"
    builds = ["functional", "subclassed", "from_model"] + (["sequential"] if linear else [])
    build = r.choice(builds)
    heads = tuple(_draw_head(r, family) for _ in range(1 if outputs == "one" else 2))
    # Keras weighs a per-token loss by per-token weights, not per-sample ones; with
    # several outputs, one array of weights must be per sample, which no per-token
    # loss takes (each output's own weights come below).
    single = {"tagger": "token" if outputs == "one" else None}.get(family, "sample")
    sample_weights = [None, None, single]
    if outputs != "one":
        sample_weights += ["output_dict" if outputs == "dict" else "output_list"] * 2
    sparse_single = outputs == "one" and heads[0].kind == "sparse" and family != "tagger"
    batch_size = r.randint(5, 12)
    if r.random() < 0.5:
        split = (("micro_batch_size", r.randint(1, batch_size - 1)),)
    else:
        split = (("accumulation_steps", r.randint(2, 4)),)
    name, options, schedule = _draw_optimizer(r)
    sample_weight = r.choice(sample_weights)
    spec = Spec(
        seed=seed,
        family=family,
        build=build,
        outputs=outputs,
        heads=heads,
        mask_zero=r.random() < 0.6,
        recurrent=r.choice(["GRU", "LSTM", "SimpleRNN", "BidirectionalGRU"]),
        regularize=r.random() < 0.3,
        add_loss=r.choice([None, None, "mean", "sum"]),
        sample_weight=sample_weight,
        class_weight=sparse_single and r.random() < 0.25 and sample_weight is None,
        loss_weights=outputs != "one" and r.random() < 0.6,
        optimizer=name,
        optimizer_options=options,
        schedule=schedule,
        samples=2 * batch_size + r.randint(1, batch_size - 1),
        batch_size=batch_size,
        split=split,
        whole_batch_loss=r.random() < 0.15,
        steps_per_execution=r.choice([1, 1, 1, 2, 3]),
        jit_compile=family in JIT_FAMILIES and r.random() < 0.1,
    )
    # Drawn last, so that the cases drawn before it stay as they were. A
    # layer with an activity regulariser is refused in a recomputed segment
    # or `Remat` (their own tests).
    remat = "each" if not spec.regularize and r.random() < 0.3 else None
    # XLA compiles no `tf.py_function`, which the fault layer runs; a
    # micro-batch of one sample has nothing to back off to.
    faulty = not spec.jit_compile and split != (("micro_batch_size", 1),)
    oom_at = r.randint(2, 16) if faulty and r.random() < 0.3 else None
    # A strategy distributes no sparse or ragged batches of these inputs; plain
    # Keras 3 compiles no step under it with XLA on the CPU.
    mirrored = family not in ("sparse", "ragged") and not spec.jit_compile and r.random() < 0.15
    validation = r.random() < 0.2
    dataset = r.random() < 0.25
    frozen = r.randint(0, 2) if r.random() < 0.2 else None
    # A learning-rate schedule object is no variable the callback could set.
    lr_callback = spec.schedule is None and r.random() < 0.2
    spec = dataclasses.replace(
        spec, remat=remat, oom_at=oom_at, mirrored=mirrored, validation=validation,
        dataset=dataset, frozen=frozen, lr_callback=lr_callback,
        metrics=r.random() < 0.25, refit=r.random() < 0.2,
    )
    # Keras 3's optimizers accumulate gradients over updates themselves too
    # (plain Keras 3 raises with it under a strategy: `merge_call` in a graph).
    if not LEGACY and r.random() < 0.1 and not spec.mirrored:
        options = (*spec.optimizer_options, ("gradient_accumulation_steps", 2))
        spec = dataclasses.replace(spec, optimizer_options=tuple(sorted(options)))
    if r.random() < 0.3:
        # A second output may train with no loss (its metrics only).
        losses = tuple(r.choice(_loss_choices(head, spec) + ["none"] * index)
                       for index, head in enumerate(spec.heads))
        spec = dataclasses.replace(spec, losses=losses)
    # The package refuses a pruned model with `whole_batch_loss` (each micro-batch
    # would run its wrappers' updates twice) and under a strategy (its own tests);
    # tfmot's wrapper hands a masked tagger's mask to `Dense.call`, which takes none.
    masked_heads = spec.family == "tagger" and spec.mask_zero
    prunable = LEGACY and not (spec.whole_batch_loss or mirrored or masked_heads)
    if prunable and r.random() < 0.25:
        spec = dataclasses.replace(spec, pruned=True)
    # `remat="auto"` chooses from the traced step of a functional graph (a
    # layer with an activity regulariser is refused in a segment, as above).
    if spec.build != "subclassed" and not spec.regularize and r.random() < 0.25:
        spec = dataclasses.replace(spec, remat="auto")
    # Plain tf_keras run eagerly builds its optimizer at the first update, after
    # tfmot's wrappers masked the kernels in the forward pass: its EMA averages
    # start from the masked kernels, where its graph run's (and an
    # AccumulatingModel's, either way) start from the kernels (seed 91031: plain
    # eager 1.3e-3 from plain graph; the AccumulatingModel eager 5.6e-17 from it).
    ema_pruned = spec.pruned and dict(spec.optimizer_options).get("use_ema")
    if not spec.jit_compile and r.random() < 0.1 and not ema_pruned:
        spec = dataclasses.replace(spec, run_eagerly=True)
    if spec.remat == "auto" and r.random() < 0.5:
        spec = dataclasses.replace(spec, remat="auto4096")
    # XLA compiles no string lookup; plain Keras 3 distributes no string batch
    # ("Value for attr 'T' of string is not in the list of allowed values").
    wordy = spec.family in TOKEN_FAMILIES and not spec.jit_compile
    if wordy and not (mirrored and not LEGACY) and r.random() < 0.25:
        spec = dataclasses.replace(spec, strings=True)
    # Keras revives no class it was not given (the subclassed builds' are made
    # per model), and tfmot's wrappers only in its own scope; the fault layer is
    # not for saving; a loss function that closes over a loss object is saved as
    # code without it (plain Keras's round trip fails the same).
    reloadable = spec.build != "subclassed" and not spec.pruned and not spec.oom_at
    reloadable = reloadable and "function" not in (spec.losses or ())
    if reloadable and r.random() < 0.2:
        spec = dataclasses.replace(spec, reload=True, refit=True)
    if spec.frozen is not None and r.random() < 0.5:
        spec = dataclasses.replace(spec, unfreeze=True, refit=True)
    # A Sequential applies each layer once; a sparse batch is fed to the model's
    # own input only.
    spec = dataclasses.replace(
        spec, constraint=r.choice([None, None, None, None, "max_norm", "non_neg"]),
        embedding_penalty=spec.family in TOKEN_FAMILIES and r.random() < 0.25,
        shared=spec.build != "sequential" and r.random() < 0.2,
        nested=spec.family in NESTABLE_FAMILIES and r.random() < 0.2,
    )
    # Plain tf_keras builds a model under a strategy in its cross-replica context,
    # where a layer's metric refuses an update (a `SyncOnReadVariable`'s `assign_add`).
    monitored = r.random() < 0.2 and not (LEGACY and mirrored)
    spec = dataclasses.replace(spec, monitored=monitored)
    # Quantization-aware training: refused with `whole_batch_loss` and under a
    # strategy as pruning is (the same `per_update` state); not a pruned head
    # wrapped again, nor saved (the quantize config is the fuzzer's own).
    quantizable = prunable and not (spec.pruned or spec.reload)
    spec = dataclasses.replace(spec, quantized=quantizable and r.random() < 0.3)
    # Features in place of token ids: no words, and no Embedding to regularise.
    maskable = spec.family in ("recurrent", "tagger") and spec.mask_zero and not spec.strings
    if maskable and r.random() < 0.4:
        spec = dataclasses.replace(spec, masking=True, embedding_penalty=False)
    if spec.sample_weight and r.random() < 0.4:
        spec = dataclasses.replace(spec, zero_weights=True)
    if spec.family == "two_inputs" and r.random() < 0.4:
        spec = dataclasses.replace(spec, listed=True)
    # Refused with `whole_batch_loss` (a second forward pass would divide again);
    # no mask reaches a wrapper's Dense on tf_keras; no wrapper around tfmot's.
    # Plain tf_keras run eagerly is not its own graph run with one (seeds 104001 and
    # 104386: 6.0e-3 and 2.3e-2 apart; an AccumulatingModel's eager runs 5.9e-15 and
    # 1.9e-15 from it), and loads no saved functional model with one back (a
    # TypeError in `reconstruct_from_config`: seed 104164).
    normalizable = not (spec.whole_batch_loss or masked_heads or spec.pruned or spec.quantized
                        or (LEGACY and (spec.run_eagerly or spec.reload)))
    if normalizable and r.random() < 0.2:
        spec = dataclasses.replace(spec, spectral=True)
    if mirrored:
        # Plain Keras 3 under the strategy fails on a batch the replicas split
        # unevenly (an `AddN` of their parts' shapes): even batches only; and
        # with `steps_per_execution` ("You must feed a value for placeholder
        # tensor" in its loop over steps).
        batch_size = spec.batch_size + spec.batch_size % 2
        spec = dataclasses.replace(
            spec, batch_size=batch_size, samples=spec.samples // 2 * 2,
            steps_per_execution=spec.steps_per_execution if LEGACY else 1,
        )
    # Keras 3's newer optimizers in place of the one drawn. Muon orthogonalises its
    # momentum by Newton-Schulz steps from a normalised matrix: not with piecewise
    # losses, whose cancelling gradients it would turn into full steps (as Lion's sign),
    # nor with a learning-rate schedule, where plain Keras's Muon fails in float64 (a
    # float32 `Mul` with a float64 input: seeds 112041, 112084).
    newer = [name for name in NEWER_OPTIMIZERS if hasattr(keras.optimizers, name)]
    if PIECEWISE_LOSSES & set(spec.losses or ()) or spec.schedule:
        newer = [name for name in newer if name != "Muon"]
    if newer and r.random() < 0.15:
        spec = dataclasses.replace(spec, optimizer=r.choice(newer))
    if r.random() < 0.25:
        weighted = spec.whole_batch_loss and not LEGACY
        choices = [None, "sum", *(["mean_with_sample_weight"] if weighted else [])]
        spec = dataclasses.replace(spec, reductions=tuple(r.choice(choices) for _ in spec.heads))
    # Keras's endpoint-layer pattern: no output has a loss, the model trains on its
    # `add_loss` terms alone (`compile(loss=None)`). Not two such outputs under a
    # strategy on Keras 3: plain Keras then builds their loss from symbolic outputs,
    # where no term is kept, and raises "No loss to compute" (seed 122222).
    endpoint = spec.add_loss and not (spec.mirrored and not LEGACY and len(spec.heads) > 1)
    if endpoint and r.random() < 0.15:
        spec = dataclasses.replace(spec, losses=("none",) * len(spec.heads))
    # Keras 3 cannot weight a scalar metric by a tagger's mask (plain Keras raises).
    masked_tokens = not LEGACY and spec.family == "tagger" and spec.mask_zero
    if spec.whole_batch_loss and not masked_tokens and r.random() < 0.3:
        spec = dataclasses.replace(spec, batch_metric=True)
    # Not where plain Keras 3 itself raises in float8: on sparse inputs, with an
    # optimizer's EMA or its own gradient accumulation (seeds 132023, 132039, 132182),
    # and running eagerly (an eager gradient through a float8 Dense; seed 134011).
    # Nor with XLA: 9e-4 and 2e-3 from plain Keras in float64 (seeds 135269, 135002),
    # 3e-16 without it. Not analysed further; presumably XLA's fusions round
    # differently at another micro-batch's shape, which the float8 round trip of the
    # gradients (2 mantissa bits) turns into a step, as float32 does (test_float8.py).
    # Nor with a Dense called twice: plain Keras assigns the sum of the two calls'
    # new scales and histories (its tape adds them), which no fold of micro-batches
    # reproduces (seeds 132051, 132082, 132113; docs/accumulation.md).
    options = dict(spec.optimizer_options)
    float8able = not (LEGACY or spec.family == "sparse" or spec.shared or spec.run_eagerly
                      or spec.jit_compile or options.get("use_ema")
                      or options.get("gradient_accumulation_steps"))
    if float8able and r.random() < 0.15:
        spec = dataclasses.replace(spec, float8=True)
    return spec


# -- the model -----------------------------------------------------------------------


class MeanPenalty(layers.Layer):
    """An `add_loss` term that averages over the samples."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True

    def call(self, inputs):
        self.add_loss(1e-2 * tf.reduce_mean(tf.square(inputs)))
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
        self.mean.update_state(tf.reduce_mean(inputs))
        self.sum.update_state(tf.reduce_sum(inputs))
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
        self.add_loss(1e-3 * tf.reduce_sum(inputs))
        return inputs


def _recurrent(spec, units, sequences):
    if spec.recurrent == "BidirectionalGRU":
        return layers.Bidirectional(layers.GRU(units, return_sequences=sequences))
    return getattr(layers, spec.recurrent)(units, return_sequences=sequences)


def _trunk(spec):
    """The trunk's layers, applied one after another (two-input and attention trunks
    are applied by `_apply`)."""
    regularizers = {}
    if spec.regularize:
        regularizers = dict(
            kernel_regularizer=keras.regularizers.L2(1e-2),
            activity_regularizer=keras.regularizers.L1(1e-3),
        )
    family = spec.family
    penalty = keras.regularizers.L2(1e-2) if spec.embedding_penalty else None
    embedding = layers.Embedding(VOCAB, 6, mask_zero=spec.mask_zero,
                                 embeddings_regularizer=penalty)
    if spec.masking:
        embedding = layers.Masking(0.0)
    if family == "dense":
        parts = [layers.Dense(8, activation="tanh", **regularizers), layers.LayerNormalization(),
                 layers.Dense(8, activation="relu")]
    elif family == "conv1d":
        parts = [layers.Conv1D(4, 3, activation="relu", **regularizers), layers.MaxPooling1D(2),
                 layers.Conv1D(6, 2, activation="tanh"), layers.GlobalAveragePooling1D()]
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
                 layers.Dense(8, activation="tanh", **regularizers)]
    elif family == "attention":
        parts = [embedding, layers.MultiHeadAttention(num_heads=2, key_dim=4),
                 layers.LayerNormalization(), layers.GlobalAveragePooling1D()]
    elif family == "sparse":
        parts = [layers.Dense(8, activation="tanh", **regularizers), layers.Dense(8)]
    elif family == "ragged":
        parts = [RaggedMean(), layers.Concatenate(), layers.Dense(8, activation="tanh",
                                                                  **regularizers)]
    else:  # two_inputs
        parts = [embedding, layers.GlobalAveragePooling1D(), layers.Dense(6, **regularizers),
                 layers.Concatenate(), layers.Dense(8, activation="tanh")]
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
        parts["shared"] = [layers.Dense(8, activation="tanh"), layers.Dense(8, activation="tanh")]
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


def batch_mean(y_true, y_pred):
    """One scalar for the batch's outputs together, which Keras averages over batches."""
    return tf.reduce_mean(y_pred)


def _metrics(head, more, batch_metric=False):
    if batch_metric:
        return [*_metrics(head, more), batch_mean]
    first = {"sparse": "sparse_categorical_accuracy", "categorical": "categorical_accuracy",
             "binary": "binary_accuracy"}.get(head.kind, "mae")
    if not more:
        return [first]
    # (Keras 3's top-k accuracies raise in float64: `InTopKV2` takes float32 only.)
    if head.kind == "sparse":
        return [first, keras.metrics.SparseCategoricalCrossentropy(
            from_logits=head.from_logits, name="crossentropy")]
    if head.kind == "categorical":
        return [first, keras.metrics.CategoricalCrossentropy(
            from_logits=head.from_logits, name="crossentropy")]
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
