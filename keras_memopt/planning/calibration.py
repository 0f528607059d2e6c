"""The calibration: measured peaks by size, and how to read between them."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = ["Calibration"]


@dataclasses.dataclass
class Calibration:
    """Measured peaks by (batch, micro-batch) size, and how to read between them.

    `per_batch_sample`: what a sample more in the batch costs, from shapes; `min_slope`: the least a
    sample more in the micro-batch can cost."""

    per_batch_sample: float
    min_slope: float
    points: dict = dataclasses.field(default_factory=dict)  # (batch, micro) -> bytes
    failed: dict = dataclasses.field(default_factory=dict)  # batch -> smallest OOM micro

    def record(self, batch, micro, peak):
        """Records a measured peak in bytes, or None for a size that ran out of memory."""
        if peak is None:
            self.failed[batch] = min(micro, self.failed.get(batch, micro))
            self.points.pop((batch, micro), None)
        else:
            self.points[(batch, micro)] = peak

    def micro_sizes(self, batch):
        """The micro-batch sizes measured at `batch`, fitted or not."""
        sizes = {m for b, m in self.points if b == batch}
        return sizes | {m for b, m in self.failed.items() if b == batch}

    def out_of_memory_at(self, batch):
        """The smallest micro-batch size seen to run out of memory at `batch`."""
        sizes = [m for b, m in self.failed.items() if b <= batch]
        return min(sizes, default=math.inf)

    def peak_at(self, batch, micro) -> float:
        """The peak at (batch, micro) read from the measurements, in bytes."""
        # One figure per micro-batch size: the one measured with the batch closest to `batch`, moved
        # to `batch` by the shape cost of the samples in between.
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
        # Beyond the measured sizes: a least-squares line through the (up to) three nearest sizes.
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
