"""keras_memopt: train Keras models that do not fit in accelerator memory.

`import keras_memopt` imports the whole public API, TensorFlow included, so that `AccumulatingModel`
and `Remat` are registered before `keras.models.load_model` needs them. Run as the `keras-memopt`
command, it loads its names on first use (PEP 562), so that `--help` returns at once. On JAX
(`KERAS_BACKEND=jax`) it exports the JAX step's `AccumulatingModel`, `Remat` and `callbacks`
(`OOMBackoff`, `MemoryLogger`); the other names say they are TensorFlow's when asked for."""

import os as _os
import sys as _sys

__version__ = "0.2.0.dev0"

__all__ = ["AccumulatingModel", "Remat", "MemoryPlanner", "MemoryReader", "configure_devices"]


def _launched_as_command():
    """Whether this process is the `keras-memopt` command: the console script, or `python -m
    keras_memopt.cli` (`sys.argv[0]` is "-m" while this package is imported)."""
    program = _os.path.basename(_sys.argv[0]) if _sys.argv and _sys.argv[0] else ""
    if program == "-m":
        return _module_run() == "keras_memopt.cli"
    # pip's launchers: `keras-memopt`, `keras-memopt.exe`, `keras-memopt-script.py`.
    return program.removesuffix(".exe").removesuffix("-script.py") == "keras-memopt"


def _module_run():
    """The module of `python -m MODULE` (the interpreter's first -m option)."""
    arguments = getattr(_sys, "orig_argv", [])
    for index, argument in enumerate(arguments[1:], start=1):
        if argument == "-m":
            return arguments[index + 1] if index + 1 < len(arguments) else ""
        if argument.startswith("-m"):
            return argument[2:]
    return ""


def _keras_backend():
    """The backend Keras runs on, as the package's Keras seam reads it."""
    from keras_memopt._keras import BACKEND

    return BACKEND


if _launched_as_command():
    _LAZY = {
        "AccumulatingModel": "keras_memopt.models",
        "Remat": "keras_memopt.remat",
        "MemoryPlanner": "keras_memopt.planning",
        "MemoryReader": "keras_memopt.memory",
        "configure_devices": "keras_memopt.devices",
    }

    def __getattr__(name):
        import importlib

        if name in ("callbacks", "pruning", "quantization", "supervise"):
            return importlib.import_module(f"keras_memopt.{name}")
        if name in _LAZY:
            value = getattr(importlib.import_module(_LAZY[name]), name)
            globals()[name] = value
            return value
        raise AttributeError(f"module 'keras_memopt' has no attribute {name!r}")

elif _keras_backend() == "jax":
    # Keras 3 on JAX: the JAX step's `AccumulatingModel`, `Remat` (`jax.checkpoint`) and the
    # callbacks that run there; the rest of the API is TensorFlow's, not there yet (issue 56).
    from keras_memopt import callbacks  # noqa: F401  (a module of the API)
    from keras_memopt.jax_models import AccumulatingModel
    from keras_memopt.remat import Remat

    __all__ = ["AccumulatingModel", "Remat"]

    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(f"module 'keras_memopt' has no attribute {name!r}")
        raise AttributeError(
            f"keras_memopt.{name} is not available on the JAX backend yet: on JAX, "
            "keras_memopt has `AccumulatingModel`, `Remat` and `callbacks.OOMBackoff` and "
            "`callbacks.MemoryLogger` only. Use the TensorFlow backend "
            f"(KERAS_BACKEND=tensorflow) for it. Received: {name!r}"
        )

elif _keras_backend() != "tensorflow":
    raise ImportError(
        "keras_memopt runs on Keras's TensorFlow backend (Keras 3 or tf_keras) and, in "
        "part, on its JAX backend; set KERAS_BACKEND to one of them. Received: "
        f"KERAS_BACKEND={_keras_backend()!r}"
    )

else:
    from keras_memopt import (  # noqa: F401  (modules of the API)
        callbacks,
        pruning,
        quantization,
        supervise,
    )
    from keras_memopt.devices import configure_devices
    from keras_memopt.memory import MemoryReader
    from keras_memopt.models import AccumulatingModel
    from keras_memopt.planning import MemoryPlanner
    from keras_memopt.remat import Remat
