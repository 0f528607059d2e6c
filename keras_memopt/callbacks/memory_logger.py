"""`MemoryLogger`: memory figures per epoch (or every N batches) during `fit`."""

from __future__ import annotations

import csv
import dataclasses
import os
import threading
import warnings

import tensorflow as tf
from tensorflow.core.framework import summary_pb2

from keras_memopt._keras import keras
from keras_memopt._validation import positive_int
from keras_memopt.memory import MemoryReader

# What `tf.summary.scalar` writes. That function is TensorBoard's, and
# TensorFlow (2.21) no longer installs TensorBoard: without it,
# `tf.summary.scalar` raises TBNotInstalledError. `tf.summary.write` with the
# scalar plugin's metadata writes the same events.
_SCALAR_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
)


@dataclasses.dataclass
class _Claim:
    """A logger's hold on a file for one `fit` call.

    Keras calls no `on_train_end` when `fit` raises, so a claim outlives a
    failed `fit`; it blocks another logger only while its `fit` may still be
    running. Keras hands every callback of one `fit` call the same `params`
    dict, which tells two loggers of one `fit` apart from loggers of two. In
    one thread, `fit` calls run one after another, so a claim made there by
    another `fit` is from one that has ended (a `fit` nested inside another's
    callback is not told apart). A claim from another thread blocks while
    that thread lives: its `fit` may be running.
    """

    owner: object
    fit: object  # the `params` of the `fit` call that made the claim
    thread: int

    def blocks(self, logger) -> bool:
        if self.owner is logger:
            return False
        if self.fit is logger.params:
            return True  # two loggers in one fit
        if self.thread == threading.get_ident():
            return False  # that fit has ended, normally or by an exception
        return any(thread.ident == self.thread for thread in threading.enumerate())


# Files that loggers are writing, so that a second logger in the same process
# cannot silently overwrite them mid-run.
_FILES_IN_USE: dict[str, _Claim] = {}


def _claim(path, owner, overwrite, append, what):
    if path is None:
        return None
    path = os.path.abspath(os.fspath(path))
    holder = _FILES_IN_USE.get(path)
    if holder is not None and holder.blocks(owner):
        raise FileExistsError(
            f"Another MemoryLogger is writing {path} in this run; two loggers "
            f"cannot share one {what}. Give each its own file. Received: "
            f"{what}={path!r}"
        )
    if path in owner._written:
        return path  # A reused logger continues its own file.
    if os.path.exists(path) and not (overwrite or append):
        raise FileExistsError(
            f"The {what} {path} already exists and MemoryLogger does not "
            "overwrite files unless asked: pass `overwrite=True` to replace it"
            + (", `append=True` to add to it," if what == "filename" else "")
            + f" or choose another path. Received: {what}={path!r}"
        )
    return path


class MemoryLogger(keras.callbacks.Callback):
    """Records memory figures while a model trains.

    At the end of every epoch (and, with `every_n_batches`, every N training
    batches) it reads, for each device, TensorFlow's allocator memory in use
    and its peak since the previous reading (the peak is reset at the start
    of each window), the host process's resident set size (psutil), and,
    where `nvidia-ml-py` finds GPUs, NVML's used and total memory. Figures
    are in MiB, named `memory_<device>_<figure>_mib` (for example
    `memory_gpu0_peak_mib`, `memory_host_rss_mib`).

    The epoch figures are written into `logs`, so `History`, `CSVLogger` and
    `TensorBoard` record them with no extra code when they come after this
    callback in the `callbacks` list. The logger can also write its own CSV
    file and TensorBoard summaries (one row or point per window), and at the
    end of training a PNG plot of the peak memory over time, one line per
    device. A figure that is not available (a CPU without allocator
    statistics, a machine without NVML) is left out, and said once.

    Files are never overwritten silently: an existing `filename` or `plot`
    raises `FileExistsError` at the start of training unless `overwrite=True`
    (or, for the CSV file, `append=True`), and two loggers cannot write one
    file at the same time (a `fit` that raised holds its files no longer).
    Nothing is written outside the paths given.

    Args:
        filename: str or path, a CSV file for the logger's own rows. Defaults
            to None (figures go into `logs` only).
        every_n_batches: int, read every this many training batches instead
            of once per epoch (own CSV, TensorBoard and plot; `logs` still get
            epoch figures). An epoch shorter than that writes no row of its
            own. Defaults to None (once per epoch).
        devices: list of str, the logical devices to read. Defaults to every
            GPU, or `["CPU:0"]` without GPUs.
        tensorboard_dir: str, a directory for the logger's own TensorBoard
            summaries (`tf.summary`). Defaults to None.
        plot: str or path, a PNG file for the memory timeline, written at the
            end of training; needs matplotlib (`pip install
            keras_memopt[plot]`). Defaults to None.
        append: bool, add rows to an existing `filename`. Defaults to False.
        overwrite: bool, replace an existing `filename` or `plot`. Defaults
            to False.
        verbose: int, 1 to print where figures are unavailable, 0 for
            warnings only. Defaults to 0.

    Example:

    ```python
    logger = MemoryLogger("memory.csv", every_n_batches=50, plot="memory.png")
    history = model.fit(x, y, epochs=5, callbacks=[logger, keras.callbacks.CSVLogger("log.csv")])
    print(history.history["memory_gpu0_peak_mib"])
    ```

    Raises:
        ValueError: if `every_n_batches` is not a positive integer.
        ImportError: if `plot` is given and matplotlib is not installed.
        FileExistsError: at the start of training, if a file would be
            overwritten.
    """

    def __init__(
        self,
        filename=None,
        every_n_batches: int | None = None,
        devices: list[str] | None = None,
        tensorboard_dir=None,
        plot=None,
        append: bool = False,
        overwrite: bool = False,
        verbose: int = 0,
    ):
        super().__init__()
        if every_n_batches is not None:
            positive_int("every_n_batches", every_n_batches)
        if append and overwrite:
            raise ValueError(
                "Pass at most one of `append` and `overwrite`. Received: "
                f"append={append!r}, overwrite={overwrite!r}"
            )
        if plot is not None:
            try:
                import matplotlib  # noqa: F401
            except ImportError as error:
                raise ImportError(
                    "`plot` needs matplotlib: pip install keras_memopt[plot]. "
                    f"Received: plot={plot!r}"
                ) from error
        self.filename = filename
        self.every_n_batches = every_n_batches
        self.tensorboard_dir = tensorboard_dir
        self.plot = plot
        self.append = append
        self.overwrite = overwrite
        self.verbose = verbose
        self.reader = MemoryReader(devices)
        if every_n_batches:
            # Only then: Keras dispatches steps without waiting for callbacks
            # when none has a batch hook, which keeps per-epoch logging free.
            self.on_train_batch_end = self._read_batch
        self.rows: list[dict] = []
        self._files = []
        self._written = set()
        self._said = set()

    # -- reading ----------------------------------------------------------------------

    def _say_unavailable(self):
        for key, reason in self.reader.unavailable.items():
            if key not in self._said:
                self._said.add(key)
                message = f"MemoryLogger: {reason}"
                if self.verbose:
                    print(message)
                warnings.warn(message, stacklevel=3)

    def _read(self):
        figures = self.reader.read()
        self._say_unavailable()
        return figures

    def _start_window(self):
        self.reader.reset_peaks()

    def _record(self, epoch, batch, figures):
        row = {"epoch": epoch, "batch": batch, "step": self._step, **figures}
        self.rows.append(row)
        self._write_row(row)
        if self._writer is not None:
            with self._writer.as_default():
                for name, value in figures.items():
                    tf.summary.write(
                        name, tf.constant(value, tf.float32), step=self._step,
                        metadata=_SCALAR_METADATA,
                    )

    # -- files ------------------------------------------------------------------------

    def _write_row(self, row):
        if self._csv_path is None:
            return
        fields = list(row)
        if self._csv_fields is None:
            exists = os.path.exists(self._csv_path) and os.path.getsize(self._csv_path)
            if self._csv_mode == "a" and exists:
                with open(self._csv_path, newline="") as handle:
                    header = next(csv.reader(handle), None)
                fields = header or fields
            else:
                with open(self._csv_path, "w", newline="") as handle:
                    csv.writer(handle).writerow(fields)
            self._csv_fields = fields
            self._csv_mode = "a"
        with open(self._csv_path, "a", newline="") as handle:
            writer = csv.DictWriter(handle, self._csv_fields, extrasaction="ignore")
            writer.writerow(row)

    def _write_plot(self):
        if self.plot is None or not self.rows:
            return
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        figure = Figure(figsize=(8, 4.5))
        FigureCanvasAgg(figure)
        axes = figure.add_subplot()
        names = [name for name in self.rows[-1] if name.endswith(("_peak_mib", "_rss_mib"))]
        names += [name for name in self.rows[-1] if name.endswith("_used_mib")]
        for name in names:
            points = [(row["step"], row[name]) for row in self.rows if name in row]
            label = name.removeprefix("memory_").removesuffix("_mib").replace("_", " ")
            axes.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=label)
        axes.set_xlabel("training step")
        axes.set_ylabel("MiB")
        axes.set_title("Memory during training")
        axes.legend()
        axes.grid(alpha=0.3)
        figure.savefig(self._plot_path, format="png", dpi=100)

    # -- callback hooks ------------------------------------------------------------

    def on_train_begin(self, logs=None):
        self._release()
        # Claim both files before writing anything, so a refusal leaves no trace.
        csv_path = _claim(self.filename, self, self.overwrite, self.append, "filename")
        plot_path = _claim(self.plot, self, self.overwrite, False, "plot")
        for path in (csv_path, plot_path):
            if path is not None:
                _FILES_IN_USE[path] = _Claim(self, self.params, threading.get_ident())
                self._files.append(path)
        self._csv_path, self._plot_path = csv_path, plot_path
        # A reused instance keeps adding to its own file.
        reused = csv_path in self._written
        self._csv_mode = "a" if (self.append or reused) else "w"
        self._written.update(p for p in (csv_path, plot_path) if p is not None)
        self._csv_fields = None
        self._writer = (
            tf.summary.create_file_writer(os.fspath(self.tensorboard_dir))
            if self.tensorboard_dir is not None
            else None
        )
        self.rows = []
        self._step = 0
        self._epoch_peaks = {}

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._epoch_peaks = {}
        self._start_window()

    def _read_batch(self, batch, logs=None):
        self._step += 1
        if (batch + 1) % self.every_n_batches == 0:
            figures = self._read()
            self._start_window()
            for name, value in figures.items():
                if name.endswith("_peak_mib"):
                    self._epoch_peaks[name] = max(self._epoch_peaks.get(name, 0.0), value)
            self._record(self._epoch, batch, figures)

    def on_epoch_end(self, epoch, logs=None):
        if not self.every_n_batches:
            # No batch hook counts steps in this mode: the epoch's steps do.
            self._step += (self.params or {}).get("steps") or 0
        figures = self._read()
        for name, value in self._epoch_peaks.items():
            if name in figures:
                figures[name] = max(figures[name], value)
        if not self.every_n_batches:
            self._record(epoch, None, figures)
        if logs is not None:
            logs.update(figures)

    def on_train_end(self, logs=None):
        try:
            if self._writer is not None:
                self._writer.flush()
                self._writer.close()
            self._write_plot()
        finally:
            self._release()

    def _release(self):
        for path in self._files:
            claim = _FILES_IN_USE.get(path)
            if claim is not None and claim.owner is self:
                del _FILES_IN_USE[path]
        self._files = []
