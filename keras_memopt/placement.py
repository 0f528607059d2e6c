"""Segments of a functional model on several devices (model parallelism): `devices=[...]` cuts it
at `remat`'s cut points into one segment per device, its variables (re-created there, Keras 3),
optimizer slots and computation on it; they run one after another. See docs/distributed.md."""

from __future__ import annotations

import tensorflow as tf

from keras_memopt import _keras
from keras_memopt._remat import graph as _graph
from keras_memopt._remat import segments as _segments

__all__ = ["Placement", "PlacementMixin", "build_plan", "place", "validate"]


class Placement:
    """Where a functional model's segments live: `devices` and `device_cuts` as given, `cuts`
    the node indices after which the segments end."""

    def __init__(self, devices, device_cuts, cuts):
        self.devices = tuple(devices)
        self.device_cuts = device_cuts
        self.cuts = list(cuts)

    def device_of(self, node):
        """The device of the segment that holds node index `node`."""
        return self.devices[sum(cut < node for cut in self.cuts)]


class PlacementMixin:
    """The part of `AccumulatingModel` that places its segments (a mixin)."""

    @property
    def devices(self) -> list[str] | None:
        """The segments' devices, in order, or None (one device)."""
        return config(self._placement)["devices"]

    @property
    def device_cuts(self) -> str | list[str] | None:
        """`"auto"` or the names of the layers that end the segments; None without `devices`."""
        return config(self._placement)["device_cuts"]

    def _set_placement(self, devices, device_cuts):
        setting = validate(devices, device_cuts, self, isinstance(self, _keras.Functional))
        self._placement = place(self, *setting) if setting else None


def config(placement):
    """The setting as `AccumulatingModel`'s config saves it."""
    if placement is None:
        return dict(devices=None, device_cuts=None)
    cuts = placement.device_cuts
    return dict(devices=list(placement.devices), device_cuts=cuts if cuts == "auto" else list(cuts))


def _device_key(name):
    """(type, index) of a device name, or None when it names no device."""
    try:
        spec = tf.DeviceSpec.from_string(name)
    except (ValueError, TypeError):
        return None
    if spec.device_type is None:
        return None
    return spec.device_type.upper(), spec.device_index or 0


def validate(devices, device_cuts, model, functional):
    """Checks the setting before the model changes; returns `(devices, device_cuts)`
    normalised (a tuple, `"auto"` or a list), or None when `devices` is None."""
    received = f"Received: devices={devices!r}, device_cuts={device_cuts!r}"
    if devices is None:
        if device_cuts is not None:
            raise ValueError(
                f"`device_cuts` cuts the model into segments for `devices`; pass `devices` "
                f"too, one device per segment. {received}"
            )
        return None
    if not functional:
        raise ValueError(
            "`devices` places the segments of a functional model's graph; a "
            "subclassed model places its blocks itself, with `tf.device` in `call` "
            f"(and in `build`). {received} for {type(model).__name__}"
        )
    if tf.distribute.has_strategy():
        raise ValueError(
            "`devices` places each segment on a device of its own, which cannot "
            "be combined with a distribution strategy that places every variable "
            f"on each replica. {received} under "
            f"{type(tf.distribute.get_strategy()).__name__}"
        )
    if isinstance(devices, str) or not isinstance(devices, (list, tuple)) or not devices:
        raise ValueError(
            "`devices` must be a non-empty list of device names, one per segment, "
            f"such as ['/GPU:0', '/GPU:1']. {received}"
        )
    available = {_device_key(d.name): d.name for d in tf.config.list_logical_devices()}
    for device in devices:
        if not isinstance(device, str) or _device_key(device) not in available:
            raise ValueError(
                f"`devices` names {device!r}, which is not a device of this machine. "
                f"Expected names among {sorted(available.values())}. {received}"
            )
    if device_cuts is None or (isinstance(device_cuts, str) and device_cuts == "auto"):
        return tuple(devices), "auto"
    names = device_cuts if isinstance(device_cuts, (list, tuple)) else None
    if (
        names is None
        or len(names) != len(devices) - 1
        or not all(isinstance(name, str) for name in names)
        or len(set(names)) != len(names)
    ):
        raise ValueError(
            "`device_cuts` must be 'auto' or a list of len(devices) - 1 distinct "
            f"layer names, the layers whose outputs end the segments: "
            f"{len(devices) - 1} for {len(devices)} devices. {received}"
        )
    return tuple(devices), list(names)


def place(model, devices, device_cuts):
    """Cuts `model` for `devices` and moves each variable to its segment's device.

    A layer called in several segments keeps its variables on the first one's. Returns the
    `Placement`; `ValueError` (before anything moves) for a cut that cannot be made, and on
    tf_keras for a variable elsewhere."""
    graph = _graph.Graph(model)
    if device_cuts == "auto":
        cuts = _balanced_cuts(graph, model, len(devices))
    else:
        cuts = _graph.named_cuts(graph, model, device_cuts, "device_cuts")
    placement = Placement(devices, device_cuts, cuts)
    moves = []
    for variable, node in _owned_variables(graph):
        device = placement.device_of(node)
        if _device_key(_keras.variable_device(variable)) != _device_key(device):
            moves.append((variable, device))
    if moves and not _keras.MOVES_VARIABLES:
        variable, device = moves[0]
        raise ValueError(
            "tf_keras cannot move a layer's variables to another device once they "
            f"exist: {variable.name!r} is on {_keras.variable_device(variable)!r}, and "
            f"its segment runs on {device!r}. Create each segment's layers (call "
            "them on the model's inputs) under `with tf.device(...)`, or use "
            f"Keras 3. Received: devices={list(devices)!r}, device_cuts={device_cuts!r}"
        )
    for variable, device in moves:
        _keras.move_variable(variable, device)
    return placement


def _owned_variables(graph):
    """`(variable, node)` for each variable of the model's layers and the first node using it."""
    owners = {}
    for node, (layer, _, _) in enumerate(graph.nodes):
        for variable in layer.variables:
            owners.setdefault(id(variable), (variable, node))
    return list(owners.values())


def _balanced_cuts(graph, model, count):
    """Cut points making `count` segments whose largest memory (variables, plus outputs for
    one sample from static shapes) is smallest."""
    separators = graph.separators()
    if len(separators) < count - 1:
        names = [graph.nodes[i][0].name for i in separators]
        raise ValueError(
            f"device_cuts='auto' needs {count - 1} cut points for {count} devices, "
            f"and model {model.name!r} has {len(separators)} layers whose output "
            f"separates its graph ({names}). Use fewer devices. Received: "
            f"devices of length {count}"
        )
    costs = [graph.sizes[node] or 0 for node in range(len(graph.nodes))]
    for variable, node in _owned_variables(graph):
        size = tf.TensorShape(variable.shape).num_elements()
        costs[node] += size * tf.as_dtype(variable.dtype).size
    blocks, start = [], 0
    for end in [*separators, len(graph.nodes) - 1]:
        blocks.append(sum(costs[start : end + 1]))
        start = end + 1
    return [separators[block] for block in _partition(blocks, count)]


def _partition(blocks, count):
    """The indices of the blocks that end each of `count` consecutive groups (but the last)
    with the smallest largest sum: dynamic programming over (groups, blocks covered)."""
    prefix = [0]
    for size in blocks:
        prefix.append(prefix[-1] + size)
    best = {(1, j): (prefix[j], []) for j in range(1, len(blocks) + 1)}
    for groups in range(2, count + 1):
        for j in range(groups, len(blocks) + 1):
            best[groups, j] = min(
                (max(largest, prefix[j] - prefix[i]), [*cuts, i - 1])
                for i in range(groups - 1, j)
                for largest, cuts in [best[groups - 1, i]]
            )
    return best[count, len(blocks)][1]


def jit_compile(placement, jit_compile):
    """`compile`'s `jit_compile` for a model placed by `placement` (or None): XLA compiles
    for one device, so `"auto"` means no XLA and `True` is refused."""
    if placement is None:
        return jit_compile
    if jit_compile is True:
        raise ValueError(
            "`jit_compile=True` compiles each micro-batch's step with XLA for one "
            "device, and `devices` spreads the step over several. Compile with "
            "jit_compile=False (or 'auto', which then means no XLA). Received: "
            f"jit_compile=True with devices={list(placement.devices)!r}"
        )
    return False


def build_plan(model, remat, placement):
    """(`SegmentPlan` at both settings' cuts or None; what `remat="auto"` chose and why)."""
    if placement is None:
        return _segments.build_plan(model, remat)
    if remat is None:
        planned = _segments.Cuts([], _graph.Graph(model))
    else:
        planned = _segments.plan_segments(model, remat)
    remat_cuts, graph = planned.indices, planned.graph
    cuts = sorted({*remat_cuts, *placement.cuts})
    ends = [*cuts, len(graph.nodes) - 1]
    last_recomputed = remat_cuts[-1] if remat_cuts else -1
    # A leading Embedding lookup that remat="auto" keeps ends at its first cut.
    first_recomputed = remat_cuts[0] if planned.lookup_kept else -1
    plan = _segments.SegmentPlan(
        model,
        cuts,
        graph,
        recomputed=[first_recomputed < end <= last_recomputed for end in ends],
        devices=[placement.device_of(end) for end in ends],
    )
    return plan, planned.note
