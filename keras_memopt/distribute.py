"""What a step needs beyond one device: replicas, workers, and their outputs (agreeing on a
failed step is `_oom.coordinator`'s; uneven replica shares `_step.shares`')."""

from __future__ import annotations

import tensorflow as tf

from keras_memopt import _autograph, _keras

__all__ = ["local_variables", "multi_worker", "reduce_per_replica", "step_function", "writes_files"]


def multi_worker(strategy) -> bool:
    """Whether `strategy` spans several worker processes (as Keras itself tests it)."""
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and bool(
        strategy.extended._in_multi_worker_mode()
    )


def writes_files(strategy) -> bool:
    """Whether this process writes checkpoints: not a non-chief worker of a cluster (tf_keras sends
    non-chief workers' files to temporary paths itself)."""
    return (
        _keras.REDIRECTS_NON_CHIEF_FILES
        or not multi_worker(strategy)
        or bool(strategy.extended.should_checkpoint)
    )


def local_variables(variables, strategy) -> list:
    """Each replica's part of `variables`: what a snapshot can read and put back on one worker
    alone (reading a sum-aggregated variable would all-reduce)."""
    parts = []
    for variable in variables:
        inner = variable
        if not isinstance(inner, tf.distribute.DistributedValues):
            inner = getattr(variable, "value", variable)  # a Keras 3 variable's tf.Variable
        if isinstance(inner, tf.distribute.DistributedValues):
            parts.extend(strategy.experimental_local_results(inner))
        else:
            parts.append(variable)
    return parts


def first_replica_part(data, strategy):
    """The first local replica's part of a distributed batch (the batch itself otherwise)."""

    def first(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    return tf.nest.map_structure(first, data)


def reduce_per_replica(values, strategy, reduction):
    """Keras's reduction of per-replica step outputs, across workers too."""
    if reduction == "auto":
        tpu = isinstance(strategy, tf.distribute.TPUStrategy)
        # tf_keras sums, Keras 3 averages (the values agree across replicas).
        reduction = "first" if tpu else ("sum" if _keras.REPLICA_OUTPUTS_SUMMED else "mean")
    workers = multi_worker(strategy)

    def reduce(value):
        if workers:
            if reduction == "concat":
                return _multi_worker_concat(value, strategy)
            # Keras 3 takes the mean over axis 0, which fails for the scalars a step returns
            # (keras-team/keras#20585); tf_keras sums results its metrics already made global (its
            # per-step logs come out doubled with two workers): the mean over the replicas is the
            # figure one process reports, on both lines.
            return strategy.reduce("MEAN", value, axis=None)
        if not isinstance(value, tf.distribute.DistributedValues):
            return value
        local = strategy.experimental_local_results(value)
        if reduction == "first":
            return local[0]
        if reduction == "concat":
            return tf.concat(local, axis=0)
        if reduction == "mean":
            return tf.reduce_mean(local, axis=0)
        return tf.reduce_sum(local)

    return tf.nest.map_structure(reduce, values)


def _multi_worker_concat(value, strategy):
    """Every replica's rows, in the order of the global batch (as Keras 3 orders them)."""
    gathered = strategy.gather(value, axis=0)
    parts = value.values if isinstance(value, tf.distribute.DistributedValues) else (value,)
    sizes = tf.concat([tf.shape(part)[:1] for part in parts], axis=0)
    sizes = strategy.gather(sizes, axis=0)
    replicas = tf.split(gathered, sizes, num=strategy.num_replicas_in_sync)
    per_worker = len(strategy.extended.worker_devices)
    ordered = []
    for replica in range(per_worker):
        ordered += replicas[replica::per_worker]
    return tf.concat(ordered, axis=0)


def step_function(model, kind, step):
    """A function that runs one `kind` step on one batch of data (not an iterator).

    Keras's pull the batch inside the graph, so a failed step could not be retried on the same
    batch; this has the same distribution, reduction and step counter, and (unless eager) is a
    `tf.function`."""
    run_step = counted(model, kind, step)
    strategy = model.distribute_strategy
    reduction = reduction_of(model, kind)

    def one_step(data):
        outputs = strategy.run(run_step, args=(data,))
        return reduce_per_replica(outputs, strategy, reduction)

    return compiled(model, one_step)


def reduction_of(model, kind):
    if kind == "predict":
        return "concat"
    return getattr(model, "_distribute_reduction_method", None) or "auto"


def counted(model, kind, step):
    """`step`, advancing tf_keras's step counter once it has run."""
    counter = _keras.step_counter(model, kind)
    if counter is None:
        return step

    def run_step(data):
        outputs = step(data)
        tensors = tf.nest.flatten(outputs, expand_composites=True)
        first = [t for t in tensors if not isinstance(t, tf.Variable)][:1]
        with tf.control_dependencies(first):  # count only steps that ran
            counter.assign_add(1)
        return outputs

    return run_step


def on_replica_device(finish):
    """`finish` on its inputs made again on the replica's device.

    Tensors that cross from one `tf.function` into another carry no device, and collective ops need
    one ("destinations can not be empty")."""

    def run(outputs):
        return finish(
            tf.nest.map_structure(
                lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t,
                outputs,
                expand_composites=True,
            )
        )

    return run


def compiled(model, function):
    if model.run_eagerly:
        return function
    # As each line's own step functions call `train_step`: not converted.
    return _autograph.function(
        function, reduce_retracing=True, jit_compile=_keras.step_jit_compile(model)
    )
