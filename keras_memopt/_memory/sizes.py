"""Byte sizes: `"8GiB"` to bytes and back, and the bytes of tensors from their shapes. Importing it
does not import TensorFlow, so that the command line can check sizes before TensorFlow loads."""

from __future__ import annotations

import re

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")

MIB = 2**20


def parse_bytes(value, name="size"):
    """A memory size in bytes from an int (bytes) or a string with a unit.

    Units: B, KB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB, TiB (powers
    of 1024), case-insensitive; a bare number is bytes.

    Example: `parse_bytes("8GiB") == 8 * 2**30`.

    Raises:
        ValueError: naming `name`, for anything but a positive size.
    """
    if isinstance(value, bool):
        value = str(value)
    if isinstance(value, (int, float)):
        size = value
    else:
        match = _SIZE.match(value) if isinstance(value, str) else None
        if match is None or (match.group(2) or "b").lower() not in _UNITS:
            raise ValueError(
                f"`{name}` must be a positive number of bytes or a string such as "
                "'512MiB' or '8GB' (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB). "
                f"Received: {name}={value!r}"
            )
        size = float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()]
    if not 1 <= size < float("inf"):
        raise ValueError(
            f"`{name}` must be at least one byte. Received: {name}={value!r}"
        )
    return int(size)


def format_bytes(size):
    """`size` bytes as a short human string in binary units ("1.50 GiB")."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{int(size)} B"


def bytes_if_known(shape, dtype, unknown_dim: int | None = None) -> int | None:
    """Bytes of a tensor of `shape` and `dtype`.

    An unknown dimension (None) counts as `unknown_dim`; without it, the
    result is None: there is no honest number."""
    size = 1
    for dim in shape:
        if dim is None:
            if unknown_dim is None:
                return None
            dim = unknown_dim
        size *= int(dim)
    import tensorflow as tf

    return size * tf.as_dtype(dtype).size


def variables_bytes(variables, dtype=None) -> int:
    """Bytes of `variables` (counted in `dtype` where given)."""
    return sum(bytes_if_known(v.shape, dtype or v.dtype) for v in variables)


def bytes_per_sample(tensors, unknown_dim: int | None = None) -> int | None:
    """Bytes of one sample of a (nest of) symbolic tensors, batch axis dropped. None if a dimension
    but the batch axis is unknown, unless `unknown_dim` says what to count it as (see
    `bytes_if_known`)."""
    import tensorflow as tf

    total = 0
    for tensor in tf.nest.flatten(tensors):
        size = bytes_if_known(tuple(tensor.shape)[1:], tensor.dtype, unknown_dim)
        if size is None:
            return None
        total += size
    return total
