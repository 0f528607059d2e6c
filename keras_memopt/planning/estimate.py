"""The shapes-only estimate: the weights' parts counted from the variables, the activations
from the traced step (`_remat.liveness`). See docs/memory.md."""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from keras_memopt import _keras
from keras_memopt._memory.sizes import variables_bytes
from keras_memopt._remat import liveness as _liveness
from keras_memopt.memory import bytes_if_known, bytes_per_sample

__all__ = [
    "MemoryEstimate", "StepActivations", "WeightBytes", "input_bytes_per_sample", "known_inputs",
    "optimizer_slot_copies",
]

# Optimizer state per trainable variable, in copies of it, by class name (None: read its config).
_SLOTS = {
    "SGD": None,
    "Adam": None,
    "AdamW": None,
    "Adamax": 2,
    "Nadam": 2,
    "Lamb": 2,
    "Lion": 1,
    "Adagrad": 1,
    "Adadelta": 2,
    "Ftrl": 2,
    "RMSprop": None,
    "Adafactor": 0,  # factored: its state is far smaller than the variables
}

def optimizer_slot_copies(optimizer) -> float:
    """Copies of the trainable variables that `optimizer` keeps as its state."""
    if optimizer is None:
        return 0.0
    config = optimizer.get_config()
    name = type(optimizer).__name__
    if name == "LossScaleOptimizer":
        return optimizer_slot_copies(getattr(optimizer, "inner_optimizer", None))
    if name == "SGD":
        copies = 1.0 if config.get("momentum") else 0.0
    elif name in ("Adam", "AdamW"):
        copies = 3.0 if config.get("amsgrad") else 2.0
    elif name == "RMSprop":
        copies = 1.0 + bool(config.get("momentum")) + bool(config.get("centered"))
    elif name in _SLOTS:
        copies = float(_SLOTS[name])
    else:
        # Unknown optimizer: Adam's two slots is the common case.
        copies = 2.0
    return copies + (1.0 if config.get("use_ema") else 0.0)


def known_inputs(model):
    """The model's (inputs, outputs), or (None, None) where it has none (subclassed)."""
    try:
        return model.inputs, model.outputs
    except (AttributeError, ValueError):
        return None, None


class StepActivations:
    """The activations one micro-batch's train step holds at its peak, from the traced step,
    less the weights' gradients and the inputs (counted on their own); `cpu` counts the CPU
    convolution kernels' buffers. `ValueError` if the step cannot be traced as `fit` would."""

    def __init__(self, model, cpu):
        self.model = model
        self._gradients = variables_bytes(model.trainable_weights)
        try:
            self._step = _trace_model(model, cpu)
        except (TypeError, ValueError, NotImplementedError, tf.errors.OpError) as error:
            raise ValueError(
                f"The planner traces a train step of model {model.name!r} to count its "
                "activations, and the trace failed: "
                f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            ) from error

    def bytes(self, micro_batch_size: int) -> int:
        """Activation bytes at the peak of a step on `micro_batch_size` samples."""
        return max(int(self._step.peak(micro_batch_size)) - self._gradients, 0)

    @property
    def per_sample(self) -> float:
        """What one more sample adds at the peak (at large micro-batches)."""
        return (self.bytes(2048) - self.bytes(1024)) / 1024


def _trace_model(model, cpu):
    """The `StepGraph` of `model`'s forward pass, a sum of its outputs, and the gradient;
    its inputs count nothing (the planner counts the batch on its own)."""
    inputs, _ = known_inputs(model)
    if isinstance(model, _keras.Functional):
        inputs, _ = _keras.nested_inputs_outputs(model)
    flat = tf.nest.flatten(inputs)
    specs = [tf.TensorSpec((None, *t.shape[1:]), t.dtype) for t in flat]

    def loss(*tensors):
        x = tf.nest.pack_sequence_as(inputs, list(tensors)) if len(flat) > 1 else tensors[0]
        outputs = model(x, training=True)
        return tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in tf.nest.flatten(outputs)])

    graph, kept = _liveness.trace(loss, specs, model.trainable_variables)
    step = _liveness.StepGraph(graph, kept, cpu=cpu)
    step.leave_out_inputs()
    return step


def input_bytes_per_sample(model) -> int:
    """Bytes of one sample of the inputs plus its (sparse) target; `ValueError` without known
    inputs (a subclassed model) or fixed input shapes."""
    inputs, outputs = known_inputs(model)
    if not inputs:
        raise ValueError(
            "The planner needs a model with known inputs: a functional or "
            "Sequential model, or `AccumulatingModel.from_model(model)` of "
            f"a built subclassed model. Received: model={model.name!r}"
        )
    size = bytes_per_sample(inputs)
    if size is None:
        raise ValueError(
            "The planner needs fixed input shapes apart from the batch "
            "axis. Received: input shapes "
            f"{[tuple(t.shape) for t in tf.nest.flatten(inputs)]}"
        )
    # Targets are counted as one class index per output row.
    for output in tf.nest.flatten(outputs):
        rows = bytes_if_known(tuple(output.shape)[1:-1], "int32")
        size += rows or 4
    return size


@dataclasses.dataclass
class WeightBytes:
    """What a train step holds whatever the batch: bytes of the model's variables."""

    parameters: int
    optimizer_slots: int
    gradient_accumulators: int
    micro_gradients: int
    largest_variable: int = 0  # the largest trainable variable's bytes

    @classmethod
    def of(cls, model, optimizer) -> WeightBytes:
        trainable = model.trainable_weights
        grads = variables_bytes(trainable)
        # Accumulators are float32 even where the variables are narrower.
        accumulators = sum(
            bytes_if_known(v.shape, "float32" if tf.as_dtype(v.dtype).size < 4 else v.dtype)
            for v in trainable
        )
        return cls(
            parameters=variables_bytes(model.weights),
            optimizer_slots=int(optimizer_slot_copies(optimizer) * grads),
            gradient_accumulators=accumulators,
            micro_gradients=grads,
            largest_variable=max((bytes_if_known(v.shape, v.dtype) for v in trainable), default=0),
        )

    @property
    def total(self) -> int:
        return (
            self.parameters + self.optimizer_slots
            + self.gradient_accumulators + self.micro_gradients
        )


@dataclasses.dataclass
class MemoryEstimate:
    """The parts of one train step's peak memory, in bytes.

    `calibrated`: False, counted from the traced step without running it; True, read from measured
    train steps (`overhead` is what the measurement adds to the counted parts). The activations'
    peak and the optimizer update's (twice the largest trainable variable: measured 1 to 3 times
    with Adam and RMSprop on a CPU) come at different times: `peak` has the larger."""

    batch_size: int
    micro_batch_size: int
    parameters: int
    optimizer_slots: int
    gradient_accumulators: int
    micro_gradients: int
    input_batch: int
    activations: int
    overhead: int = 0
    calibrated: bool = False
    optimizer_update: int = 0

    @classmethod
    def of_step(cls, weights: WeightBytes, batch_size, micro_batch_size, input_batch,
                activations) -> MemoryEstimate:
        """The shapes-only estimate (with one micro-batch per batch, no gradient sum)."""
        return cls(
            batch_size=batch_size,
            micro_batch_size=micro_batch_size,
            parameters=weights.parameters,
            optimizer_slots=weights.optimizer_slots,
            gradient_accumulators=(
                weights.gradient_accumulators if micro_batch_size < batch_size else 0
            ),
            micro_gradients=weights.micro_gradients,
            input_batch=input_batch,
            activations=activations,
            optimizer_update=2 * weights.largest_variable,
        )

    @property
    def peak(self) -> int:
        return (
            self.parameters
            + self.optimizer_slots
            + self.gradient_accumulators
            + self.micro_gradients
            + self.input_batch
            + max(self.activations, self._update_beyond_gradients())
            + self.overhead
        )

    def _update_beyond_gradients(self):
        """What the update holds beyond a micro-batch's gradients: its temporaries,
        less those gradients where it applies the sum after the loop."""
        if self.gradient_accumulators:
            return self.optimizer_update - self.micro_gradients
        return self.optimizer_update

    def rows(self):
        """(part, bytes) rows for a table, the peak last."""
        parts = [
            ("parameters", self.parameters),
            ("optimizer slots", self.optimizer_slots),
            ("gradient accumulators", self.gradient_accumulators),
            ("micro-batch gradients", self.micro_gradients),
            (f"input batch ({_samples(self.batch_size)})", self.input_batch),
            (f"activations ({_samples(self.micro_batch_size)})", self.activations),
        ]
        update = self._update_beyond_gradients()
        if update > self.activations:
            parts.append(("optimizer update, beyond the activations", update - self.activations))
        if self.overhead or self.calibrated:
            parts.append(("measured, not counted above", self.overhead))
        kind = "measured" if self.calibrated else "shapes only"
        parts.append((f"peak ({kind})", self.peak))
        return parts


def _samples(count):
    return f"{count} sample" + ("" if count == 1 else "s")
