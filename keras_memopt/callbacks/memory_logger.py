"""`MemoryLogger`: memory figures per epoch (or every N batches) during `fit`."""

from __future__ import annotations

import os
import warnings

from keras_memopt._io import print_msg
from keras_memopt._keras import keras
from keras_memopt._memory import files as _memory_files
from keras_memopt._memory import plot as _memory_plot
from keras_memopt._memory.writers import CsvRows, Summaries
from keras_memopt._validation import positive_int
from keras_memopt.memory import MemoryReader

__all__ = ["MemoryLogger"]


class MemoryLogger(keras.callbacks.Callback):
    """Records memory figures while a model trains.

    At the end of every epoch (and, with `every_n_batches`, every N training batches) it reads each
    device's memory in use and its peak since the last reading, the host's RSS and NVML's figures,
    in MiB, named `memory_<device>_<figure>_mib` (e.g. `memory_gpu0_peak_mib`). The epoch figures go
    into `logs` (for `History`, `CSVLogger` and `TensorBoard` after it); it can also write its own
    CSV, TensorBoard summaries and a PNG plot. A figure not available is left out, and said once.
    An existing `filename` is replaced unless `append=True`. What the figures count: docs/memory.md.

    Args:
        filename: str or path, a CSV file for the logger's own rows. Defaults to None (figures go
            into `logs` only).
        every_n_batches: int, read every this many training batches instead of once per epoch
            (own CSV, TensorBoard and plot; `logs` still get epoch figures). An epoch shorter than
            that writes no row of its own. Defaults to None (once per epoch).
        devices: list of str, the logical devices to read. Defaults to every GPU, or `["CPU:0"]`
            without GPUs.
        tensorboard_dir: str, a directory for the logger's own TensorBoard summaries
            (`tf.summary`). Defaults to None.
        plot: str or path, a PNG file for the memory timeline, written at the end of training;
            needs matplotlib (`pip install "keras_memopt[plot]"`). Defaults to None.
        append: bool, add rows to an existing `filename` instead of replacing it. Defaults to False.
        verbose: int, 1 to also print (as Keras prints its messages) where figures are
            unavailable, 0 for warnings only. Defaults to 0.

    Example:

    ```python
    logger = MemoryLogger("memory.csv", every_n_batches=50, plot="memory.png")
    history = model.fit(x, y, epochs=5, callbacks=[logger, keras.callbacks.CSVLogger("log.csv")])
    print(history.history["memory_gpu0_peak_mib"])
    ```

    Raises:
        ValueError: if `every_n_batches` is not a positive integer, or `filename` and `plot` are
            one file; at the start of training, if the folder of `filename` or `plot` does not
            exist or cannot be written.
        ImportError: if `plot` is given and matplotlib is not installed.
        FileExistsError: at the start of training, if another logger is writing the same file.
    """

    def __init__(
        self,
        filename=None,
        every_n_batches: int | None = None,
        devices: list[str] | None = None,
        tensorboard_dir=None,
        plot=None,
        append: bool = False,
        verbose: int = 0,
    ):
        super().__init__()
        if every_n_batches is not None:
            positive_int("every_n_batches", every_n_batches)
        for name, path in (("filename", filename), ("plot", plot)):
            if path is not None and not isinstance(path, (str, os.PathLike)):
                raise ValueError(
                    f"`{name}` must be a path (a str or an os.PathLike). "
                    f"Received: {name}={path!r}"
                )
        if filename is not None and plot is not None and (
            os.path.abspath(os.fspath(filename)) == os.path.abspath(os.fspath(plot))
        ):
            raise ValueError(
                "`filename` and `plot` must be two files. "
                f"Received: filename={filename!r}, plot={plot!r}"
            )
        if plot is not None:
            _memory_plot.require_matplotlib(plot)
        self.filename = filename
        self.every_n_batches = every_n_batches
        self.tensorboard_dir = tensorboard_dir
        self.plot = plot
        self.append = append
        self.verbose = verbose
        self.reader = MemoryReader(devices)
        if every_n_batches:
            # Only then: without a batch hook Keras dispatches steps without waiting for callbacks.
            self.on_train_batch_end = self._read_batch
        self.rows: list[dict] = []
        self._csv = None
        self._summaries = None
        self._plot_path = None
        self._said = set()

    # -- reading ----------------------------------------------------------------------

    def _say_unavailable(self):
        for key, reason in self.reader.unavailable.items():
            if key not in self._said:
                self._said.add(key)
                message = f"MemoryLogger: {reason}"
                if self.verbose:
                    print_msg(message)
                warnings.warn(message, stacklevel=3)

    def _read(self):
        figures = self.reader.read()
        self._say_unavailable()
        return figures

    def _record(self, epoch, batch, figures):
        row = {"epoch": epoch, "batch": batch, "step": self._step, **figures}
        self.rows.append(row)
        if self._csv is not None:
            self._csv.write(row)
        if self._summaries is not None:
            self._summaries.write(self._step, figures)

    # -- callback hooks ------------------------------------------------------------

    def on_train_begin(self, logs=None):
        _memory_files.release(self)
        # Every path checked and held before anything is written: a refusal leaves no trace.
        paths = {
            what: _memory_files.check_path(path, what)
            for what, path in (("filename", self.filename), ("plot", self.plot))
            if path is not None
        }
        _memory_files.claim(paths, self, self.params)
        self._csv = CsvRows(paths["filename"], self.append) if "filename" in paths else None
        self._plot_path = paths.get("plot")
        self._summaries = (
            Summaries(self.tensorboard_dir) if self.tensorboard_dir is not None else None
        )
        self.rows = []
        self._step = 0
        self._epoch_peaks = {}

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._epoch_peaks = {}
        self.reader.reset_peaks()

    def _read_batch(self, batch, logs=None):
        self._step += 1
        if (batch + 1) % self.every_n_batches == 0:
            figures = self._read()
            self.reader.reset_peaks()
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
            if self._summaries is not None:
                self._summaries.close()
            if self._plot_path is not None and self.rows:
                _memory_plot.write_plot(self.rows, self._plot_path)
        finally:
            _memory_files.release(self)
