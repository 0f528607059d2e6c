"""Out-of-memory errors: recognise them (`is_oom`), say what failed (`parse_oom`), where (`Phase`)
and what the step holds (`StepMemory`), and the message a user reads (`report`)."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import re
import sys
import traceback

import tensorflow as tf

from keras_memopt._keras import BACKEND
from keras_memopt._step.scopes import (
    GRADIENT_SUM_SCOPE,
    UPDATE_RESERVATION_OP,
    WHOLE_BATCH_LOSS_SCOPE,
)
from keras_memopt.memory import allocator_memory, format_bytes, parse_bytes

# What TensorFlow says when an allocation failed but the error is no `ResourceExhaustedError`.
_OOM_MESSAGE_MARKERS = (
    "resourceexhausted",
    "resource exhausted",
    "resource_exhausted",
    "oom when allocating",
    "out of memory",
    "dst tensor is not initialized",
)
_TENSOR = re.compile(
    r"OOM when allocating tensor with shape\s*\[([^\]]*)\]\s*and type (\w+)"
    r"(?: on (\S+))?(?: by allocator (\S+))?"
)
_NODE = re.compile(r"\[\[\{\{node ([^}]+)\}\}\]\]|Detected at node '?([^\s']+)'?")
_BYTES = re.compile(r"(\d+) bytes")
_SIZE = re.compile(r"allocate ([\d.]+\s*[KMGT]iB)")  # XLA: "allocate 34.12MiB"
_DEVICE = re.compile(r"device:([A-Z]+:\d+)")


def is_oom(error: BaseException) -> bool:
    """Whether `error` (or an error it was raised from) means out of memory.

    Besides `ResourceExhaustedError`: `InvalidArgumentError: Cannot parse tensor from proto` (a
    folded constant not allocated, seen on CPU under a memory limit), `UnknownError` or
    `InternalError` naming resource exhaustion or "Dst tensor is not initialized" (GPUs), and on
    JAX a `JaxRuntimeError` beginning `RESOURCE_EXHAUSTED:` (at compile or run time)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, tf.errors.ResourceExhaustedError) or _xla_exhausted(error):
            return True
        message = str(error).lower()
        if isinstance(error, (tf.errors.UnknownError, tf.errors.InternalError)):
            if any(marker in message for marker in _OOM_MESSAGE_MARKERS):
                return True
        if isinstance(error, tf.errors.InvalidArgumentError):
            if "cannot parse tensor from proto" in message:
                return True
        error = error.__cause__ or error.__context__
    return False


def _xla_exhausted(error) -> bool:
    """Whether `error` is XLA's out-of-memory error as JAX raises it."""
    jax = sys.modules.get("jax")  # only where JAX is in use: nothing imported for it
    return (
        jax is not None
        and isinstance(error, jax.errors.JaxRuntimeError)
        and str(error).lstrip().startswith("RESOURCE_EXHAUSTED")
    )


def exhausted(message: str) -> Exception:
    """The error that reports, with `message`, an out-of-memory error that ends a step: TensorFlow's
    `ResourceExhaustedError`, on JAX the `JaxRuntimeError` XLA raises (`RESOURCE_EXHAUSTED:`)."""
    if BACKEND == "jax":
        import jax

        return jax.errors.JaxRuntimeError(f"RESOURCE_EXHAUSTED: {message}")
    return tf.errors.ResourceExhaustedError(None, None, message)


def parse_oom(message: str) -> dict:
    """What failed to allocate, as far as the error message says: a dict of `shape` (a tuple),
    `dtype`, `op` (the graph node), `device` (`"GPU:0"`), `allocator` and `bytes` (a byte count
    given instead of a shape), each None when the message does not say."""
    info = dict(shape=None, dtype=None, op=None, device=None, allocator=None, bytes=None)
    match = _TENSOR.search(message)
    if match:
        dims = [d.strip() for d in match.group(1).split(",") if d.strip()]
        try:
            info["shape"] = tuple(int(d) for d in dims)
        except ValueError:
            info["shape"] = tuple(dims)
        info["dtype"] = match.group(2)
        info["allocator"] = match.group(4)
        if match.group(3):
            device = _DEVICE.search(match.group(3))
            info["device"] = device.group(1) if device else match.group(3)
    match = _NODE.search(message)
    if match:
        info["op"] = match.group(1) or match.group(2)
    match = _BYTES.search(message)
    if match:
        info["bytes"] = int(match.group(1))
    elif _SIZE.search(message):
        info["bytes"] = parse_bytes(_SIZE.search(message).group(1))
    if info["device"] is None:
        device = _DEVICE.search(message)
        info["device"] = device.group(1) if device else None
    return info


def allocation_bytes(allocation: dict) -> int | None:
    """The bytes of the allocation `parse_oom` described: from its shape and type, else the byte
    count given (None: the message does not say)."""
    shape, dtype = allocation["shape"], allocation["dtype"]
    if shape is not None and dtype and all(isinstance(d, int) for d in shape):
        try:
            size = tf.as_dtype({"float": "float32", "double": "float64"}.get(dtype, dtype)).size
        except TypeError:
            return allocation["bytes"]
        count = 1
        for dim in shape:
            count *= dim
        return count * size
    return allocation["bytes"]


def describe_allocation(info: dict) -> str:
    """`parse_oom`'s result in words ("a tensor of shape [64, 1024] and type float ...")."""
    if info["shape"] is not None:
        what = "a tensor of shape [" + ", ".join(str(d) for d in info["shape"]) + "]"
        if info["dtype"]:
            what += f" and type {info['dtype']}"
    elif info["bytes"] is not None:
        what = f"{format_bytes(info['bytes'])} ({info['bytes']} bytes)"
    else:
        what = "memory (the error message does not say how much)"
    if info["op"]:
        what += f" in op {info['op']}"
    if info["device"]:
        what += f" on {info['device']}"
    return what


def allocation_note(error: BaseException) -> str:
    """`" (what failed to allocate)"`, or `""` when the message does not say."""
    info = parse_oom(str(error))
    return f" ({describe_allocation(info)})" if any(info.values()) else ""


@dataclasses.dataclass(frozen=True)
class ErrorText:
    """An error in words (its type's name and message), what is kept of an out-of-memory error
    once its step was put back: the exception's frames hold the batch, `fit`'s iterator and data."""

    name: str
    message: str

    @classmethod
    def of(cls, error) -> ErrorText:
        """`error`'s text (an `ErrorText` is returned as it is)."""
        if isinstance(error, ErrorText):
            return error
        return cls(type(error).__name__, str(error))

    def __str__(self) -> str:
        return self.message


def drop_tracebacks(error: BaseException) -> None:
    """Clears the finished frames of the tracebacks of `error` and every error along `__cause__`
    and `__context__` (TensorFlow's `from None` hides the context but keeps it), and drops them."""
    seen, pending = set(), [error]
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if error.__traceback__ is not None:
            traceback.clear_frames(error.__traceback__)  # skips frames still running
            error.__traceback__ = None
        pending += [error.__cause__, error.__context__]


class Phase(enum.Enum):
    """Where in a step memory ran out, and whether a smaller micro-batch can help."""

    STATE = "before the first step, while making the optimizer's and metrics' variables"
    MICRO_BATCH = "a micro-batch's forward and backward pass"
    GRADIENT_SUM = "the sum of the micro-batches' gradients"
    UPDATE = "the optimizer update"
    WHOLE_BATCH_LOSS = "the loss over the whole batch's outputs (whole_batch_loss=True)"
    EVALUATION = "a micro-batch's evaluation or prediction"

    @property
    def micro_batch_helps(self) -> bool:
        """Whether a smaller micro-batch needs less memory in this phase."""
        return self in (Phase.MICRO_BATCH, Phase.EVALUATION)


def scoped_phase(op: str | None) -> Phase | None:
    """The phase an op's name marks, or None (a micro-batch's own ops)."""
    op = op or ""
    if GRADIENT_SUM_SCOPE in op:
        return Phase.GRADIENT_SUM
    if WHOLE_BATCH_LOSS_SCOPE in op:
        return Phase.WHOLE_BATCH_LOSS
    if UPDATE_RESERVATION_OP in op:
        return Phase.UPDATE
    return None


@dataclasses.dataclass
class StepMemory:
    """What a training step holds on the device, in bytes (None: not known).

    Attributes:
        weights: the model's variables (trainable and not).
        optimizer_state: the optimizer's variables (slots, iterations, ...).
        gradient_sum: the summed gradients: one float32 copy of the trainable weights.
        largest_gradient: the largest variable's gradient, held beside the sum at least.
        update: what the optimizer update allocates above its start, measured at
            `micro_batch_size` in an earlier step.
        step_peak: the failed attempt's peak above its start, as the allocator measured it (the
            sum, a micro-batch's activations and gradients; the loop's peak past the loop).
        micro_batch_size: the micro-batch size of the failed attempt.
        device_total: the memory the device can hand out.
    """

    weights: int | None = None
    optimizer_state: int | None = None
    gradient_sum: int | None = None
    largest_gradient: int | None = None
    update: int | None = None
    step_peak: int | None = None
    micro_batch_size: int | tuple | None = None
    device_total: int | None = None

    def describe(self) -> str:
        def size(value):
            return "unknown" if value is None else format_bytes(value)

        if self.update is None:
            update = "not measured yet (no update has run at this micro-batch size)"
        else:
            update = f"{size(self.update)} at micro_batch_size={self.micro_batch_size}"
        peak = f"{size(self.step_peak)} above its start"
        if None not in (self.step_peak, self.gradient_sum) and self.step_peak > self.gradient_sum:
            peak += (
                f", {size(self.step_peak - self.gradient_sum)} of it beyond the gradient sum "
                "(a micro-batch's activations and gradients)"
            )
        return (
            f"weights {size(self.weights)}, optimizer state {size(self.optimizer_state)}, "
            f"gradient sum {size(self.gradient_sum)} (its largest variable "
            f"{size(self.largest_gradient)}); the failed attempt at "
            f"micro_batch_size={self.micro_batch_size} peaked at {peak}, as measured; "
            f"the optimizer update's own memory: {update}; the device can hand out "
            f"{size(self.device_total)}"
        )


@dataclasses.dataclass
class OutOfMemory:
    """An out-of-memory error that ended an attempt at a step, once put back: what the step runner
    hands `BackoffPolicy.back_off`, figures and the error's text, no exception (`ErrorText`)."""

    kind: str
    phase: Phase
    error: ErrorText
    micro_batch_size: int | tuple | None
    memory_in_use: int | None
    memory: StepMemory
    failed_step_seconds: float
    recovery_seconds: float


_MICRO_BATCH_ADVICE = [
    "recompute activations in the backward pass instead of storing them "
    "(rematerialisation, keras_memopt's `remat` option);",
    "mixed precision: `keras.mixed_precision.set_global_policy(\"mixed_float16\")` "
    "halves activation memory;",
    "a smaller model (fewer or narrower layers) or smaller inputs;",
    "on a GPU, if memory is fragmented (much is free but no large block), start "
    "Python with `TF_GPU_ALLOCATOR=cuda_malloc_async`."
    if BACKEND != "jax" else
    "on a GPU, JAX hands XLA 75% of its memory by default: "
    "`XLA_PYTHON_CLIENT_MEM_FRACTION=.95` before JAX starts hands it more.",
]
_STATE_ADVICE = [
    "an optimizer that keeps less state per weight: plain SGD keeps none, SGD with "
    "momentum and RMSprop one slot per weight, Adam and AdamW two; Adafactor keeps "
    "factored (row and column) statistics;",
    "weights and optimizer state in 16 bits (a `bfloat16` dtype policy), which "
    "halves them;",
    "a smaller model (fewer or narrower layers), or more device memory.",
]
_WHOLE_BATCH_LOSS_ADVICE = [
    "a smaller batch: the loss's own tensors grow with the batch (a contrastive "
    "loss's similarities with its square), not with the micro-batch;",
    "a loss that couples fewer samples at once (negatives from a part of the batch);",
    "more device memory.",
]
_ADVICE = {Phase.WHOLE_BATCH_LOSS: _WHOLE_BATCH_LOSS_ADVICE}


def report(error: BaseException | ErrorText, phase: Phase, memory: StepMemory | None = None,
           micro_batch_size=None, minimum=None, note: str | None = None) -> str:
    """The message of the error raised when an out-of-memory `error` ends a step for good;
    `minimum`: the smallest micro-batch allowed, `note`: why nothing was retried."""
    if phase is Phase.STATE:
        headline = (
            f"Out of memory {phase.value}: the model's state does not fit on the "
            "device, whatever the micro-batch size."
        )
    elif phase.micro_batch_helps:
        headline = (
            f"Out of memory in {phase.value} at the smallest micro-batch allowed "
            f"(micro_batch_size={micro_batch_size}, min_micro_batch_size={minimum}); "
            "the model, optimizer and metrics are as they were before the failed step."
        )
    else:
        headline = (
            f"Out of memory in {phase.value} (micro_batch_size={micro_batch_size}): "
            "a smaller micro-batch needs no less memory there, so none was tried; "
            "the model, optimizer and metrics are as they were before the failed step."
        )
    if note:
        headline += f" {note}"
    advice = _ADVICE.get(phase) or (
        _MICRO_BATCH_ADVICE if phase.micro_batch_helps else _STATE_ADVICE
    )
    info = parse_oom(str(error))
    lines = [headline, f"  Failed to allocate: {describe_allocation(info)}."]
    lines.append(f"  Device memory: {_device_line(info['device'])}.")
    if memory is not None:
        lines.append(f"  The step holds: {memory.describe()}.")
    lines.append("  What to try:")
    lines.extend(f"  - {line}" for line in advice)
    lines.append(f"Original error: {ErrorText.of(error).name}: {_first_line(error)}")
    return "\n".join(lines)


def _device_line(device):
    memory = allocator_memory(device)
    if memory is None:
        return "not available for this device"
    return (
        f"{format_bytes(memory['current'])} in use, peak {format_bytes(memory['peak'])} "
        f"on {memory['device']}"
    )


def _first_line(error):
    for line in str(error).splitlines():
        if "OOM" in line or "memory" in line.lower() or "Dst tensor" in line:
            return line.strip()
    lines = str(error).strip().splitlines()
    return lines[0].strip() if lines else ""


@contextlib.contextmanager
def state_must_fit():
    """Raises a readable report for an out-of-memory error before the first step, where the
    optimizer's and metrics' variables are made: no micro-batch size can help there."""
    try:
        yield
    except tf.errors.OpError as error:
        if not is_oom(error):
            raise
        raise tf.errors.ResourceExhaustedError(None, None, report(error, Phase.STATE)) \
            from error
