"""The first step's probe: a few samples, repeated, to see what the loss and metrics do.

Before the first step, in inference mode and putting back what it changes, on the batch's first two
samples, on them repeated and on each alone: the loss and each term of `model.losses`
(`probe.loss`), the compiled metrics and the layers' `Mean`s (`probe.metrics`), a custom step's
`loss_fn`. Each value is a `Seen`: a mean keeps its value on the repeated samples and is the sum of
the samples' weighted parts; a sum doubles; anything else couples the samples. A value zero on two
samples tells nothing: the next pairs are probed (`pairs`). See docs/accumulation.md.

Tolerance (`RTOL`, `tolerance`, `close`): float32 evaluations of the same per-sample values in
another order differ by a few units in the last place (~1e-7 of the value, or of the magnitude of
the parts a sum adds up); a value that couples the samples changes by its own size (twice as large,
another ratio). 1e-4 sits between the two, three orders of magnitude from each. Values computed in
float16 or bfloat16 (mixed precision) round each part on its own: 4 of their epsilons there. A
metric's figure, which may sit at zero with rounding around it, also passes within `NEGLIGIBLE`, the
size below which a value tells nothing."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import tensorflow as tf

from keras_memopt import _keras
from keras_memopt._step import loop as _loop
from keras_memopt._step.losses import MEAN, SUM

RTOL = 1e-4
_EPSILONS = {tf.float16: 2.0**-10, tf.bfloat16: 2.0**-7}
# A value this small tells nothing by its value (a sum of LayerNormalization outputs
# is zero until their offsets move).
NEGLIGIBLE = 1e-6
# How many pairs of the first batch's samples a value that tells nothing is probed on.
PAIRS = 8
NAN = float("nan")


def tolerance(dtype=tf.float32) -> float:
    """The relative tolerance of values computed in `dtype` (see the module docstring)."""
    return max(RTOL, 4 * _EPSILONS.get(tf.as_dtype(dtype), 0.0))


def close(a, b, rtol=RTOL, scale=0.0, atol=0.0) -> bool:
    """Whether `a` and `b` (numbers or arrays; NaN equals NaN) are equal within `rtol`
    of the larger of them and of `scale`, the magnitude they were summed from."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return False
    bound = rtol * np.maximum(np.maximum(np.abs(a), np.abs(b)), max(scale, 1e-12)) + atol
    return bool(np.all((np.abs(a - b) <= bound) | (np.isnan(a) & np.isnan(b))))


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
        rtol: the relative tolerance of the value's float type (`tolerance`).
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


# -- the samples ---------------------------------------------------------------------


def pairs(data):
    """The batch's first two samples, then its next pairs while a value tells nothing
    there (the caller stops), `PAIRS` pairs at most."""
    size = int(_loop.batch_size_of(data))
    for start in range(0, max(min(size - 1, 2 * PAIRS), 1), 2):
        yield _loop.micro_slice(data, start, 2)


def repeat(data):
    """Every sample twice (`x + x`), masks and the logits behind a softmax or
    sigmoid output included (Keras's cross-entropies read those)."""
    return _rebuilt(data, lambda t: _loop.concat_rows([t, t]))


def sample(data, index):
    """Sample `index` of a batch, as `repeat` keeps masks and logits."""
    return _rebuilt(data, lambda t: _loop.rows(t, index, 1))


def _rebuilt(data, rows):
    def rebuilt(t):
        if t is None:
            return None
        mask, logits = _keras.get_mask(t), _keras.logits_of(t)
        result = rows(t)
        if logits is not None:
            result = _keras.carry_logits(result, rows(logits), t)
        if mask is not None:
            _keras.set_mask(result, rows(mask))
        return result

    return tf.nest.map_structure(rebuilt, data)


def in_replica(model, fn, *args):
    """`fn(*args)` in the first replica (where Keras updates its trackers), as Python
    numbers; Keras's warnings come from the step, once."""
    strategy = model.distribute_strategy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        values = strategy.run(fn, args=args)
    return tf.nest.map_structure(
        lambda v: strategy.experimental_local_results(v)[0].numpy().tolist(), values
    )
