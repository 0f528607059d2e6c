"""Argument checks shared by the public classes, worded as Keras words them."""

import numpy as np


def positive_int(name, value):
    """Returns `value` as an int, or raises naming the argument."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    return int(value)
