"""A functional model's layer graph and the points where it can be cut.

Recomputed and placed segments cut at a layer whose single output every path from the inputs to the
outputs passes through: `Graph` finds them, `named_cuts` checks the layers named."""

from __future__ import annotations

import collections

import tensorflow as tf

from keras_memopt import _keras
from keras_memopt._step import per_update as _per_update
from keras_memopt.memory import bytes_per_sample


class Graph:
    """The dependency structure of a functional model's nodes."""

    def __init__(self, model):
        self.nodes = _keras.functional_nodes(model)
        count = len(self.nodes)
        self.calls = collections.Counter(id(layer) for layer, _, _ in self.nodes)
        producer = {}
        for index, (_, _, outputs) in enumerate(self.nodes):
            for tensor in outputs:
                producer[id(tensor)] = index
        self.ancestors = [0] * count
        children = [[] for _ in range(count)]
        self.children = [0] * count
        for index, (_, inputs, _) in enumerate(self.nodes):
            for tensor in inputs:
                parent = producer.get(id(tensor))
                if parent is not None:
                    self.ancestors[index] |= self.ancestors[parent] | (1 << parent)
                    children[parent].append(index)
                    self.children[parent] |= 1 << index
        self.descendants = [0] * count
        for index in reversed(range(count)):
            for child in children[index]:
                self.descendants[index] |= self.descendants[child] | (1 << child)
        self.everything = (1 << count) - 1
        _, outputs = _keras.nested_inputs_outputs(model)
        self.output_ids = {id(t) for t in tf.nest.flatten(outputs)}
        # Unknown dimensions count as 1: the sizes only compare blocks.
        self.sizes = [bytes_per_sample(outputs, unknown_dim=1) for _, _, outputs in self.nodes]

    def unrecomputable(self, index):
        """Whether no recomputation reruns node `index`'s layer exactly (`_remat.recompute`)."""
        layer = self.nodes[index][0]
        refused = _keras.regularised_sublayer(layer) or _per_update.normalizing_sublayer(layer)
        return refused is not None

    def is_input(self, index):
        return not self.nodes[index][1]

    def _name(self, index):
        return repr(self.nodes[index][0].name)

    def bypass(self, index):
        """Why node `index`'s output does not separate the graph, or None. It separates it when
        every other node feeds it or depends on it and no tensor computed before it is used after it
        (a skip connection)."""
        related = self.ancestors[index] | self.descendants[index] | (1 << index)
        missing = self.everything & ~related
        if missing:
            other = (missing & -missing).bit_length() - 1
            return f"layer {self._name(other)} neither feeds it nor depends on it"
        before, upto = self.ancestors[index], self.ancestors[index] | (1 << index)
        rest = before
        while rest:
            parent = (rest & -rest).bit_length() - 1
            rest &= rest - 1
            later = self.children[parent] & ~upto
            if later:
                child = (later & -later).bit_length() - 1
                return (
                    f"the output of layer {self._name(parent)} skips past it to "
                    f"layer {self._name(child)}"
                )
        return None

    def separates(self, index):
        """Whether node `index`'s output is a cut point: a single tensor that separates the graph,
        of a layer called once (a shared layer's output is not one point; Keras 3 builds no model
        that starts at it and calls the layer again)."""
        layer, _, outputs = self.nodes[index]
        return (
            len(outputs) == 1
            and self.calls[id(layer)] == 1
            and not self.is_input(index)
            and id(outputs[0]) not in self.output_ids
            and self.bypass(index) is None
        )

    def separators(self):
        """The nodes whose output separates the graph, in graph order."""
        return [i for i in range(len(self.nodes)) if self.separates(i)]


def named_cuts(graph, model, names, argument):
    """The node indices, in graph order, of the cut layers `names`; `ValueError` naming
    `argument` for a layer not in the model, called twice, an input, or not separating it."""
    by_name = {}
    for index, (layer, _, _) in enumerate(graph.nodes):
        by_name.setdefault(layer.name, []).append(index)
    received = f"Received: {argument}={list(names)!r}"
    cuts = []
    for name in names:
        indices = by_name.get(name)
        if not indices:
            raise ValueError(
                f"`{argument}` names layer {name!r}, which is not in model "
                f"{model.name!r}. Known layers: {sorted(by_name)}. {received}"
            )
        if len(indices) > 1:
            raise ValueError(
                f"Layer {name!r} is called {len(indices)} times in model "
                f"{model.name!r}, so its output is not one cut point. Name "
                f"a layer that is called once. {received}"
            )
        index = indices[0]
        if graph.is_input(index):
            raise ValueError(
                f"Layer {name!r} is an input of model {model.name!r}: there is "
                "nothing before it to make a segment of. Name the layers whose "
                f"outputs end the segments. {received}"
            )
        if not graph.separates(index):
            reason = graph.bypass(index) or (
                "its output is a model output or is not a single tensor"
            )
            raise ValueError(
                f"Layer {name!r} does not separate the graph of model "
                f"{model.name!r} (not every path from the inputs to the outputs "
                f"passes through its output): {reason}. Name a layer whose "
                f"single output everything after it depends on. {received}"
            )
        cuts.append(index)
    return sorted(cuts)
