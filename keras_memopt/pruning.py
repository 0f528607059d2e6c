"""Magnitude pruning of an `AccumulatingModel` with tensorflow-model-optimization (tfmot), on
tf_keras only (`TF_USE_LEGACY_KERAS=1` and the `tfmot` extra). See docs/pruning.md."""

from __future__ import annotations

from keras_memopt import _keras
from keras_memopt._keras import tfmot as _tfmot
from keras_memopt._step import per_update as _per_update
from keras_memopt.models import AccumulatingModel

__all__ = ["prune_low_magnitude", "strip_pruning"]


def prune_low_magnitude(model, **kwargs):
    """Wraps a model's prunable layers for magnitude pruning (tfmot).

    Calls `tfmot.sparsity.keras.prune_low_magnitude`; an `AccumulatingModel` comes back as an
    `AccumulatingModel` with the same `micro_batch_size`, `accumulation_steps` and `remat`. The
    result wraps `model`'s own layers, so `model` is pruned too. Train it with
    `tfmot.sparsity.keras.UpdatePruningStep()`; `pruning_step` counts optimizer updates.

    Args:
        model: a functional or `Sequential` tf_keras model (an `AccumulatingModel` or not), a layer,
            or a list of layers, as for tfmot. Inside a subclassed `AccumulatingModel`, wrap its
            layers with this function instead.
        **kwargs: passed on to tfmot: `pruning_schedule`, `block_size`, `block_pooling_type`,
            `pruning_policy`, `sparsity_m_by_n`.

    Returns:
        The model (or layer, or list of layers) with pruning wrappers.

    Example:

    ```python
    schedule = tfmot.sparsity.keras.ConstantSparsity(0.75, begin_step=0)
    pruned = kmo.pruning.prune_low_magnitude(model, pruning_schedule=schedule)
    ```

    Raises:
        RuntimeError: on Keras 3 (`TF_USE_LEGACY_KERAS` unset), where tfmot does not work.
        ImportError: if tensorflow-model-optimization is not installed.
        TypeError: if `model` is not a tf_keras model or layer (a Keras 3 one, say).
    """
    sparsity = _tfmot.tfmot("Pruning").sparsity.keras
    for item in model if isinstance(model, list) else [model]:
        _tfmot.check_model(item, _keras.keras.layers.Layer)
    return _tfmot.rewrap(model, sparsity.prune_low_magnitude(model, **kwargs), AccumulatingModel)


def strip_pruning(model):
    """Removes the pruning wrappers, keeping the pruned (sparse) weights.

    Calls `tfmot.sparsity.keras.strip_pruning`; an `AccumulatingModel` comes back as one with the
    same settings: the model to export, its weights holding the schedule's zeros.

    Args:
        model: a model returned by `prune_low_magnitude`, trained.

    Returns:
        The same architecture as the model before pruning, with sparse weights.

    Example:

    ```python
    exported = kmo.pruning.strip_pruning(pruned)
    exported.save("model.keras")
    ```

    Raises:
        RuntimeError: on Keras 3 (`TF_USE_LEGACY_KERAS` unset).
        ImportError: if tensorflow-model-optimization is not installed.
        TypeError: if `model` is not a tf_keras model.
    """
    sparsity = _tfmot.tfmot("Pruning").sparsity.keras
    _tfmot.check_model(model)
    return _tfmot.rewrap(model, sparsity.strip_pruning(model), AccumulatingModel)


def step_counters(model):
    """`model`'s pruning wrappers' `pruning_step` variables (they count optimizer updates)."""
    return _per_update.counters(model)
