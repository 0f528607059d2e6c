"""Where a `MemoryLogger`'s rows go besides `logs`: its CSV file and TensorBoard."""

from __future__ import annotations

import csv
import os

import tensorflow as tf
from tensorflow.core.framework import summary_pb2

# What `tf.summary.scalar` writes, which without TensorBoard (TensorFlow 2.21 no longer installs
# it) raises TBNotInstalledError: `tf.summary.write` with the scalar plugin's metadata.
_SCALAR_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
)


class CsvRows:
    """A CSV file of rows, the header from the first row or the file appended to; opened (and
    without `append` emptied, as `CSVLogger` does) at the start of training."""

    def __init__(self, path: str, append: bool):
        self.path = path
        self._fields = None
        if append and os.path.exists(path) and os.path.getsize(path):
            with open(path, newline="") as handle:
                self._fields = next(csv.reader(handle), None)
        with open(path, "a" if append else "w", newline=""):
            pass

    def write(self, row: dict):
        if self._fields is None:
            self._fields = list(row)
            with open(self.path, "a", newline="") as handle:
                csv.writer(handle).writerow(self._fields)
        with open(self.path, "a", newline="") as handle:
            csv.DictWriter(handle, self._fields, extrasaction="ignore").writerow(row)


class Summaries:
    """TensorBoard scalars, one point per figure and row."""

    def __init__(self, folder):
        self._writer = tf.summary.create_file_writer(os.fspath(folder))

    def write(self, step: int, figures: dict):
        with self._writer.as_default():
            for name, value in figures.items():
                tf.summary.write(
                    name, tf.constant(value, tf.float32), step=step, metadata=_SCALAR_METADATA
                )

    def close(self):
        self._writer.flush()
        self._writer.close()
