"""JAX's memory figures for `keras_memopt.memory` on Keras 3's JAX backend: a device's
`memory_stats()` (a GPU's; None on JAX's CPU client), whose peak counts from the process's
start (JAX cannot reset it). Read only where Keras runs on JAX (`allocator.on_jax()`)."""

from __future__ import annotations

import jax


def device(name: str):
    """JAX's device for a canonical device name (`"GPU:0"`: JAX's first GPU), or None."""
    kind, index = name.split(":")
    try:
        devices = jax.devices(kind.lower())
    except RuntimeError:  # no backend of that kind
        return None
    return devices[int(index)] if int(index) < len(devices) else None


def stats(name: str) -> dict:
    """`memory_stats()` of the device `name` (canonical), or `{}` where JAX gives none."""
    found = device(name)
    return (found.memory_stats() if found is not None else None) or {}


def memory(name: str) -> dict | None:
    """`{"device", "current", "peak"}` bytes on the device `name` (canonical), or None."""
    figures = stats(name)
    if "bytes_in_use" not in figures:
        return None
    current = figures["bytes_in_use"]
    return dict(device=name, current=current, peak=figures.get("peak_bytes_in_use", current))


def default_device() -> str:
    """JAX's default device, as a logical device name (`"CPU:0"`, `"GPU:0"`)."""
    return f"{jax.devices()[0].platform.upper()}:0"


def gpus() -> list:
    """JAX's GPUs (none without a GPU backend)."""
    try:
        return jax.devices("gpu")
    except RuntimeError:  # no GPU backend
        return []
