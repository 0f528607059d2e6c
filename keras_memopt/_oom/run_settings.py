"""What a `fit`, `evaluate` or `predict` call leaves behind: the run-time settings it found.

Callbacks may change an `AccumulatingModel`'s run-time settings for the
length of a call (`OOMBackoff` attaches its policy as `model.oom_policy` and
may turn XLA off in micro-batches) and put them back in `on_*_end`, which
Keras does not call when the call raises. The model puts them back itself
when a call ends, however it ends, so that a `fit` that raised does not leave
a policy behind for the next `fit` without the callback.
"""

from __future__ import annotations

import contextlib


class KeepsRunSettings:
    """`fit`, `evaluate` and `predict` leave `oom_policy` and
    `micro_batch_jit_compile` as they found them (a mixin of `AccumulatingModel`)."""

    @contextlib.contextmanager
    def _settings_kept(self):
        policy, jit = self.oom_policy, self.micro_batch_jit_compile
        try:
            yield
        finally:
            self.oom_policy = policy
            self.micro_batch_jit_compile = jit  # retraces only where it changed

    def fit(self, *args, **kwargs):
        with self._settings_kept():
            return super().fit(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        with self._settings_kept():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        with self._settings_kept():
            return super().predict(*args, **kwargs)
