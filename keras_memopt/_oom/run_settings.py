"""What a `fit`, `evaluate` or `predict` call leaves behind: the run-time settings it found.

Callbacks change run-time settings for a call (`OOMBackoff`: `oom_policy`, XLA) and put them back in
`on_*_end`, which Keras skips when the call raises: `kept` puts them back however the call ends."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def kept(model):
    """Puts back `model.oom_policy` and `micro_batch_jit_compile` (where the model
    has it: not on JAX, whose steps are always XLA's) as they were on entry."""
    policy = model.oom_policy
    has_jit = hasattr(model, "micro_batch_jit_compile")
    jit = model.micro_batch_jit_compile if has_jit else None
    try:
        yield
    finally:
        model.oom_policy = policy
        if has_jit:
            model.micro_batch_jit_compile = jit  # retraces only where it changed
