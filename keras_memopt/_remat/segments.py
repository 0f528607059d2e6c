"""Segments of a functional model: where to cut it, and running it segment by segment.

`plan_segments(model, remat)` finds the cut points (`"auto"`: by activation
sizes along the graph's separating tensors; or the named layers), and
`SegmentPlan` runs the model as a chain of segments, each recomputed in the
backward pass (`keras_memopt._remat.recompute`) and/or placed on a device
(`keras_memopt.placement`). `AccumulatingModel(remat=...)` uses them.
"""

from __future__ import annotations

import warnings

from keras_memopt import _keras
from keras_memopt._remat import graph as _graph
from keras_memopt._remat.recompute import check_no_activity_regularizer, on, on_device, recompute


def _estimate_peak(blocks, boundaries, cuts):
    """Estimated activation peak (bytes) when cutting after the given blocks.

    Segments before the last are recomputed: during the backward pass of
    segment k the stored boundary tensors up to k and the segment's own
    activations are alive. The last segment is not recomputed.
    """
    peak, stored, start = 0, 0, 0
    for end in [*cuts, len(blocks) - 1]:
        peak = max(peak, stored + sum(blocks[start : end + 1]))
        if end < len(blocks) - 1:
            stored += boundaries[end]
        start = end + 1
    return peak


def _choose_cuts(blocks, boundaries):
    """Cuts minimising the estimated peak over a range of segment budgets."""
    total = sum(blocks)
    best_cuts, best_peak = [], total
    low = max(max(blocks), 1)
    steps = 64
    for step in range(steps + 1):
        budget = low * (max(total, low) / low) ** (step / steps)
        cuts, running = [], 0
        for index, size in enumerate(blocks[:-1]):
            running += size
            if running + blocks[index + 1] > budget:
                cuts.append(index)
                running = 0
        peak = _estimate_peak(blocks, boundaries, cuts)
        if peak < best_peak or (peak == best_peak and len(cuts) < len(best_cuts)):
            best_cuts, best_peak = cuts, peak
    return best_cuts, best_peak


def plan_segments(model, remat):
    """The node indices after which `model`'s recomputed segments end.

    With `remat="auto"`: the candidate cut points are the tensors that
    separate the graph (every path from the inputs to the outputs passes
    through them: the output of a block in a chain, a residual block's output
    after its addition). Consecutive cut points delimit blocks whose activation
    sizes are read from the model's static shapes (bytes per sample). Segments
    are made by merging blocks up to a budget; the budget is chosen among 65
    values between the largest block and the whole model so that the estimated
    peak, the stored boundary tensors plus the largest segment's activations,
    is smallest. For n equal layers this gives the classic about-√n segments.
    The last segment (the head, whose backward pass starts right after its
    forward pass) is never recomputed. Only the model's own graph is
    searched: a nested model is one node.

    Returns:
        A list of node indices (the cut points) and the `keras_memopt._remat.graph.Graph`.
    """
    graph = _graph.Graph(model)
    if remat == "auto":
        separators = graph.separators()
        regularised = [i for i in range(len(graph.nodes)) if graph.regularised(i)]
        if regularised:  # Everything up to the last cut is recomputed.
            separators = [i for i in separators if i < regularised[0]]
        blocks, start = [], 0
        for end in [*separators, len(graph.nodes) - 1]:
            blocks.append(sum(graph.sizes[start : end + 1]))
            start = end + 1
        boundaries = [graph.sizes[i] for i in separators]
        chosen, peak = _choose_cuts(blocks, boundaries)
        cuts = [separators[i] for i in chosen]
        if not cuts or peak >= 0.9 * sum(blocks):
            warnings.warn(
                f"remat='auto' found nothing worth recomputing in model "
                f"{model.name!r}: no tensor that separates its graph splits it "
                "into segments that lower its activation memory. Training "
                "goes on without recomputation; wrap blocks in "
                "`keras_memopt.Remat` or name cut layers in `remat=[...]`.",
                stacklevel=3,
            )
            return [], graph
        return cuts, graph
    cuts = _graph.named_cuts(graph, model, remat, "remat")
    check_no_activity_regularizer(
        [graph.nodes[i][0] for i in range(cuts[-1] + 1)], f"remat in model {model.name!r}"
    )
    return cuts, graph


class SegmentPlan:
    """A functional model's forward pass run as a chain of segments.

    Each segment is a functional model over the original layers (weights
    shared) from one cut tensor to the next. In training, the segments marked
    in `recomputed` (by default all but the last) are recomputed in the
    backward pass. A segment given a device in `devices` runs there, its
    backward pass included (see `keras_memopt.placement`).
    """

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
        x = inputs
        for segment, recomputed, device in zip(
            self.segments, self.recomputed, self.devices, strict=True
        ):
            def call(t, segment=segment):
                return segment(t, training=training)

            if training and recomputed:
                x = recompute(call, segment, (x,), device=device)
            elif training and device:
                x = on_device(call, (x,), device)
            else:
                with on(device):
                    x = call(x)
        return x


def build_plan(model, remat):
    """The `SegmentPlan` for `AccumulatingModel(..., remat=remat)`, or None."""
    if remat is None:
        return None
    cuts, graph = plan_segments(model, remat)
    if not cuts:
        return None
    return SegmentPlan(model, cuts, graph)


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
