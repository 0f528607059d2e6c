"""`micro_batch_size="auto"`: the largest micro-batch that runs, found by trying.

The first step starts with the whole batch as one micro-batch; each
out-of-memory error is rolled back and the micro-batch shrunk by the policy
an `OOMBackoff` attached (or a quiet `BackoffPolicy` with its defaults), and
the first attempt that runs is the real step. The choice and its cost are reported once.
"""

from __future__ import annotations

import time

from keras_memopt import _io
from keras_memopt._backoff import BackoffPolicy


class AutoSearch:
    """One search, from the first batch of `batch_size` samples per replica."""

    def __init__(self, model, batch_size):
        self.model = model
        self.policy = model.oom_policy or BackoffPolicy(verbose=0)
        self._known = len(self.policy.backoffs)
        self.started = time.perf_counter()
        model.micro_batch_size = None
        model.micro_batch_size = batch_size or 1

    def chose(self, size):
        """Reports the size that ran (printed, and kept in `model.micro_batch_search`)."""
        seconds = time.perf_counter() - self.started
        trials = [
            (event["failed_micro_batch_size"], event["failed_step_seconds"])
            for event in self.policy.backoffs[self._known:]
        ]
        failed = ", ".join(str(size) for size, _ in trials) or "none"
        _io.print_msg(
            f'micro_batch_size="auto": chose micro_batch_size={size} '
            f"(out of memory at: {failed}; search took {seconds:.1f} s, "
            f"{sum(s for _, s in trials):.1f} s of it in failed attempts)"
        )
        # A plain dict: Keras would otherwise track (and wrap) it as model state.
        object.__setattr__(
            self.model,
            "micro_batch_search",
            dict(
                micro_batch_size=size,
                out_of_memory_trials=[size for size, _ in trials],
                seconds=seconds,
            ),
        )
