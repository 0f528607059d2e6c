"""What a `fit`, `evaluate` or `predict` call leaves behind: the run-time settings it found.

Callbacks may change an `AccumulatingModel`'s run-time settings for the
length of a call (`OOMBackoff` attaches its policy as `model.oom_policy` and
may turn XLA off in micro-batches) and put them back in `on_*_end`, which
Keras does not call when the call raises. The model puts them back itself
when a call ends, however it ends (`kept`), so that a `fit` that raised does
not leave a policy behind for the next `fit` without the callback.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def kept(model):
    """Puts back `model.oom_policy` and `micro_batch_jit_compile` as they were on entry."""
    policy, jit = model.oom_policy, model.micro_batch_jit_compile
    try:
        yield
    finally:
        model.oom_policy = policy
        model.micro_batch_jit_compile = jit  # retraces only where it changed
