"""`MemoryPlan`: the recommendation, and how a micro-batch size is chosen for a budget."""

from __future__ import annotations

import dataclasses
import math

from keras_memopt.memory import format_bytes
from keras_memopt.planning import estimate as _estimate

__all__ = [
    "COVERS", "MEASURED_MARGIN", "SHAPES_ONLY_MARGIN", "MemoryPlan", "choose_micro_batch",
    "measured_choice",
]

# The share of the budget to keep free when the figures come from shapes alone, which miss working
# memory no tensor shows (docs/benchmarks.md, "The estimate without measuring").
SHAPES_ONLY_MARGIN = 0.8
# Measured near the recommendation, a step's peak still spreads between processes (benchmarks.md).
MEASURED_MARGIN = 0.1

# What a plan's figures cover, said in every table: `MemoryLogger` reads more
# on the same model where `fit` holds the data set on the device.
COVERS = (
    "These figures are one train step's: parameters, optimizer slots, gradients, "
    "the input batch and activations; not the data set, which `fit` holds beside "
    "the step (NumPy arrays passed to `fit` become tensors in TensorFlow's allocator)."
)


@dataclasses.dataclass
class MemoryPlan:
    """A recommended micro-batch setting for a batch size and a budget (see `COVERS`).

    Args:
        batch_size: int, the effective batch planned for.
        budget: int, the memory available, in bytes.
        micro_batch_size: int, the recommended samples per micro-batch.
        remat: str or None, the recommended `remat` setting.
        estimate: `MemoryEstimate` of the recommended setting; its `calibrated` says whether the
            peak was measured or counted from shapes alone.
        fits: bool, whether the estimate fits the budget less its margin.
        note: str, what else the plan has to say.
    """

    batch_size: int
    budget: int
    micro_batch_size: int | None
    remat: str | None
    estimate: _estimate.MemoryEstimate
    fits: bool
    note: str = ""

    def table(self) -> str:
        """The plan as a readable text table."""
        rows = self.estimate.rows()
        width = max(len(name) for name, _ in rows) + 2
        lines = [f"{name:<{width}}{format_bytes(size):>12}" for name, size in rows]
        lines.append(f"{'budget':<{width}}{format_bytes(self.budget):>12}")
        lines.append("")
        lines.append(
            f"recommendation: micro_batch_size={self.micro_batch_size}, remat={self.remat!r}"
            + self._split()
        )
        if not self.estimate.calibrated:
            lines.append(
                "The peak is estimated from shapes alone: TensorFlow's own working "
                "memory is not in it (on a CPU, a small CNN's true peak was up to "
                "4.7 times such an estimate). Measure it: `plan(..., profile=True)`, "
                "or `keras-memopt plan` without `--no-profile`."
            )
        lines.append(COVERS)
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)

    def _split(self):
        if not self.micro_batch_size:
            return ""
        steps = math.ceil(self.batch_size / self.micro_batch_size)
        unit = "micro-batch" if steps == 1 else "micro-batches"
        return f"  ({steps} {unit} of a batch of {self.batch_size})"


def choose_micro_batch(peak_at, batch_size: int, usable: float, high: int) -> int | None:
    """The micro-batch size to recommend, or None when one sample does not fit.

    The largest size up to `high` whose peak (`peak_at(size)`, in bytes, growing with the size) fits
    in `usable` bytes, or a divisor of `batch_size` at least half as large."""
    if high < 1 or peak_at(1) > usable:
        return None
    low = 1
    while low < high:
        middle = (low + high + 1) // 2
        if peak_at(middle) <= usable:
            low = middle
        else:
            high = middle - 1
    even = max(d for d in _divisors(batch_size) if d <= low)
    return even if even * 2 > low else low


def measured_choice(points: dict, batch_size: int, micro: int, usable: float) -> int:
    """`micro`, or the largest measured size that fitted where `micro` was not measured.

    Measurements are noisy: where the rounds of measuring did not settle on a measured size, the
    plan prefers one that was seen to fit."""
    fitting = [
        m for (b, m), peak in points.items()
        if b == batch_size and m <= micro and peak <= usable
    ]
    if (batch_size, micro) not in points and fitting:
        return max(fitting)
    return micro


def _divisors(n):
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
