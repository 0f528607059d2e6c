"""Measuring recomputation settings: `MemoryPlanner.compare_remat`.

Where `remat="auto"`'s estimated candidates are close, what the estimate cannot see decides:
`compare` measures the shortlist, as `MemoryPlanner.profile` does, and orders it."""

from __future__ import annotations

import dataclasses
import time
import warnings

from keras_memopt import _keras
from keras_memopt._io import print_msg
from keras_memopt._remat import candidates as _candidates
from keras_memopt._remat import segments as _segments
from keras_memopt.memory import format_bytes

__all__ = ["RematCandidate", "compare"]

# Candidates measured beside the lowest estimate: those this close to it.
_CLOSE = 0.25


@dataclasses.dataclass
class RematCandidate:
    """One recomputation setting, its estimated and measured peaks.

    Attributes:
        description: str, what it is ("none", "a segment every 2 cut points").
        remat: the `remat=` value that gives it: None or the cut layers' names.
        estimated: int, the estimated step peak in bytes: a micro-batch's
            activations and gradients, and the gradient sum beside them.
        measured: int or None, the measured step peak in bytes (parameters, optimizer slots,
            gradients, the batch and activations), or None where it ran out of memory.
    """

    description: str
    remat: list | None
    estimated: int
    measured: int | None = None


def shortlist(candidates, count):
    """The candidates worth measuring, in this order: the lowest estimate, no recomputation, a
    segment per block and at every cut point, others within `_CLOSE`; the first `count` (>= 2)."""
    lowest = candidates[0][2]
    chosen = [candidates[0]]
    chosen += [c for c in candidates if not c[1]]
    obvious = (_candidates.PER_BLOCK, _candidates.EVERY_CUT_POINT)
    chosen += [c for c in candidates if c[0] in obvious]
    chosen += [c for c in candidates if c[2] <= lowest * (1 + _CLOSE)]
    unique = []
    for candidate in chosen:
        if all(candidate[1] != other[1] for other in unique):
            unique.append(candidate)
    return unique[: max(count, 2)]


def compare(planner, batch_size, micro_batch_size, count, verbose):
    """`MemoryPlanner.compare_remat`'s work: the shortlist, measured, lowest first."""
    from keras_memopt.models import AccumulatingModel

    model = planner.model
    if not isinstance(model, _keras.Functional):
        raise ValueError(
            "`compare_remat` cuts a functional model's graph into segments; a "
            "subclassed model wraps its blocks in `keras_memopt.Remat` instead. "
            f"Received: model={model.name!r} of type {type(model).__name__}"
        )
    rows = shortlist(_segments.estimated_candidates(model, micro_batch_size), count)
    device = planner._profile_device()
    results = []
    for description, names, estimated in rows:
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a copy's "nothing worth recomputing"
            copy = AccumulatingModel.from_model(
                model, micro_batch_size=micro_batch_size, remat=names or None
            )
        measured, where = planner._peak_of(copy, batch_size, micro_batch_size, device, 4)
        results.append(RematCandidate(description, names or None, int(estimated), measured))
        if verbose:
            figure = "out of memory" if measured is None else f"peak {format_bytes(measured)}"
            print_msg(f"{description}: {figure} ({time.perf_counter() - started:.1f} s, {where})")
    return sorted(results, key=lambda r: (r.measured is None, r.measured or 0))

