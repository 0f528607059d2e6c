"""What pruning and quantization with tensorflow-model-optimization (tfmot) share.

tfmot 0.8 works only with tf_keras; its functions clone a model into a plain functional one, which
`rewrap` makes an `AccumulatingModel` again, with the original's settings."""

from __future__ import annotations

import os

from keras_memopt import _keras


def keras_3_error(feature: str) -> RuntimeError:
    """The error for `feature` ("Pruning", "Quantization-aware training") on Keras 3."""
    now = os.environ.get("TF_USE_LEGACY_KERAS")
    if now is None:
        received = "TF_USE_LEGACY_KERAS unset"
    elif now.lower() in ("1", "true"):
        # tfmot sets it when imported (its `compat.py`): imported after keras_memopt, too late.
        received = (
            f"TF_USE_LEGACY_KERAS={now!r} set after keras_memopt was imported "
            "(importing tensorflow_model_optimization sets it)"
        )
    else:
        received = f"TF_USE_LEGACY_KERAS={now!r}"
    return RuntimeError(
        f"{feature} uses tensorflow-model-optimization, which works only with "
        "tf_keras (Keras 2), but keras_memopt is running on Keras 3. Set the "
        "environment variable TF_USE_LEGACY_KERAS=1 before anything imports "
        "TensorFlow (for example `TF_USE_LEGACY_KERAS=1 python train.py`; in a "
        "notebook, restart the kernel and set it in the first cell), install "
        'the extra with `pip install "keras_memopt[tfmot]"`, and build the '
        "model with `tf_keras` (or `tf.keras`). "
        f"Received: Keras {_keras.keras.__version__} with {received}"
    )


def tfmot(feature: str):
    """The `tensorflow_model_optimization` module, or a clear error saying what to do."""
    if not _keras.LEGACY:
        # Before importing tfmot, which sets TF_USE_LEGACY_KERAS=1 for every process this starts.
        raise keras_3_error(feature)
    try:
        import tensorflow_model_optimization
    except Exception as error:  # noqa: BLE001 - any failure to import it says the same
        missing = isinstance(error, ImportError) and error.name == "tensorflow_model_optimization"
        what = "is not installed" if missing else "could not be imported"
        raise ImportError(
            f"{feature} needs tensorflow-model-optimization, which {what}. Install "
            'it, with the tf_keras it needs, by `pip install "keras_memopt[tfmot]"`. '
            f"Received: {type(error).__name__}: {error}"
        ) from error
    return tensorflow_model_optimization


def check_model(model, expected=None):
    """Refuses what is not a tf_keras `expected` (a Keras 3 model, say)."""
    expected = expected or _keras.keras.Model
    if not isinstance(model, expected):
        raise TypeError(
            f"`model` must be a tf_keras `{expected.__name__}`: with "
            "TF_USE_LEGACY_KERAS=1, build it with `tf_keras` or `tf.keras`, not "
            "with `import keras`, which is Keras 3 (importing "
            "tensorflow_model_optimization sets TF_USE_LEGACY_KERAS=1, so "
            "keras_memopt imported after it runs on tf_keras). Received: "
            f"model={model!r} of type {type(model).__module__}.{type(model).__name__}"
        )


def rewrap(original, rebuilt, accumulating):
    """`rebuilt` (tfmot's functional clone of `original`) as an `AccumulatingModel`
    (the class `accumulating`) with `original`'s settings; other models unchanged."""
    if not isinstance(original, accumulating) or isinstance(rebuilt, accumulating):
        return rebuilt
    remat = original.remat
    if isinstance(remat, list):
        # tfmot's wrappers rename the layers they wrap (and quantization adds
        # one): a wrapper's `layer` has the original's name.
        names = {getattr(new, "layer", new).name: new.name for new in rebuilt.layers}
        remat = [names[name] for name in remat]
    inputs, outputs = _keras.nested_inputs_outputs(rebuilt)
    return type(original)(
        inputs,
        outputs,
        name=rebuilt.name,
        micro_batch_size=original.micro_batch_size,
        accumulation_steps=original.accumulation_steps,
        remat=remat,
    )
