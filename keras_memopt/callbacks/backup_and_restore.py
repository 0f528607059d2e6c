"""`BackupAndRestore`: Keras's, with the random state and one writer per cluster."""

from __future__ import annotations

import os

import numpy as np

from keras_memopt import _keras, distribute
from keras_memopt._keras import keras

__all__ = ["BackupAndRestore"]

_RANDOM_STATE = "random_state.npz"


def _random_variables(model):
    """Variables that hold random state: Keras 3 seed generators (the model's own,
    which are not among its weights, and the global one)."""
    return _keras.seed_variables(model) + _keras.global_random_state()


class _BackupAndRestore(keras.callbacks.BackupAndRestore):
    """Backs up and restores the training state, random state included.

    Keras 3's `keras.callbacks.BackupAndRestore` with two additions:

    - The seed generators' states (a `Dropout`'s, the global one) are backed
      up and restored with the weights, so that training resumed after an
      interruption draws the same random numbers as training that was never
      interrupted. Keras's own callback saves the weights only: a model with
      `Dropout` resumed from it trains on with other masks.
    - Under `MultiWorkerMirroredStrategy`, only the chief worker writes and
      deletes the backup (Keras's own callback makes every worker write the
      same files); every worker restores from it, so the backup directory
      must be shared (a network file system, or one machine's disk).

    When resumed training ends with the weights of training never
    interrupted: with `save_freq="epoch"` (the default), the backup is taken
    at the end of each epoch and training resumes at the next one. With an
    integer `save_freq`, Keras 3 (its own callback, and so this one) keeps no
    batch position: a resumed run restarts the interrupted epoch from its
    first batch, from the weights of the last backup taken inside it, so the
    batches of that epoch before the backup are trained twice (and
    `optimizer.iterations` counts them twice).

    It is what `keras-memopt run` restarts a crashed training process from.
    On tf_keras, `keras_memopt.callbacks.BackupAndRestore` is tf_keras's own
    callback, which already checkpoints the whole training state, writes
    from the chief only, and with an integer `save_freq` resumes at the
    batch after the backup.

    Args:
        backup_dir, save_freq, double_checkpoint, delete_checkpoint: as for
            `keras.callbacks.BackupAndRestore`; see above for an integer
            `save_freq`.

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
