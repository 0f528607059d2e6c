"""Keras callbacks for training in limited memory."""

from keras_memopt.callbacks.backup_and_restore import BackupAndRestore
from keras_memopt.callbacks.memory_logger import MemoryLogger
from keras_memopt.callbacks.oom_backoff import OOMBackoff

__all__ = ["BackupAndRestore", "MemoryLogger", "OOMBackoff"]
