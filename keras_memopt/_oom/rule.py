"""The backoff rule: the micro-batch size to retry with after an out-of-memory error.

One rule for `BackoffPolicy` (`OOMBackoff`, `micro_batch_size="auto"`) and the process supervisor
(`keras-memopt run`), which imports it before anything heavy: no TensorFlow here."""

import numbers


def backoff_factor(value):
    """Returns a backoff `factor` as a float in (0, 1), or raises naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < 1:
        raise ValueError(
            "`factor` must be a number between 0 and 1 (exclusive), the fraction "
            f"of the micro-batch to keep. Received: factor={value!r}"
        )
    return float(value)


def shrink(size: int, factor: float, minimum: int) -> int:
    """The micro-batch size after an out-of-memory error at `size`: the one rule. `size * factor`
    rounded down, at least one sample smaller and never below `minimum`; used by `OOMBackoff` and
    `keras-memopt run`."""
    return max(minimum, min(size - 1, int(size * factor)))
