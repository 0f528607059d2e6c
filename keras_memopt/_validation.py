"""Argument checks shared by the public classes, worded as Keras words them.

Light to import (no NumPy, no TensorFlow): the command line uses them before
it loads anything heavy.
"""

import argparse
import numbers


def positive_int(name, value):
    """Returns `value` as an int, or raises naming the argument.

    Python and NumPy integers are accepted; bools (Python's and NumPy's) and
    floats are not.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    return int(value)


def backoff_factor(value):
    """Returns a backoff `factor` as a float in (0, 1), or raises naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < 1:
        raise ValueError(
            "`factor` must be a number between 0 and 1 (exclusive), the fraction "
            f"of the micro-batch to keep. Received: factor={value!r}"
        )
    return float(value)


def positive_int_argument(text: str) -> int:
    """`positive_int` for a command-line option: `parser.add_argument(..., type=this)`."""
    try:
        return positive_int("value", int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a positive integer, received {text!r}"
        ) from None
