"""The recomputed segments of a JAX `AccumulatingModel`: named (`remat=[...]`) or chosen
(`remat="auto"`) by XLA's memory analysis of the compiled train step.

`remat="auto"` takes the TensorFlow line's cut points (`_remat.segments.candidate_separators`) and
candidates (`_remat.candidates`), and measures each the JAX way: the model's train step, with that
candidate's segments, is lowered and compiled for abstract arrays (`jax.ShapeDtypeStruct`) of the
step's batch, split as the step splits it (on the state's and the batch's own shardings under
`keras.distribution.DataParallel`), so nothing runs, and `memory_analysis()` gives its temporaries.
`pick` chooses by the TensorFlow line's rule, what a candidate recomputes counted as its units
recomputed. The choice is made once per micro-batch setting, before that setting's first
compiled step, when the step's state and batch are known; a new setting (`OOMBackoff`, a new
`micro_batch_size`) chooses anew, and going back to one reuses its choice. docs/remat.md ("On
JAX") has the figures.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from keras_memopt._keras import keras
from keras_memopt._memory.sizes import variables_bytes
from keras_memopt._remat import candidates as _candidates
from keras_memopt._remat import graph as _graph
from keras_memopt._remat import segments as _segments
from keras_memopt._step import jax_step
from keras_memopt._step.jax_fractions import Refused

# Above this many candidates, `"auto"` compiles a geometric sample of the "every k cut
# points" ones (k = 1, 2, 3, 4, 6, 8, 12, ...), besides none and a segment per block.
MAX_COMPILED = 16


class Recomputation:
    """A functional model's recomputed segments: none (`names` None), after the layers
    `names` (a tuple), or `remat="auto"`'s choice (`names` "auto", chosen by `prepare`).

    `stages` is the model's forward pass in training: its segments (functional models
    over its own layers; the TensorFlow line's `SegmentPlan`, which checks the names),
    each but the last wrapped in `recomputed` (`keras_memopt.Remat`). `note` says what
    `"auto"` chose and why. A plain holder: Keras does not track the segments.
    """

    def __init__(self, model, names, recomputed):
        self.model = model
        self._recomputed = recomputed
        self.names = names if names is None or names == "auto" else tuple(names)
        self.plan, self.stages, self.note = None, [], ""
        self._chosen = {}  # micro-batch setting -> (plan, stages, note)
        if self.names is not None and self.names != "auto":
            self.plan, _ = _segments.build_plan(model, list(self.names))
            self.stages = self._stages(self.plan)

    def prepare(self, state, data):
        """Before a train step on `data` from `state`: with `"auto"`, the segments of the
        model's micro-batch setting (chosen at its first step)."""
        if self.names != "auto":
            return
        model = self.model
        setting = (model.micro_batch_size, model.accumulation_steps)
        if setting not in self._chosen:
            self._chosen[setting] = self._choose(state, data)
        self.plan, self.stages, self.note = self._chosen[setting]

    def _choose(self, state, data):
        model = self.model
        graph = _graph.Graph(model)
        separators = _segments.candidate_separators(graph)
        if not separators:
            _candidates.warn_nothing_chosen(
                model, "no tensor separates its graph before the head", stacklevel=4)
            return None, [], "none: no tensor separates its graph"
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        split = jax_step.Split(model.micro_batch_size_for, jax_step.batch_size_of(x))
        micro = split.m * split.devices
        units = _segments.SegmentPlan(model, separators, graph).segments
        found = _thinned(_candidates.candidates(len(units), _candidates.unit_signatures(units)))
        # The whole step (its micro-batches, the gradients' sum): with `accumulation_steps`
        # a micro-batch's rows alone would be split again.
        specs = (_abstract(state), _abstract(data))
        started = time.perf_counter()
        temporaries, plans = {}, {}
        for cuts in found:
            plan = (_segments.SegmentPlan(model, [separators[i] for i in cuts], graph)
                    if cuts else None)
            try:
                temporaries[cuts] = self._temporaries(self._stages(plan), specs)
            except (Refused, TypeError, ValueError, NotImplementedError):
                if not cuts:
                    raise  # the step itself fails so
                continue  # a candidate it cannot recompute (an `add_loss` in a segment)
            plans[cuts] = plan
        seconds = time.perf_counter() - started
        per_block = _candidates.blocks(_candidates.unit_signatures(units))
        best = _candidates.pick(temporaries, lambda cuts: (max(cuts, default=-1), -len(cuts)),
                                per_block, variables_bytes(model.weights))
        every = tuple(range(len(units) - 1))
        shares = f" ({split.m} on each of {split.devices} devices)" if split.devices > 1 else ""
        note = _note(found[best], temporaries, best, every, f"{micro}{shares}", seconds)
        if not best:
            _candidates.warn_nothing_chosen(model, (
                "no set of segments between tensors that separate its graph saves 5% or more "
                f"of its compiled step's temporaries and weights ({note})"), stacklevel=4)
        return plans[best], self._stages(plans[best]), note

    def _stages(self, plan):
        if plan is None:
            return []
        return [self._recomputed(segment) if recomputed else segment
                for segment, recomputed in zip(plan.segments, plan.recomputed, strict=True)]

    def _temporaries(self, stages, specs):
        """Bytes of temporaries of the model's train step compiled with `stages`
        (donating its state, as Keras's steps do)."""
        saved = self.stages
        self.stages = stages
        try:
            lowered = jax.jit(self.model.train_step, donate_argnums=0).lower(*specs)
            return lowered.compile().memory_analysis().temp_size_in_bytes
        finally:
            self.stages = saved


def _abstract(tree):
    """`tree`'s arrays as `jax.ShapeDtypeStruct`s, on their own shardings."""

    def spec(leaf):
        if not isinstance(leaf, (jax.Array, np.ndarray)):
            return leaf
        sharding = leaf.sharding if isinstance(leaf, jax.Array) else None
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    return jax.tree_util.tree_map(spec, tree)


def _thinned(found):
    """`found`, or, above `MAX_COMPILED` candidates, none, a segment per block and the
    "every k cut points" ones for k in 1, 2, 3, 4, 6, 8, 12, ... ."""
    if len(found) <= MAX_COMPILED:
        return found
    kept = {1, 2, 3}
    k = 4
    while k <= len(found):
        kept.update({k, k * 3 // 2})
        k *= 2

    def every(name):
        if name == _candidates.EVERY_CUT_POINT:
            return 1
        words = name.split()
        return int(words[3]) if name.startswith("a segment every ") else None

    return {cuts: name for cuts, name in found.items()
            if every(name) is None or every(name) in kept}


def _note(name, temporaries, best, every, micro, seconds):
    def mib(cuts):
        return f"{temporaries.get(cuts, temporaries[()]) / 2**20:.1f} MiB"

    segments = f" ({len(best) + 1} segments, the last not recomputed)" if best else ""
    return (
        f"{name}{segments}: temporaries of the compiled train step {mib(best)} "
        f"(XLA's memory analysis) at a micro-batch of {micro}, against {mib(())} without "
        f"recomputation and {mib(every)} with a segment at every cut point; "
        f"{len(temporaries)} candidates compiled in {seconds:.1f} s"
    )
