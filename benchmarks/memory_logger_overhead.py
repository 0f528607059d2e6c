"""MemoryLogger overhead: step time with and without it, as a ratio in one run.

Trains the same small `AccumulatingModel` (Dense 512-1024-1024-10, batch 256,
micro-batch 64) for alternating epochs without and with a `MemoryLogger` that
reads once per epoch (the default), every 10 and every batch, and compares
the median per-epoch time. Goal: at most 2% slower.

Run: TF_CPU_ALLOCATOR_USE_BFC=true python benchmarks/memory_logger_overhead.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import statistics  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402

from keras_memopt import AccumulatingModel  # noqa: E402
from keras_memopt._keras import keras  # noqa: E402
from keras_memopt.callbacks import MemoryLogger  # noqa: E402

ROUNDS = 7


def main():
    inputs = keras.Input((512,))
    x = keras.layers.Dense(1024, activation="relu")(inputs)
    x = keras.layers.Dense(1024, activation="relu")(x)
    model = AccumulatingModel(inputs, keras.layers.Dense(10)(x), micro_batch_size=64)
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    data = rng.random((256 * 20, 512), dtype=np.float32), rng.random((256 * 20, 10), np.float32)
    model.fit(*data, batch_size=256, epochs=1, verbose=0)  # trace once

    def epoch(callbacks):
        start = time.perf_counter()
        model.fit(*data, batch_size=256, epochs=1, verbose=0, callbacks=callbacks)
        return time.perf_counter() - start

    settings = {"plain": None, "MemoryLogger()": {}, "every_n_batches=10": {"every_n_batches": 10},
                "every_n_batches=1": {"every_n_batches": 1}}
    times = {name: [] for name in settings}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(ROUNDS):
            for name, kwargs in settings.items():
                times[name].append(epoch([] if kwargs is None else [MemoryLogger(**kwargs)]))
    plain = statistics.median(times["plain"])
    print("| setting | median epoch, 20 steps (s) | ratio to plain |")
    print("|---|---:|---:|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.3f} | {median / plain:.3f} |")


if __name__ == "__main__":
    main()
