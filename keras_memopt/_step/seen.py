"""What the first step's probe saw of a value, and what it makes of it, on any backend.

The probe (TensorFlow: `keras_memopt._step.probe`; JAX: `keras_memopt._step.jax_terms`) evaluates
a value on a few samples, on them repeated and, where random draws show, on them a second time: a
mean keeps its value on the repeated samples, a sum doubles, anything else couples the samples. A
value zero on two samples tells nothing: the next pairs are probed (`pair_starts`). See
docs/accumulation.md, "How the fraction is found".

Tolerance (`RTOL`, `tolerance`, `close`): float32 evaluations of the same per-sample values in
another order differ by a few units in the last place (~1e-7 of the value, or of the magnitude of
the parts a sum adds up); a value that couples the samples changes by its own size (twice as large,
another ratio). 1e-4 sits between the two, three orders of magnitude from each. Values computed in
float16 or bfloat16 (mixed precision) round each part on its own: 4 of their epsilons there. A
metric's figure, which may sit at zero with rounding around it, also passes within `NEGLIGIBLE`, the
size below which a value tells nothing."""

from __future__ import annotations

import dataclasses

import numpy as np

MEAN, SUM = "mean", "sum"

RTOL = 1e-4
_EPSILONS = {"float16": 2.0**-10, "bfloat16": 2.0**-7}
# A value this small tells nothing by its value (a sum of LayerNormalization outputs
# is zero until their offsets move).
NEGLIGIBLE = 1e-6
# How many pairs of the first batch's samples a value that tells nothing is probed on.
PAIRS = 8
NAN = float("nan")


def tolerance_of(dtype_name: str) -> float:
    """The relative tolerance of values computed in the dtype named `dtype_name`."""
    return max(RTOL, 4 * _EPSILONS.get(dtype_name, 0.0))


def close(a, b, rtol=RTOL, scale=0.0, atol=0.0) -> bool:
    """Whether `a` and `b` (numbers or arrays; NaN equals NaN) are equal within `rtol`
    of the larger of them and of `scale`, the magnitude they were summed from."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return False
    bound = rtol * np.maximum(np.maximum(np.abs(a), np.abs(b)), max(scale, 1e-12)) + atol
    return bool(np.all((np.abs(a - b) <= bound) | (np.isnan(a) & np.isnan(b))))


def pair_starts(size: int) -> range:
    """Where the probed pairs of a batch of `size` start: the first two samples, then the next
    pairs while a value tells nothing there (the caller stops), `PAIRS` pairs at most."""
    return range(0, max(min(size - 1, 2 * PAIRS), 1), 2)


@dataclasses.dataclass(frozen=True)
class Seen:
    """One value as the probe saw it.

    Attributes:
        once: on a few samples.
        twice: on the same samples repeated (every sample twice).
        again: on the same samples a second time, where random draws show (NaN: not run).
        parts: the samples' own values, each alone and weighted as the micro-batches
            weigh it, added up (NaN: not evaluated).
        magnitude: the parts' absolute values added up: the scale of their rounding.
        rtol: the relative tolerance of the value's float type (`tolerance_of`).
    """

    once: float
    twice: float = NAN
    again: float = NAN
    parts: float = NAN
    magnitude: float = 0.0
    rtol: float = RTOL

    @property
    def negligible(self) -> bool:
        return max(abs(self.once), abs(self.twice)) < NEGLIGIBLE

    @property
    def random(self) -> bool:
        """Whether two evaluations on the same samples differ (random draws)."""
        return not np.isnan(self.again) and not close(self.again, self.once, self.rtol)

    def kind(self):
        """MEAN if the value stays when every sample is repeated, SUM if it doubles, else
        None; a random value is the nearer of the two, within the spread of its draws."""
        scale = max(abs(self.once), abs(self.twice), 1e-12)
        bound = self.rtol * scale
        spread = 0.0 if np.isnan(self.again) else abs(self.again - self.once)
        if spread > bound:
            bound = max(4 * spread, 0.25 * scale)
        to_mean, to_sum = abs(self.twice - self.once), abs(self.twice - 2 * self.once)
        if to_mean <= bound and to_mean <= to_sum:
            return MEAN
        return SUM if to_sum <= bound else None

    def adds_up(self) -> bool:
        """Whether the parts add up to the value (True where either is not evaluated)."""
        if np.isnan(self.parts) or np.isnan(self.once):
            return True
        return close(self.once, self.parts, self.rtol, scale=abs(self.magnitude))

    def not_a_mean(self) -> str | None:
        """How the value is no mean of per-sample terms (None where it is one): it does
        not keep its value on the repeated samples, or its parts do not add up to it."""
        if self.kind() != MEAN:
            return self.changed()
        return None if self.adds_up() else self.split()

    def changed(self) -> str:
        ratio = f" (x{self.twice / self.once:.3g})" if self.once else ""
        return (f"went from {self.once:.6g} to {self.twice:.6g}{ratio} when every sample "
                "was repeated")

    def split(self, alone=False) -> str:
        if alone:
            return (
                f"was {self.once:.6g} on two samples weighted 1 on one and 0 on the other but "
                f"{self.parts:.6g} on that one alone weighted by its share, as a micro-batch "
                "adds it up"
            )
        return (
            f"was {self.once:.6g} on two samples but {self.parts:.6g} as the sum of each "
            "sample's loss weighted by its share, as micro-batches add it up"
        )


def coupled_loss_message(model, changed: str, overridden: bool) -> str:
    """The error for a loss of the outputs that is no mean of per-sample terms (`changed`: how
    the probe saw it; `overridden`: the loss is the model's own `compute_loss`)."""
    where = "`compute_loss`" if overridden else "compiled loss"
    return (
        "AccumulatingModel adds up each micro-batch's loss weighted by its share "
        "of the batch, which equals the batch's loss when the loss is a mean of "
        f"per-sample terms; this {where} is not: on the same outputs it "
        f"{changed}, so it sums over the batch or couples its samples "
        "(a contrastive loss whose negatives are the batch's other rows, a listwise "
        "ranking loss, a ratio of the batch's sums such as a Dice loss, targets of shape "
        "(batch,) broadcast against outputs of shape (batch, 1)). Pass "
        "`whole_batch_loss=True` to AccumulatingModel to evaluate "
        "it once on the whole batch's outputs (exact for any loss of the outputs, "
        "for about one more forward pass), or return one loss value per sample "
        "(Keras averages them). Received: "
        f"loss={getattr(model, 'loss', None)!r}, whole_batch_loss=False"
    )


# -- the terms of `model.losses` -----------------------------------------------------


def silent_terms(terms) -> list[int]:
    """The indices of the terms (`(Seen of the value, Seen of its gradient's norm)`, or
    None before any pair) that told nothing on the pairs probed so far."""
    return [i for i, term in enumerate(terms or ()) if tells_nothing(*term)]


def seen_terms(terms, once, again, twice) -> list:
    """Each term's `(Seen of its value, Seen of its gradient's norm)` from the
    `(value, norm)` of each term on a pair (`once`), on it a second time (`again`) and
    on it repeated (`twice`); where `terms` (the earlier pairs') tells already, kept."""
    found = [
        tuple(Seen(o[k], t[k], a[k]) for k in range(2))
        for o, a, t in zip(once, again, twice, strict=True)
    ]
    if terms is None:
        return found
    silent = silent_terms(terms)
    return [found[i] if i in silent else term for i, term in enumerate(terms)]


def tells_nothing(value, norm) -> bool:
    return value.negligible and max(norm.once, norm.twice) == 0


def term_kind(index, value, norm, error=ValueError):
    """MEAN or SUM for one term of `model.losses`; raises `error` where it is neither. Its value
    decides; where the value is negligible, its gradient's norm, which keeps its size when the term
    averages over samples and doubles when it sums over them (or, where that cannot tell, the value
    if not zero and the norm leans its way); a term negligible with no gradient counts as a mean."""
    kind = by_value = value.kind()
    if value.negligible:
        kind = MEAN if tells_nothing(value, norm) else norm.kind()
        if kind is None and min(abs(value.once), norm.once) > 0:
            # Quantized (float8), the norm can move (x0.95) where the value, small but
            # not zero, stays to the last bit: the value decides where the norm leans its way.
            ratio = norm.twice / norm.once
            nearer = MEAN if abs(ratio - 1) < abs(ratio - 2) else SUM
            kind = by_value if by_value == nearer else None
    if kind is None:
        change = value.changed()
        if value.negligible:
            change = (f"went from {value.once:.6g} to {value.twice:.6g} (below "
                      f"{NEGLIGIBLE:g}) and its gradient norm {norm.changed()}")
        raise error(
            "AccumulatingModel cannot split a loss term over micro-batches "
            f"exactly: term {index} of `model.losses` {change}, neither the "
            "same (a mean over samples) nor twice as large (a sum). Add it "
            "as separate terms, one that sums over samples and one that "
            f"does not. Received: model.losses[{index}]"
        )
    return kind
