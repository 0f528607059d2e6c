"""Planner accuracy: predicted vs measured allocator peak of a train step.

For an MLP, a small CNN and a small transformer block, at several (batch,
micro-batch) sizes, this compares `MemoryPlanner.estimate(batch, micro).peak`
with the allocator peak of real `AccumulatingModel` train steps (Adam,
`train_on_batch`): in a fresh process on TensorFlow's BFC CPU allocator, one
step to trace, then the peak over the next two steps less what was in use
before the model was built; the median of `REPEATS` processes.

Predictions, each from a fresh planner (and, but for the default profile, in a
fresh process per setting):

- shapes only: no measurement;
- profiled near: `profile((micro // 2, micro), batch_size=batch)`, what
  `plan(..., profile=True)` has measured when it recommends `micro` (on a
  CPU each measurement runs in a fresh process of its own, so the error is
  that of one fresh process against the median of others);
- extrapolated: `profile((micro // 4, micro // 2), batch_size=batch)`, a
  straight line out to twice the largest measured size;
- default profile: `profile()` (micro-batches of 16 and 64, each its own
  batch), moved to the batch by the input's bytes.

Then `plan(1024, budget, profile=True)` per model, and the measured peak of the
recommended setting.

With `--inter-op-threads 1`, every process runs TensorFlow's ops one at a
time (`tf.config.threading.set_inter_op_parallelism_threads(1)`): with
parallel ops the CPU kernels' workspaces overlap or not depending on
scheduling, and the same step's peak differs from process to process by up to
a third on the CNN; one inter-op thread takes most of that noise out (the
peaks it measures are of that configuration, not of the default one).

Run: python benchmarks/planner_accuracy.py [--inter-op-threads 1]
(about 15 minutes on 2 busy cores)
"""

import os
import statistics
import sys

import _common

_common.use_allocator_env()  # quiet; and the workers' settings, before TensorFlow starts

from keras_memopt import _subprocess  # noqa: E402

ENV = dict(_common.ALLOCATOR_ENV)
CONFIGS = [(64, 64), (256, 256), (256, 64), (1024, 128)]
MODELS = ["mlp", "cnn", "transformer"]
PLANS = {"mlp": (1024, "100MiB"), "cnn": (1024, "160MiB"), "transformer": (1024, "128MiB")}
REPEATS = 3
COLUMNS = ["shapes", "near", "extrapolated", "default"]


def build(name):
    from keras_memopt._keras import keras

    if name == "mlp":
        inputs, outputs = _common.mlp(512, depth=4, width=1024)
    elif name == "cnn":
        inputs, outputs = _common.cnn([32, 32, "pool", 64])
    else:
        inputs, outputs = _common.transformer(length=64, blocks=1, hidden=256, add_layers=True)
    return keras.Model(inputs, outputs, name=name)


def measure(name, batch, micro):
    import tensorflow as tf

    from keras_memopt import AccumulatingModel
    from keras_memopt.planning.measure import synthetic_batch

    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    model = AccumulatingModel.from_model(build(name), micro_batch_size=micro)
    model.compile(optimizer="adam", loss="mse")
    x, y = synthetic_batch(model, batch)
    model.train_on_batch(x, y)
    tf.config.experimental.reset_memory_stats("CPU:0")
    for _ in range(2):
        model.train_on_batch(x, y)
    return tf.config.experimental.get_memory_info("CPU:0")["peak"] - before


def predict(name, batch, micro):
    """Shapes-only, profiled-near and extrapolated estimates of one setting."""
    from keras_memopt.planning import MemoryPlanner

    model = build(name)
    result = {"shapes": MemoryPlanner(model, optimizer="adam").estimate(batch, micro).peak}
    for column, sizes in (
        ("near", (micro // 2, micro)),
        ("extrapolated", (micro // 4, micro // 2)),
    ):
        planner = MemoryPlanner(model, optimizer="adam")
        planner.profile(sizes, batch_size=batch)
        result[column] = planner.estimate(batch, micro).peak
    return result


def predict_default(name):
    """Estimates after the default `profile()`, and a profiled `plan()`."""
    from keras_memopt.planning import MemoryPlanner

    model = build(name)
    planner = MemoryPlanner(model, optimizer="adam")
    planner.profile()
    result = {f"{b},{m}": planner.estimate(b, m).peak for b, m in CONFIGS}
    batch, budget = PLANS[name]
    plan = MemoryPlanner(model, optimizer="adam").plan(batch, budget, profile=True)
    return {"default": result,
            "plan": [batch, budget, plan.micro_batch_size, plan.estimate.peak, plan.budget]}


def child(code):
    output = _subprocess.run([__file__, "--child", code], env=ENV)
    return _subprocess.result_of(output, f"The child {code}")


def measured(name, batch, micro):
    """Median peak over `REPEATS` fresh processes, and (max - min) / median."""
    runs = [child(f"measure:{name}:{batch}:{micro}") for _ in range(REPEATS)]
    median = statistics.median(runs)
    return median, (max(runs) - min(runs)) / median


def main():
    mib = 2**20
    print("| model | batch | micro-batch | measured MiB (spread) | shapes only "
          "| profiled near | extrapolated | default profile |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    worst = dict.fromkeys(COLUMNS, 0.0)
    plans = []
    for name in MODELS:
        by_model = child(f"default:{name}")
        for batch, micro in CONFIGS:
            median, spread = measured(name, batch, micro)
            predicted = child(f"predict:{name}:{batch}:{micro}")
            predicted["default"] = by_model["default"][f"{batch},{micro}"]
            cells = []
            for column in COLUMNS:
                error = predicted[column] / median - 1
                worst[column] = max(worst[column], abs(error))
                cells.append(f"{predicted[column] / mib:.1f} ({error:+.0%})")
            print(f"| {name} | {batch} | {micro} | {median / mib:.1f} ({spread:.0%}) | "
                  + " | ".join(cells) + " |", flush=True)
        batch, budget, micro, peak, budget_bytes = by_model["plan"]
        plans.append((name, batch, budget, micro, peak, budget_bytes,
                      *measured(name, batch, micro)))
    print("\nworst error: " + ", ".join(f"{c} {worst[c]:.1%}" for c in COLUMNS))
    print("\n| model | batch | budget | recommended micro-batch | predicted MiB "
          "| measured MiB (spread) | error | measured within budget |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, batch, budget, micro, peak, budget_bytes, median, spread in plans:
        print(f"| {name} | {batch} | {budget} | {micro} | {peak / mib:.1f} "
              f"| {median / mib:.1f} ({spread:.0%}) | {peak / median - 1:+.0%} "
              f"| {'yes' if median <= budget_bytes else 'no'} |")


if __name__ == "__main__":
    if "--inter-op-threads" in sys.argv:
        threads = sys.argv[sys.argv.index("--inter-op-threads") + 1]
        ENV["KMO_BENCH_INTER_OP_THREADS"] = threads
        print(f"inter-op threads: {threads}")
    if os.environ.get("KMO_BENCH_INTER_OP_THREADS"):
        import tensorflow as tf

        threads = int(os.environ["KMO_BENCH_INTER_OP_THREADS"])
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        kind, *args = sys.argv[2].split(":")
        if kind == "default":
            _subprocess.send_result(predict_default(args[0]))
        elif kind == "predict":
            _subprocess.send_result(predict(args[0], int(args[1]), int(args[2])))
        else:
            _subprocess.send_result(measure(args[0], int(args[1]), int(args[2])))
    else:
        main()
