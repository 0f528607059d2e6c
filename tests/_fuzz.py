"""A differential fuzzer: models drawn from Keras's own parts, trained two ways, in float64.

Each case is a seed. `draw(seed)` draws a model from Keras's parts (Dense and
LayerNormalization stacks, Conv1D/Conv2D with pooling, Embedding with and
without `mask_zero` into pooling, GRU, LSTM or MultiHeadAttention, per-token
taggers, two inputs, one output or two as a dict or a list), how it is made
(functional, Sequential, subclassed, `from_model`), its heads (logits, or a
softmax or sigmoid activation with either `from_logits`, confident or not), its
loss and the loss's options (per-sample, per-token and per-output sample weights
as dict and list, `class_weight`, `loss_weights`, `ignore_class`, label
smoothing, masks, `add_loss`, kernel and activity regularisers), an optimizer of
`keras.optimizers` with clipping, a schedule or EMA, a batch and a micro-batch
size with uneven last ones, `steps_per_execution`, sometimes `jit_compile`, and
sometimes recomputation (`remat=` a cut after every layer that separates the
graph, or in a subclassed model `Remat` around every layer of its trunk, or
`remat="auto"`'s own choice), an out-of-memory error at the n-th run of a layer
before the heads with `OOMBackoff` attached (`_faults.OutOfMemoryOnce`; plain
Keras runs no fault), `MirroredStrategy` over two logical CPUs for both runs,
validation data in `fit`, batches from a `tf.data.Dataset`, a frozen trunk
layer, a `LearningRateScheduler` callback, more metrics (AUC, cross-entropy,
RMSE) and `weighted_metrics`, a second `fit` at another batch size and split,
per head another of Keras's losses for its kind (or none on a second output), on
Keras 3 the optimizer's own `gradient_accumulation_steps`, on tf_keras the heads
pruned by tfmot's `prune_low_magnitude`, `run_eagerly`, token ids given as
words through a `StringLookup` in the model, both models saved to a `.keras`
file after their first `fit` and loaded back to go on training, and the
frozen layer made trainable before the second `fit` with the model compiled
again (fine-tuning's second phase), a kernel constraint on the heads, an
`embeddings_regularizer`, a Dense layer called twice (shared weights), the
trunk as a `keras.Sequential` nested in the model, a layer that updates
metrics of its own in `call`, on tf_keras the heads' kernels quantized in the
forward pass (tfmot's `QuantizeWrapperV2`, quantization-aware training), a
recurrent model or tagger fed float features through a `Masking` layer, sample
weights of which about 40% are zero, two inputs as a list, each head in a
`SpectralNormalization`, on Keras 3 its `Muon` or `ScheduleFreeAdamW`, and each
head's loss summing over the batch (`reduction="sum"`) or, on Keras 3 with
`whole_batch_loss`, dividing by the sum of its weights (`"mean_with_sample_weight"`),
no loss for any output, the model trained on its `add_loss` terms alone, and on
Keras 3 its Dense layers trained in float8 (`model.quantize("float8")`).

`run(spec)` trains the model as an `AccumulatingModel` and as plain Keras at
the whole batch, from the same weights on the same batches, with
`keras.config.set_floatx("float64")`, and compares every variable,
`optimizer.iterations`, every figure `fit` logged, `evaluate`'s figures and
the predictions. In float64 an accumulated update and the whole batch's differ
by rounding only (1e-14 to 1e-16 after several Adam updates; a float32 cast
anywhere shows as 1e-8, a wrong weighting as 1e-3): the tolerance, `RTOL`, is
1e-9 relative to each variable's (or figure's) largest magnitude, or to `FLOOR`
(1e-5) where that is smaller: a figure that is zero but for rounding is held to
1e-14 apart.

The oracle is plain Keras with dense gradients (`_oracles.dense_gradients`):
Keras 3 applies an Embedding's sparse gradient slice by slice, tf_keras clips
the unsummed slices; neither is the whole batch's update.

On Keras 3's JAX backend (`KERAS_BACKEND=jax`) the oracle is plain Keras on JAX
(float64 with `jax_enable_x64`), and the draw leaves out what Keras has not there
(`_fuzz_cases`). A case that draws what the JAX line refuses
(`_fuzz_jax.jax_refusals`) trains the AccumulatingModel first and counts as
REFUSED where it raises an error that names such a feature and left the weights
and `iterations` as they were; any other error is a failure.

A case that fails within ten times plain Keras's own spread counts as ILL-CONDITIONED,
neither passed nor failed: on Keras 3, plain Keras trains once more with each gradient it
applies moved by up to float64's epsilon times its variable's largest (`_spread`),
the rounding a micro-batch's sum adds. A well-conditioned case moves about 1e-15 so; one
whose optimizer normalises a gradient that cancels to rounding (Adafactor) moves 1e-9 and
more, as the accumulation does.

Run as a script for a long sweep (`python tests/_fuzz.py --cases 300`): one
line per case and a summary (`--traceback` adds what a failing run raised);
`--seed N` replays one case, `--only FIELD` keeps the seeds whose case draws
that field (`--first 80000 --cases 400 --only reload`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
import time
import traceback
import warnings

# As the tests run (tests/conftest.py), when run as a script.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _fuzz_cases import Spec, draw  # noqa: E402
from _fuzz_jax import jax_refusals  # noqa: E402
from _fuzz_models import arm_fault, build_model, fit_callbacks  # noqa: E402
from _fuzz_training import compile_kwargs, custom_objects, make_data, make_optimizer  # noqa: E402
from _oracles import build_first, dense_gradients  # noqa: E402

from keras_memopt._keras import BACKEND, LEGACY, keras  # noqa: E402
from keras_memopt.callbacks import OOMBackoff  # noqa: E402

if BACKEND == "jax":  # float64 on JAX, before any array is made
    import jax

    jax.config.update("jax_enable_x64", True)

RTOL = 1e-9
FLOOR = 1e-5
EPOCHS = 2


@contextlib.contextmanager
def float64():
    """Keras's default float type is float64 inside (layers, losses, metrics).

    The global dtype policy is set too: once a test has set one (float32 after
    a mixed-precision test), layers follow it, not `floatx`.
    """
    before = keras.backend.floatx(), keras.mixed_precision.global_policy().name
    keras.backend.set_floatx("float64")
    keras.mixed_precision.set_global_policy("float64")
    try:
        yield
    finally:
        keras.backend.set_floatx(before[0])
        keras.mixed_precision.set_global_policy(before[1])


@dataclasses.dataclass
class Run:
    """What one training of a case left: every figure to compare."""

    initial: list  # the weights it started from
    variables: dict
    iterations: int
    history: dict
    evaluation: dict
    predictions: list
    raised: int = 0  # the out-of-memory errors its fault layer raised (and it backed off from)
    segments: int = 0  # the segments it recomputed


def _first_rows(x, count=2):
    def first(a):
        if isinstance(a, tf.SparseTensor):
            rows = tf.sparse.slice(a, [0, 0], [count, a.dense_shape[1]])
            # A model on JAX is called on no `tf.SparseTensor`: dense rows build it alike.
            return tf.sparse.to_dense(rows).numpy() if BACKEND == "jax" else rows
        return a[:count]

    return tf.nest.map_structure(first, x)


def train(spec, accumulating: bool, initial=None) -> Run:
    """Fits the case's model one way, from `initial` weights where given; returns what it left."""
    x, y, fit_kwargs = make_data(spec)
    model = build_model(spec, accumulating, _first_rows(x))
    if initial is not None:
        model.set_weights(initial)
    initial = model.get_weights()
    if spec.float8:
        model.quantize("float8")
    _compile(model, spec, accumulating)
    callbacks, fault = fit_callbacks(spec), None
    if spec.lr_callback:
        callbacks.append(keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate * 0.5))
    if accumulating and spec.oom_at:
        fault = arm_fault(model, spec)
        callbacks.append(OOMBackoff(verbose=0))
    weights = [fit_kwargs.pop("sample_weight")] if "sample_weight" in fit_kwargs else []
    labelled, unlabelled = _feed(spec, x, y, weights, spec.batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if spec.validation:
            validation = labelled["x"] if spec.dataset else (x, y, *weights)
            fit_kwargs = dict(fit_kwargs, validation_data=validation)
        history = _fit(
            model, **labelled, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks,
            **fit_kwargs,
        ).history
        if spec.reload:
            model = _reloaded(model, accumulating)
        if spec.refit:
            if spec.unfreeze:
                _unfreeze(model, spec, accumulating)
            if accumulating:
                (setting, value), = spec.split
                if setting == "accumulation_steps":
                    model.micro_batch_size = None  # where `OOMBackoff` set one
                setattr(model, setting, value + 1)
            more = _fit(
                model, **_feed(spec, x, y, weights, spec.batch_size + 2)[0], epochs=EPOCHS + 1,
                initial_epoch=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks,
                **fit_kwargs,
            )
            history = dict(history, **{f"refit {k}": v for k, v in more.history.items()})
        evaluation = model.evaluate(
            **labelled, verbose=0, return_dict=True, callbacks=callbacks
        )
        predictions = model.predict(**unlabelled, verbose=0, callbacks=callbacks)
    if fault is not None:
        # The callback's own figure: the micro-batch in use (plain Keras has none).
        history = {k: v for k, v in history.items() if not k.endswith("micro_batch_size")}
    return Run(
        initial=initial,
        variables={_name(v, i): np.asarray(v) for i, v in enumerate(model.weights)},
        iterations=int(_value(model.optimizer.iterations)),
        history=history,
        evaluation=dict(evaluation),
        predictions=[np.asarray(p) for p in tf.nest.flatten(predictions)],
        raised=fault.raised if fault is not None else 0,
        segments=len(getattr(model, "recomputed_segments", ())),
    )


def _fit(model, **kwargs):
    """`model.fit(**kwargs)`; what it raises says whether it left the model's weights and
    its optimizer's count of updates as they were (`untouched`: a refusal must)."""
    before = _trace_of(model)
    try:
        return model.fit(**kwargs)
    except Exception as error:
        try:
            after = _trace_of(model)
        except Exception:  # noqa: BLE001 - a variable left unreadable (Keras's JAX state)
            after = None
        error.untouched = after is not None and len(before) == len(after) and all(
            np.array_equal(a, b, equal_nan=True) for a, b in zip(before, after, strict=True))
        raise


def _trace_of(model):
    """What an update changes: the model's weights and its optimizer's `iterations`."""
    iterations = getattr(model.optimizer, "iterations", None)
    counts = [] if iterations is None else [_value(iterations)]
    return [np.array(v) for v in model.weights] + counts


def _value(variable):
    """A variable's value as an array: its `numpy()` where it has one (under a strategy,
    tf_keras's mirrored count has no array interface), else `np.asarray` (a JAX array,
    as Keras's `iterations` is with `gradient_accumulation_steps` on JAX)."""
    read = getattr(variable, "numpy", None)
    return np.asarray(read() if read is not None else variable)


def _reloaded(model, accumulating):
    """`model` saved to a `.keras` file and loaded back (the oracle's optimizer
    applying dense gradients again: the wrapper is no saved object)."""
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "model.keras")
        model.save(path)
        # A loss given as a Python function is saved as its code.
        model = keras.models.load_model(path, custom_objects=custom_objects(), safe_mode=False)
    if not accumulating:
        dense_gradients(model.optimizer)
    return model


def _compile(model, spec, accumulating):
    """Compiles `model` with a fresh optimizer; plain Keras's is the oracle's
    (`_oracles`: dense gradients, built before `fit`)."""
    optimizer = make_optimizer(spec)
    if not accumulating:
        optimizer = dense_gradients(optimizer)
    model.compile(optimizer=optimizer, **compile_kwargs(spec))
    if not accumulating:
        build_first(model)


def _unfreeze(model, spec, accumulating):
    """Makes the frozen layers trainable and compiles `model` again with a fresh
    optimizer, as fine-tuning's second phase does.

    A BatchNormalization stays frozen: training, it normalises each micro-batch by
    its own statistics, which no whole-batch oracle computes (docs/accumulation.md).
    """
    for layer in model._flatten_layers():
        if not layer.trainable and not isinstance(layer, keras.layers.BatchNormalization):
            layer.trainable = True
    _compile(model, spec, accumulating)


def _feed(spec, x, y, weights, batch_size):
    """The keyword arguments that pass the samples with their targets (and sample
    `weights`, a list of none or one) to `fit` and `evaluate`, and without to
    `predict`: arrays with `batch_size`, or a `tf.data.Dataset` in such batches."""
    if not spec.dataset:
        labelled = dict(x=x, y=y, batch_size=batch_size)
        if weights:
            labelled["sample_weight"] = weights[0]
        return labelled, dict(x=x, batch_size=batch_size)

    def batched(*parts):
        # A list of arrays would be stacked into one tensor: a tuple stays a structure.
        parts = tuple(tuple(p) if isinstance(p, list) else p for p in parts)
        # A lone tuple of inputs stays in one: Keras would read two as (x, y).
        lone = len(parts) == 1 and not isinstance(parts[0], tuple)
        data = tf.data.Dataset.from_tensor_slices(parts[0] if lone else parts)
        return data.batch(batch_size)

    return dict(x=batched(x, y, *weights)), dict(x=batched(x))


def _name(variable, index):
    return f"{index}:{getattr(variable, 'path', None) or variable.name}"


# -- the comparison ------------------------------------------------------------------


def _zero_gradient(name):
    """Variables whose exact gradient is zero, left out of the comparison.

    An attention layer's key bias shifts every logit of a softmax row by the
    same amount, which the softmax ignores: its gradient is zero, and what is
    computed is rounding, which Lion (a sign) and Adafactor (a normalisation)
    turn into full steps in both runs, differently.
    """
    return "/key/bias" in name or "key/bias" in name.replace("_", "/")


def relative_error(expected, received) -> float:
    """The largest difference relative to the largest magnitude of `expected`; below
    `FLOOR` in magnitude, relative to `FLOOR`: a figure that is zero but for rounding
    (a layer's metric of the sum of a frozen LayerNormalization's outputs, about 1e-16,
    seed 107055) is held to 1e-14 apart, not to 1e-9 of its rounding."""
    expected, received = np.asarray(expected, "float64"), np.asarray(received, "float64")
    if expected.shape != received.shape:
        return float("inf")
    if not np.array_equal(np.isnan(expected), np.isnan(received)):
        return float("inf")
    finite = ~np.isnan(expected)
    if not finite.any():
        return 0.0
    expected, received = expected[finite], received[finite]
    scale = max(float(np.max(np.abs(expected))), FLOOR)
    return float(np.max(np.abs(expected - received))) / scale


def differences(expected: Run, received: Run) -> dict:
    """Every compared figure's relative error; `inf` where one is missing."""
    errors = {}
    names = list(expected.variables)
    if len(names) != len(received.variables):
        errors["number of variables"] = float("inf")
    for a, b in zip(names, received.variables, strict=False):
        if not _zero_gradient(a):
            errors[f"variable {a}"] = relative_error(expected.variables[a], received.variables[b])
    errors["iterations"] = 0.0 if expected.iterations == received.iterations else float("inf")
    for what, first, second in (
        ("fit", expected.history, received.history),
        ("evaluate", expected.evaluation, received.evaluation),
    ):
        for key in set(first) | set(second):
            if key not in first or key not in second:
                errors[f"{what} {key}"] = float("inf")
            else:
                errors[f"{what} {key}"] = relative_error(first[key], second[key])
    for index, (a, b) in enumerate(zip(expected.predictions, received.predictions, strict=False)):
        errors[f"predict {index}"] = relative_error(a, b)
    return errors


@dataclasses.dataclass
class Result:
    spec: Spec
    worst: float  # the largest relative error (inf: a figure missing)
    failures: dict  # figures over RTOL
    error: str | None = None  # what AccumulatingModel raised
    seconds: float = 0.0
    invalid: str | None = None  # what plain Keras raised: a case the generator should not draw
    raised: int = 0  # out-of-memory errors injected in the AccumulatingModel's run
    segments: int = 0  # the segments the AccumulatingModel's run recomputed
    trace: str | None = None  # the traceback of what either run raised
    # What AccumulatingModel refused (on JAX), naming a feature the case draws, and
    # before any update: counted apart, neither a pass nor a failure.
    refused: str | None = None
    # A failure within ten times plain Keras's own spread under a rounding of its initial
    # weights (`_spread`): that spread. Counted apart, neither a pass nor a failure.
    ill_conditioned: float | None = None

    @property
    def passed(self):
        return (self.error is None and self.invalid is None and self.refused is None
                and not self.failures)

    def line(self):
        status = "PASS" if self.passed else ("INVALID" if self.invalid else "FAIL")
        status = "REFUSED" if self.refused else status
        status = "ILL-CONDITIONED" if self.ill_conditioned is not None else status
        detail = f"worst={self.worst:.1e}"
        if self.spec.oom_at:
            detail += f" backed off {self.raised}x"
        if self.spec.remat:
            detail += f" recomputed {self.segments} segment(s)"
        if self.invalid:
            detail = f"plain Keras raised {self.invalid}"
        elif self.refused:
            detail = f"refused {self.refused}"
        elif self.error:
            detail = f"raised {self.error}"
        elif self.failures:
            shown = sorted(self.failures.items(), key=lambda kv: -kv[1])[:3]
            detail += " " + "; ".join(f"{k}: {v:.1e}" for k, v in shown)
        if self.ill_conditioned is not None:
            detail += f"; plain Keras's own spread {self.ill_conditioned:.1e}"
        return f"{status} {self.seconds:5.1f}s {self.spec.describe()} | {detail}"


def mirrored_strategy():
    """The process's `MirroredStrategy` over two logical CPUs (made once: strategies
    made one after another can hand out clashing collective keys on tf_keras)."""
    global _STRATEGY
    if _STRATEGY is None:
        _STRATEGY = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    return _STRATEGY


_STRATEGY = None


def run(spec: Spec, strategy=None) -> Result:
    """Trains the case both ways in float64 and compares them (under `strategy`, or
    the process's own `mirrored_strategy()`, where the case draws one)."""
    started = time.perf_counter()
    with float64(), contextlib.ExitStack() as stack:
        keras.backend.clear_session()  # before the scope: it resets the graph the scope is on
        if spec.mirrored:
            stack.enter_context((strategy or mirrored_strategy()).scope())
        received = None
        if jax_refusals(spec):
            # On JAX, a case that draws what the JAX line refuses trains the
            # AccumulatingModel first: a refusal needs no oracle (it stops that run).
            try:
                received = train(spec, accumulating=True)
            except Exception as error:  # noqa: BLE001 - a refusal, or run again below
                if _refusal(spec, error):
                    return Result(spec, float("inf"), {}, None, time.perf_counter() - started,
                                  refused=_refusal(spec, error), trace=traceback.format_exc())
        try:
            expected = train(spec, accumulating=False, initial=received and received.initial)
        except Exception as error:  # noqa: BLE001 - reported: the generator's to mend
            seconds = time.perf_counter() - started
            return Result(spec, float("inf"), {}, None, seconds, invalid=_summary(error),
                          trace=traceback.format_exc())
        try:
            received = received or train(spec, accumulating=True, initial=expected.initial)
        except Exception as error:  # noqa: BLE001 - a case's failure, reported
            seconds, refused = time.perf_counter() - started, _refusal(spec, error)
            return Result(spec, float("inf"), {}, None if refused else _summary(error), seconds,
                          refused=refused, trace=traceback.format_exc())
        errors = differences(expected, received)
        failures = {k: v for k, v in errors.items() if not v <= RTOL}
        worst = max(errors.values(), default=0.0)
        spread = _spread(spec, expected) if failures and worst < float("inf") else None
    seconds = time.perf_counter() - started
    return Result(spec, worst, failures, None, seconds, raised=received.raised,
                  segments=received.segments,
                  ill_conditioned=spread if spread is not None and worst <= 10 * spread else None)


def _spread(spec, expected: Run) -> float | None:
    """How far plain Keras's own run moves when each gradient it applies moves by up to
    float64's epsilon times its variable's largest (`_nudged`): the rounding a
    micro-batch's sum adds, and what a case may amplify (Adafactor's normalisation, the
    fuzzer's seed 351 on JAX: 1.3e-9 apart, gradients within 7.6e-16 at every step,
    plain Keras's own spread 9.0e-9). A failure within ten times it is the case's
    conditioning, not the accumulation: a float32 fraction of the loss is 1e-8 off where
    the spread is about 1e-15 (test_fuzz). Keras 3 only (its optimizers' `apply`)."""
    if LEGACY:
        return None
    from keras.src.optimizers import base_optimizer

    apply = base_optimizer.BaseOptimizer.apply

    def nudged(self, grads, trainable_variables=None):
        return apply(self, [_nudged(g, k) for k, g in enumerate(grads)], trainable_variables)

    base_optimizer.BaseOptimizer.apply = nudged
    try:
        run = train(spec, accumulating=False, initial=expected.initial)
    finally:
        base_optimizer.BaseOptimizer.apply = apply
    return max(differences(expected, run).values(), default=0.0)


def _nudged(gradient, index):
    """`gradient` with each non-zero element moved by up to float64's epsilon times its
    largest magnitude, one or two units in the last place of it (a dense gradient;
    others as they are)."""
    if gradient is None or hasattr(gradient, "indices"):
        return gradient
    ops = keras.ops
    noise = keras.random.uniform(ops.shape(gradient), -1.0, 1.0, dtype=gradient.dtype, seed=index)
    step = 2.0**-52 * ops.max(ops.abs(gradient))
    return gradient + ops.where(gradient != 0, step * noise, ops.zeros_like(gradient))


def _refusal(spec, error):
    """What `error` refused, where it names a feature of the case that the JAX line
    refuses (`_fuzz_jax.jax_refusals`) and left the model untouched; else None."""
    named = [feature for feature, words in jax_refusals(spec).items() if words in str(error)]
    if not named or not getattr(error, "untouched", True):
        return None
    return f"{' and '.join(named)} ({_summary(error)})"


def _summary(error):
    """The line of an error's message that says what happened."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [""]
    if lines[0].startswith(("Graph execution", "in user code")):
        lines = lines[-1:]
    # Keras's header of an error in a layer's call: the message follows it.
    lines = [line for line in lines if not line.startswith("Exception encountered")] or lines
    return f"{type(error).__name__}: {lines[0][:200]}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first", type=int, default=0, help="the first seed")
    parser.add_argument("--cases", type=int, default=100, help="how many seeds")
    parser.add_argument("--seed", type=int, action="append", help="replay these seeds only")
    fields = [field.name for field in dataclasses.fields(Spec)]
    parser.add_argument("--only", metavar="FIELD", choices=fields,
                        help="only the seeds whose case draws FIELD (a `Spec` field, e.g. reload)")
    parser.add_argument("--traceback", action="store_true",
                        help="print the whole traceback of what a case's run raised")
    args = parser.parse_args(argv)
    if BACKEND != "jax":
        # Two logical CPUs for the cases under `MirroredStrategy`, as the tests have them.
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    tf.get_logger().setLevel("ERROR")  # retracing notes: every case traces anew
    seeds = args.seed or range(args.first, args.first + args.cases)
    if args.only:
        seeds = [seed for seed in seeds if getattr(draw(seed), args.only)]
    results = []
    for seed in seeds:
        result = run(draw(seed))
        results.append(result)
        print(result.line(), flush=True)
        if args.traceback and result.trace:
            print(result.trace, flush=True)
    ill = [r.spec.seed for r in results if r.ill_conditioned is not None]
    failed = [r.spec.seed for r in results
              if not (r.passed or r.invalid or r.refused or r.ill_conditioned is not None)]
    invalid = [r.spec.seed for r in results if r.invalid]
    refused = [r.spec.seed for r in results if r.refused]
    passed = len(results) - len(failed) - len(invalid) - len(refused) - len(ill)
    worst = max((r.worst for r in results if r.passed), default=0.0)
    line = {"jax": "Keras 3 on JAX"}.get(BACKEND, "Keras 3" if not LEGACY else "tf_keras")
    refusals = f"; refused seeds: {refused}" if BACKEND == "jax" else ""
    print(
        f"summary: {passed}/{len(results)} passed on {line} at rtol {RTOL:g} "
        f"(worst passing {worst:.1e}); failed seeds: {failed}; invalid seeds: {invalid}"
        f"{refusals}; ill-conditioned seeds: {ill}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
