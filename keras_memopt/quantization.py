"""Quantization-aware training of an `AccumulatingModel` with tensorflow-model-optimization, on
tf_keras only; the quantizers' ranges advance once per update, as in plain QAT. docs/pruning.md."""

from __future__ import annotations

from keras_memopt._keras import tfmot as _tfmot
from keras_memopt._step import per_update as _per_update
from keras_memopt.models import AccumulatingModel

__all__ = ["quantize_model", "range_variables"]

_FEATURE = "Quantization-aware training"


def quantize_model(model):
    """Makes a model quantization-aware (tfmot's `quantize_model`).

    Calls `tfmot.quantization.keras.quantize_model`; an `AccumulatingModel` comes back as an
    `AccumulatingModel` with the same `micro_batch_size`, `accumulation_steps` and `remat`.

    Args:
        model: a functional or `Sequential` tf_keras model (an `AccumulatingModel` or not).

    Returns:
        The quantization-aware model.

    Example:

    ```python
    quantized = kmo.quantization.quantize_model(model)
    ```

    Raises:
        RuntimeError: on Keras 3 (`TF_USE_LEGACY_KERAS` unset), where tfmot does not work.
        ImportError: if tensorflow-model-optimization is not installed.
        TypeError: if `model` is not a tf_keras model (a Keras 3 one, say).
    """
    quantization = _tfmot.tfmot(_FEATURE).quantization.keras
    _tfmot.check_model(model)
    return _tfmot.rewrap(model, quantization.quantize_model(model), AccumulatingModel)


def range_variables(model) -> tuple[list, list]:
    """The quantizers' range variables of `model`: `(minimums, maximums)` (at the whole batch's
    values after each step, as plain QAT)."""
    return _per_update.ranges(model)
