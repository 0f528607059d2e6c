"""Argument checks shared by the public classes, worded as Keras words them.

Light to import (no NumPy, no TensorFlow): the command line uses them before it loads anything
heavy."""

import argparse
import numbers


def positive_int(name, value):
    """Returns `value` as an int, or raises naming the argument. Python and NumPy integers are
    accepted; bools (Python's and NumPy's) and floats are not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    return int(value)


def micro_batch_split(micro_batch_size, accumulation_steps):
    """Checks `AccumulatingModel`'s micro-batch setting; returns it as a validated pair."""
    if micro_batch_size is not None and accumulation_steps is not None:
        raise ValueError(
            "Pass at most one of `micro_batch_size` (samples per micro-batch) "
            "and `accumulation_steps` (micro-batches per batch). Received: "
            f"micro_batch_size={micro_batch_size!r}, "
            f"accumulation_steps={accumulation_steps!r}"
        )
    if isinstance(micro_batch_size, str) and micro_batch_size == "auto":
        return "auto", None  # resolved by the step runner at the first step
    if isinstance(micro_batch_size, (list, tuple)):
        if not micro_batch_size:
            raise ValueError(
                "`micro_batch_size` as a list gives one size per replica; it cannot be "
                f"empty. Received: micro_batch_size={micro_batch_size!r}"
            )
        return tuple(positive_int("micro_batch_size", size) for size in micro_batch_size), None
    if micro_batch_size is not None:
        return positive_int("micro_batch_size", micro_batch_size), None
    if accumulation_steps is None:
        return None, None
    return None, positive_int("accumulation_steps", accumulation_steps)


def whole_batch_loss(value, replica_shares=None):
    """Checks `AccumulatingModel`'s `whole_batch_loss`; returns it as a bool."""
    if not isinstance(value, bool):
        raise ValueError(
            "`whole_batch_loss` must be True or False. "
            f"Received: whole_batch_loss={value!r}"
        )
    if value and replica_shares is not None:
        raise ValueError(
            "`whole_batch_loss=True` evaluates the loss on each replica's whole "
            "batch, which uneven `replica_shares` make unlike plain Keras's even "
            "split. Use one of the two. Received: whole_batch_loss=True, "
            f"replica_shares={list(replica_shares)!r}"
        )
    return value


def positive_int_argument(text: str) -> int:
    """`positive_int` for a command-line option: `parser.add_argument(..., type=this)`."""
    try:
        return positive_int("value", int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a positive integer, received {text!r}"
        ) from None


def check_one_split(model, name, value, other):
    """Refuses `model.<name> = value` while `other`, the other way to split a batch, is set."""
    if value is not None and getattr(model, other) is not None:
        raise ValueError(
            f"`{name}` and `{other}` are two ways to split a batch, and "
            f"`{other}` is set ({other}={getattr(model, other)!r}): set "
            f"`model.{other} = None` first. Received: {name}={value!r}"
        )
