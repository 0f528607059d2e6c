"""The micro-batch setting of an `AccumulatingModel`: one source of truth, read at run time.

What the user set, validated once, mirrored in variables the traced step reads (changing it retraces
nothing). `cap` (`keras-memopt run` after a crash) bounds what the setting gives and leaves the
setting as the user made it."""

from __future__ import annotations

import tensorflow as tf

from keras_memopt._validation import micro_batch_split


class MicroBatchSetting:
    """Samples per micro-batch, or micro-batches per batch, for `replicas` replicas.

    `micro_batch_size` may be a tuple (one per replica) or `"auto"`; `cap`, the largest size this
    process may use. `ValueError` for a setting `micro_batch_split` refuses, or a bad tuple."""

    def __init__(
        self, replicas: int, micro_batch_size=None, accumulation_steps=None, cap=None
    ):
        self.replicas = replicas
        self.micro_batch_size, self.accumulation_steps = self._validated(
            micro_batch_size, accumulation_steps
        )
        self.cap = cap
        with tf.init_scope():
            self._sizes = tf.Variable(
                tf.zeros([replicas], tf.int32), trainable=False, name="micro_batch_sizes"
            )
            self._steps = tf.Variable(1, trainable=False, name="accumulation_steps")
            self._cap = tf.Variable(self.cap or 0, trainable=False, name="micro_batch_cap")
        self._assign()

    def _validated(self, micro_batch_size, accumulation_steps):
        size, steps = micro_batch_split(micro_batch_size, accumulation_steps)
        if isinstance(size, tuple) and len(size) != self.replicas:
            raise ValueError(
                "`micro_batch_size` as a list gives one size per replica, and the "
                f"model's strategy has {self.replicas} replica(s). Received: "
                f"micro_batch_size={list(size)!r}"
            )
        return size, steps

    def set(self, micro_batch_size=None, accumulation_steps=None):
        """Replaces the setting (validated first; nothing changes on an error)."""
        self.micro_batch_size, self.accumulation_steps = self._validated(
            micro_batch_size, accumulation_steps
        )
        self._assign()

    def _assign(self):
        size = self.micro_batch_size
        if isinstance(size, tuple):
            sizes = list(size)
        else:
            sizes = [size if isinstance(size, int) else 0] * self.replicas
        with tf.init_scope():
            self._sizes.assign(sizes)
            self._steps.assign(self.accumulation_steps or 1)

    def in_use(self, batch_size: int | None):
        """The micro-batch size a step on `batch_size` samples runs with (None: unknown; a
        tuple where the sizes were given per replica)."""
        size = self.micro_batch_size
        if isinstance(size, tuple):
            return tuple(self._capped(s) for s in size)
        if isinstance(size, int):
            return self._capped(min(size, batch_size or size))
        if batch_size is None:
            return None
        return self._capped(max(1, -(-batch_size // (self.accumulation_steps or 1))))

    def _capped(self, size: int) -> int:
        return size if self.cap is None else min(size, self.cap)

    def describe(self) -> str:
        """The setting in words, as `model.summary()` shows it."""
        per_replica = " per replica" if self.replicas > 1 else ""
        if self.micro_batch_size == "auto":
            text = 'micro_batch_size="auto" (chosen at the first step)'
        elif self.micro_batch_size is not None:
            size = self.micro_batch_size
            size = list(size) if isinstance(size, tuple) else size
            text = f"micro_batch_size={size}{per_replica}"
        elif self.accumulation_steps is not None:
            text = f"accumulation_steps={self.accumulation_steps}{per_replica}"
        else:
            text = "each batch one micro-batch (micro_batch_size=None)"
        if self.cap is not None:
            text += f", capped at {self.cap} by keras-memopt run"
        return text

    def splits(self) -> bool:
        """Whether the setting may split a batch into several micro-batches."""
        return self.micro_batch_size is not None or (self.accumulation_steps or 1) > 1

    def size_tensor(self, batch_size):
        """The micro-batch size, in the traced step, for a batch of `batch_size` samples."""
        replica = tf.distribute.get_replica_context()
        index = 0 if replica is None else replica.replica_id_in_sync_group
        index = tf.minimum(tf.cast(index, tf.int32), self.replicas - 1)
        size = tf.cast(self._sizes[index], batch_size.dtype)
        steps = tf.cast(self._steps, batch_size.dtype)
        by_steps = tf.maximum((batch_size + steps - 1) // steps, 1)
        size = tf.where(size > 0, tf.minimum(size, tf.maximum(batch_size, 1)), by_steps)
        cap = tf.cast(self._cap, batch_size.dtype)
        return tf.where(cap > 0, tf.minimum(size, cap), size)
