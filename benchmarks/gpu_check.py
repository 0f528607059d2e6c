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
     python benchmarks/gpu_check.py --small --rehearse   (the GPU's parts on a CPU)
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
from _gpu_parts import SCALES, build, compiled, host_data, logical_worker, oom_worker
from _gpu_report import logger_row, logical_row, memory_rows, oom_row, table, why_failed

_common.use_allocator_env()  # a CPU's real allocator figures; before TensorFlow starts

# A GPU whose TensorFlow was not built for its architecture compiles kernels at
# first use; a cache large enough to keep them (CUDA's largest) lets later
# processes reuse them.
os.environ.setdefault("CUDA_CACHE_MAXSIZE", str(4 * 2**30))

DTYPES = ("float32", "mixed_float16")
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
    "gpu": dict(memory=50, oom=75, logical=45),
    "cpu": dict(memory=240, oom=75, logical=45),
    "small": dict(memory=120, oom=75, logical=45),
}
PROBE_SECONDS = 40
# TensorFlow's CUDA 12 wheels carry no kernels built for compute capability 9.0 (H100,
# H200), only PTX, which CUDA compiles at first use and caches (CUDA_CACHE_MAXSIZE):
# a first part of tiny models pays for that, not the measured ones.
WARM_UP_SECONDS = 120
REHEARSAL_LIMIT_MIB = 512  # the CPU allocator's, for --rehearse


# -- workers: memory and time -----------------------------------------------------------


def config_id(kind, split, remat):
    return f"{kind}_{split}" + ("_remat" if remat else "")


def config_label(kind, split, remat, batch):
    if kind == "plain":
        return f"plain keras.Model, batch {batch // split}" + (" (the micro-batch)" if split > 1
                                                                else "")
    return (f"AccumulatingModel, micro-batch {batch // split} (1/{split})"
            + (", remat='auto'" if remat else ""))


def start_tensorflow(**settings):
    """TensorFlow and keras_memopt, the GPU set up with `settings` where there is one."""
    import tensorflow as tf

    import keras_memopt as kmo

    if tf.config.list_physical_devices("GPU"):
        kmo.configure_devices(allocator="bfc", **settings)
    # Each configuration collects garbage three times (its peak window, Keras's clear_session, the
    # loop); a full collection walks every object TensorFlow and Keras made at import, 0.2 s each
    # on 2 cores. Frozen, they are skipped (the small check: 17.5 -> 11.2 CPU-s in the worker).
    gc.collect()
    gc.freeze()
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


def run_part(kind, task, limit, clock, what, limit_mb=None):
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
    worker = _common.start_worker(__file__, {"kind": kind, **task}, limit_mb=limit_mb)
    try:
        result = module.result_of(module.wait_all([worker], seconds)[0], worker.name)
    except module.ChildFailed as error:
        result = dict(status=f"failed: {why_failed(error)}", error=str(error)[-3000:])
    result.setdefault("status", "ok")
    result["seconds"] = time.monotonic() - started
    print(f"[{clock.elapsed():4.0f} s] {what}: {result['status'].split(':')[0]} in "
          f"{result['seconds']:.0f} s", file=sys.stderr, flush=True)
    return result


def warm_up(clock):
    """A first part of tiny models on the GPU (see WARM_UP_SECONDS), as a row."""
    runs = [(name, dtype, SMALL_CONFIGS) for name in SCALES["small"] for dtype in DTYPES]
    result = run_part("memory", dict(scale="small", runs=runs), WARM_UP_SECONDS, clock,
                      "warm-up: tiny models (CUDA compiles the kernels it lacks)")
    return dict(part="warm_up", model="all", dtype="both", config="tiny models, once",
                status=result["status"], seconds=result.get("seconds"),
                note=f"{result.get('seconds', 0):.0f} s that the measured parts do not pay")


def gpu_parts(clock, limits, rehearse=False):
    """The rows of the GPU's own parts, at the GPU's sizes even in the small check (at
    tiny ones the allocator's rounding would decide where memory runs out); rehearsed
    on the CPU's allocator (see `_gpu_parts`) at the CPU's."""
    task = dict(scale="cpu", rehearse=True) if rehearse else dict(scale="gpu")
    limit_mb = REHEARSAL_LIMIT_MIB if rehearse else None
    rows = []
    for allocator in ("bfc", "cuda_malloc_async"):
        result = run_part("oom", dict(task, allocator=allocator), limits["oom"], clock,
                          f"out-of-memory backoff, {allocator}", limit_mb)
        rows.append(oom_row(result, allocator))
    result = run_part("logical", task, limits["logical"], clock, "two logical GPUs", limit_mb)
    rows.append(logical_row(result))
    for row in rows if rehearse else ():
        row["note"] = "; ".join(filter(None, ("rehearsed on the CPU: its figures mean nothing",
                                               row.get("note"))))
    return rows


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
    rows, logger, gpu_rows = [], None, []
    if scale == "gpu":
        rows.append(warm_up(clock))
    for index, group in enumerate(groups):
        task = dict(scale=scale, runs=group, logger=index == 0)
        what = "memory and time: " + ", ".join(f"{m} {d}" for m, d, _ in group)
        result = run_part("memory", task, limits["memory"] * len(group), clock, what)
        found = found or result.get("facts")
        rows += memory_rows(result, group)
        logger = result.get("logger") if index == 0 else logger
        if index == 0 and found and (found["gpus"] or args.rehearse):
            gpu_rows = gpu_parts(clock, limits, rehearse=not found["gpus"])
    gpu = bool(found and found["gpus"])
    if not gpu and not gpu_rows:
        why = "no GPU visible to TensorFlow" if found else "TensorFlow's devices unknown"
        skipped = dict(status=f"skipped: {why}", model="mlp", dtype="float32")
        gpu_rows = [dict(part="oom_backoff", config=a, **skipped)
                    for a in ("bfc", "cuda_malloc_async")]
        gpu_rows.append(dict(part="logical_devices", config="2 x GPU:0", **skipped))
    rows += gpu_rows + [logger_row(logger, gpu)]
    return found, scale, rows, clock.elapsed()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true",
                        help="tiny models and a few steps, all in one process (the test's)")
    parser.add_argument("--json", default="gpu_check.json",
                        help="where to write the rows (default gpu_check.json)")
    parser.add_argument("--rehearse", action="store_true",
                        help="without a GPU, run the GPU's parts on the CPU's allocator, to "
                        "check the script (their figures mean nothing there)")
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
