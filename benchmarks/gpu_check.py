"""One check of the package's GPU claims: memory, time, backoff, devices, NVML.

Every figure keras_memopt published before this script was measured on a CPU
(TensorFlow's BFC allocator with a software limit). This measures the claims
on an NVIDIA GPU in one command of under 8 minutes; on a CPU it runs what it
can and says which parts it skipped. The parts, each in fresh processes:

- memory and time: an MLP, a CNN and a transformer, float32 and
  mixed_float16: plain `keras.Model` at the whole batch and at the
  micro-batch (1/4), `AccumulatingModel` at 1/8, 1/4 (also with
  `remat="auto"`) and 1/2. Peaks from TensorFlow's allocator (`MemoryReader`)
  and NVML, step times as ratios against plain Keras at the whole batch;
- one `OOMBackoff` backoff with TensorFlow's BFC allocator and with
  `cuda_malloc_async` (set by `configure_devices`);
- `configure_devices(memory_limit=..., logical_devices=2)` with two models
  training side by side in two threads;
- `MemoryLogger`'s columns, NVML's among them.

docs/gpu.md says how each figure is taken. Each part has a time limit (one
that runs out is reported, the others go on) and none starts past `--budget`
seconds (default 450), so that a run stays under 8 minutes.

Run: python benchmarks/gpu_check.py --json gpu_check.json   (GPU: at most 8 min)
     python benchmarks/gpu_check.py --small   (tiny models, a few steps: the test's)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import _common
from _gpu_report import logger_row, logical_row, memory_rows, oom_row, table, why_failed

_common.use_allocator_env()  # a CPU's real allocator figures; before TensorFlow starts

# A GPU whose TensorFlow was not built for its architecture compiles kernels at
# first use; a cache large enough to keep them lets later processes reuse them.
os.environ.setdefault("CUDA_CACHE_MAXSIZE", str(4 * 2**30))

DTYPES = ("float32", "mixed_float16")
# Per scale: (builder arguments, effective batch) of each model. "gpu": GiBs of
# activations and steps of tens of milliseconds on an H200; "cpu": a few
# seconds a configuration on 2 cores; "small": the test's.
SCALES = {
    "gpu": dict(
        mlp=(dict(features=1024, depth=8, width=4096), 8192),
        cnn=(dict(layout=[64, 64, "pool", 128, 128, "pool", 256, 256]), 512),
        transformer=(dict(length=512, blocks=2, width=512, heads=8), 64),
    ),
    "cpu": dict(
        mlp=(dict(features=256, depth=6, width=512), 2048),
        cnn=(dict(layout=[16, 16, "pool", 32, 32, "pool"]), 128),
        transformer=(dict(length=64, blocks=2, width=64, heads=4), 64),
    ),
    "small": dict(
        mlp=(dict(features=32, depth=3, width=64), 256),
        cnn=(dict(layout=[8, "pool", 16]), 32),
        transformer=(dict(length=16, blocks=1, width=32, heads=2, vocabulary=100), 32),
    ),
}
# Steps per configuration: (warm-up, timed).
STEPS = {"gpu": (2, 6), "cpu": (1, 3), "small": (1, 2)}
# (kind, 1/split of the batch, remat="auto"), in rising order of expected memory.
CONFIGS = (
    ("accumulating", 8, False),
    ("accumulating", 4, True),
    ("accumulating", 4, False),
    ("plain", 4, False),
    ("accumulating", 2, False),
    ("plain", 1, False),
)
# The small check's configurations beyond its first run (the MLP in float32).
SMALL_CONFIGS = (("accumulating", 4, False), ("plain", 1, False))
# Per scale: seconds each part may take at most.
# (The first part, which finds the devices and so the scale, may take PROBE_SECONDS.)
LIMITS = {
    "gpu": dict(memory=45, oom=75, logical=45),
    "cpu": dict(memory=240, oom=75, logical=45),
    "small": dict(memory=120, oom=75, logical=45),
}
PROBE_SECONDS = 40
GPU_LIMIT_MIB = 12 * 1024  # configure_devices' limit in the OOM and logical-device parts
LOGICAL_LIMIT_MIB = 8 * 1024
MIB = 2**20


# -- workers: memory and time -----------------------------------------------------------


def config_id(kind, split, remat):
    return f"{kind}_{split}" + ("_remat" if remat else "")


def config_label(kind, split, remat, batch):
    if kind == "plain":
        return f"plain keras.Model, batch {batch // split}" + (" (the micro-batch)" if split > 1
                                                                else "")
    return (f"AccumulatingModel, micro-batch {batch // split} (1/{split})"
            + (", remat='auto'" if remat else ""))


def build(name, scale):
    kwargs, _ = SCALES[scale][name]
    return {"mlp": _common.mlp, "cnn": _common.cnn, "transformer": _common.transformer}[name](
        **({"padding": "same", **kwargs} if name == "cnn" else kwargs))


def start_tensorflow(**settings):
    """TensorFlow and keras_memopt, the GPU set up with `settings` where there is one."""
    import tensorflow as tf

    import keras_memopt as kmo

    if tf.config.list_physical_devices("GPU"):
        kmo.configure_devices(allocator="bfc", **settings)
    return tf, kmo


def facts():
    """What this process's TensorFlow sees: versions, GPUs and their names."""
    import tensorflow as tf

    from keras_memopt._keras import keras

    gpus = []
    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu)
        gpus.append(f"{details.get('device_name', gpu.name)} "
                    f"(compute capability {details.get('compute_capability')})")
    return dict(tensorflow=tf.__version__, keras=keras.__version__, gpus=gpus,
                python=sys.version.split()[0], package=_common.package_file())


def compiled(model, keras):
    model.compile(optimizer=keras.optimizers.Adam(1e-4), jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def host_data(model, size, steps, vocabulary=1000):
    """`steps` batches of `size` (the same one) as a tf.data pipeline from host memory."""
    import tensorflow as tf

    x, y = _common.synthetic_batch(model, size, vocabulary)
    return tf.data.Dataset.from_tensors((x.numpy(), y.numpy())).repeat(steps)


def peak_window(reader, warm):
    """A callback that times each step after the first `warm` (which trace) and reads
    `reader` when they are done (`before`, its peaks reset) and at the end (`after`)."""
    keras = _common._keras()

    class PeakWindow(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.seconds, self.before, self.after = [], None, None

        def on_train_batch_begin(self, batch, logs=None):
            self.started = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            if batch >= warm:
                self.seconds.append(time.perf_counter() - self.started)
            elif batch == warm - 1:
                gc.collect()
                reader.reset_peaks()
                self.before = reader.read()

        def on_train_end(self, logs=None):
            self.after = reader.read()

    return PeakWindow()


def measure_config(name, dtype, scale, kind, split, remat):
    """One configuration's peak above resident, NVML's memory in use and median step."""
    import warnings

    import keras_memopt as kmo
    from keras_memopt._keras import keras

    batch = SCALES[scale][name][1]
    keras.backend.clear_session()  # which resets the global dtype policy: set it after
    keras.mixed_precision.set_global_policy(dtype)
    keras.utils.set_random_seed(0)
    inputs, outputs = build(name, scale)
    with warnings.catch_warnings(record=True) as caught:  # remat="auto" choosing nothing
        warnings.simplefilter("always")
        if kind == "plain":
            model, size = keras.Model(inputs, outputs), batch // split
        else:
            model, size = kmo.AccumulatingModel(
                inputs, outputs, micro_batch_size=batch // split,
                remat="auto" if remat else None), batch
    compiled(model, keras)
    warm, timed = STEPS[scale]
    device = kmo.memory.default_device()
    tag = kmo.memory.device_tag(device)
    window = peak_window(kmo.MemoryReader(devices=[device], host=False), warm)
    vocabulary = SCALES[scale][name][0].get("vocabulary", 1000)
    model.fit(host_data(model, size, warm + timed, vocabulary), verbose=0, callbacks=[window])
    resident = window.before[f"memory_{tag}_current_mib"]
    return dict(
        config=config_id(kind, split, remat), label=config_label(kind, split, remat, batch),
        policy=model.dtype_policy.name, batch=batch, samples_per_step=size, resident_mib=resident,
        peak_mib=window.after[f"memory_{tag}_peak_mib"] - resident,
        nvml_used_mib=window.after.get("memory_nvml0_used_mib"),
        step_s=statistics.median(window.seconds),
        remat_choice=(getattr(model, "remat_choice", "") or "; ".join(
            str(w.message)[:160] for w in caught if "remat" in str(w.message))) if remat else "",
    )


def memory_worker(task):
    """Every configuration of each (model, dtype) in `task["runs"]`, in this process."""
    start_tensorflow(memory_growth=True)  # so that NVML sees TensorFlow's pool grow
    from keras_memopt._keras import keras

    rows = []
    for name, dtype, configs in task["runs"]:
        group = []
        for kind, split, remat in configs:
            group.append(dict(part="memory", model=name, dtype=dtype, status="ok",
                              **measure_config(name, dtype, task["scale"], kind, split, remat)))
            gc.collect()
        plain = next(r for r in group if r["config"] == "plain_1")
        for row in group:
            row["peak_vs_plain"] = row["peak_mib"] / plain["peak_mib"]
            row["step_vs_plain"] = row["step_s"] / plain["step_s"]
        rows += group
    keras.backend.clear_session()
    keras.mixed_precision.set_global_policy("float32")
    logger = memory_logger_columns(task["scale"]) if task.get("logger") else None
    return dict(facts=facts(), rows=rows, logger=logger)


def memory_logger_columns(scale):
    """`MemoryLogger`'s figures for one epoch of plain Keras's MLP, as History has them."""
    import keras_memopt as kmo
    from keras_memopt._keras import keras

    inputs, outputs = build("mlp", scale)
    model = compiled(keras.Model(inputs, outputs), keras)
    history = model.fit(host_data(model, SCALES[scale]["mlp"][1], STEPS[scale][1]), verbose=0,
                        callbacks=[kmo.callbacks.MemoryLogger()])
    return {k: v[-1] for k, v in history.history.items() if k.startswith("memory_")}


# -- workers: the GPU's own parts --------------------------------------------------------


def nvml_memory():
    """NVML's (used, free, total) bytes of TensorFlow's GPU 0."""
    from keras_memopt.memory import nvml, nvml_handle_of_tf_gpu

    info = nvml().nvmlDeviceGetMemoryInfo(nvml_handle_of_tf_gpu(0))
    return int(info.used), int(info.free), int(info.total)


def fill_device(tf, nbytes, piece):
    """Tensors on GPU 0 holding about `nbytes`, and the bytes they hold.

    In pieces of at most `piece` bytes: they also fill the holes between what the
    allocator holds, which one tensor of `nbytes` would need in one piece. Stops at
    the first piece that does not fit.
    """
    pieces, held = [], 0
    with tf.device("GPU:0"):
        while nbytes - held >= 4:
            size = min(piece, nbytes - held) // 4
            try:
                pieces.append(tf.zeros([size]))
            except tf.errors.ResourceExhaustedError:
                break
            held += 4 * size
    return pieces, held


def failing_allocation(tf, nbytes):
    """(seconds, error type, message) of an allocation of `nbytes` that cannot fit."""
    started = time.perf_counter()
    try:
        with tf.device("GPU:0"):
            tf.zeros([nbytes // MIB, MIB // 4]).numpy()
    except tf.errors.OpError as error:
        return time.perf_counter() - started, type(error).__name__, str(error)[:200]
    return time.perf_counter() - started, None, f"an allocation of {nbytes} bytes succeeded"


def oom_worker(task):
    """One backoff from a real out-of-memory error under `task["allocator"]`."""
    import tensorflow as tf

    import keras_memopt as kmo
    from keras_memopt._keras import keras

    if not kmo.configure_devices(memory_limit=GPU_LIMIT_MIB * MIB, allocator=task["allocator"]):
        return dict(status="skipped: no GPU visible to TensorFlow")
    allocator = os.environ.get("TF_GPU_ALLOCATOR") or "bfc"
    whole = SCALES[task["scale"]]["mlp"][1]
    keras.utils.set_random_seed(0)
    model = compiled(kmo.AccumulatingModel(*build("mlp", task["scale"]),
                                           micro_batch_size=whole // 2), keras)
    backoff = kmo.callbacks.OOMBackoff(verbose=0)
    data = host_data(model, whole, 3)
    model.fit(data, verbose=0, callbacks=[backoff])  # traces at the half
    peaks, high = {}, tf.config.experimental.get_memory_info("GPU:0")["peak"]
    for size in (whole // 2, whole):
        model.micro_batch_size = size
        tf.config.experimental.reset_memory_stats("GPU:0")
        resident = tf.config.experimental.get_memory_info("GPU:0")["current"]
        model.fit(data, verbose=0, callbacks=[backoff])
        info = tf.config.experimental.get_memory_info("GPU:0")
        peaks[size], high = info["peak"] - resident, max(high, info["peak"])
    current = tf.config.experimental.get_memory_info("GPU:0")["current"]
    used, free, total = nvml_memory()
    # What the allocator could still hand out: BFC up to its limit; the async
    # pool what the device has free plus what its pool keeps (its high-water mark).
    available = GPU_LIMIT_MIB * MIB - current if allocator == "bfc" else free + high - current
    headroom = (peaks[whole] + peaks[whole // 2]) // 2
    ballast, ballast_bytes = fill_device(tf, max(available - headroom, 0),
                                         piece=max(min(16 * MIB, headroom // 8), 4096))
    model.micro_batch_size = whole
    timer = _common.step_timer()
    started = time.perf_counter()
    model.fit(data, verbose=0, callbacks=[timer, backoff])
    epoch = time.perf_counter() - started
    wait = failing_allocation(tf, total + 2**30)
    del ballast
    keys = ("failed_micro_batch_size", "micro_batch_size", "failed_step_seconds",
            "recovery_seconds")
    return dict(
        status="ok", allocator=allocator, peak_mib=peaks[whole] / MIB,
        peak_half_mib=peaks[whole // 2] / MIB, ballast_mib=ballast_bytes / MIB,
        nvml_used_mib=used / MIB, tf_current_mib=current / MIB,
        backoffs=[{k: event.get(k) for k in keys} for event in backoff.backoffs],
        final_micro_batch_size=model.micro_batch_size, steps=timer.seconds, epoch_s=epoch,
        failing_allocation=dict(zip(("seconds", "error", "message"), wait, strict=True)),
    )


def logical_worker(task):
    """Two AccumulatingModels on two logical GPUs of one GPU, trained in two threads."""
    import threading

    import tensorflow as tf

    import keras_memopt as kmo
    from keras_memopt._keras import keras

    if not kmo.configure_devices(memory_limit=LOGICAL_LIMIT_MIB * MIB, logical_devices=2,
                                 gpus=[0], allocator="bfc"):
        return dict(status="skipped: no GPU visible to TensorFlow")
    devices = [d.name for d in tf.config.list_logical_devices("GPU")][:2]
    batch = SCALES[task["scale"]]["mlp"][1] // 2
    runs, models = [{} for _ in devices], []
    for device in devices:
        with tf.device(device):
            models.append(compiled(kmo.AccumulatingModel(
                *build("mlp", task["scale"]), micro_batch_size=batch // 4), keras))

    def train(index):
        try:
            timer = _common.step_timer()
            with tf.device(devices[index]):
                models[index].fit(host_data(models[index], batch, 6), verbose=0,
                                  callbacks=[timer])
            runs[index].update(steps=len(timer.seconds), step_s=statistics.median(timer.seconds))
        except Exception as error:  # noqa: BLE001 - reported in the table, not raised
            runs[index]["error"] = f"{type(error).__name__}: {str(error)[:300]}"

    for device in devices:
        tf.config.experimental.reset_memory_stats(device)
    started = time.perf_counter()
    threads = [threading.Thread(target=train, args=(i,)) for i in range(len(devices))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for run, device, model in zip(runs, devices, models, strict=True):
        run.update(device=device, weights_on=variable_device(model.weights[0]),
                   limit_mib=(kmo.memory.device_total(device) or 0) / MIB,
                   peak_mib=tf.config.experimental.get_memory_info(device)["peak"] / MIB)
    return dict(status="ok", runs=runs, wall_s=time.perf_counter() - started,
                nvml_used_mib=nvml_memory()[0] / MIB)


def variable_device(variable):
    """Where a Keras 3 variable (its `value`, a `tf.Variable`) or a tf_keras one lives."""
    value = getattr(variable, "value", None)
    return (variable if value is None or callable(value) else value).device


def probe_worker(task):
    import tensorflow  # noqa: F401 - the versions and devices of facts()

    return dict(facts=facts())


WORKERS = dict(probe=probe_worker, memory=memory_worker, oom=oom_worker,
               logical=logical_worker)


# -- parent ------------------------------------------------------------------------------


class Clock:
    """The run's time budget: each part gets its own limit, cut to what is left."""

    def __init__(self, budget):
        self.started = time.monotonic()
        self.deadline = self.started + budget

    def elapsed(self):
        return time.monotonic() - self.started

    def limit(self, seconds):
        return min(seconds, self.deadline - time.monotonic())


def run_part(kind, task, limit, clock, what):
    """`kind`'s worker on `task` in a fresh process; its result, or a status saying why not."""
    seconds = clock.limit(limit)
    if seconds < min(limit, 10):
        print(f"[{clock.elapsed():4.0f} s] {what}: skipped, the budget is spent",
              file=sys.stderr, flush=True)
        return dict(status=f"skipped: the time budget was spent ({clock.elapsed():.0f} s)")
    print(f"[{clock.elapsed():4.0f} s] {what}: started (at most {seconds:.0f} s)",
          file=sys.stderr, flush=True)
    module = _common.subprocess_module()
    started = time.monotonic()
    worker = _common.start_worker(__file__, {"kind": kind, **task})
    try:
        result = module.result_of(module.wait_all([worker], seconds)[0], worker.name)
    except module.ChildFailed as error:
        result = dict(status=f"failed: {why_failed(error)}", error=str(error)[-3000:])
    result.setdefault("status", "ok")
    result["seconds"] = time.monotonic() - started
    print(f"[{clock.elapsed():4.0f} s] {what}: {result['status'].split(':')[0]} in "
          f"{result['seconds']:.0f} s", file=sys.stderr, flush=True)
    return result


def check(args):
    """Every part, within the budget; (facts, scale, rows)."""
    clock = Clock(args.budget)
    found = None
    if not args.small:
        probe = run_part("probe", {}, PROBE_SECONDS, clock, "TensorFlow's devices")
        found = probe.get("facts")
    scale = "small" if args.small else ("gpu" if found and found["gpus"] else "cpu")
    limits = LIMITS[scale]
    runs = [(name, dtype, CONFIGS) for name in SCALES[scale] for dtype in DTYPES]
    if scale == "small":  # every configuration on one run only: the test's time
        runs = [(name, dtype, CONFIGS if index == 0 else SMALL_CONFIGS)
                for index, (name, dtype, _) in enumerate(runs)
                if name == "mlp" or dtype == "float32"]
    # One process for all of the small check (start-up dominates there); else one each.
    groups = [runs] if scale == "small" else [[run] for run in runs]
    rows, logger, gpu_parts = [], None, []
    for index, group in enumerate(groups):
        task = dict(scale=scale, runs=group, logger=index == 0)
        what = "memory and time: " + ", ".join(f"{m} {d}" for m, d, _ in group)
        result = run_part("memory", task, limits["memory"] * len(group), clock, what)
        found = found or result.get("facts")
        rows += memory_rows(result, group)
        logger = result.get("logger") if index == 0 else logger
        if index == 0 and found and found["gpus"]:
            # The GPU's own parts next, so that each claim is measured within the budget;
            # at the GPU's sizes even in the small check (at tiny ones, the allocator's
            # rounding would decide where memory runs out).
            for allocator in ("bfc", "cuda_malloc_async"):
                oom = run_part("oom", dict(scale="gpu", allocator=allocator), limits["oom"],
                               clock, f"out-of-memory backoff, {allocator}")
                gpu_parts.append(oom_row(oom, allocator))
            logical = run_part("logical", dict(scale="gpu"), limits["logical"], clock,
                               "two logical GPUs")
            gpu_parts.append(logical_row(logical))
    gpu = bool(found and found["gpus"])
    if not gpu:
        why = "no GPU visible to TensorFlow" if found else "TensorFlow's devices unknown"
        skipped = dict(status=f"skipped: {why}", model="mlp", dtype="float32")
        gpu_parts = [dict(part="oom_backoff", config=a, **skipped)
                     for a in ("bfc", "cuda_malloc_async")]
        gpu_parts.append(dict(part="logical_devices", config="2 x GPU:0", **skipped))
    rows += gpu_parts + [logger_row(logger, gpu)]
    return found, scale, rows, clock.elapsed()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true",
                        help="tiny models and a few steps, all in one process (the test's)")
    parser.add_argument("--json", default="gpu_check.json",
                        help="where to write the rows (default gpu_check.json)")
    parser.add_argument("--budget", type=float, default=450.0,
                        help="seconds after which no part starts (default 450)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        task = json.loads(args.worker)
        _common.subprocess_module().send_result(WORKERS[task.pop("kind")](task))
        return 0
    found, scale, rows, seconds = check(args)
    print(table(found, scale, rows, seconds))
    with open(args.json, "w") as file:
        json.dump(dict(date=time.strftime("%Y-%m-%d"), facts=found, scale=scale,
                       seconds=seconds, rows=rows), file, indent=1)
    print(f"# rows written to {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
