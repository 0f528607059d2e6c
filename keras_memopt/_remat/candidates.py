"""`remat="auto"`'s candidates and the rule that picks one, on either backend.

The cut points are the tensors that separate a functional model's graph (`_remat.graph`); between
them lie *units*, the last one the head. `candidates` lists the sets of cuts a user would try; each
line measures them its own way (TensorFlow: `_remat.choice` plays them on a traced step; JAX:
`_remat.jax_segments` compiles the step for each and reads XLA's memory analysis) and `pick` chooses
by the same rule. The rule's constants and the measurements behind them: docs/remat.md."""

from __future__ import annotations

import warnings

from keras_memopt import _keras

# A candidate within this share of the lowest peak counts as as low.
TIE = 0.02
# Recomputation costs time: it must lower the peak by at least this share.
WORTH = 0.05
# A segment per block is chosen within this share of the lowest peak.
BLOCK_TIE = 0.20
PER_BLOCK = "a segment per block"
EVERY_CUT_POINT = "a segment at every cut point"


def unit_signatures(units):
    """Each unit's layers' classes, in order (what `blocks` finds repeats of)."""
    return [
        tuple(type(layer).__name__ for layer in unit.layers
              if not isinstance(layer, _keras.keras.layers.InputLayer))
        for unit in units
    ]


def blocks(signatures):
    """The cuts after each block in `signatures` (the units' layers' classes;
    the last unit is the head): a block is what repeats in the longest run of
    two or more repeats (the shortest such), cut after wherever it occurs
    (also past a pooling layer between stages); () where nothing repeats."""
    body = signatures[:-1]
    block, covered = None, 0
    for length in range(1, len(body) // 2 + 1):
        for start in range(len(body) - 2 * length + 1):
            if len(body) - start <= covered:
                break  # no longer run can start here
            candidate = body[start:start + length]
            repeats = 1
            while body[start + repeats * length:start + (repeats + 1) * length] == candidate:
                repeats += 1
            if repeats >= 2 and repeats * length > covered:
                block, covered = candidate, repeats * length
    cuts, index = [], 0
    while block and index + len(block) <= len(body):
        if body[index:index + len(block)] == block:
            cuts.append(index + len(block) - 1)
            index += len(block)
        else:
            index += 1
    return tuple(cuts)


def candidates(count, signatures):
    """Cut sets a user would try over `count` units (the last is the head),
    a segment per block of the units' `signatures` among them."""
    found = {(): "none"}
    separators = count - 1
    for k in range(1, separators + 1):
        from_end = tuple(sorted(range(separators - 1, -1, -k)))
        from_start = tuple(range(k - 1, separators, k))
        name = EVERY_CUT_POINT if k == 1 else f"a segment every {k} cut points"
        found.setdefault(from_end, name)
        found.setdefault(from_start, name + " from the first")
    per_block = blocks(signatures)
    if per_block:
        found[per_block] = PER_BLOCK
    return found


def pick(peaks, cost, per_block, parameters):
    """The cuts `remat="auto"` chooses among `peaks` ({cuts: peak in bytes}, `()` among them):
    of those within `TIE` of the lowest, the one of lowest `cost(cuts)` (what it recomputes);
    `per_block` where it is within `BLOCK_TIE` of the lowest; `()` where the choice saves less
    than `WORTH` of none's peak and the `parameters`' bytes."""
    lowest = min(peaks.values())
    near = [cuts for cuts, peak in peaks.items() if peak <= lowest * (1 + TIE)]
    best = min(near, key=cost)
    if per_block and per_block in peaks and peaks[per_block] <= lowest * (1 + BLOCK_TIE):
        best = per_block
    none = peaks[()]
    if best and none - peaks[best] < WORTH * (none + parameters):
        best = ()
    return best


def warn_nothing_chosen(model, why, stacklevel):
    """The warning of a `remat="auto"` that recomputes nothing in `model`, and `why`."""
    warnings.warn(
        f"remat='auto' found nothing worth recomputing in model {model.name!r}: {why}. "
        "Training goes on without recomputation; wrap blocks in `keras_memopt.Remat` "
        "or name cut layers in `remat=[...]`.",
        stacklevel=stacklevel + 1,
    )
