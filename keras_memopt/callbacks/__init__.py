"""Keras callbacks for training in limited memory."""

from keras_memopt._keras import BACKEND as _BACKEND
from keras_memopt.callbacks.memory_logger import MemoryLogger
from keras_memopt.callbacks.oom_backoff import OOMBackoff

if _BACKEND == "jax":
    __all__ = ["MemoryLogger", "OOMBackoff"]

    def __getattr__(name):
        if name == "BackupAndRestore":
            raise AttributeError(
                "keras_memopt.callbacks.BackupAndRestore is not available on the JAX backend "
                "yet; on JAX, use `keras.callbacks.BackupAndRestore` (which does not back up "
                "the seed generators' state). Received: 'BackupAndRestore'"
            )
        raise AttributeError(f"module 'keras_memopt.callbacks' has no attribute {name!r}")

else:
    from keras_memopt.callbacks.backup_and_restore import BackupAndRestore

    __all__ = ["BackupAndRestore", "MemoryLogger", "OOMBackoff"]
