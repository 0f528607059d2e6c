"""Segments of a functional model: where to cut it (`plan_segments`), and running it as a
chain of segments (`SegmentPlan`), each recomputed and/or placed on a device."""

from __future__ import annotations

import functools
from typing import NamedTuple

import tensorflow as tf

from keras_memopt import _keras
from keras_memopt._remat import candidates as _candidates
from keras_memopt._remat import choice as _remat_choice
from keras_memopt._remat import graph as _graph
from keras_memopt._remat.recompute import check_recomputable, on, on_device, recompute

# The micro-batch `remat="auto"` estimates at where the model has no number (whole batch, "auto"):
# large, so that candidates are ranked by what each sample keeps, where recomputation matters.
_NOMINAL_BATCH = 4096


class Cuts(NamedTuple):
    """Where `plan_segments` cuts a model, and why."""

    indices: list  # node indices after which segments end, in graph order
    graph: _graph.Graph
    note: str = ""  # what `remat="auto"` chose and why
    lookup_kept: bool = False  # the first segment, a leading `Embedding`, is not recomputed


def plan_segments(model, remat, batch=None) -> Cuts:
    """Where `model`'s recomputed segments end (`Cuts`), for `remat` "auto" or layer names. `"auto"`
    cuts at tensors that separate the graph and picks the candidate with the lowest estimated step
    peak at `batch` samples (defaults to the model's `micro_batch_size` where it is a number, else
    4096); where the step cannot be traced, nothing is recomputed, with a warning. The last segment
    is never recomputed; a nested model is one node. See docs/remat.md."""
    graph = _graph.Graph(model)
    if remat != "auto":
        cuts = _graph.named_cuts(graph, model, remat, "remat")
        check_recomputable(
            [graph.nodes[i][0] for i in range(cuts[-1] + 1)], f"remat in model {model.name!r}"
        )
        return Cuts(cuts, graph)
    separators = candidate_separators(graph)
    if batch is None:
        size = getattr(model, "micro_batch_size", None)
        batch = size if isinstance(size, int) else _NOMINAL_BATCH
    chosen, note, traced = _auto_cuts(model, graph, separators, batch)
    if not chosen:
        why = note if not traced else (
            "no set of segments between tensors that separate its graph saves 5% or more "
            "of its estimated step peak" + (f" ({note})" if note else "")
        )
        _candidates.warn_nothing_chosen(model, why, stacklevel=3)
        return Cuts([], graph, note)
    return _keep_lookup(graph, separators, [separators[i] for i in chosen], note)


def _keep_lookup(graph, separators, cuts, note) -> Cuts:
    """`cuts`, a leading `Embedding` lookup made a kept segment of its own where the first
    segment would hold it (recomputed, it measured higher: docs/remat.md)."""
    first = separators[0]
    layer = graph.nodes[first][0]
    leading = isinstance(layer, _keras.keras.layers.Embedding) and all(
        graph.is_input(i) for i in range(len(graph.nodes)) if graph.ancestors[first] >> i & 1
    )
    if not leading or cuts == [first]:
        return Cuts(cuts, graph, note)
    note = (f"{note}; " if note else "") + (
        f"and before them the lookup of layer {layer.name!r}, a segment of its own, kept"
    )
    return Cuts(sorted({first, *cuts}), graph, note, lookup_kept=True)


def candidate_separators(graph):
    """The cut points `remat="auto"` considers: up to the first layer not rerun exactly."""
    separators = graph.separators()
    refused = [i for i in range(len(graph.nodes)) if graph.unrecomputable(i)]
    if refused:  # Everything up to the last cut is recomputed.
        separators = [i for i in separators if i < refused[0]]
    return separators


def estimated_candidates(model, batch):
    """[(description, cut layers' names, estimated peak in bytes)] for `remat="auto"`'s
    candidates at `batch` samples, lowest first; `ValueError` where there is no segment."""
    graph = _graph.Graph(model)
    separators = candidate_separators(graph)
    if not separators:
        raise ValueError(
            f"Model {model.name!r} has no tensor that separates its graph: there is no "
            "segment to recompute. Received: model=" + repr(model.name)
        )
    traced, separators = _traced_units(model, graph, separators)
    if traced is None:
        raise ValueError(
            f"Model {model.name!r} adds a loss in `call` before its first tensor that "
            "separates its graph: there is no segment to recompute (the term would get "
            "no gradient). Received: model=" + repr(model.name)
        )
    found = [
        (name, [graph.nodes[separators[i]][0].name for i in cuts], peak)
        for cuts, (name, peak) in _remat_choice.estimates(traced, batch).items()
    ]
    return sorted(found, key=lambda row: row[2])


def _auto_cuts(model, graph, separators, batch):
    """(indices into `separators`, note, whether the step was traced) for `remat="auto"`."""
    if not separators:
        return [], "", True
    try:
        traced, separators = _traced_units(model, graph, separators)
        if traced is None:
            return [], ("a layer that adds a loss in `call` comes before any tensor that "
                        "separates its graph (recomputed, the term would get no gradient)"), False
        choice = _remat_choice.choose(traced, batch)
    except (TypeError, ValueError, NotImplementedError, tf.errors.OpError) as error:
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
        return [], f"its step could not be traced to estimate its peak ({reason})", False
    return choice.cuts, choice.note, True


def _traced_units(model, graph, separators):
    """(`TracedUnits` between `separators`, the separators), ending before the first unit that adds
    a loss in `call` (recomputed, its term gets no gradient); (None, []) where none is left."""
    traced = _remat_choice.TracedUnits(model, SegmentPlan(model, separators, graph).segments)
    if traced.adding_loss is None or traced.adding_loss >= len(separators):
        return traced, separators
    separators = separators[:traced.adding_loss]
    if not separators:
        return None, []
    units = SegmentPlan(model, separators, graph).segments
    return _remat_choice.TracedUnits(model, units), separators


class SegmentPlan:
    """A functional model's forward pass run as a chain of segments, functional models over
    the same layers; in training, those marked `recomputed` (default: all but the last) are
    recomputed, and each runs on its `devices` entry, backward pass included."""

    def __init__(self, model, cuts, graph, recomputed=None, devices=None):
        inputs, outputs = _keras.nested_inputs_outputs(model)
        ends = [graph.nodes[i][2][0] for i in cuts]
        boundaries = [inputs, *ends, outputs]
        self.segments = []
        for index in range(len(boundaries) - 1):
            segment = _keras.keras.Model(
                boundaries[index],
                boundaries[index + 1],
                name=f"{model.name}_segment_{index}",
            )
            self.segments.append(segment)
        count = len(self.segments)
        self.recomputed = recomputed or [True] * (count - 1) + [False]
        self.devices = devices or [None] * count
        self.placed = any(self.devices)

    def __call__(self, inputs, training):
        """The model's outputs, with their Keras masks (`recompute` and `on_device` carry
        each segment's output masks onto their new tensors)."""
        x = inputs
        for segment, recomputed, device in zip(
            self.segments, self.recomputed, self.devices, strict=True
        ):
            call = functools.partial(_silenced, segment, training=training)
            if training and recomputed:
                x = recompute(call, segment, (x,), device=device)
            elif training and device:
                x = on_device(call, (x,), device)
            else:
                with on(device):
                    x = call(x)
        return x


def _silenced(segment, x, training):
    """`segment(x)`, also where its recomputation runs it again."""
    with _keras.mask_warning_silenced():
        return segment(x, training=training)


def build_plan(model, remat):
    """(`SegmentPlan` or None, note) for `AccumulatingModel(..., remat=remat)`."""
    if remat is None:
        return None, ""
    cuts = plan_segments(model, remat)
    if not cuts.indices:
        return None, cuts.note
    recomputed = [True] * len(cuts.indices) + [False]
    recomputed[0] = not cuts.lookup_kept
    return SegmentPlan(model, cuts.indices, cuts.graph, recomputed), cuts.note


def recomputed_layer_names(plan) -> list[list[str]]:
    """The names of the layers of each recomputed segment of `plan` (None: no segments)."""
    if plan is None:
        return []
    names = []
    for segment, recomputed in zip(plan.segments, plan.recomputed, strict=True):
        if recomputed:
            names.append([
                layer.name for layer in segment.layers
                if not isinstance(layer, _keras.keras.layers.InputLayer)
            ])
    return names
