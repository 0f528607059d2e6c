"""The out-of-memory backoff policy, asked by the step runner after a failed attempt was put back:
a smaller micro-batch for the same batch, or the report of why none helps. `OOMBackoff` owns one;
`micro_batch_size="auto"` uses it or a quiet one. The rule: docs/oom-backoff.md."""

from __future__ import annotations

from keras_memopt import _io
from keras_memopt._oom.errors import (
    OutOfMemory,
    Phase,
    allocation_bytes,
    allocation_note,
    exhausted,
    parse_oom,
    report,
)
from keras_memopt._oom.rule import backoff_factor, shrink
from keras_memopt._validation import positive_int


class BackoffPolicy:
    """Decides, after an out-of-memory error, the micro-batch to retry with, or refuses. The
    arguments, and the `ValueError` for bad ones, are `OOMBackoff`'s."""

    def __init__(self, factor: float = 0.5, min_micro_batch_size: int = 1, verbose: int = 1):
        self.factor = backoff_factor(factor)
        self.min_micro_batch_size = positive_int("min_micro_batch_size", min_micro_batch_size)
        self.verbose = verbose
        self.backoffs: list[dict] = []
        self.trained_micro_batch_size = None

    def reset(self):
        """Forgets the backoffs so far (a new `fit`)."""
        self.backoffs = []
        self.trained_micro_batch_size = None

    def trained(self, micro_batch_size):
        """After a training step ran: the size it ran with (the largest replica's)."""
        self.trained_micro_batch_size = max(_sizes(micro_batch_size))

    def shrunk(self, size: int) -> int:
        """The micro-batch size after an out-of-memory error at `size`."""
        return shrink(size, self.factor, self.min_micro_batch_size)

    def back_off(self, model, failure: OutOfMemory):
        """Sets the micro-batch size to retry with after `failure` (the step put back), or
        raises the report (`ResourceExhaustedError`; on JAX, XLA's `JaxRuntimeError`) where a
        smaller one cannot help."""
        message = self.refusal(failure)
        if message is not None:
            # Not raised from the error: its traceback would hold the failed attempt's frames.
            raise exhausted(message)
        current = failure.micro_batch_size
        # Per-replica sizes all shrink: the failed step does not say which replica's memory ran out.
        shrunk = tuple(
            size if size <= self.min_micro_batch_size else self.shrunk(size)
            for size in _sizes(current)
        )
        if model.accumulation_steps is not None:
            model.accumulation_steps = None  # a size replaces the number of micro-batches
        model.micro_batch_size = shrunk if isinstance(current, tuple) else shrunk[0]
        allocation = parse_oom(str(failure.error))
        event = dict(
            kind=failure.kind,
            phase=failure.phase.name.lower(),
            allocation=allocation_note(failure.error),
            op=allocation["op"],
            shape=allocation["shape"],
            bytes=allocation_bytes(allocation),
            failed_micro_batch_size=current,
            micro_batch_size=model.micro_batch_size,
            failed_step_seconds=failure.failed_step_seconds,
            recovery_seconds=failure.recovery_seconds,
        )
        self.backoffs.append(event)
        if self.verbose:
            _io.print_msg(
                f"OOMBackoff: out of memory in a {event['kind']} step at "
                f"micro_batch_size={current}{event['allocation']}; retrying the same "
                f"batch with micro_batch_size={event['micro_batch_size']}."
            )

    def refusal(self, failure: OutOfMemory) -> str | None:
        """The report `back_off` would raise for `failure`, or None; changes nothing (several
        workers each ask before they agree, so that all stop where one must)."""
        refusal = self._refusal(failure)
        if refusal is None:
            return None
        phase, note = refusal
        return report(
            failure.error, phase, failure.memory, failure.micro_batch_size,
            self.min_micro_batch_size, note,
        )

    def _refusal(self, failure):
        """`(phase, note)` to report instead of backing off, or None."""
        if not failure.phase.micro_batch_helps:
            return failure.phase, None
        if failure.micro_batch_size is None or all(
            size <= self.min_micro_batch_size for size in _sizes(failure.micro_batch_size)
        ):
            return failure.phase, None
        memory = failure.memory
        floor = [failure.memory_in_use, memory.gradient_sum, memory.largest_gradient]
        if failure.kind == "train" and memory.device_total is not None and None not in floor:
            if sum(floor) > memory.device_total:
                return Phase.GRADIENT_SUM, (
                    "Whatever the micro-batch size, a training step holds the gradient "
                    "sum and one micro-batch's gradient of the largest variable beside "
                    "what is in use when it starts, and they do not fit: "
                    f"{sum(floor)} bytes are needed, {memory.device_total} can be had."
                )
        if memory.device_total is None and self._repeated(failure):
            return failure.phase, (
                "The micro-batch was halved and the same allocation, whose size does "
                "not depend on the micro-batch, failed again: the micro-batch size is "
                "not what fills the device."
            )
        return None

    def _repeated(self, failure):
        """Whether `failure` repeats the last backoff's allocation, which no micro-batch sized."""
        if not self.backoffs or self.backoffs[-1]["phase"] != failure.phase.name.lower():
            return False
        last, now = self.backoffs[-1], parse_oom(str(failure.error))
        if now["shape"] is None or (now["op"], now["shape"]) != (last["op"], last["shape"]):
            return False
        sizes = {*_sizes(failure.micro_batch_size), *_sizes(last["failed_micro_batch_size"])}
        return not sizes & set(now["shape"])


def _sizes(size):
    return size if isinstance(size, tuple) else (size,)
