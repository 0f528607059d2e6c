"""The dtype a sum is kept in, shared by the step and the Keras seam."""

import tensorflow as tf

_NARROW_FLOATS = (tf.float16, tf.bfloat16)


def sum_dtype(dtype) -> tf.DType:
    """The dtype a sum of `dtype` values is kept in: float32 for float16, bfloat16, else `dtype`."""
    dtype = tf.as_dtype(dtype)
    return tf.float32 if dtype in _NARROW_FLOATS else dtype


def widened(tensor) -> tf.Tensor:
    """`tensor` in `sum_dtype` of its dtype."""
    return tf.cast(tensor, sum_dtype(tensor.dtype))
