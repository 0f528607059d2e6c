"""What a `fit`, `evaluate` or `predict` call leaves behind: the run-time settings it found.

Callbacks change run-time settings for a call (`OOMBackoff`: `oom_policy`, XLA) and put them back in
`on_*_end`, which Keras skips when the call raises: `kept` puts them back however the call ends."""

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
