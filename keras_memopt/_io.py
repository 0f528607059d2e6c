"""Messages to the user, the way Keras prints its own (`keras.src.utils.io_utils.print_msg`).

With interactive logging on (Keras's default), a message goes to standard output; with it off
(`keras.config.disable_interactive_logging()`), to the log, as Keras's progress bars do."""

from __future__ import annotations

import logging
import sys

from keras_memopt._keras import keras

_LOGGER = logging.getLogger("keras_memopt")


def _interactive() -> bool:
    config = getattr(keras, "config", None)
    enabled = getattr(config, "is_interactive_logging_enabled", None)
    if enabled is None:  # tf_keras
        enabled = getattr(keras.utils, "is_interactive_logging_enabled", None)
    return True if enabled is None else bool(enabled())


def print_msg(message: str):
    """Prints `message` where Keras prints its own messages."""
    if _interactive():
        sys.stdout.write(message + "\n")
        sys.stdout.flush()
    else:
        _LOGGER.info(message)
