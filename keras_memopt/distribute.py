"""What a step needs beyond one device: replicas, workers, and agreeing on out-of-memory.

- `one_step_function(model, kind)`: one train, test or predict step on one
  batch across the model's replicas, with Keras's reduction of the outputs
  (across workers too, under `MultiWorkerMirroredStrategy`).
- `local_variables`: the per-replica parts of distributed variables, which
  can be read and written without any collective op.
- `Agreement`: under several workers, every worker runs its share of a step
  without collective ops, then all agree (one small all-reduce) whether any
  ran out of memory; if one did, all roll back and retry at the same smaller
  micro-batch. A worker that retried alone would wait in collective ops the
  others never join (measured: every worker hangs).
"""

from __future__ import annotations

import warnings

import tensorflow as tf

from keras_memopt import _keras as K

# `Agreement` statuses: a sum of at least FAILED means some worker cannot go on.
OK, OUT_OF_MEMORY, FAILED = 0.0, 1.0, 1000.0


def multi_worker(strategy) -> bool:
    """Whether `strategy` spans several worker processes (as Keras itself tests it)."""
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and bool(
        strategy.extended._in_multi_worker_mode()
    )


def writes_files(strategy) -> bool:
    """Whether this process writes checkpoints: not a non-chief worker of a cluster.

    (tf_keras sends non-chief workers' files to temporary paths itself.)
    """
    return K.LEGACY or not multi_worker(strategy) or bool(strategy.extended.should_checkpoint)


def share_sizes(batch_size: int, shares) -> list[int]:
    """Samples per replica when a batch of `batch_size` is split by `shares`.

    In proportion, rounded so that they add up to the batch; a replica's
    part is never negative, and the earlier replicas get the remainder.
    """
    total = sum(shares)
    sizes = [int(batch_size * share // total) for share in shares]
    for index in range(batch_size - sum(sizes)):
        sizes[index % len(sizes)] += 1
    return sizes


def split_by_shares(data, strategy, shares):
    """A distributed batch, re-split so that replica r takes its share.

    Keras hands each replica an even part; here the parts are put back
    together in order (the global batch) and cut again by `shares`.
    """

    def whole(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return tf.concat(strategy.experimental_local_results(value), axis=0)
        return value

    data = tf.nest.map_structure(whole, data)
    leaves = [t for t in tf.nest.flatten(data) if t is not None]
    sizes = share_sizes(int(leaves[0].shape[0]), shares)
    starts = [sum(sizes[:r]) for r in range(len(sizes))]

    def part(context):
        r = context.replica_id_in_sync_group
        return tf.nest.map_structure(
            lambda t: None if t is None else t[starts[r] : starts[r] + sizes[r]], data
        )

    return strategy.experimental_distribute_values_from_function(part)


def resolve_shares(shares, strategy):
    """`AccumulatingModel`'s `replica_shares`, checked: a tuple of floats, or None."""
    replicas = strategy.num_replicas_in_sync
    if shares is None:
        return None
    if multi_worker(strategy) or not isinstance(strategy, tf.distribute.MirroredStrategy):
        raise ValueError(
            "`replica_shares` splits each batch unevenly among the replicas of a "
            "`tf.distribute.MirroredStrategy` (one machine); create the model in the "
            f"scope of one. Received: replica_shares={shares!r} under "
            f"{type(strategy).__name__}"
        )
    if isinstance(shares, str) and shares == "auto":
        memory = device_memory(strategy)
        if None in memory:
            warnings.warn(
                'replica_shares="auto" could not read every device\'s memory '
                f"({memory}); the replicas take equal shares.",
                stacklevel=3,
            )
            return tuple(1.0 for _ in memory)
        return tuple(float(size) for size in memory)
    valid = (
        isinstance(shares, (list, tuple))
        and len(shares) == replicas
        and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in shares
        )
    )
    if not valid:
        raise ValueError(
            "`replica_shares` must be 'auto' or a list of positive numbers, one per "
            f"replica ({replicas} under this strategy): replica r takes "
            "shares[r] / sum(shares) of every batch. Received: "
            f"replica_shares={shares!r}"
        )
    return tuple(float(v) for v in shares)


def effective_batch_size(batch_size, shares):
    """The replica batch size the loss shares are counted against.

    With even parts, this replica's own; with `shares`, the global batch over
    the number of replicas (Keras scales each replica's loss by one over the
    number of replicas), so that uneven parts add up to the global mean.
    """
    if shares is None:
        return batch_size
    context = tf.distribute.get_replica_context()
    total = context.all_reduce("SUM", tf.cast(batch_size, tf.float32))
    return total / context.num_replicas_in_sync


def device_memory(strategy) -> list[int | None]:
    """Each replica's device memory in bytes, where it can be read (else None).

    A logical device's memory limit, else a GPU's total (TensorFlow's device
    details, or NVML).
    """
    sizes = []
    for device in strategy.extended.worker_devices:
        spec = tf.DeviceSpec.from_string(device)
        sizes.append(_device_total(spec.device_type, spec.device_index or 0))
    return sizes


def _device_total(kind, index):
    if kind != "GPU":
        return None
    from keras_memopt import memory

    physical = tf.config.list_physical_devices("GPU")
    logical = []
    for gpu in physical:
        configs = tf.config.get_logical_device_configuration(gpu) or [None]
        logical.extend((gpu, c) for c in configs)
    if index >= len(logical):
        return None
    gpu, config = logical[index]
    if config is not None and getattr(config, "memory_limit", None):
        return int(config.memory_limit) * 2**20
    try:
        handle = memory.nvml_handle_of_tf_gpu(physical.index(gpu))
        return int(memory.nvml().nvmlDeviceGetMemoryInfo(handle).total)
    except Exception:  # noqa: BLE001 - NVML missing or unusable: unknown
        return None


def local_variables(variables, strategy) -> list:
    """The variables this process holds for `variables` (each replica's part).

    Reading a sum-aggregated (metric) variable in cross-replica context adds
    the replicas' parts up, across workers an all-reduce: the parts are what a
    snapshot can read and put back on one worker alone.
    """
    parts = []
    for variable in variables:
        inner = getattr(variable, "value", variable)  # a Keras 3 variable's tf.Variable
        if isinstance(inner, tf.distribute.DistributedValues):
            parts.extend(strategy.experimental_local_results(inner))
        else:
            parts.append(variable)
    return parts


def first_local_batch(strategy, iterator):
    """Keras 3: the first batch of a Keras data iterator, its first local replica's part.

    What Keras 3 reads the shapes of before the first step
    (`_maybe_symbolic_build`). Keras reduces a distributed batch across
    replicas for that, which fails across workers (keras-team/keras#20585);
    the first local replica's tensors have the same shapes.
    """
    for _, _, batches in iterator:
        return tf.nest.map_structure(
            lambda v: strategy.experimental_local_results(v)[0]
            if isinstance(v, tf.distribute.DistributedValues)
            else v,
            next(batches),
        )
    return None


def reduce_per_replica(values, strategy, reduction):
    """Keras's reduction of per-replica step outputs, across workers too."""
    if reduction == "auto":
        tpu = isinstance(strategy, tf.distribute.TPUStrategy)
        # tf_keras sums, Keras 3 averages (the values agree across replicas).
        reduction = "first" if tpu else ("sum" if K.LEGACY else "mean")
    workers = multi_worker(strategy)

    def reduce(value):
        if workers:
            if reduction == "concat":
                return _multi_worker_concat(value, strategy)
            # Keras 3 takes the mean over axis 0, which fails for the scalars
            # a step returns (keras-team/keras#20585); tf_keras sums results
            # its metrics already made global (its per-step logs come out
            # doubled with two workers): the mean over the replicas is the
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


def one_step_function(model, kind, step=None):
    """A function that runs one `kind` step on one batch of data (not an iterator).

    Keras's own step functions pull the batch from a `tf.data` iterator inside
    the graph, so a failed step cannot be retried on the same batch. This is
    their one-batch equivalent: the same distribution, reduction and (tf_keras)
    step counter. Unless the model runs eagerly it is a `tf.function`, so
    `get_concrete_function(data)` creates the optimizer's and metrics' variables
    without running a step.
    """
    step = step or getattr(model, f"{kind}_step")
    run_step = _counted(model, kind, step)
    strategy = model.distribute_strategy
    reduction = _reduction(model, kind)

    def one_step(data):
        outputs = strategy.run(run_step, args=(data,))
        return reduce_per_replica(outputs, strategy, reduction)

    return _compiled(model, one_step)


def _reduction(model, kind):
    if kind == "predict":
        return "concat"
    return getattr(model, "_distribute_reduction_method", None) or "auto"


def _counted(model, kind, step):
    """`step`, advancing tf_keras's step counter once it has run."""
    counter = getattr(model, f"_{kind}_counter", None) if K.LEGACY else None
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


def _placed(finish):
    """`finish` on its inputs made again on the replica's device.

    Tensors that cross from one `tf.function` into another carry no device,
    and collective ops need one ("destinations can not be empty").
    """

    def run(outputs):
        return finish(
            tf.nest.map_structure(
                lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t,
                outputs,
                expand_composites=True,
            )
        )

    return run


def _compiled(model, function):
    if model.run_eagerly:
        return function
    jit_compile = False if K.LEGACY else bool(model.jit_compile)
    # As each line's own step functions: tf_keras converts the step with
    # AutoGraph, Keras 3 does not.
    return tf.function(
        function, reduce_retracing=True, jit_compile=jit_compile, autograph=K.LEGACY
    )


class Agreement:
    """A step under several workers in three calls, so that all retry an out-of-memory error.

    1. `local(data)`: this worker's share of the step, no collective op (the
       micro-batch loop, metric updates); an out-of-memory error here is
       caught on this worker alone.
    2. `agree(status)`: one all-reduce of every worker's status (`OK`,
       `OUT_OF_MEMORY`, `FAILED`); every worker learns whether any must retry
       or stop, and all act alike.
    3. `finish(outputs)`: the collective part (the gradient all-reduce and the
       update, or the logs' reduction), on what `local` returned.

    Functions with collective ops are traced in the same order on every
    worker (their ops are matched by keys handed out when traced): `agree`
    first, then `finish`; `local` may be traced again on one worker alone.
    """

    def __init__(self, model, kind, local, finish):
        strategy = model.distribute_strategy
        reduction = _reduction(model, kind)
        finish = _counted(model, kind, _placed(finish or (lambda outputs: outputs)))
        self.local = _compiled(model, lambda data: strategy.run(local, args=(data,)))
        self.finish = _compiled(
            model,
            lambda outputs: reduce_per_replica(
                strategy.run(finish, args=(outputs,)), strategy, reduction
            ),
        )
        # Waits for the slowest worker's local pass, a real out-of-memory error
        # (about 10 s on a CPU) included: no timeout, whatever the strategy's.
        options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=0.0)

        @tf.function(input_signature=[tf.TensorSpec([], tf.float32)])
        def agree(status):
            def replica(value):
                context = tf.distribute.get_replica_context()
                return context.all_reduce("SUM", tf.identity(value), options=options)

            return strategy.experimental_local_results(strategy.run(replica, args=(status,)))[0]

        self.agree = agree
