"""Chooses CI's fixed sample of fuzz cases (`SEEDS` in tests/test_fuzz.py) for what it covers.

`python tests/_fuzz_sample.py` draws the cases of seeds 0 to 1999 on each Keras line
(`draw(seed)` only: no model is built or trained, about a second a line) and picks, per
line, a few seeds so that every pair of values of the main axes below meets in at least
one picked case where the draw allows it, the three-way meeting that needs a strategy, an
Embedding and an optimizer that is not linear in its gradient's rows meets too, and a few
more things a split can get wrong are drawn at least once. It prints the lists to paste
into tests/test_fuzz.py and which targets they cover, and which no seed of the pool can.

Picked greedily and deterministically: each next seed is the one that covers the most
targets not yet covered, the cheaper (`cost`) and then the lower seed on a tie (none that
costs more than `MOST_COST`); once every
coverable target is covered, the `LATER` targets get a seed more where none covers them
yet, seeds of families not yet in the sample fill it to `SIZE`, and the seeds `KEPT` for
a bug only they catch join it.
`--line keras3`, `--line tf_keras` or `--line jax` (Keras 3 on JAX, where it is
installed; no seed whose case draws what the JAX line refuses) picks for one line only
(in this process).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import subprocess
import sys

POOL = range(2000)
LINES = ("keras3", "tf_keras", "jax")  # jax: Keras 3 on JAX (KERAS_BACKEND=jax)
SIZE, MOST = 8, 10  # seeds per line: at least SIZE where families are left, at most MOST
# Keras 3 on JAX: fewer (a case there compiles each micro-batch shape, 5 to 40 s). Seven:
# with `add_loss` terms taken on JAX, six covered 44 of the 46 targets.
JAX_SIZE, JAX_MOST = 4, 7

# Optimizers whose update of a sparse gradient with repeated rows is the update of their
# sum (measured on Keras 3: one update with rows [1, 1, 3] against the same rows summed;
# every other optimizer of `_fuzz_cases.OPTIMIZERS` differs by 1e-4 to 0.15, Adamax too).
# Muon updates an Embedding as AdamW does.
ROW_LINEAR = ("SGD", "Lion")


# -- the axes: small functions of a drawn `Spec` -------------------------------------


def strategy(spec) -> bool:
    """Both runs under `MirroredStrategy` (the all-reduce concatenates the replicas' rows)."""
    return spec.mirrored


def sparse_gradient(spec) -> bool:
    """A trained Embedding (or the ragged family's gathered table): `tf.IndexedSlices`."""
    from _fuzz_cases import TOKEN_FAMILIES

    if spec.family == "ragged":
        return True
    frozen_embedding = spec.frozen == 0 and not spec.unfreeze  # trunk layer 0 is the Embedding
    return spec.family in TOKEN_FAMILIES and not spec.masking and not frozen_embedding


def nonlinear_optimizer(spec) -> bool:
    """An optimizer whose update is not linear in its gradient (Adam, RMSprop, ...)."""
    return spec.optimizer not in ROW_LINEAR


def counted_tokens(spec) -> bool:
    """A tagger whose split loss divides by the tokens its mask or ignored class leaves."""
    if spec.family != "tagger" or spec.whole_batch_loss or (spec.losses or ("usual",))[0] == "none":
        return False
    return spec.mask_zero or any(head.ignore_class is not None for head in spec.heads)


def clipped(spec) -> bool:
    """`clipnorm`, `clipvalue` or `global_clipnorm` (drawn below these gradients' sizes)."""
    from _fuzz_cases import CLIP_THRESHOLDS

    return bool(CLIP_THRESHOLDS.keys() & dict(spec.optimizer_options).keys())


def averaged_penalty(spec) -> bool:
    """A term of `model.losses` that each micro-batch adds its share of: a kernel or
    Embedding regulariser, an activity regulariser, a mean `add_loss`."""
    return spec.regularize or spec.embedding_penalty or spec.add_loss == "mean"


AXES = (strategy, sparse_gradient, nonlinear_optimizer, counted_tokens, clipped,
        averaged_penalty)


def line_axes():
    """`AXES` of the line in use: on JAX, no strategy (none is drawn there)."""
    from _fuzz_cases import JAX

    return tuple(axis for axis in AXES if not (JAX and axis is strategy))


def _micro_batches(spec):
    """Each training batch's micro-batch sizes (per replica), both `fit`s."""
    (setting, value), = spec.split
    fits = [(spec.batch_size, value)]
    if spec.refit:
        fits.append((spec.batch_size + 2, value + 1))
    for batch_size, value in fits:
        full, last = divmod(spec.samples, batch_size)
        for batch in [batch_size] * full + ([last] if last else []):
            rows = batch // 2 if spec.mirrored else batch
            size = value if setting == "micro_batch_size" else -(-rows // value)
            size = max(1, min(size, rows))
            count, rest = divmod(rows, size)
            yield [size] * count + ([rest] if rest else [])


def _split_loss(spec) -> bool:
    return not spec.whole_batch_loss


# Targets beyond the pairs, each a thing a wrong split shows on (tests/_mutations.py).
EXTRAS = {
    # Dropping `sum_rows` in the chained update: the replicas' rows concatenated again.
    "strategy+sparse_gradient+nonlinear_optimizer": lambda s: (
        strategy(s) and sparse_gradient(s) and nonlinear_optimizer(s)),
    "uneven micro-batches, split loss": lambda s: _split_loss(s) and any(
        len(set(sizes)) > 1 for sizes in _micro_batches(s)),
    "a one-sample micro-batch": lambda s: any(1 in sizes for sizes in _micro_batches(s)),
    "sample weights, split loss": lambda s: _split_loss(s) and bool(
        s.sample_weight or s.class_weight),
    "clipping on a split loss": lambda s: clipped(s) and _split_loss(s),
    "whole_batch_loss": lambda s: s.whole_batch_loss,
}


# Targets sought once the others are covered, with a seed more where none covers them yet.
LATER = {
    # tf_keras weighs a micro-batch's loss by its share after its loss container, but for
    # an output with a share of its own (counted tokens, a summed loss), in its weights.
    "sample weights on an output with a share of its own": lambda s: bool(
        (s.sample_weight or s.class_weight) and (counted_tokens(s) or (
            _split_loss(s) and "sum" in (s.reductions or ())))),
}


# Extras the JAX line draws no case of: a strategy.
NOT_ON_JAX = ("strategy+sparse_gradient+nonlinear_optimizer",)


def _line_extras() -> dict:
    from _fuzz_cases import JAX

    return {name: covers for name, covers in EXTRAS.items() if not (JAX and name in NOT_ON_JAX)}


def targets(spec) -> set:
    """What a case covers: `axis=value` pairs, and `EXTRAS` (of the line in use)."""
    values = {axis.__name__: axis(spec) for axis in line_axes()}
    covered = {
        f"{a}={values[a]:d} & {b}={values[b]:d}"
        for a, b in itertools.combinations(values, 2)
    }
    extras = _line_extras() | LATER
    return covered | {name for name, covers in extras.items() if covers(spec)}


def all_targets() -> list:
    names = [axis.__name__ for axis in line_axes()]
    pairs = [
        f"{a}={u:d} & {b}={v:d}"
        for a, b in itertools.combinations(names, 2)
        for u, v in itertools.product((False, True), repeat=2)
    ]
    return pairs + list(_line_extras()) + list(LATER)


def cost(spec) -> float:
    """A rough time of the case, to prefer the cheaper of two that cover as much."""
    slow_family = spec.family in ("recurrent", "tagger", "attention")
    gated = spec.family in ("recurrent", "tagger") and spec.recurrent != "SimpleRNN"
    bidirectional = spec.recurrent == "BidirectionalGRU" and spec.family in ("recurrent", "tagger")
    return (1.0 + 2.0 * spec.mirrored * (1 + slow_family) + 1.5 * slow_family + 1.0 * gated
            + 4.0 * spec.jit_compile + 1.0 * bidirectional + 1.0 * spec.refit + 1.0 * spec.reload
            + 1.0 * bool(spec.remat) + 0.5 * bool(spec.oom_at)
            + 1.5 * spec.run_eagerly + 0.5 * spec.validation + 1.0 * spec.float8
            + 0.5 * (spec.pruned or spec.quantized) + 0.5 * spec.strings + 0.5 * spec.monitored
            + 0.05 * spec.samples)


# Seeds left out of the pool, per line, with the reason (a case that fails or that plain
# Keras cannot run belongs in the long sweep's report, not in CI's sample).
EXCLUDED = {"keras3": {}, "tf_keras": {}, "jax": {}}
# Cases that cost more are left to the long sweep: a gated recurrent tagger under a
# strategy with recomputed segments (cost 9.4) took 98 s of an idle CI run on tf_keras.
MOST_COST = 8.0
# On JAX, where each micro-batch shape compiles anew: a SimpleRNN tagger at most (at
# 3.5 no tagger is left, no case of counted tokens; at 4.5 two LSTM taggers, cost 4.2
# and 4.3, took 57 and 67 s of a loaded machine, seeds 1586 and 1697).
JAX_MOST_COST = 4.0
# Seeds kept in a line's sample for a bug that `tests/_mutations.py` showed only they catch.
KEPT = {
    "jax": {},
    "keras3": {},
    "tf_keras": {1224: "float32_penalty_fraction (a conv1d with regularisers, SGD, "
                       "fractions of 3/5 and 2/5): no other case of the sample shows it"},
}


def choose(line: str):
    """`(seeds, covered, uncoverable)` for the Keras line this process runs."""
    from _fuzz_cases import FAMILIES, draw
    from _fuzz_jax import jax_refusals

    size, most = (JAX_SIZE, JAX_MOST) if line == "jax" else (SIZE, MOST)
    specs = {seed: draw(seed) for seed in POOL if seed not in EXCLUDED[line]}
    # On JAX, no case that draws what the JAX line refuses: the sample trains.
    most_cost = JAX_MOST_COST if line == "jax" else MOST_COST
    specs = {seed: spec for seed, spec in specs.items()
             if cost(spec) <= most_cost and not jax_refusals(spec)}
    covers = {seed: targets(spec) for seed, spec in specs.items()}
    wanted = all_targets()
    coverable = set().union(*covers.values()) & set(wanted)
    seeds = []
    for group in (coverable - set(LATER), coverable & set(LATER)):
        left = group - set().union(set(), *(covers[s] for s in seeds))
        while left and len(seeds) < most:
            seed = max(specs, key=lambda s: (len(covers[s] & left), -cost(specs[s]), -s))
            seeds.append(seed)
            left -= covers[seed]
    families = set(FAMILIES) - {specs[s].family for s in seeds}
    while families and len(seeds) < size:
        seed = min((s for s in specs if specs[s].family in families),
                   key=lambda s: (cost(specs[s]), s))
        seeds.append(seed)
        families.discard(specs[seed].family)
    seeds += [seed for seed in KEPT[line] if seed not in seeds]
    covered = set().union(*(covers[s] for s in seeds)) & set(wanted)
    uncoverable = [t for t in wanted if t not in coverable]
    return sorted(seeds), covered, uncoverable, {s: specs[s] for s in seeds}


def report(line: str):
    seeds, covered, uncoverable, specs = choose(line)
    wanted = all_targets()
    print(f"# {line}: {len(seeds)} seeds cover {len(covered)} of {len(wanted)} targets"
          f" ({len(wanted) - len(uncoverable)} coverable in seeds {POOL.start}..{POOL.stop - 1})")
    print(f"{line.upper()}_SEEDS = {seeds}")
    for seed in seeds:
        spec = specs[seed]
        axes = " ".join(f"{axis.__name__}={axis(spec):d}" for axis in line_axes())
        print(f"  {seed:5d} cost={cost(spec):4.1f} {axes}\n        {spec.describe()}")
    missed = [t for t in wanted if t not in covered and t not in uncoverable]
    print("  not covered (coverable):", missed or "none")
    print("  not coverable (no seed draws it):", uncoverable or "none")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--line", choices=LINES,
                        help="pick for this Keras line only, in this process")
    args = parser.parse_args(argv)
    if args.line:
        os.environ["TF_USE_LEGACY_KERAS"] = "1" if args.line == "tf_keras" else "0"
        os.environ["KERAS_BACKEND"] = "jax" if args.line == "jax" else "tensorflow"
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        report(args.line)
        return 0
    # A process per line: the line is read at import. JAX's where it is installed.
    lines = [line for line in LINES if line != "jax" or importlib.util.find_spec("jax")]
    for line in lines:
        subprocess.run([sys.executable, __file__, "--line", line], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
