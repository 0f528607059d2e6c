"""Uneven replica shares: each replica of a MirroredStrategy takes its own part of a batch.

Keras hands every replica an even part; the parts are put back together and cut again
(`split_by_shares`), and the loss fractions counted against the global batch
(`effective_batch_size`), so the update is plain Keras's on the whole batch."""

from __future__ import annotations

import warnings

import tensorflow as tf

from keras_memopt import distribute, memory


def share_sizes(batch_size: int, shares) -> list[int]:
    """Samples per replica when a batch of `batch_size` is split by `shares`: in proportion,
    adding up to the batch, the earlier replicas getting the remainder."""
    total = sum(shares)
    sizes = [int(batch_size * share // total) for share in shares]
    for index in range(batch_size - sum(sizes)):
        sizes[index % len(sizes)] += 1
    return sizes


def split_by_shares(data, strategy, shares):
    """A distributed batch, put back together in order and cut again so that replica r takes
    its share."""

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
    mirrored = isinstance(strategy, tf.distribute.MirroredStrategy)
    if distribute.multi_worker(strategy) or not mirrored:
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
    """The replica batch size the loss fractions are counted against: this replica's own, or
    with `shares` the global batch over the replicas (Keras scales each replica's loss by one
    over their number), so that uneven parts add up to the global mean."""
    if shares is None:
        return batch_size
    context = tf.distribute.get_replica_context()
    total = context.all_reduce("SUM", tf.cast(batch_size, tf.float32))
    return total / context.num_replicas_in_sync


def device_memory(strategy) -> list[int | None]:
    """Each replica's device memory in bytes, where it can be read (else None). A logical device's
    memory limit, else a GPU's total (TensorFlow's device details, or NVML)."""
    return [
        memory.device_total(device) if "GPU" in device.upper() else None
        for device in strategy.extended.worker_devices
    ]
