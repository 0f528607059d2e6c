"""Planner accuracy: predicted vs measured allocator peak of a train step.

For an MLP, a small CNN and a small transformer block, at several (batch,
micro-batch) sizes, this compares `MemoryPlanner.estimate(...).peak` — from
shapes alone, and after `profile((16, 64))` (real steps on micro-batches of 16
and 64 samples) — with the allocator peak of a real `AccumulatingModel` train
step (`train_on_batch`, Adam), each measured in a fresh process on
TensorFlow's BFC CPU allocator: the peak over the second
step less what was in use before the model was built.

Run: python benchmarks/planner_accuracy.py   (about two minutes on 2 cores)
"""

import json
import os
import subprocess
import sys

ENV = dict(
    TF_CPP_MIN_LOG_LEVEL="3",
    TF_ENABLE_ONEDNN_OPTS="0",
    TF_CPU_ALLOCATOR_USE_BFC="true",
    TF_CPU_BFC_MEM_LIMIT_IN_MB="8192",
)
CONFIGS = [(64, 64), (256, 256), (256, 64), (1024, 128)]
MODELS = ["mlp", "cnn", "transformer"]


def build(name):
    from keras_memopt._keras import keras

    layers = keras.layers
    if name == "mlp":
        inputs = keras.Input((512,))
        x = inputs
        for _ in range(4):
            x = layers.Dense(1024, activation="relu")(x)
        outputs = layers.Dense(10)(x)
    elif name == "cnn":
        inputs = keras.Input((32, 32, 3))
        x = layers.Conv2D(32, 3, activation="relu")(inputs)
        x = layers.Conv2D(32, 3, activation="relu")(x)
        x = layers.MaxPooling2D()(x)
        x = layers.Conv2D(64, 3, activation="relu")(x)
        x = layers.GlobalAveragePooling2D()(x)
        outputs = layers.Dense(10)(x)
    else:
        inputs = keras.Input((64,), dtype="int32")
        x = layers.Embedding(1000, 128)(inputs)
        attended = layers.MultiHeadAttention(num_heads=4, key_dim=32)(x, x)
        x = layers.LayerNormalization()(layers.Add()([x, attended]))
        hidden = layers.Dense(256, activation="gelu")(x)
        x = layers.LayerNormalization()(layers.Add()([x, layers.Dense(128)(hidden)]))
        x = layers.GlobalAveragePooling1D()(x)
        outputs = layers.Dense(10)(x)
    return keras.Model(inputs, outputs, name=name)


def measure(name, batch, micro):
    import tensorflow as tf

    from keras_memopt import AccumulatingModel
    from keras_memopt.planning import _synthetic_batch

    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    model = AccumulatingModel.from_model(build(name), micro_batch_size=micro)
    model.compile(optimizer="adam", loss="mse")
    x, y = _synthetic_batch(model, batch)
    model.train_on_batch(x, y)
    tf.config.experimental.reset_memory_stats("CPU:0")
    model.train_on_batch(x, y)
    return tf.config.experimental.get_memory_info("CPU:0")["peak"] - before


def predict(name):
    from keras_memopt.planning import MemoryPlanner

    planner = MemoryPlanner(build(name), optimizer="adam")
    shapes = {f"{b},{m}": planner.estimate(b, m).peak for b, m in CONFIGS}
    planner.profile((16, 64))
    calibrated = {f"{b},{m}": planner.estimate(b, m).peak for b, m in CONFIGS}
    return {"shapes": shapes, "calibrated": calibrated}


def child(code):
    env = dict(os.environ, **ENV)
    out = subprocess.run(
        [sys.executable, __file__, "--child", code], env=env, capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    mib = 2**20
    print("| model | batch | micro-batch | measured MiB | shapes-only MiB (err) "
          "| calibrated MiB (err) |")
    print("|---|---:|---:|---:|---:|---:|")
    worst = 0.0
    for name in MODELS:
        predicted = child(f"predict:{name}")
        for batch, micro in CONFIGS:
            measured = child(f"measure:{name}:{batch}:{micro}")
            key = f"{batch},{micro}"
            shapes, calibrated = predicted["shapes"][key], predicted["calibrated"][key]
            err_s, err_c = shapes / measured - 1, calibrated / measured - 1
            worst = max(worst, abs(err_c))
            print(f"| {name} | {batch} | {micro} | {measured / mib:.1f} "
                  f"| {shapes / mib:.1f} ({err_s:+.0%}) | {calibrated / mib:.1f} ({err_c:+.0%}) |")
    print(f"\nworst calibrated error: {worst:.1%} (goal: within 10%)")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        kind, *args = sys.argv[2].split(":")
        if kind == "predict":
            print(json.dumps(predict(args[0])))
        else:
            print(json.dumps(measure(args[0], int(args[1]), int(args[2]))))
    else:
        main()
