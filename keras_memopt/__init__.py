"""keras_memopt: train Keras models that do not fit in accelerator memory."""

from keras_memopt import callbacks  # noqa: F401  (keras_memopt.callbacks.OOMBackoff, ...)
from keras_memopt.devices import configure_devices
from keras_memopt.memory import MemoryReader
from keras_memopt.models import AccumulatingModel
from keras_memopt.planning import MemoryPlanner
from keras_memopt.remat import Remat

__version__ = "0.1.0"

__all__ = ["AccumulatingModel", "Remat", "MemoryPlanner", "MemoryReader", "configure_devices"]
