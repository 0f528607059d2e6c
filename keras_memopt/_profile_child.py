"""Measures one train step's allocator peak in a fresh process.

`MemoryPlanner.profile()` runs `python -m keras_memopt._profile_child` with a
JSON specification on stdin (the model's architecture, the optimizer, the
sizes, the device, the parent's threading and precision policy) and reads one
result line from stdout: `KMO_PEAK <bytes>`, `KMO_PEAK oom`, or
`KMO_UNLOADABLE <reason>` when the architecture cannot be rebuilt here (a
custom layer this process cannot import, say).
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    spec = json.loads(sys.stdin.read())
    import tensorflow as tf

    # Before TensorFlow runs anything: the parent's threading, which changes
    # how much working memory overlaps.
    tf.config.threading.set_inter_op_parallelism_threads(spec["inter_op_threads"])
    tf.config.threading.set_intra_op_parallelism_threads(spec["intra_op_threads"])

    from keras_memopt import _keras as K
    from keras_memopt.planning import _measure_step

    keras = K.keras
    keras.mixed_precision.set_global_policy(spec["policy"])
    try:
        model = keras.models.model_from_json(spec["model"])
        optimizer = keras.optimizers.deserialize(spec["optimizer"])
    except Exception as error:  # noqa: BLE001 - any failure means "cannot rebuild here"
        reason = f"{type(error).__name__}: {error}".replace("\n", " ")
        print(f"KMO_UNLOADABLE {reason}", flush=True)
        return 3
    peak = _measure_step(model, optimizer, spec["batch"], spec["micro"], spec["device"])
    print(f"KMO_PEAK {'oom' if peak is None else peak}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
