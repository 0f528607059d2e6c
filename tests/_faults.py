"""Layers that run out of memory on purpose, as TensorFlow's allocator reports it.

For unit tests of the out-of-memory control flow: a real out-of-memory error
takes TensorFlow's allocator about 10 s to report, so these raise the same
error at once, from inside the step, when the layer's own batch says so.
TensorFlow wraps an error raised in `tf.py_function` as an `UnknownError`
naming `ResourceExhaustedError`, one of the forms `is_oom` recognises.
The real allocator is tested in subprocesses (tests marked slow).
"""

import time

import tensorflow as tf

from keras_memopt._keras import keras

MESSAGE = (
    "OOM when allocating tensor with shape[{rows},16] and type float on "
    "/job:localhost/replica:0/task:0/device:CPU:0 by allocator cpu"
)


class OutOfMemoryAbove(keras.layers.Layer):
    """Passes its input through; raises out of memory for a batch of more than `limit` rows.

    `limit` (None: never) is read when the layer runs, so changing it needs
    no new trace; `raised` counts the errors.
    """

    def __init__(self, limit=None, **kwargs):
        super().__init__(**kwargs)
        self.limit = limit
        self.raised = 0

    def _check(self, rows):
        rows = int(rows)
        if self.limit is not None and rows > self.limit:
            self.raised += 1
            raise tf.errors.ResourceExhaustedError(None, None, MESSAGE.format(rows=rows))
        return rows

    def call(self, inputs):
        rows = tf.py_function(self._check, [tf.shape(inputs)[0]], tf.int32)
        with tf.control_dependencies([rows]):
            return tf.identity(inputs)


class OutOfMemoryAtSample(keras.layers.Layer):
    """Raises out of memory for a batch holding a sample index of at least `first`.

    The index is the input's last column; the layer passes the other columns
    on. With micro-batches, the ones before that sample run (and change the
    model's state) before the failing one.
    """

    def __init__(self, first=None, **kwargs):
        super().__init__(**kwargs)
        self.first = first

    def _check(self, largest, rows):
        if self.first is not None and int(largest) >= self.first:
            raise tf.errors.ResourceExhaustedError(None, None, MESSAGE.format(rows=int(rows)))
        return rows

    def call(self, inputs):
        largest = tf.cast(tf.reduce_max(inputs[:, -1]), tf.int32)
        rows = tf.py_function(self._check, [largest, tf.shape(inputs)[0]], tf.int32)
        with tf.control_dependencies([rows]):
            return tf.identity(inputs[:, :-1])


class OutOfMemoryOnce(keras.layers.Layer):
    """Passes its input (and its Keras mask) on; raises out of memory once, at its
    `at`-th run on a batch of more than one row (None: never).

    Counted wherever a traced step runs the layer: a micro-batch's forward
    pass in training, evaluation or prediction, or its recomputation in the
    backward pass, so the failure comes wherever the count falls, with
    micro-batches before it run. Not in eager calls: the package's probes of
    two samples before the first step, where running out of memory means the
    model's state does not fit. `at` and `runs` are read when the layer runs;
    `raised` counts errors.
    """

    def __init__(self, at=None, replica=None, delay=0.0, training_only=False, **kwargs):
        super().__init__(**kwargs)
        self.at, self.runs, self.raised = at, 0, 0
        # With `replica`, only that replica's runs count (under a strategy);
        # `delay` seconds pass before the error, while other replicas go on.
        self.replica, self.delay = replica, delay
        # With `training_only`, no run in inference mode counts: not evaluation's,
        # nor the first step's probes, which run in a graph for a model with
        # float8 layers (`keras_memopt._step.probe`).
        self.training_only = training_only
        self.supports_masking = True

    def _check(self, rows, replica):
        rows = int(rows)
        if rows > 1 and self.replica in (None, int(replica)):
            self.runs += 1
            if self.runs == self.at:
                self.raised += 1
                time.sleep(self.delay)
                raise tf.errors.ResourceExhaustedError(None, None, MESSAGE.format(rows=rows))
        return rows

    def call(self, inputs, training=None):
        if tf.executing_eagerly() or (self.training_only and not training):
            return tf.identity(inputs)
        context = tf.distribute.get_replica_context()
        replica = 0 if context is None else context.replica_id_in_sync_group
        rows = tf.py_function(self._check, [tf.shape(inputs)[0], replica], tf.int32)
        with tf.control_dependencies([rows]):
            return tf.identity(inputs)


class OutOfMemoryInBackward(keras.layers.Layer):
    """Passes its input on; raises out of memory in the backward pass, at its `at`-th
    run there on a batch of more than one row: after the forward pass of its
    micro-batch ran through the layers after it (and changed what they change)."""

    def __init__(self, at=None, **kwargs):
        super().__init__(**kwargs)
        self.at, self.runs, self.raised = at, 0, 0

    def _check(self, rows):
        rows = int(rows)
        if rows > 1:
            self.runs += 1
            if self.runs == self.at:
                self.raised += 1
                raise tf.errors.ResourceExhaustedError(None, None, MESSAGE.format(rows=rows))
        return rows

    def call(self, inputs):
        @tf.custom_gradient
        def identity(x):
            def gradient(upstream):
                if tf.executing_eagerly():  # the package's probes before the first step
                    return upstream
                rows = tf.py_function(self._check, [tf.shape(upstream)[0]], tf.int32)
                with tf.control_dependencies([rows]):
                    return tf.identity(upstream)

            return tf.identity(x), gradient

        return identity(inputs)
