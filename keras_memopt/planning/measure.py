"""Measuring real train steps: in this process, or in a fresh one per size (`measure_isolated`, the
model rebuilt from `model.to_json()` with the parent's threading and precision policy)."""

from __future__ import annotations

import gc
import json

import numpy as np
import tensorflow as tf

from keras_memopt import _keras, _subprocess
from keras_memopt._oom.auto_search import headroom

keras = _keras.keras

__all__ = [
    "CannotIsolate", "measure_in_child", "measure_isolated", "measure_step", "synthetic_batch",
    "training_copy",
]


# The steps measured after the tracing step: enough for a median.
STEPS = 3


class CannotIsolate(Exception):
    """The model cannot be measured in a fresh process; `str()` says why."""


def training_copy(model, optimizer):
    """A fresh `AccumulatingModel` copy of `model`, compiled with a copy of `optimizer`."""
    from keras_memopt.models import AccumulatingModel

    copy = keras.models.clone_model(model)
    if not isinstance(copy, AccumulatingModel):
        copy = AccumulatingModel.from_model(copy)
    optimizer = type(optimizer).from_config(optimizer.get_config())
    copy.compile(optimizer=optimizer, loss="mse")
    return copy


def synthetic_batch(model, size):
    """(x, y) of `size` samples shaped like the model's inputs and outputs."""

    def fill(tensor):
        shape = (size, *tuple(tensor.shape)[1:])
        dtype = tf.as_dtype(tensor.dtype)
        if dtype.is_integer:
            return np.zeros(shape, dtype.as_numpy_dtype)
        return np.random.default_rng(0).random(shape, dtype=np.float32).astype(
            dtype.as_numpy_dtype
        )

    x = tf.nest.map_structure(fill, model.inputs)
    y = tf.nest.map_structure(fill, model.outputs)
    if len(x) == 1:
        x = x[0]
    if len(y) == 1:
        y = y[0]
    return x, y


def measure_step(source, optimizer, batch, micro, device) -> int | None:
    """Allocator peak of train steps of a fresh training copy of `source`, with headroom.

    Bytes over what was in use before the copy was made: the highest peak of `STEPS` steps after a
    tracing step, plus `headroom`'s margin; None if it ran out of memory. `RuntimeError` if `device`
    gives no allocator figures."""
    from keras_memopt._oom.errors import is_oom

    x, y = synthetic_batch(source, batch)
    gc.collect()
    before = _memory_in_use(device)
    model = None
    # Every copy traces its own step functions: TensorFlow's retracing warning would be noise here.
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel("ERROR")
    try:
        with tf.device(device):
            model = training_copy(source, optimizer)
            model.micro_batch_size = micro
            # The first step traces and builds the slots: its allocations are not training's.
            model.train_on_batch(x, y)
            peaks = []
            for _ in range(STEPS):
                tf.config.experimental.reset_memory_stats(device)
                model.train_on_batch(x, y)
                peaks.append(tf.config.experimental.get_memory_info(device)["peak"] - before)
        # What `micro_batch_size="auto"` keeps free beside its highest step peak.
        spread = headroom(peaks, None)
        return spread["highest"] + spread["margin"]
    except tf.errors.OpError as error:
        if not is_oom(error):
            raise
        return None
    finally:
        logger.setLevel(level)
        del model
        gc.collect()


def _memory_in_use(device):
    try:
        return tf.config.experimental.get_memory_info(device)["current"]
    except ValueError as error:
        raise RuntimeError(
            f"`profile()` reads TensorFlow's allocator peak on {device}, which "
            "gives no memory figures there. On a CPU, set "
            "TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow starts. "
            f"Received: device={device!r}"
        ) from error


def measure_isolated(model, optimizer, batch, micro, device) -> int | None:
    """`measure_step` in a fresh process: the peak in bytes or None; `CannotIsolate` where the
    model cannot be rebuilt there, `ChildFailed` if the child fails otherwise."""
    try:
        spec = dict(
            model=model.to_json(),
            optimizer=keras.optimizers.serialize(optimizer),
            batch=batch,
            micro=micro,
            device=device,
            inter_op_threads=tf.config.threading.get_inter_op_parallelism_threads(),
            intra_op_threads=tf.config.threading.get_intra_op_parallelism_threads(),
            policy=keras.mixed_precision.global_policy().name,
        )
        json.dumps(spec)  # what `call` sends: fails here if it cannot
    except (NotImplementedError, TypeError, ValueError) as error:
        raise CannotIsolate(f"the model or optimizer cannot be written as JSON ({error})") from None
    # The child's CPU allocator must report figures; measuring on the CPU, the GPUs stay here.
    env = _subprocess.tensorflow_env(quiet=False)
    if "GPU" not in device.upper():
        env["CUDA_VISIBLE_DEVICES"] = "-1"
    result = _subprocess.call(
        "keras_memopt.planning.measure:measure_in_child",
        spec,
        env=env,
        name=f"Measuring micro-batch {micro} of a batch of {batch} in a fresh process",
    )
    if "unloadable" in result:
        raise CannotIsolate(f"the subprocess cannot rebuild it ({result['unloadable']})")
    return result["peak"]


def measure_in_child(spec):
    """The child's side of `measure_isolated`: {"peak": bytes or None} or {"unloadable": reason}."""
    # `measure_step` collects garbage twice; a full collection walks what TensorFlow and Keras made
    # at import (0.2 s on 2 cores), which nothing here frees: frozen, it is skipped.
    gc.collect()
    gc.freeze()
    # Before TensorFlow runs anything: the parent's threading (it changes how much memory overlaps).
    tf.config.threading.set_inter_op_parallelism_threads(spec["inter_op_threads"])
    tf.config.threading.set_intra_op_parallelism_threads(spec["intra_op_threads"])
    keras.mixed_precision.set_global_policy(spec["policy"])
    # tf_keras's JSON names a registered class without its package.
    registered = keras.saving.get_registered_object("keras_memopt>AccumulatingModel")
    try:
        model = keras.models.model_from_json(
            spec["model"], custom_objects={"AccumulatingModel": registered}
        )
        optimizer = keras.optimizers.deserialize(spec["optimizer"])
    except Exception as error:  # noqa: BLE001 - any failure means "cannot rebuild here"
        return {"unloadable": f"{type(error).__name__}: {error}".replace("\n", " ")}
    if not isinstance(model, keras.Model):
        return {"unloadable": f"the JSON gave {type(model).__name__}, not a model"}
    return {"peak": measure_step(model, optimizer, spec["batch"], spec["micro"], spec["device"])}
