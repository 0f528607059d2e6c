"""A `MemoryLogger`'s plot: the memory timeline, device and host on panels of their own (the host's
RSS, hundreds of MiB of TensorFlow's libraries, would press a device's curve flat)."""

from __future__ import annotations

_DEVICE_SUFFIXES = ("_peak_mib", "_used_mib")
_HOST = "memory_host_rss_mib"


def require_matplotlib(plot):
    """`ImportError` naming the extra, at construction, where `plot` needs missing matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "`plot` needs matplotlib, which is not installed. Install it with "
            f'`pip install "keras_memopt[plot]"`. Received: plot={plot!r}'
        ) from error


def _label(name):
    return name.removeprefix("memory_").removesuffix("_mib").replace("_", " ")


def memory_figure(rows: list[dict]):
    """A matplotlib `Figure` of the rows' figures over their `step`. One panel for the device
    figures (where there are any), one for the host's RSS (where read), sharing the step axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(rows[-1]) if rows else []
    panels = [
        ("Device memory (TensorFlow's allocator, NVML)",
         [n for n in names if n.endswith(_DEVICE_SUFFIXES)]),
        ("Host process (resident set size)", [n for n in names if n == _HOST]),
    ]
    panels = [(title, series) for title, series in panels if series]
    figure = Figure(figsize=(8, 3 * max(len(panels), 1)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(max(len(panels), 1), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (title, series) in zip(axes, panels, strict=False):
        for name in series:
            points = [(row["step"], row[name]) for row in rows if name in row]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=".",
                    label=_label(name))
        ax.set_title(title)
        ax.set_ylabel("MiB")
        ax.legend()
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("training step")
    figure.suptitle("Memory during training")
    return figure


def write_plot(rows: list[dict], path: str):
    """Writes `memory_figure(rows)` to `path` as a PNG."""
    memory_figure(rows).savefig(path, format="png", dpi=100)
