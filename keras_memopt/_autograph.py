"""The package's `tf.function`s: its own code as written, the user's converted as Keras converts it.

tf_keras converts a layer's `call`, a loss and a metric's `update_state` with AutoGraph where the
traced function leaves the choice open, as its own step functions do, and `function` does too:
`autograph=False` turned it off for the user's code (`OperatorNotAllowedInGraphError` on Python
control flow on tensors), `autograph=True` converted the package's own as well (about 2.5 s of CPU
at each process's first step). Keras 3 converts nothing."""

from __future__ import annotations

import functools

import tensorflow as tf

# No public name; tf_keras reads it through `tf.__internal__.autograph.control_status_ctx()`.
from tensorflow.python.autograph.core import ag_ctx


def function(fn, **kwargs):
    """`tf.function(fn, autograph=False, **kwargs)`, AutoGraph left to the code `fn` calls."""

    @functools.wraps(fn)
    def open_choice(*args, **kw):
        with ag_ctx.ControlStatusCtx(status=ag_ctx.Status.UNSPECIFIED):
            return fn(*args, **kw)

    return tf.function(open_choice, autograph=False, **kwargs)
