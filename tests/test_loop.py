"""The micro-batch loop (`keras_memopt._step.loop`) on hand-computed numbers.

As Keras's optimizer tests do, each case states its inputs and the result
worked out by hand: the loop must run `fn` once per micro-batch, the last one
short, and add up what it returns (dense tensors summed, sparse gradients
summed per row, None kept).
"""

import numpy as np
import pytest
import tensorflow as tf

from keras_memopt._step import loop as _loop

pytestmark = pytest.mark.line_independent  # no Keras code


def _run(fn, data, size):
    """`_loop.accumulate` in a traced function, as the train step runs it."""

    @tf.function
    def run():
        return _loop.accumulate(fn, data, tf.constant(size, tf.int32))

    return run()


def test_dense_outputs_are_summed_and_the_last_micro_batch_is_short():
    data = tf.constant([[1.0], [2.0], [3.0], [4.0], [5.0]])
    sizes = []

    def fn(micro):
        tf.py_function(lambda n: sizes.append(int(n)), [tf.shape(micro)[0]], [])
        return {"sum": tf.reduce_sum(micro), "square": tf.reduce_sum(tf.square(micro))}

    result = _run(fn, data, 2)
    assert sizes == [2, 2, 1]  # micro-batches [1, 2], [3, 4], [5]
    assert float(result["sum"]) == 15.0  # 3 + 7 + 5
    assert float(result["square"]) == 55.0  # 5 + 25 + 25


def test_weighted_means_add_up_to_the_batch_mean():
    """Each micro-batch's mean weighted by its share n_i / N is the batch's mean."""
    data = tf.constant([2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0])

    def fn(micro):
        share = tf.cast(tf.size(micro), tf.float32) / 7.0
        return tf.reduce_mean(micro) * share

    # Micro-batches of 3: means 4, 10 and 14, weighted 3/7, 3/7 and 1/7.
    np.testing.assert_allclose(float(_run(fn, data, 3)), (12 + 30 + 14) / 7, rtol=1e-6)


def test_sparse_gradients_are_summed_per_row():
    # Two lookups a sample; micro-batches of 2 on 5 samples: [s0, s1], [s2, s3], [s4],
    # so rows repeat within a micro-batch and across micro-batches.
    ids = tf.constant([[0, 2], [0, 0], [2, 2], [1, 1], [1, 1]])
    values = tf.constant([[1.0, 2.0], [3.0, 0.0], [5.0, 6.0], [7.0, 0.0], [0.0, 9.0]])

    def fn(micro):
        micro_ids, micro_values = micro
        return tf.IndexedSlices(
            tf.reshape(micro_values, [-1, 1]), tf.reshape(micro_ids, [-1]), tf.constant([3, 1])
        )

    result = _run(fn, (ids, values), 2)
    assert isinstance(result, tf.IndexedSlices)
    indices = result.indices.numpy()
    assert sorted(indices.tolist()) == [0, 1, 2]  # each row once
    summed = dict(zip(indices.tolist(), result.values.numpy()[:, 0].tolist(), strict=True))
    # Row 0: 1 + 3 + 0; row 2: 2 + 5 + 6; row 1: 7 + 0 + 0 + 9.
    assert summed == {0: 4.0, 1: 16.0, 2: 13.0}


def test_none_stays_none_and_narrow_floats_are_summed_in_float32():
    data = tf.ones([3000, 1], tf.float16)

    def fn(micro):
        # 2048 + 1 is not a float16: a float16 running sum would stop at 2048.
        return None, tf.reduce_sum(micro)

    nothing, total = _run(fn, data, 1)
    assert nothing is None
    assert total.dtype == tf.float16
    assert float(total) == 3000.0  # float32 sums, cast back once (3000 is a float16)


def test_concatenate_keeps_the_order_of_the_samples():
    data = tf.reshape(tf.range(7, dtype=tf.float32), [7, 1])

    @tf.function
    def run():
        return _loop.concatenate(lambda micro: micro * 10.0, data, tf.constant(3))

    np.testing.assert_array_equal(run().numpy()[:, 0], np.arange(7) * 10.0)
