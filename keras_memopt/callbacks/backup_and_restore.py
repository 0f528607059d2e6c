"""`BackupAndRestore`: Keras's, with the random state and one writer per cluster."""

from __future__ import annotations

import os

import numpy as np

from keras_memopt import _keras, distribute
from keras_memopt._keras import keras

__all__ = ["BackupAndRestore"]

_RANDOM_STATE = "random_state.npz"


def _random_variables(model):
    """Keras 3's seed generators' variables: the model's own (not among its weights) and global."""
    return _keras.seed_variables(model) + _keras.global_random_state()


class _BackupAndRestore(keras.callbacks.BackupAndRestore):
    """Backs up and restores the training state, random state included.

    Keras 3's `keras.callbacks.BackupAndRestore`, plus: the seed generators' states (a `Dropout`'s,
    the global one) are backed up and restored with the weights, so resumed training draws the
    random numbers of training never interrupted; under `MultiWorkerMirroredStrategy` only the
    chief writes and deletes the backup, and every worker restores from it (a shared directory).
    With an integer `save_freq`, Keras 3 keeps no batch position: the interrupted epoch restarts
    from its first batch, and its batches before the backup are trained twice. It is what
    `keras-memopt run` restarts from (docs/oom-backoff.md); on tf_keras it is tf_keras's own
    callback, which already does all this (docs/distributed.md).

    Args:
        backup_dir, save_freq, double_checkpoint, delete_checkpoint: as for
            `keras.callbacks.BackupAndRestore`.

    Example:

    ```python
    model.fit(x, y, epochs=10, callbacks=[
        keras_memopt.callbacks.BackupAndRestore("/tmp/backup"),
    ])
    ```
    """

    def _writes(self):
        return distribute.writes_files(self.model.distribute_strategy)

    def _save_model(self):
        if not self._writes():
            return
        super()._save_model()
        values = [np.asarray(v) for v in _random_variables(self.model)]
        path = os.path.join(self.backup_dir, _RANDOM_STATE)
        temporary = f"{path}.tmp.npz"
        np.savez(temporary, *values)
        os.replace(temporary, path)

    def _load_model(self):
        super()._load_model()
        path = os.path.join(self.backup_dir, _RANDOM_STATE)
        if not os.path.exists(path):
            return
        with np.load(path) as saved:
            values = [saved[f"arr_{i}"] for i in range(len(saved.files))]
        variables = _random_variables(self.model)
        if len(values) == len(variables):
            for variable, value in zip(variables, values, strict=True):
                variable.assign(value)

    def on_train_end(self, logs=None):
        if self._writes():  # removes the backup directory, random state included
            super().on_train_end(logs)


# tf_keras's own already does what this one adds: its layers keep no random state in
# variables, and it sends a non-chief worker's files to temporary paths itself.
BackupAndRestore = (
    _BackupAndRestore if _keras.RANDOM_STATE_IN_VARIABLES
    else keras.callbacks.BackupAndRestore
)
