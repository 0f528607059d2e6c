"""`MemoryPlanner`: estimate, measure and plan the memory of a micro-batched train step."""

from __future__ import annotations

import time
import warnings

from keras_memopt import _keras
from keras_memopt._io import print_msg
from keras_memopt._validation import positive_int
from keras_memopt.memory import default_device, format_bytes, parse_bytes
from keras_memopt.planning import estimate as _estimate
from keras_memopt.planning import measure as _measure
from keras_memopt.planning import remat_plan as _remat_plan
from keras_memopt.planning.calibration import Calibration
from keras_memopt.planning.plan import (
    MEASURED_MARGIN,
    SHAPES_ONLY_MARGIN,
    MemoryPlan,
    choose_micro_batch,
    measured_choice,
)

__all__ = ["MEASURED_MARGIN", "SHAPES_ONLY_MARGIN", "MemoryPlan", "MemoryPlanner"]

keras = _keras.keras


class MemoryPlanner:
    """Estimates and plans the peak memory of training a model in micro-batches.

    `estimate()` counts a train step's peak from shapes and the traced graph, `profile()` measures
    real train steps (which `estimate()` then interpolates), `plan()` recommends a micro-batch size
    for a budget; the figures are one train step's: keep `plan()`'s `margin`. What is counted, how
    well, and why: docs/memory.md.

    Args:
        model: a built `keras.Model` (an `AccumulatingModel` or a plain model)
            with known inputs of fixed shape but for the batch axis.
        optimizer: the optimizer to plan for: an instance or a name such as
            `"adam"`. Defaults to the model's compiled optimizer, or Adam.
        device: str, the device `profile()` measures on. Defaults to `"GPU:0"`
            where there is a GPU, else `"CPU:0"`.
        isolate: bool, whether `profile()` measures each size in a fresh process. Defaults to
            `None`: yes on a CPU, no on a GPU. `True` raises instead of falling back when the model
            cannot be rebuilt in a subprocess; on a GPU it needs the GPU's memory free (memory
            growth, or a limit that leaves room).

    Example:

    ```python
    planner = MemoryPlanner(model, optimizer="adam")
    plan = planner.plan(batch_size=256, budget="8GiB", profile=True)
    print(plan.table())
    model = AccumulatingModel.from_model(model, micro_batch_size=plan.micro_batch_size)
    ```

    Raises:
        TypeError: if `model` is not a `keras.Model`, or `isolate` is not a bool or None.
        ValueError: if the model is not built, has no known inputs (a subclassed model: wrap it with
            `AccumulatingModel.from_model`), or an input shape is unknown apart from the batch axis.
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
        self._input_bytes = _estimate.input_bytes_per_sample(model)  # raises for unknown shapes
        self.model = model
        self.isolate = isolate
        self.optimizer = keras.optimizers.get(optimizer)
        self.device = device
        self._calibration = None
        self._cannot_isolate = None  # why a fresh process cannot rebuild the model
        self._activations = None  # traced on first use

    # -- shapes ---------------------------------------------------------------------

    @property
    def input_bytes_per_sample(self) -> int:
        """Bytes of one sample of the inputs plus its (sparse) target."""
        return self._input_bytes

    @property
    def activation_bytes_per_sample(self) -> int:
        """Activation bytes one more sample adds at the step's peak (from the traced step)."""
        return int(self._step_activations().per_sample)

    def _step_activations(self):
        if self._activations is None:
            cpu = "GPU" not in self._profile_device().upper()
            self._activations = _estimate.StepActivations(self.model, cpu=cpu)
        return self._activations

    # -- estimate, profile, plan ------------------------------------------------

    def estimate(
        self, batch_size: int, micro_batch_size: int | None = None
    ) -> _estimate.MemoryEstimate:
        """The estimated peak memory of one train step.

        Args:
            batch_size: int, the effective batch (what the input pipeline delivers).
            micro_batch_size: int, samples per micro-batch. Defaults to `batch_size` (no splitting).

        Returns:
            A `MemoryEstimate`; `.peak` is the total in bytes. Once `profile()` has measured,
            `.peak` comes from the measurements (interpolated in the micro-batch size, extrapolated
            beyond), `.calibrated` is True and `.overhead` is what they add to the counted parts.
        """
        batch_size = positive_int("batch_size", batch_size)
        micro = batch_size if micro_batch_size is None else micro_batch_size
        micro = min(positive_int("micro_batch_size", micro), batch_size)
        estimate = _estimate.MemoryEstimate.of_step(
            _estimate.WeightBytes.of(self.model, self.optimizer), batch_size, micro,
            batch_size * self.input_bytes_per_sample, self._step_activations().bytes(micro),
        )
        if self._calibration is not None:
            estimate.overhead = int(self._calibration.peak_at(batch_size, micro)) - estimate.peak
            estimate.calibrated = True
        return estimate

    def profile(
        self,
        micro_batch_sizes: tuple[int, ...] = (16, 64),
        batch_size: int | None = None,
        verbose: int = 0,
    ) -> dict[int, int | None]:
        """Measures real train steps and calibrates the estimate with them.

        Each size trains a fresh copy of the model on synthetic data (how: docs/memory.md), on a
        CPU in a fresh process (`isolate`). Measurements add up over calls (a size measured again
        replaces the old figure).

        Args:
            micro_batch_sizes: two or more distinct ints, the micro-batch sizes to measure. Defaults
                to `(16, 64)`. Measuring at and around the sizes you will plan for gives the closest
                estimates; `plan(..., profile=True)` does that for you.
            batch_size: int, the batch each micro-batch size is measured with. Defaults to one
                micro-batch per batch. Give the batch size you will train with: a larger batch costs
                more than its input tensors' bytes.
            verbose: int, 1 to print a line per measurement (its peak and time), 0 for none.
                Defaults to 0.

        Returns:
            A dict from micro-batch size to the measured peak in bytes (parameters and optimizer
            slots included), or to `None` for a size that ran out of memory.

        Raises:
            ValueError: if fewer than two distinct sizes are given, or a size exceeds `batch_size`.
            RuntimeError: if a measurement in this process is needed on a device without allocator
                figures (a CPU without `TF_CPU_ALLOCATOR_USE_BFC=true`), or a child process fails.
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
        measured = {}
        for size in sizes:  # a loop, not a comprehension: warnings point at the caller
            measured[size] = self._measure(batch_size or size, size, verbose, stacklevel=3)
        return measured

    def _profile_device(self):
        return self.device or default_device()

    def _isolated(self, device):
        return ("GPU" not in device.upper()) if self.isolate is None else self.isolate

    def _measure(self, batch, micro, verbose, stacklevel):
        """Measures one (batch, micro-batch) size and records it; None on OOM.
        `stacklevel` counts the user's call from here, for the warning."""
        if self._calibration is None:
            self._calibration = Calibration(
                per_batch_sample=self.input_bytes_per_sample,
                min_slope=self.activation_bytes_per_sample,
            )
        device = self._profile_device()
        started = time.perf_counter()
        peak, where = self._peak_of(self.model, batch, micro, device, stacklevel + 1)
        self._calibration.record(batch, micro, peak)
        if verbose:
            figure = "out of memory" if peak is None else f"peak {format_bytes(peak)}"
            print_msg(
                f"measured micro-batch {micro} of a batch of {batch} on {device}: {figure} "
                f"({time.perf_counter() - started:.1f} s, {where})"
            )
        return peak

    def _peak_of(self, model, batch, micro, device, stacklevel):
        """(step peak at (batch, micro) or None on OOM, where measured): in a fresh process where
        `isolate` says so and the model can be rebuilt there, else here with a warning."""
        if self._isolated(device) and self._cannot_isolate is None:
            try:
                peak = _measure.measure_isolated(model, self.optimizer, batch, micro, device)
                return peak, "in a fresh process"
            except _measure.CannotIsolate as reason:
                self._fall_back(reason, stacklevel + 1)
                self._cannot_isolate = reason  # the next sizes go straight here
        return _measure.measure_step(model, self.optimizer, batch, micro, device), "in this process"

    def _fall_back(self, reason, stacklevel):
        if self.isolate:
            raise RuntimeError(
                f"`profile()` cannot measure in a fresh process: {reason}. Pass "
                "`isolate=False` to `MemoryPlanner` to measure in this process. "
                f"Received: isolate={self.isolate!r}"
            )
        warnings.warn(
            f"MemoryPlanner measures in this process: {reason}. Its figures can be "
            "15-25% off a fresh process's where other models trained before.",
            stacklevel=stacklevel,
        )

    def plan(
        self,
        batch_size: int,
        budget,
        margin: float = MEASURED_MARGIN,
        profile: bool = False,
        verbose: int = 0,
    ) -> MemoryPlan:
        """Recommends the micro-batch size (and remat) for a batch and a budget.

        The largest micro-batch size whose estimated peak, plus `margin`, fits in `budget`
        (preferring sizes that divide the batch); where not even one sample fits, `remat="auto"`,
        its estimate then an upper bound. Without measurements keep a wider margin
        (`SHAPES_ONLY_MARGIN`, 0.8). How `profile=True` measures: docs/memory.md.

        Args:
            batch_size: int, the effective batch size.
            budget: the memory available: bytes, or a string such as `"8GiB"` or `"512MB"`.
            margin: float, the share of the budget kept free for what the estimate misses.
                Defaults to 0.1.
            profile: bool, whether to measure real train steps near the recommendation first.
                Defaults to `False` (shapes and any earlier `profile()` measurements only).
            verbose: int, 1 to print a line per measurement. Defaults to 0.

        Returns:
            A `MemoryPlan`; `plan.table()` is a readable summary.

        Raises:
            ValueError: if the budget is below what the parameters, optimizer
                slots and gradients alone need, or an argument is invalid.
            RuntimeError: with `profile=True`, if a measurement cannot be made (see `profile()`).
        """
        batch_size = positive_int("batch_size", batch_size)
        budget = parse_bytes(budget, "budget")
        if not 0 <= margin < 1:
            raise ValueError(f"`margin` must be in [0, 1). Received: margin={margin!r}")
        usable = budget * (1 - margin)
        self._check_fixed_part_fits(budget, usable, margin)
        if profile:
            self._measure_near_choice(batch_size, usable, verbose)
        micro = self._choose(batch_size, usable)
        if profile and micro is not None:
            micro = measured_choice(self._calibration.points, batch_size, micro, usable)
        if micro is None:
            note = (
                "Not even a micro-batch of one sample fits in the budget. "
                "remat='auto' recomputes activations in the backward pass; its "
                "saving is not modelled here, so check it with a real run."
            )
            smallest = self.estimate(batch_size, 1)
            return MemoryPlan(batch_size, budget, 1, "auto", smallest, fits=False, note=note)
        return MemoryPlan(
            batch_size, budget, micro, None, self.estimate(batch_size, micro), fits=True
        )

    def compare_remat(
        self, batch_size: int, micro_batch_size: int | None = None, count: int = 4,
        verbose: int = 0,
    ) -> list[_remat_plan.RematCandidate]:
        """Measures the recomputation settings `remat="auto"` weighs, lowest peak first.

        Measures, as `profile()` does, the lowest estimate, no recomputation, a segment at every cut
        point and the others within 25% of the lowest estimate (at most `count`). Pass the first
        one's `remat` to `AccumulatingModel`. See docs/remat.md.

        Args:
            batch_size: int, the effective batch.
            micro_batch_size: int, samples per micro-batch. Defaults to `batch_size`.
            count: int, the most settings to measure. Defaults to 4.
            verbose: int, 1 to print a line per measurement. Defaults to 0.

        Returns:
            A list of `RematCandidate` (description, `remat`, estimated and measured peak in
            bytes), lowest measured first.

        Raises:
            ValueError: for a model that is not functional or has no tensor
                that separates its graph, or an invalid size.
        """
        batch_size = positive_int("batch_size", batch_size)
        micro = positive_int("micro_batch_size", micro_batch_size or batch_size)
        count = positive_int("count", count)
        return _remat_plan.compare(self, batch_size, min(micro, batch_size), count, verbose)

    def _check_fixed_part_fits(self, budget, usable, margin):
        fixed = _estimate.WeightBytes.of(self.model, self.optimizer).total
        if fixed > usable:
            raise ValueError(
                f"The budget of {format_bytes(budget)} is below what the parameters "
                "alone need: parameters, optimizer slots, gradient accumulators "
                f"and one set of gradients take {format_bytes(fixed)} (with a "
                f"margin of {margin:.0%}). Raise the budget or use an optimizer "
                f"with fewer slots. Received: budget={budget}"
            )

    def _measure_near_choice(self, batch_size, usable, verbose):
        """Measures at the size it would recommend until that size is a measured one."""
        for _ in range(4):
            micro = self._choose(batch_size, usable) or 1
            measured = self._calibration.micro_sizes(batch_size) if self._calibration else ()
            if micro in measured:
                return
            todo = [micro]
            if not measured and micro > 1:
                todo.insert(0, micro // 2)  # a slope for interpolation
            for size in todo:
                if self._measure(batch_size, size, verbose, stacklevel=4) is None:
                    break  # larger sizes will not fit either

    def _choose(self, batch_size, usable):
        """The micro-batch size to recommend, or None when one sample does not fit."""
        high = batch_size
        if self._calibration is not None:
            high = min(high, self._calibration.out_of_memory_at(batch_size) - 1)
        return choose_micro_batch(
            lambda micro: self.estimate(batch_size, micro).peak, batch_size, usable, high
        )

