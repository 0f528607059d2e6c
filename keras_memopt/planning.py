"""Estimate, measure and plan the memory of an `AccumulatingModel` train step."""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import json
import math
import os
import subprocess
import sys
import warnings

import numpy as np
import tensorflow as tf

from keras_memopt import _keras as K
from keras_memopt._validation import positive_int
from keras_memopt.memory import format_bytes, parse_bytes

keras = K.keras

# Optimizer state per trainable variable, in copies of the variable, by class
# name; `None` means "read the optimizer's configuration".
_SLOTS = {
    "SGD": None,
    "Adam": None,
    "AdamW": None,
    "Adamax": 2,
    "Nadam": 2,
    "Lamb": 2,
    "Lion": 1,
    "Adagrad": 1,
    "Adadelta": 2,
    "Ftrl": 2,
    "RMSprop": None,
    "Adafactor": 0,  # factored: its state is far smaller than the variables
}

# Copies of a layer's output that its backward pass keeps alive, per layer
# class, beyond the output itself (dropout keeps its mask, layer normalisation
# its centred input and statistics, GELU its intermediate terms).
_EXTRA_COPIES = {
    "Dropout": 1.0,
    "LayerNormalization": 2.0,
    "BatchNormalization": 1.0,
    "GroupNormalization": 2.0,
}


def _slot_copies(optimizer):
    if optimizer is None:
        return 0.0
    config = optimizer.get_config()
    name = type(optimizer).__name__
    if name == "LossScaleOptimizer":
        inner = getattr(optimizer, "inner_optimizer", None)
        return _slot_copies(inner)
    if name == "SGD":
        copies = 1.0 if config.get("momentum") else 0.0
    elif name in ("Adam", "AdamW"):
        copies = 3.0 if config.get("amsgrad") else 2.0
    elif name == "RMSprop":
        copies = 1.0 + bool(config.get("momentum")) + bool(config.get("centered"))
    elif name in _SLOTS:
        copies = float(_SLOTS[name])
    else:
        # Unknown optimizer: Adam's two slots is the common case.
        copies = 2.0
    return copies + (1.0 if config.get("use_ema") else 0.0)


def _nbytes(shape, dtype):
    size = 1
    for dim in shape:
        if dim is None:
            return None
        size *= int(dim)
    return size * tf.as_dtype(dtype).size


def _per_sample(tensors):
    """Bytes per sample of a (nest of) symbolic tensors, batch axis dropped."""
    total = 0
    for tensor in tf.nest.flatten(tensors):
        shape = tuple(tensor.shape)[1:]
        size = _nbytes(shape, tensor.dtype)
        if size is None:
            return None
        total += size
    return total


def _leaf_layers(model):
    for layer in model.layers:
        if isinstance(layer, keras.Model) and hasattr(layer, "layers") and layer.layers:
            yield from _leaf_layers(layer)
        elif type(layer).__name__ != "InputLayer":
            yield layer


def _layer_activations(layer):
    """(bytes per sample the backward pass keeps for `layer`, note)."""
    try:
        output = layer.output
    except (AttributeError, ValueError, RuntimeError):
        return 0, "output shape unknown (layer used more than once?)"
    per_sample = _per_sample(output)
    if per_sample is None:
        return 0, "dynamic output shape"
    name = type(layer).__name__
    copies = 1.0 + _EXTRA_COPIES.get(name, 0.0)
    activation = getattr(getattr(layer, "activation", None), "__name__", None)
    if activation in ("gelu", "swish", "silu", "elu", "selu", "tanh", "sigmoid", "softmax"):
        copies += 1.0
    if name == "MultiHeadAttention":
        return _attention_activations(layer, output, per_sample), ""
    return int(per_sample * copies), ""


def _attention_activations(layer, output, output_bytes):
    # Query, key and value projections, the attention logits and their
    # softmax (and dropout), the attended values and the output projection.
    heads = layer.num_heads
    key_dim = layer.key_dim
    value_dim = layer.value_dim or key_dim
    length = output.shape[1] if len(output.shape) == 3 else 1
    itemsize = tf.as_dtype(output.dtype).size
    projections = length * heads * (2 * key_dim + 2 * value_dim) * itemsize
    scores = heads * length * length * itemsize * (3 if layer.dropout else 2)
    return int(projections + scores + output_bytes)


@dataclasses.dataclass
class MemoryEstimate:
    """The parts of one train step's peak memory, in bytes."""

    batch_size: int
    micro_batch_size: int
    parameters: int
    optimizer_slots: int
    gradient_accumulators: int
    micro_gradients: int
    input_batch: int
    activations: int
    overhead: int = 0
    calibrated: bool = False

    @property
    def peak(self) -> int:
        return (
            self.parameters
            + self.optimizer_slots
            + self.gradient_accumulators
            + self.micro_gradients
            + self.input_batch
            + self.activations
            + self.overhead
        )

    def rows(self):
        """(part, bytes) rows for a table, the peak last."""
        parts = [
            ("parameters", self.parameters),
            ("optimizer slots", self.optimizer_slots),
            ("gradient accumulators", self.gradient_accumulators),
            ("micro-batch gradients", self.micro_gradients),
            (f"input batch ({self.batch_size} samples)", self.input_batch),
            (f"activations ({self.micro_batch_size} samples)", self.activations),
        ]
        if self.overhead or self.calibrated:
            parts.append(("measured, not counted above", self.overhead))
        parts.append(("peak" + (" (measured)" if self.calibrated else ""), self.peak))
        return parts


@dataclasses.dataclass
class MemoryPlan:
    """A recommended micro-batch setting for a batch size and a budget."""

    batch_size: int
    budget: int
    micro_batch_size: int | None
    remat: str | None
    estimate: MemoryEstimate
    fits: bool
    note: str = ""

    def table(self) -> str:
        """The plan as a readable text table."""
        width = max(len(name) for name, _ in self.estimate.rows()) + 2
        lines = [f"{name:<{width}}{format_bytes(size):>12}" for name, size in self.estimate.rows()]
        lines.append(f"{'budget':<{width}}{format_bytes(self.budget):>12}")
        lines.append("")
        steps = math.ceil(self.batch_size / self.micro_batch_size) if self.micro_batch_size else 0
        lines.append(
            f"recommendation: micro_batch_size={self.micro_batch_size}, remat={self.remat!r}"
            + (f"  ({steps} micro-batches of a batch of {self.batch_size})" if steps else "")
        )
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)


def _remat_available():
    return importlib.util.find_spec("keras_memopt.remat") is not None


class MemoryPlanner:
    """Estimates and plans the peak memory of training a model in micro-batches.

    The estimate counts what an `AccumulatingModel` train step holds at its
    peak: the parameters, the optimizer's slots, the float32 gradient
    accumulators, one micro-batch's gradients, the whole input batch (the
    effective batch arrives at once) and the activations that one
    micro-batch's backward pass keeps, layer by layer.

    An estimate from shapes alone misses what TensorFlow adds (workspace,
    allocator rounding, copies a kernel makes): on a CPU, convolutions hold
    tens of MiB that no shape shows. `profile()` runs real train steps on a
    copy of the model and records the allocator's peak at each (batch,
    micro-batch) size it measures; `estimate()` then interpolates between the
    measured sizes, so its figures are close where it has measured nearby and
    an extrapolation elsewhere. `plan(..., profile=True)` measures where it
    matters: at the micro-batch size it is about to recommend, for the batch
    size asked about, until its recommendation is a measured size.

    Where it measures: the allocator's bytes in use depend on what was
    allocated and freed before, and in which order, so a copy trained in a
    process where other copies trained before can peak 15-25% away from the
    same step in a fresh process, which is what training will run in. So by
    default, on a CPU, each measurement runs in a fresh Python process (a
    subprocess that rebuilds the model from `model.to_json()` with fresh
    weights, with this process's environment, threading and precision
    policy; a few seconds each). Models that cannot be rebuilt there (a
    subclassed model without `get_config`, a custom layer the subprocess
    cannot import) are measured in this process instead, with a warning. On
    a GPU, measurements run in this process: it holds the GPU's memory.

    Peaks are not exactly reproducible even so: on a CPU, the same step's
    peak in fresh processes spread by up to 31% (a small CNN, default
    threading; up to 16% with one inter-op thread): independent ops' working
    memory overlaps or not, and the first (tracing) step leaves more or less
    allocated, from run to run. Keep `plan()`'s `margin` for that.

    Args:
        model: a built `keras.Model` (an `AccumulatingModel` or a plain model).
        optimizer: the optimizer to plan for: an instance or a name such as
            `"adam"`. Defaults to the model's compiled optimizer, or Adam.
        device: str, the device `profile()` measures on. Defaults to `"GPU:0"`
            where there is a GPU, else `"CPU:0"`.
        isolate: bool, whether `profile()` measures each size in a fresh
            process. Defaults to `None`: yes on a CPU, no on a GPU. `True`
            raises instead of falling back when the model cannot be rebuilt
            in a subprocess; on a GPU it needs the GPU's memory free (memory
            growth, or a limit that leaves room).

    Example:

    ```python
    planner = MemoryPlanner(model, optimizer="adam")
    plan = planner.plan(batch_size=256, budget="8GiB", profile=True)
    print(plan.table())
    model = AccumulatingModel.from_model(model, micro_batch_size=plan.micro_batch_size)
    ```

    Raises:
        ValueError: if the model is not built, or has no fixed input shape.
    """

    def __init__(
        self, model, optimizer=None, device: str | None = None, isolate: bool | None = None
    ):
        if not isinstance(model, keras.Model):
            raise TypeError(
                f"`model` must be a `keras.Model`. Received: model={model!r} "
                f"of type {type(model).__name__}"
            )
        if not model.built or not model.weights:
            raise ValueError(
                "The model must be built before its memory can be planned: "
                "build it from `keras.Input`s, call it once on a batch, or call "
                f"`model.build(input_shape)`. Received: model={model.name!r} "
                f"(built={model.built})"
            )
        if isolate not in (None, True, False):
            raise TypeError(
                f"`isolate` must be None, True or False. Received: isolate={isolate!r}"
            )
        if optimizer is None:
            optimizer = getattr(model, "optimizer", None) or "adam"
        self.model = model
        self.isolate = isolate
        self.optimizer = keras.optimizers.get(optimizer)
        self.device = device
        self._calibration = None
        self.layers = self._layer_table()

    # -- shapes ---------------------------------------------------------------------

    def _layer_table(self):
        rows = []
        try:
            inputs = self.model.inputs
        except (AttributeError, ValueError):
            inputs = None
        for layer in _leaf_layers(self.model) if inputs else ():
            size, note = _layer_activations(layer)
            rows.append((layer.name, type(layer).__name__, size, note))
        return rows

    @property
    def input_bytes_per_sample(self) -> int:
        """Bytes of one sample of the inputs plus its (sparse) target."""
        try:
            inputs, outputs = self.model.inputs, self.model.outputs
        except (AttributeError, ValueError):
            inputs = outputs = None
        if not inputs:
            raise ValueError(
                "The planner needs a model with known inputs: a functional or "
                "Sequential model, or `AccumulatingModel.from_model(model)` of "
                f"a built subclassed model. Received: model={self.model.name!r}"
            )
        size = _per_sample(inputs)
        if size is None:
            raise ValueError(
                "The planner needs fixed input shapes apart from the batch "
                "axis. Received: input shapes "
                f"{[tuple(t.shape) for t in tf.nest.flatten(inputs)]}"
            )
        # Targets are counted as one class index per output row.
        for output in tf.nest.flatten(outputs):
            rows = _nbytes(tuple(output.shape)[1:-1], "int32")
            size += rows or 4
        return size

    @property
    def activation_bytes_per_sample(self) -> int:
        """Activation bytes one sample keeps alive for the backward pass."""
        return sum(size for _, _, size, _ in self.layers)

    def _weights(self):
        trainable = self.model.trainable_weights
        parameters = sum(_nbytes(v.shape, v.dtype) for v in self.model.weights)
        grads = sum(_nbytes(v.shape, v.dtype) for v in trainable)
        accumulators = sum(
            _nbytes(v.shape, "float32" if tf.as_dtype(v.dtype).size < 4 else v.dtype)
            for v in trainable
        )
        slots = int(_slot_copies(self.optimizer) * grads)
        return parameters, slots, accumulators, grads

    # -- estimate, profile, plan ------------------------------------------------

    def estimate(self, batch_size: int, micro_batch_size: int | None = None) -> MemoryEstimate:
        """The estimated peak memory of one train step.

        Args:
            batch_size: int, the effective batch (what the input pipeline
                delivers).
            micro_batch_size: int, samples per micro-batch. Defaults to
                `batch_size` (no splitting).

        Returns:
            A `MemoryEstimate`; `.peak` is the total in bytes. Once `profile()`
            has measured, `.peak` comes from the measurements (interpolated in
            the micro-batch size, extrapolated beyond the measured sizes) and
            `.overhead` is what the measurement adds to the counted parts.
        """
        batch_size = positive_int("batch_size", batch_size)
        micro = batch_size if micro_batch_size is None else micro_batch_size
        micro = min(positive_int("micro_batch_size", micro), batch_size)
        parameters, slots, accumulators, grads = self._weights()
        estimate = MemoryEstimate(
            batch_size=batch_size,
            micro_batch_size=micro,
            parameters=parameters,
            optimizer_slots=slots,
            gradient_accumulators=accumulators,
            micro_gradients=grads,
            input_batch=batch_size * self.input_bytes_per_sample,
            activations=micro * self.activation_bytes_per_sample,
        )
        if self._calibration is not None:
            estimate.overhead = int(self._calibration.peak_at(batch_size, micro)) - estimate.peak
            estimate.calibrated = True
        return estimate

    def profile(
        self,
        micro_batch_sizes: tuple[int, ...] = (16, 64),
        batch_size: int | None = None,
    ) -> dict[int, int]:
        """Measures real train steps and calibrates the estimate with them.

        For each size, a fresh copy of the model (fresh weights; the model
        itself is not touched) is compiled as an `AccumulatingModel` with a
        copy of the optimizer and trained on synthetic data: one step to
        trace it and build the optimizer, then two steps whose allocator
        peak, less what was in use before the copy was made, is the
        measurement. On a CPU that happens in a fresh process per size (see
        `isolate` in the class documentation). Measurements add up over calls
        (a size measured again replaces the old figure); `estimate()`
        interpolates between them.

        Args:
            micro_batch_sizes: two or more distinct ints, the micro-batch
                sizes to measure. Defaults to `(16, 64)`. Measuring at and
                around the sizes you will plan for gives the closest
                estimates; `plan(..., profile=True)` does that for you.
            batch_size: int, the batch each micro-batch size is measured
                with. Defaults to one micro-batch per batch. Give the batch
                size you will train with: a larger batch costs more than its
                input tensors' bytes.

        Returns:
            A dict from micro-batch size to the measured peak in bytes
            (parameters and optimizer slots included), or `None` for a size
            that ran out of memory.

        Raises:
            ValueError: if fewer than two distinct sizes are given, or a size
                exceeds `batch_size`.
            RuntimeError: if the device has no allocator figures (a CPU
                without `TF_CPU_ALLOCATOR_USE_BFC=true`).
        """
        sizes = sorted({positive_int("micro_batch_sizes", s) for s in tuple(micro_batch_sizes)})
        if len(sizes) < 2:
            raise ValueError(
                "`micro_batch_sizes` must hold at least two distinct positive "
                f"integers. Received: micro_batch_sizes={micro_batch_sizes!r}"
            )
        if batch_size is not None:
            batch_size = positive_int("batch_size", batch_size)
            if sizes[-1] > batch_size:
                raise ValueError(
                    "Every micro-batch size must be at most `batch_size`. "
                    f"Received: micro_batch_sizes={micro_batch_sizes!r}, "
                    f"batch_size={batch_size}"
                )
        device = self._profile_device()
        measured = {}
        for size in sizes:  # a loop, not a comprehension: warnings point at the caller
            measured[size] = self._measure(batch_size or size, size, device)
        return measured

    def _profile_device(self):
        device = self.device or (
            "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
        )
        try:
            tf.config.experimental.get_memory_info(device)
        except ValueError as error:
            raise RuntimeError(
                f"`profile()` reads TensorFlow's allocator peak on {device}, which "
                "gives no memory figures there. On a CPU, set "
                "TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow starts. "
                f"Received: device={device!r}"
            ) from error
        return device

    def _measure(self, batch, micro, device):
        """Measures one (batch, micro-batch) size and records it; None on OOM."""
        if self._calibration is None:
            self._calibration = _Calibration(
                per_batch_sample=self.input_bytes_per_sample,
                min_slope=self.activation_bytes_per_sample,
            )
        isolate = self.isolate
        if isolate is None:
            isolate = "GPU" not in device.upper()
        peak = _NOT_ISOLATED
        if isolate:
            peak = _measure_in_subprocess(
                self.model, self.optimizer, batch, micro, device, required=self.isolate
            )
        if peak is _NOT_ISOLATED:
            peak = _measure_step(self.model, self.optimizer, batch, micro, device)
        self._calibration.record(batch, micro, peak)
        return peak

    def plan(
        self,
        batch_size: int,
        budget,
        margin: float = 0.1,
        profile: bool = False,
    ) -> MemoryPlan:
        """Recommends the micro-batch size (and remat) for a batch and a budget.

        Picks the largest micro-batch size whose estimated peak, plus
        `margin`, fits in `budget`, preferring sizes that divide the batch
        evenly. Where not even a micro-batch of one sample fits, it
        recommends `remat="auto"` (recomputing activations) when
        `keras_memopt.remat` is available; its saving is not modelled, so
        the plan's estimate is then an upper bound.

        With `profile=True` it measures (see `profile()`) at `batch_size`:
        the size it would recommend and half of it, then, while the
        measurements move its recommendation, the new recommendation (at most
        four rounds), and recommends a measured size that fitted where the
        rounds did not settle. It only measures sizes it estimates to fit the
        budget; one that runs out of memory all the same counts as not
        fitting.

        Args:
            batch_size: int, the effective batch size.
            budget: the memory available: bytes, or a string such as
                `"8GiB"` or `"512MB"`.
            margin: float, the share of the budget kept free for what the
                estimate misses. Defaults to 0.1.
            profile: bool, whether to measure real train steps near the
                recommendation first. Defaults to `False` (shapes and any
                earlier `profile()` measurements only).

        Returns:
            A `MemoryPlan`; `plan.table()` is a readable summary.

        Raises:
            ValueError: if the budget is below what the parameters, optimizer
                slots and gradients alone need, or an argument is invalid.
            RuntimeError: with `profile=True`, if the device has no allocator
                figures.
        """
        batch_size = positive_int("batch_size", batch_size)
        budget = parse_bytes(budget, "budget")
        if not 0 <= margin < 1:
            raise ValueError(f"`margin` must be in [0, 1). Received: margin={margin!r}")
        usable = budget * (1 - margin)
        smallest = self.estimate(batch_size, 1)
        fixed = (
            smallest.parameters + smallest.optimizer_slots
            + smallest.gradient_accumulators + smallest.micro_gradients
        )
        if fixed > usable:
            raise ValueError(
                f"The budget of {format_bytes(budget)} is below what the parameters "
                "alone need: parameters, optimizer slots, gradient accumulators "
                f"and one set of gradients take {format_bytes(fixed)} (with a "
                f"margin of {margin:.0%}). Raise the budget or use an optimizer "
                f"with fewer slots. Received: budget={budget}"
            )
        if profile:
            device = self._profile_device()
            for _ in range(4):
                micro = self._choose(batch_size, usable) or 1
                measured = self._calibration.micro_sizes(batch_size) if self._calibration else ()
                if micro in measured:
                    break
                todo = [micro]
                if not measured and micro > 1:
                    todo.insert(0, micro // 2)  # a slope for interpolation
                for size in todo:
                    if self._measure(batch_size, size, device) is None:
                        break  # larger sizes will not fit either
        micro = self._choose(batch_size, usable)
        if profile and micro is not None:
            # Measurements are noisy: when the rounds did not settle, prefer
            # the largest measured size that fitted.
            points = self._calibration.points
            fitting = [
                m for (b, m), peak in points.items()
                if b == batch_size and m <= micro and peak <= usable
            ]
            if (batch_size, micro) not in points and fitting:
                micro = max(fitting)
        if micro is None:
            smallest = self.estimate(batch_size, 1)
            remat = "auto" if _remat_available() else None
            note = "Not even a micro-batch of one sample fits in the budget. " + (
                "remat='auto' recomputes activations in the backward pass; its "
                "saving is not modelled here, so check it with a real run."
                if remat
                else "Activation recomputation (keras_memopt.remat) is not available "
                "in this version: lower the batch size or raise the budget."
            )
            return MemoryPlan(batch_size, budget, 1, remat, smallest, fits=False, note=note)
        return MemoryPlan(
            batch_size, budget, micro, None, self.estimate(batch_size, micro), fits=True
        )

    def _choose(self, batch_size, usable):
        """The micro-batch size to recommend, or None when one sample does not fit."""
        high = batch_size
        if self._calibration is not None:
            high = min(high, self._calibration.out_of_memory_at(batch_size) - 1)
        if high < 1 or self.estimate(batch_size, 1).peak > usable:
            return None
        low = 1  # the peak grows with the micro-batch size
        while low < high:
            middle = (low + high + 1) // 2
            if self.estimate(batch_size, middle).peak <= usable:
                low = middle
            else:
                high = middle - 1
        even = max(d for d in _divisors(batch_size) if d <= low)
        return even if even * 2 > low else low


def _divisors(n):
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _training_copy(model, optimizer):
    from keras_memopt.models import AccumulatingModel

    copy = keras.models.clone_model(model)
    if not isinstance(copy, AccumulatingModel):
        copy = AccumulatingModel.from_model(copy)
    optimizer = type(optimizer).from_config(optimizer.get_config())
    copy.compile(optimizer=optimizer, loss="mse")
    return copy


@dataclasses.dataclass
class _Calibration:
    """Measured peaks by (batch, micro-batch) size, and how to read between them."""

    per_batch_sample: float  # what a sample more in the batch costs, from shapes
    min_slope: float  # the shape-based activation bytes per micro-batch sample
    points: dict = dataclasses.field(default_factory=dict)  # (batch, micro) -> bytes
    failed: dict = dataclasses.field(default_factory=dict)  # batch -> smallest OOM micro

    def record(self, batch, micro, peak):
        if peak is None:
            self.failed[batch] = min(micro, self.failed.get(batch, micro))
            self.points.pop((batch, micro), None)
        else:
            self.points[(batch, micro)] = peak

    def micro_sizes(self, batch):
        sizes = {m for b, m in self.points if b == batch}
        return sizes | {m for b, m in self.failed.items() if b == batch}

    def out_of_memory_at(self, batch):
        """The smallest micro-batch size seen to run out of memory at `batch`."""
        sizes = [m for b, m in self.failed.items() if b <= batch]
        return min(sizes, default=math.inf)

    def peak_at(self, batch, micro):
        # One figure per micro-batch size: the one measured with the batch
        # closest to `batch`, moved to `batch` by the shape cost of the
        # samples in between.
        nearest = {}
        for (b, m), peak in self.points.items():
            if m not in nearest or abs(b - batch) < abs(nearest[m][0] - batch):
                nearest[m] = (b, peak)
        if not nearest:
            return 0.0
        sizes = sorted(nearest)
        values = [nearest[m][1] + (batch - nearest[m][0]) * self.per_batch_sample for m in sizes]
        if micro in nearest:
            return values[sizes.index(micro)]
        if sizes[0] < micro < sizes[-1]:
            return float(np.interp(micro, sizes, values))
        # Beyond the measured sizes: a straight line fitted by least squares
        # to the (up to) three nearest sizes, from the nearest one.
        above = micro > sizes[-1]
        near = slice(-3, None) if above else slice(0, 3)
        slope = _slope(sizes[near], values[near])
        if above:
            return values[-1] + (micro - sizes[-1]) * max(slope, self.min_slope)
        return max(values[0] - (sizes[0] - micro) * max(slope, 0.0), 0.0)


def _slope(sizes, values):
    if len(sizes) < 2:
        return 0.0
    return float(np.polyfit(np.asarray(sizes, float), np.asarray(values, float), 1)[0])


def _measure_step(source, optimizer, batch, micro, device):
    """Allocator peak of train steps of a fresh training copy of `source`.

    Bytes over what was in use before the copy was made, so the copy's
    parameters and optimizer slots count; None if it ran out of memory.
    """
    from keras_memopt._oom import is_oom

    x, y = _synthetic_batch(source, batch)
    gc.collect()
    before = tf.config.experimental.get_memory_info(device)["current"]
    model = None
    # Every copy traces its own step functions: TensorFlow's retracing
    # warning would be noise here.
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel("ERROR")
    try:
        with tf.device(device):
            model = _training_copy(source, optimizer)
            model.micro_batch_size = micro
            # The first step traces the step and builds the optimizer's slots;
            # its transient allocations are not those of training.
            model.train_on_batch(x, y)
            tf.config.experimental.reset_memory_stats(device)
            for _ in range(2):
                model.train_on_batch(x, y)
        return tf.config.experimental.get_memory_info(device)["peak"] - before
    except tf.errors.OpError as error:
        if not is_oom(error):
            raise
        return None
    finally:
        logger.setLevel(level)
        del model
        gc.collect()


_NOT_ISOLATED = object()


def _measure_in_subprocess(model, optimizer, batch, micro, device, required):
    """`_measure_step` in a fresh process (see `keras_memopt._profile_child`).

    Returns `_NOT_ISOLATED` where the model cannot be rebuilt there and
    `required` is not True (after a warning), so the caller measures here.
    """
    try:
        spec = json.dumps(
            dict(
                model=model.to_json(),
                optimizer=keras.optimizers.serialize(optimizer),
                batch=batch,
                micro=micro,
                device=device,
                inter_op_threads=tf.config.threading.get_inter_op_parallelism_threads(),
                intra_op_threads=tf.config.threading.get_intra_op_parallelism_threads(),
                policy=keras.mixed_precision.global_policy().name,
            )
        )
    except (NotImplementedError, TypeError, ValueError) as error:
        reason = f"the model or optimizer cannot be written as JSON ({error})"
    else:
        env = dict(os.environ)
        if "GPU" not in device.upper():
            env["CUDA_VISIBLE_DEVICES"] = "-1"  # leave this process's GPUs alone
        result = subprocess.run(
            [sys.executable, "-m", "keras_memopt._profile_child"],
            input=spec,
            capture_output=True,
            text=True,
            env=env,
        )
        lines = [line for line in result.stdout.splitlines() if line.startswith("KMO_")]
        if result.returncode == 0 and lines and lines[-1].startswith("KMO_PEAK "):
            value = lines[-1].split()[1]
            return None if value == "oom" else int(value)
        if not (lines and lines[-1].startswith("KMO_UNLOADABLE ")):
            raise RuntimeError(
                f"Measuring micro-batch {micro} of a batch of {batch} in a subprocess "
                f"failed (exit status {result.returncode}):\n{result.stderr[-3000:]}"
            )
        reason = f"the subprocess cannot rebuild it ({lines[-1].split(' ', 1)[1]})"
    if required:
        raise RuntimeError(
            f"`profile()` cannot measure in a fresh process: {reason}. Pass "
            "`isolate=False` to `MemoryPlanner` to measure in this process. "
            f"Received: isolate={required!r}"
        )
    warnings.warn(
        f"MemoryPlanner measures in this process: {reason}. Its figures can be "
        "15-25% off a fresh process's where other models trained before.",
        stacklevel=4,
    )
    return _NOT_ISOLATED


def _synthetic_batch(model, size):
    def fill(tensor):
        shape = (size, *tuple(tensor.shape)[1:])
        dtype = tf.as_dtype(tensor.dtype)
        if dtype.is_integer:
            return np.zeros(shape, dtype.as_numpy_dtype)
        return np.random.default_rng(0).random(shape, dtype=np.float32).astype(
            dtype.as_numpy_dtype
        )

    x = tf.nest.map_structure(fill, model.inputs)
    y = tf.nest.map_structure(fill, model.outputs)
    if len(x) == 1:
        x = x[0]
    if len(y) == 1:
        y = y[0]
    return x, y
