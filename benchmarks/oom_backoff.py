"""The cost of one OOMBackoff backoff, with real out-of-memory errors.

For MLPs of three sizes (the state a rollback puts back grows from 21 MiB to
about 250 MiB), each an `AccumulatingModel` trained with Adam and an
`OOMBackoff(factor=0.5)`, this finds a memory limit at which a micro-batch of
the whole batch runs out of memory and half of it fits, then trains under
that limit (`TF_CPU_BFC_MEM_LIMIT_IN_MB` on TensorFlow's BFC CPU allocator),
each run in a fresh process:

- the limit: the midpoint of the two sizes' peaks, each measured alone with
  OOMBackoff attached and no limit;
- TensorFlow's own wait: before it reports an out-of-memory error, the
  allocator waits up to 10 s for memory to be freed (`kMaxMillisToWait` in
  `bfc_allocator.cc`). Each warm process times one failing allocation (an
  eager tensor larger than the limit), which is that wait;
- *warm* (a backoff in the middle of training): after epochs at the half size
  (traced, warmed up), the micro-batch is set to the whole batch (run-time
  state: nothing is traced again) and the next epoch's first step runs out of
  memory, backs off and retries. From `OOMBackoff.backoffs`: the failed
  attempt (from the step's start to the error) and the rollback
  (`recovery_seconds`); the retried step is the rest of that step's time.
  *Lost beyond the wait* is that step's time, less a normal step (the median
  of the epoch's other steps), less the measured wait;
- *first fit* (the error comes in the first `fit`, where users meet it): a
  run started at the whole batch against a run started at the half size,
  each in its own process; lost beyond the wait is the difference of their
  epochs (both trace once) less the wait. Which step ran out is reported;
- stalls: steps after the first (and other than the backoff's) that took 5 s
  longer than a normal step (an allocation that waited for memory and then
  got it), in all runs;
- the snapshot OOMBackoff takes before every step: epochs with and without
  OOMBackoff alternate in the warm process; per pair, the ratio of their
  median steps; the median over pairs and processes.

Times are wall-clock on shared cores: each figure is the median over
`--repeats` processes, with the range. `--compare-with PATH` runs the same in
processes that import another checkout's keras_memopt (its `PYTHONPATH`).

Run: python benchmarks/oom_backoff.py   (mlp_small, 3 repeats: ~5 minutes on 2 cores)
     python benchmarks/oom_backoff.py --models mlp_small mlp mlp_wide
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import _common

_common.use_allocator_env()  # quiet; the workers' allocator, before TensorFlow starts

# features, Dense layers, width, batch. mlp_small is tests/test_oom_backoff.py's
# model; mlp is benchmarks/accumulation.py's; mlp_wide has 86 MiB of weights
# (and 172 MiB of Adam slots) for the rollback to put back.
MODELS = {
    "mlp_small": dict(features=32, depth=8, width=512, batch=4096),
    "mlp": dict(features=256, depth=12, width=512, batch=4096),
    "mlp_wide": dict(features=256, depth=6, width=2048, batch=4096),
}
STEPS_PER_EPOCH = 5
SNAPSHOT_PAIRS = 3  # epochs without and with OOMBackoff, alternating
STALL_SECONDS = 5.0
UNLIMITED_MB = 8192


# -- workers --------------------------------------------------------------------------


def _model(name, micro_batch_size):
    """The model, compiled, and `epoch(backoff=None)`: its step seconds."""
    import numpy as np
    import tensorflow as tf

    import keras_memopt as kmo
    from keras_memopt._keras import keras

    spec = MODELS[name]
    keras.utils.set_random_seed(0)
    inputs, outputs = _common.mlp(spec["features"], spec["depth"], spec["width"])
    model = kmo.AccumulatingModel(inputs, outputs, micro_batch_size=micro_batch_size)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    rng = np.random.default_rng(0)
    x = rng.standard_normal((spec["batch"], spec["features"])).astype("float32")
    y = rng.integers(0, 10, spec["batch"]).astype("int32")
    # One batch held in memory, delivered STEPS_PER_EPOCH times.
    data = tf.data.Dataset.from_tensors((x, y)).repeat(STEPS_PER_EPOCH)
    timer = _common.step_timer()

    def epoch(backoff=None):
        callbacks = [timer] + ([backoff] if backoff is not None else [])
        model.fit(data, epochs=1, verbose=0, callbacks=callbacks)
        return list(timer.seconds)

    return model, epoch


def _backoffs(backoff):
    keys = ("failed_micro_batch_size", "micro_batch_size", "failed_step_seconds",
            "recovery_seconds")
    return [{k: event[k] for k in keys} for event in backoff.backoffs]


def allocator_wait():
    """Seconds TensorFlow takes to report an allocation larger than the limit."""
    import tensorflow as tf

    limit = int(os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"]) * 2**20
    started = time.perf_counter()
    try:
        tf.zeros([limit // 4 + 2**20]).numpy()
    except tf.errors.ResourceExhaustedError:
        return time.perf_counter() - started
    raise RuntimeError(f"An allocation of more than the limit ({limit} bytes) succeeded.")


def calibrate_worker(task):
    """Peak and resident memory of a micro-batch size, OOMBackoff attached, no limit."""
    import tensorflow as tf

    from keras_memopt.callbacks import OOMBackoff

    model, epoch = _model(task["model"], task["micro_batch_size"])
    backoff = OOMBackoff(verbose=0)
    epoch(backoff)
    first = tf.config.experimental.get_memory_info("CPU:0")["peak"]  # tracing included
    tf.config.experimental.reset_memory_stats("CPU:0")
    epoch(backoff)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    state = sum(int(v.numpy().nbytes) for v in model.variables + model.optimizer.variables)
    return dict(peak=peak, first=first, state=state, package=_common.package_file())


def warm_worker(task):
    """A backoff in the middle of training (see the module docstring)."""
    import statistics

    from keras_memopt.callbacks import OOMBackoff

    whole = MODELS[task["model"]]["batch"]
    model, epoch = _model(task["model"], whole // 2)
    backoff = OOMBackoff(verbose=0)
    epoch()  # traces (and builds the optimizer)
    epoch(backoff)  # an old checkout traces again for OOMBackoff
    snapshot = []
    for pair in range(SNAPSHOT_PAIRS):
        if pair % 2 == 0:
            without, guarded = epoch(), epoch(backoff)
        else:
            guarded, without = epoch(backoff), epoch()
        snapshot.append(statistics.median(guarded) / statistics.median(without))
    model.micro_batch_size = whole
    steps = epoch(backoff)
    return dict(
        steps=steps,
        backoffs=_backoffs(backoff),
        final=model.micro_batch_size,
        snapshot=snapshot,
        wait=allocator_wait(),
        package=_common.package_file(),
    )


def cold_worker(task):
    """The first `fit` at `micro_batch_size` (traced there)."""
    from keras_memopt.callbacks import OOMBackoff

    model, epoch = _model(task["model"], task["micro_batch_size"])
    backoff = OOMBackoff(verbose=0)
    steps = epoch(backoff)
    return dict(steps=steps, backoffs=_backoffs(backoff), final=model.micro_batch_size)


WORKERS = {"calibrate": calibrate_worker, "warm": warm_worker, "cold": cold_worker}


# -- parent ----------------------------------------------------------------------------


def run(kind, task, checkout, limit_mb):
    """One worker in a fresh process under `limit_mb` MiB; its result."""
    worker = _common.start_worker(__file__, {"kind": kind, **task}, checkout, limit_mb)
    return _common.results([worker])[0]


def find_limit(name, checkout):
    """The calibration runs of the whole and the half batch, and a limit between them."""
    whole = MODELS[name]["batch"]
    sizes = {
        size: run("calibrate", dict(model=name, micro_batch_size=size), checkout, UNLIMITED_MB)
        for size in (whole, whole // 2)
    }
    # The half size must run from its first step on (which can peak higher:
    # the optimizer's slots are made, the graph is optimised); the whole
    # batch must fail in a steady step.
    peak, fits = sizes[whole]["peak"], max(sizes[whole // 2]["peak"], sizes[whole // 2]["first"])
    if fits >= peak:
        raise RuntimeError(
            f"No limit separates the sizes: {whole // 2}'s first epoch peaks at "
            f"{fits / 2**20:.0f} MiB, {whole}'s steady steps at {peak / 2**20:.0f} MiB."
        )
    return sizes, int((peak + fits) / 2 / 2**20)


def check(runs, failed, final, limit):
    """Raises unless each run backed off from the sizes `failed` and ended at `final`."""
    for result in runs:
        events = result["backoffs"]
        if [e["failed_micro_batch_size"] for e in events] != failed or result["final"] != final:
            raise RuntimeError(
                f"Expected backoffs from {failed} to {final} under {limit} MiB. "
                f"Received: backoffs={events}, final micro_batch_size={result['final']}"
            )


def summarise(warm, cold, start_half):
    """The figures of the table (see the module docstring) from the runs."""
    median_range = _common.median_range
    normal = [statistics.median(r["steps"][1:]) for r in warm]
    events = [r["backoffs"][0] for r in warm]
    wait = statistics.median(r["wait"] for r in warm)
    typical = statistics.median(normal)
    # Stalls: steps after the first, the backoff's step (the longest) left out.
    later_steps = [
        seconds
        for r in warm + cold + start_half
        for index, seconds in enumerate(r["steps"])
        if index > 0 and not (r["backoffs"] and seconds == max(r["steps"]))
    ]
    return dict(
        wait=median_range(r["wait"] for r in warm),
        failed=median_range(e["failed_step_seconds"] for e in events),
        recovery=median_range(e["recovery_seconds"] for e in events),
        retried=median_range(
            r["steps"][0] - e["failed_step_seconds"] - e["recovery_seconds"]
            for r, e in zip(warm, events, strict=True)
        ),
        normal=median_range(normal),
        lost=median_range(
            r["steps"][0] - n - r["wait"] for r, n in zip(warm, normal, strict=True)
        ),
        cold_lost=median_range(
            sum(c["steps"]) - sum(s["steps"]) - wait
            for c, s in zip(cold, start_half, strict=True)
        ),
        # The step that took the longest is the one that waited and failed.
        cold_step=sorted({1 + c["steps"].index(max(c["steps"])) for c in cold}),
        snapshot=median_range(ratio for r in warm for ratio in r["snapshot"]),
        stalls=sum(1 for seconds in later_steps if seconds > typical + STALL_SECONDS),
    )


def measure(name, checkout, repeats):
    whole = MODELS[name]["batch"]
    sizes, limit = find_limit(name, checkout)
    print(
        f"# {name} ({checkout}): peak {sizes[whole]['peak'] / 2**20:.0f} MiB at {whole}, "
        f"{sizes[whole // 2]['peak'] / 2**20:.0f} MiB at {whole // 2} "
        f"({sizes[whole // 2]['first'] / 2**20:.0f} MiB in its first epoch): limit {limit} MiB",
        file=sys.stderr,
        flush=True,
    )
    warm, cold, start_half = [], [], []
    for _ in range(repeats):
        warm.append(run("warm", dict(model=name), checkout, limit))
        cold.append(run("cold", dict(model=name, micro_batch_size=whole), checkout, limit))
        start_half.append(
            run("cold", dict(model=name, micro_batch_size=whole // 2), checkout, limit)
        )
    check(warm + cold, [whole], whole // 2, limit)
    check(start_half, [], whole // 2, limit)
    return dict(
        model=name,
        checkout=checkout,
        package=warm[0]["package"],
        whole=whole,
        state_mib=sizes[whole // 2]["state"] / 2**20,
        peak_mib=[sizes[size]["peak"] / 2**20 for size in (whole, whole // 2)],
        limit_mib=limit,
        **summarise(warm, cold, start_half),
        runs=dict(warm=warm, cold=cold, start_half=start_half),
    )


def _cell(values, digits=2):
    median, low, high = values
    return f"{median:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def table(rows):
    lines = [
        "| model | checkout | state MiB | micro-batch | peak MiB | limit MiB "
        "| TF's wait s | failed attempt s | rollback s | retried step s | normal step s "
        "| lost beyond wait, warm s | lost beyond wait, first fit s (step) "
        "| snapshot cost per step | stalls |",
        "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        whole, (peak_whole, peak_half) = r["whole"], r["peak_mib"]
        steps = ", ".join(str(step) for step in r["cold_step"])
        lines.append(
            f"| {r['model']} | {os.path.basename(r['checkout'])} | {r['state_mib']:.0f} "
            f"| {whole} → {whole // 2} | {peak_whole:.0f} / {peak_half:.0f} | {r['limit_mib']} "
            f"| {_cell(r['wait'])} | {_cell(r['failed'])} | {_cell(r['recovery'], 3)} "
            f"| {_cell(r['retried'])} | {_cell(r['normal'])} | {_cell(r['lost'])} "
            f"| {_cell(r['cold_lost'])} ({steps}) | {_cell(r['snapshot'])}x | {r['stalls']} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=["mlp_small"])
    parser.add_argument("--repeats", type=int, default=3, help="processes per measurement")
    parser.add_argument(
        "--compare-with", metavar="PATH", help="another checkout of keras_memopt, measured too"
    )
    parser.add_argument("--json", help="also write the rows (and every step) to this JSON file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        task = json.loads(args.worker)
        _common.subprocess_module().send_result(WORKERS[task.pop("kind")](task))
        return 0
    checkouts = [_common.REPOSITORY]
    if args.compare_with:
        checkouts.append(os.path.abspath(args.compare_with))
    rows = []
    for name in args.models:
        for checkout in checkouts:
            started = time.perf_counter()
            rows.append(measure(name, checkout, args.repeats))
            print(
                f"# {name}: {time.perf_counter() - started:.0f} s; keras_memopt from "
                f"{rows[-1]['package']}",
                file=sys.stderr,
                flush=True,
            )
    print(table(rows))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
