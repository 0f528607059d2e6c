"""`remat="auto"`: which segments to recompute, chosen from the traced step.

The model is traced once, unit by unit (`_remat.liveness`), every op labelled with its unit (a
gradient op by its forward op's name scope, else by the earliest unit it reads from). Each candidate
is played on that graph as it would run, a recomputed segment's forward ops again just before its
first gradient op, the loop's gradient sum alive all along (without it, gradients made late hid what
recomputation frees early; issue 55). Candidates and rule: `_remat.candidates`, docs/remat.md."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import tensorflow as tf

from keras_memopt import _keras
from keras_memopt._memory.sizes import variables_bytes
from keras_memopt._remat import liveness as _liveness
from keras_memopt._remat.candidates import blocks, candidates, pick, unit_signatures
from keras_memopt._remat.recompute import added_losses


@dataclasses.dataclass
class Choice:
    """What `remat="auto"` chose (`cuts`: the units after which segments end) and why: the
    estimated `peaks` in bytes ("none", "every cut point", "chosen") at `batch`, and a `note`."""

    cuts: list
    batch: int
    peaks: dict
    note: str


class TracedUnits:
    """A model's step traced unit by unit, and the schedule of a set of cuts.

    `units`: the segments' functional models, in order, the last the head;
    `adding_loss`: the first unit that adds an `add_loss` term in `call`, or None."""

    def __init__(self, model, units):
        inputs, _ = _keras.nested_inputs_outputs(model)
        flat = tf.nest.flatten(inputs)
        specs = [tf.TensorSpec((None, *t.shape[1:]), t.dtype) for t in flat]
        bounds, adding = [], []

        def call(*tensors):
            graph = tf.compat.v1.get_default_graph()
            x = tf.nest.pack_sequence_as(inputs, list(tensors))
            for index, unit in enumerate(units):
                bounds.append(len(graph.get_operations()))
                with added_losses(unit) as grown, _keras.mask_warning_silenced():
                    x = unit(x, training=True)
                if grown:
                    adding.append(index)
            bounds.append(len(graph.get_operations()))
            loss = tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in tf.nest.flatten(x)])
            bounds.append(len(graph.get_operations()))
            return loss

        graph, kept = _liveness.trace(call, specs, model.trainable_variables)
        self.step = _liveness.StepGraph(graph, kept, cpu=not tf.config.list_logical_devices("GPU"))
        self.parameters = variables_bytes(model.weights)
        self.count = len(units)
        self.adding_loss = adding[0] if adding else None
        self.signatures = unit_signatures(units)
        # The gradients the step returns: the loop folds each into the sum as soon as it is made.
        self.gradients = {
            buffer for buffer in self.step.kept
            if self.step.ops[self.step.producer[buffer]].type != "Placeholder"
        }
        self._label(bounds)

    def _label(self, bounds):
        """Each op's unit: -1 before the model; a float for gradient ops."""
        ops = self.step.ops
        self.backward_start = bounds[-1]
        unit = np.full(len(ops), -1.0)
        for index in range(self.count):
            unit[bounds[index]:bounds[index + 1]] = index
        unit[bounds[-2]:bounds[-1]] = self.count - 1  # the loss: with the head
        self.forward_unit = unit[: self.backward_start].astype(np.int64)
        named = {}  # forward ops' names and name scopes: their unit
        for i in range(bounds[0], self.backward_start):
            parts = ops[i].name.split("/")
            for end in range(1, len(parts) + 1):
                named.setdefault("/".join(parts[:end]), unit[i])
        read_by = self._read_by(unit)
        for index in range(self.backward_start, len(ops)):
            found = _differentiated(ops[index].name, named)
            unit[index] = self._from_inputs(index, unit, read_by) if found is None else found
        self.gradient_unit = np.ceil(np.maximum(unit[self.backward_start:], -0.5))

    def _read_by(self, unit):
        """Each buffer's label as a gradient op's input: a tensor a later unit
        reads is that unit's input as much as its maker's output."""
        labels = {}
        for buffer, users in enumerate(self.step.users):
            made = unit[self.step.producer[buffer]]
            later = [u for u in users if u < self.backward_start and unit[u] > made]
            labels[buffer] = made + 0.5 if later else made
        return labels

    def _from_inputs(self, index, unit, read_by):
        """A gradient op that names no forward op: the earliest unit it reads from."""
        labels = []
        for tensor in self.step.ops[index].inputs:
            buffer = self.step.buffer_of.get(tensor.ref())
            if buffer is None:
                continue
            producer = self.step.producer[buffer]
            labels.append(read_by[buffer] if producer < self.backward_start else unit[producer])
        return min(labels, default=math.inf)

    def profile(self, cuts):
        """The `_liveness.Profile` of the step with segments ending after `cuts`."""
        segment_of_unit = np.searchsorted(np.asarray(sorted(cuts), dtype=np.int64),
                                          np.arange(self.count), side="left")
        last = len(cuts)  # the last segment, never recomputed
        forward_segment = np.where(self.forward_unit >= 0,
                                   segment_of_unit[np.maximum(self.forward_unit, 0)], -1)
        recomputed = (forward_segment >= 0) & (forward_segment < last)
        gradient_segment = np.full(len(self.gradient_unit), -1)
        finite = np.isfinite(self.gradient_unit)
        gradient_segment[finite] = segment_of_unit[
            np.clip(self.gradient_unit[finite].astype(np.int64), 0, self.count - 1)
        ]
        position, again = self._positions(forward_segment, gradient_segment, last)
        return self._lifetimes(position, again, forward_segment, recomputed, gradient_segment)

    def _positions(self, forward_segment, gradient_segment, last):
        """Where each op runs in the schedule; `again[i]`: where a recomputed op runs again."""
        ops = len(self.step.ops)
        position = np.zeros(ops, dtype=np.int64)
        again = np.full(ops, -1, dtype=np.int64)
        position[: self.backward_start] = np.arange(self.backward_start)
        now, done = self.backward_start, set()
        for index in range(self.backward_start, ops):
            segment = gradient_segment[index - self.backward_start]
            if 0 <= segment < last and segment not in done:
                done.add(segment)
                members = np.flatnonzero(forward_segment == segment)
                again[members] = now + np.arange(len(members))
                now += len(members)
            position[index] = now
            now += 1
        self.length = now + 1
        return position, again

    def _lifetimes(self, position, again, forward_segment, recomputed, gradient_segment):
        step, start = self.step, self.backward_start
        firsts, lasts, sizes, floored = [], [], [], []
        for buffer, users in enumerate(step.users):
            producer = step.producer[buffer]
            size = step.sizes[buffer]
            own = forward_segment[producer] if producer < start else -2
            ends, copy_ends = [position[producer]], []
            for user in users:
                if user < start:
                    if own >= 0 and recomputed[producer] and forward_segment[user] == own:
                        ends.append(position[user])
                        copy_ends.append(again[user])
                        continue
                    ends.append(max(position[user], again[user]))
                elif own >= 0 and recomputed[producer] and gradient_segment[user - start] == own:
                    copy_ends.append(position[user])
                else:
                    ends.append(position[user])
            if buffer in self.gradients:
                ends = [position[producer] + 1]  # folded into the sum at once
            elif buffer in step.kept:
                ends.append(self.length - 1)
            firsts.append(position[producer])
            lasts.append(max(ends))
            sizes.append(size)
            floored.append(buffer in step.floored)
            if copy_ends and again[producer] >= 0:
                firsts.append(again[producer])
                lasts.append(max(again[producer], *copy_ends))
                sizes.append(size)
                floored.append(buffer in step.floored)
        # The gradient sum of the micro-batches before, alive all along.
        firsts.append(0)
        lasts.append(self.length - 1)
        sizes.append(step.sizes[sorted(self.gradients)].sum(axis=0))
        floored.append(False)
        sizes = np.array(sizes, dtype=np.float64).reshape(-1, 2)
        return _liveness.Profile(firsts, lasts, sizes, self.length, np.array(floored, dtype=bool))

    def recomputed_bytes(self, cuts):
        """Per-sample bytes the recomputation makes again (its cost in time)."""
        if not cuts:
            return 0.0
        end = max(cuts)
        total = 0.0
        for buffer, producer in enumerate(self.step.producer):
            if producer < self.backward_start and 0 <= self.forward_unit[producer] <= end:
                total += self.step.sizes[buffer][0]
        return total


def _differentiated(name, forward):
    """The unit of the forward op that gradient op `name` differentiates (the tape names it
    `gradient_tape/<forward scope>/<op>`; `forward` maps forward names and scopes to units)."""
    prefix = "gradient_tape/"
    if not name.startswith(prefix):
        return None
    parts = name[len(prefix):].split("/")
    for end in range(len(parts) - 1, 1, -1):
        found = forward.get("/".join(parts[:end]))
        if found is not None:
            return found
    return None


def estimates(traced, batch):
    """{cuts: (description, estimated peak in bytes at `batch` samples)} of `candidates`."""
    return {
        cuts: (name, traced.profile(list(cuts)).peak(batch))
        for cuts, name in candidates(traced.count, traced.signatures).items()
    }


def choose(traced, batch):
    """The `Choice` among `candidates` for `traced` at `batch` samples."""
    estimated = estimates(traced, batch)
    peaks = {cuts: peak for cuts, (_, peak) in estimated.items()}
    names = {cuts: name for cuts, (name, _) in estimated.items()}
    best = pick(peaks, lambda cuts: (traced.recomputed_bytes(cuts), -len(cuts)),
                blocks(traced.signatures), traced.parameters)
    none = peaks[()]
    per_unit = tuple(range(traced.count - 1))
    summary = {"none": none, "every cut point": peaks.get(per_unit, none), "chosen": peaks[best]}
    note = _note(names[best], len(best), summary, batch)
    return Choice(cuts=list(best), batch=batch, peaks=summary, note=note)


def _note(name, cuts, peaks, batch):
    def mib(value):
        return f"{value / 2**20:.1f} MiB"

    segments = f" ({cuts + 1} segments, the last not recomputed)" if cuts else ""
    return (
        f"{name}{segments}: estimated step peak {mib(peaks['chosen'])} (activations, "
        f"gradients and their sum) at a micro-batch of {batch}, against "
        f"{mib(peaks['none'])} without recomputation and {mib(peaks['every cut point'])} "
        "with a segment at every cut point"
    )
