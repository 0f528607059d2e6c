"""MemoryLogger overhead: step time with and without it, as a ratio in one run.

Trains the same small `AccumulatingModel` (Dense 512-1024-1024-10, batch 256,
micro-batch 64) for alternating epochs without and with a `MemoryLogger` that
reads once per epoch (the default), every 10 and every batch, and compares
the median per-epoch time. Goal: at most 2% slower.

Run: TF_CPU_ALLOCATOR_USE_BFC=true python benchmarks/memory_logger_overhead.py
"""

import _common

_common.use_allocator_env()  # before TensorFlow starts

import statistics  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402

from keras_memopt import AccumulatingModel  # noqa: E402
from keras_memopt.callbacks import MemoryLogger  # noqa: E402

ROUNDS = 7


def main():
    inputs, outputs = _common.mlp(512, depth=2, width=1024)
    model = AccumulatingModel(inputs, outputs, micro_batch_size=64)
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
