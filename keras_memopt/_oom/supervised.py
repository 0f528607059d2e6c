"""The training process's side of `keras-memopt run` (`keras_memopt.supervise`).

It reads its cap from `CAP_VARIABLE` and writes the size in use to `STATE_VARIABLE`'s file."""

from __future__ import annotations

import json
import os

from keras_memopt._validation import positive_int

STATE_VARIABLE = "KERAS_MEMOPT_RUN_STATE"
CAP_VARIABLE = "KERAS_MEMOPT_MAX_MICRO_BATCH_SIZE"


def max_micro_batch_size() -> int | None:
    """The cap on the micro-batch size this process was started with, if any."""
    value = os.environ.get(CAP_VARIABLE)
    if not value:
        return None
    try:
        return positive_int(CAP_VARIABLE, int(value))
    except ValueError as error:
        raise ValueError(
            f"The environment variable {CAP_VARIABLE} must be a positive integer, "
            f"the largest micro-batch size to use. Received: {CAP_VARIABLE}={value!r}"
        ) from error


class SizeFile:
    """Writes the micro-batch size in use for a supervisor, when there is one."""

    def __init__(self):
        self.path = os.environ.get(STATE_VARIABLE) or None
        self._last = None

    def write(self, micro_batch_size):
        if isinstance(micro_batch_size, tuple):  # one per replica
            micro_batch_size = max(micro_batch_size)
        if self.path is None or micro_batch_size is None or micro_batch_size == self._last:
            return
        # Written whole, then renamed: a crash never leaves half a file.
        temporary = f"{self.path}.{os.getpid()}"
        with open(temporary, "w") as handle:
            json.dump({"micro_batch_size": int(micro_batch_size)}, handle)
        os.replace(temporary, self.path)
        self._last = micro_batch_size
