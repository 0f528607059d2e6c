"""`micro_batch_size="auto"`: from the whole batch, shrunk by the backoff policy at each
out-of-memory error, the first size that runs must train `STEPS` steps with their peaks' spread
free (`headroom`), else it shrinks. Kept in `model.micro_batch_search`; docs/oom-backoff.md."""

from __future__ import annotations

import statistics
import time

from keras_memopt import _io, memory
from keras_memopt._oom.backoff import BackoffPolicy
from keras_memopt.memory import device_total


def headroom(peaks: list[int], total: int | None) -> dict:
    """Whether steps whose allocator peaks were `peaks` leave their spread (the highest above
    the median: what the next step may need beyond the highest seen) free of `total`.
    Returns `margin`, `highest`, `total` and `fits` (True where `total` is unknown)."""
    highest = max(peaks)
    margin = highest - int(statistics.median(peaks))
    fits = total is None or highest + margin <= total
    return dict(margin=margin, highest=highest, total=total, fits=fits)


class AutoSearch:
    """One search, from the first batch of `batch_size` samples per replica. The step runner calls
    `stepped` after each step that ran, until it returns True."""

    STEPS = 10  # the run of consecutive steps a size must train

    def __init__(self, model, batch_size):
        self.model = model
        self.batch_size = batch_size
        self.policy = model.oom_policy or BackoffPolicy(verbose=0)
        self._known = len(self.policy.backoffs)
        self.started = time.perf_counter()
        self._candidate = None
        self._peaks = []  # one dict {device: peak} per step of the current run
        self._too_close = []  # sizes shrunk for want of headroom
        model.micro_batch_size = None
        model.micro_batch_size = batch_size or 1

    def stepped(self, batch_size, peaks: dict) -> bool:
        """After a step that ran on a batch of `batch_size` with allocator `peaks`
        per device: records it; returns whether the search is over."""
        size = self.model.micro_batch_size
        if not isinstance(size, int):
            return True  # set by hand meanwhile: no longer the search's
        if self._candidate is None:
            self._report_candidate(size)
        if size != self._candidate:  # an out-of-memory error shrank it: a new run
            self._candidate, self._peaks = size, []
        if not peaks or None in peaks.values():
            self._keep(size, margin=None)  # no allocator figures: no spread to measure
            return True
        if batch_size != self.batch_size:
            return False  # a short last batch peaks lower: not one of the run's
        self._peaks.append(peaks)
        if len(self._peaks) < self.STEPS:
            return False
        checks = {
            device: headroom([p[device] for p in self._peaks], device_total(device))
            for device in peaks
        }
        fits = all(check["fits"] for check in checks.values())
        if fits or size <= self.policy.min_micro_batch_size:
            self._report_choice(size, checks)
            return True
        smaller = self.policy.shrunk(size)
        _io.print_msg(
            f'micro_batch_size="auto": micro_batch_size={size} ran {self.STEPS} steps '
            f"but leaves less than the spread of their peaks free ({_describe(checks)}); "
            f"trying micro_batch_size={smaller}."
        )
        self._too_close.append(size)
        self.model.micro_batch_size = smaller
        self._candidate, self._peaks = smaller, []
        return False

    def _trials(self):
        return [
            (event["failed_micro_batch_size"], event["failed_step_seconds"])
            for event in self.policy.backoffs[self._known:]
        ]

    def _report_candidate(self, size):
        trials = self._trials()
        failed = ", ".join(str(s) for s, _ in trials) or "none"
        _io.print_msg(
            f'micro_batch_size="auto": chose micro_batch_size={size} '
            f"(out of memory at: {failed}; search took "
            f"{time.perf_counter() - self.started:.1f} s, "
            f"{sum(s for _, s in trials):.1f} s of it in failed attempts); checking "
            f"over {self.STEPS} steps that it leaves the spread of their peaks free."
        )
        self._keep(size, margin=None)

    def _report_choice(self, size, checks):
        margin = max(check["margin"] for check in checks.values())
        fits = all(check["fits"] for check in checks.values())
        verdict = "kept a margin of" if fits else "could not keep (at min_micro_batch_size)"
        _io.print_msg(
            f'micro_batch_size="auto": micro_batch_size={size} trained {self.STEPS} steps '
            f"and {verdict} {memory.format_bytes(margin)}, the spread of their peaks "
            f"({_describe(checks)})."
        )
        self._keep(size, margin=margin, checks=checks)

    def _keep(self, size, margin, checks=None):
        trials = self._trials()
        # A plain dict: Keras would otherwise track (and wrap) it as model state.
        object.__setattr__(
            self.model,
            "micro_batch_search",
            dict(
                micro_batch_size=size,
                out_of_memory_trials=[s for s, _ in trials],
                too_close=list(self._too_close),
                margin=margin,
                steps=self.STEPS if margin is not None else 0,
                highest_peak=None if checks is None else max(c["highest"] for c in checks.values()),
                seconds=time.perf_counter() - self.started,
            ),
        )


def _describe(checks):
    parts = []
    for device, check in checks.items():
        total = check["total"]
        total = "an unknown total" if total is None else memory.format_bytes(total)
        parts.append(
            f"on {device}: highest peak {memory.format_bytes(check['highest'])}, spread "
            f"{memory.format_bytes(check['margin'])}, of {total}"
        )
    return "; ".join(parts)
