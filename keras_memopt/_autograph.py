"""The package's `tf.function`s: its own code as written, the user's converted as Keras converts it.

tf_keras converts a subclassed layer's `call`, a loss function and a metric's
`update_state` with AutoGraph where the function being traced leaves the
choice open, so that their Python control flow on tensors (`if
tf.reduce_mean(x) > 0:`) runs in the graph; plain tf_keras's step functions
leave it open. `tf.function(autograph=False)` does not: it turns AutoGraph off
for everything it calls, and such a `call` failed in an `AccumulatingModel`
with `OperatorNotAllowedInGraphError`. `tf.function(autograph=True)` converts
the package's own code as well, which needs no conversion (Keras 3 converts
nothing) and took tf_keras about 2.5 s of CPU at each process's first step.
`function` leaves the choice open, as tf_keras's own step functions do. On
Keras 3 nothing reads it: its layers and losses are not converted, and
`strategy.run` converts nothing unless AutoGraph is on.
"""

from __future__ import annotations

import functools

import tensorflow as tf

# The status itself has no public name; tf_keras reads it through
# `tf.__internal__.autograph.control_status_ctx()`.
from tensorflow.python.autograph.core import ag_ctx


def function(fn, **kwargs):
    """`tf.function(fn, autograph=False, **kwargs)`, AutoGraph left to the code `fn` calls."""

    @functools.wraps(fn)
    def open_choice(*args, **kw):
        with ag_ctx.ControlStatusCtx(status=ag_ctx.Status.UNSPECIFIED):
            return fn(*args, **kw)

    return tf.function(open_choice, autograph=False, **kwargs)
