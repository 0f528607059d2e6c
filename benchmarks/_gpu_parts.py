"""The models of benchmarks/gpu_check.py, and its parts that need a GPU.

The backoff under each allocator and the two logical devices each run in a
fresh process (`gpu_check.py --worker`), because TensorFlow reads the
allocator and the devices' limits when it starts. `--rehearse` runs them on
the CPU's BFC allocator instead, the device read as "CPU:0" and NVML's figures
made up from the allocator's: their figures mean nothing there, but a broken
part shows before a GPU session's few minutes are spent on it.
"""

from __future__ import annotations

import os
import statistics
import time

import _common

MIB = 2**20
GPU_LIMIT_MIB = 12 * 1024  # configure_devices' limit in the backoff part
LOGICAL_LIMIT_MIB = 8 * 1024  # each logical device's

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


def build(name, scale):
    kwargs, _ = SCALES[scale][name]
    return {"mlp": _common.mlp, "cnn": _common.cnn, "transformer": _common.transformer}[name](
        **({"padding": "same", **kwargs} if name == "cnn" else kwargs))


def compiled(model, keras):
    model.compile(optimizer=keras.optimizers.Adam(1e-4), jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def host_data(model, size, steps, vocabulary=1000):
    """`steps` batches of `size` (the same one) as a tf.data pipeline from host memory."""
    import tensorflow as tf

    x, y = _common.synthetic_batch(model, size, vocabulary)
    return tf.data.Dataset.from_tensors((x.numpy(), y.numpy())).repeat(steps)


# -- the GPU's own parts ------------------------------------------------------------------


def set_up(task, **settings):
    """(TensorFlow, the device a part measures, its allocator's limit in bytes) after
    `configure_devices(**settings)`, or None where there is no GPU. A rehearsal takes
    the CPU (split as `logical_devices` says) and the CPU allocator's limit instead."""
    import tensorflow as tf

    import keras_memopt as kmo

    if task.get("rehearse"):
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * settings.get("logical_devices", 1))
        return tf, "CPU", int(os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"]) * MIB
    if not kmo.configure_devices(**settings):
        return None
    return tf, "GPU", settings["memory_limit"]


def device_memory(tf, device, limit):
    """(used, free, total) bytes of `device`: NVML's for GPU 0; for a rehearsal's CPU,
    made up from its allocator's figures and `limit`."""
    if device.startswith("CPU"):
        info = tf.config.experimental.get_memory_info(device)
        return info["current"], limit - info["peak"], limit
    from keras_memopt.memory import nvml, nvml_handle_of_tf_gpu

    info = nvml().nvmlDeviceGetMemoryInfo(nvml_handle_of_tf_gpu(0))
    return int(info.used), int(info.free), int(info.total)


def fill_device(tf, device, nbytes, piece):
    """Tensors on `device` holding about `nbytes`, and the bytes they hold.

    In pieces of at most `piece` bytes: they also fill the holes between what the
    allocator holds, which one tensor of `nbytes` would need in one piece. Stops at
    the first piece that does not fit.
    """
    pieces, held = [], 0
    with tf.device(device):
        while nbytes - held >= 4:
            size = min(piece, nbytes - held) // 4
            try:
                pieces.append(tf.zeros([size]))
            except tf.errors.ResourceExhaustedError:
                break
            held += 4 * size
    return pieces, held


def failing_allocation(tf, device, nbytes):
    """(seconds, error type, message) of an allocation of `nbytes` that cannot fit."""
    started = time.perf_counter()
    try:
        with tf.device(device):
            tf.zeros([nbytes // MIB, MIB // 4]).numpy()
    except tf.errors.OpError as error:
        return time.perf_counter() - started, type(error).__name__, str(error)[:200]
    return time.perf_counter() - started, None, f"an allocation of {nbytes} bytes succeeded"


def oom_worker(task):
    """One backoff from a real out-of-memory error under `task["allocator"]`."""
    import keras_memopt as kmo
    from keras_memopt._keras import keras

    ready = set_up(task, memory_limit=GPU_LIMIT_MIB * MIB, allocator=task["allocator"])
    if ready is None:
        return dict(status="skipped: no GPU visible to TensorFlow")
    tf, kind, limit = ready
    device = f"{kind}:0"
    allocator = os.environ.get("TF_GPU_ALLOCATOR") or "bfc"
    allocator = task["allocator"] if task.get("rehearse") else allocator
    whole = SCALES[task["scale"]]["mlp"][1]
    keras.utils.set_random_seed(0)
    model = compiled(kmo.AccumulatingModel(*build("mlp", task["scale"]),
                                           micro_batch_size=whole // 2), keras)
    backoff = kmo.callbacks.OOMBackoff(verbose=0)
    data = host_data(model, whole, 3)
    model.fit(data, verbose=0, callbacks=[backoff])  # traces at the half
    peaks, high = {}, tf.config.experimental.get_memory_info(device)["peak"]
    for size in (whole // 2, whole):
        model.micro_batch_size = size
        tf.config.experimental.reset_memory_stats(device)
        resident = tf.config.experimental.get_memory_info(device)["current"]
        model.fit(data, verbose=0, callbacks=[backoff])
        info = tf.config.experimental.get_memory_info(device)
        peaks[size], high = info["peak"] - resident, max(high, info["peak"])
    current = tf.config.experimental.get_memory_info(device)["current"]
    used, free, total = device_memory(tf, device, limit)
    # What the allocator could still hand out: BFC up to its limit; the async
    # pool what the device has free plus what its pool keeps (its high-water mark).
    available = limit - current if allocator == "bfc" else free + high - current
    headroom = (peaks[whole] + peaks[whole // 2]) // 2
    ballast, ballast_bytes = fill_device(tf, device, max(available - headroom, 0),
                                         piece=max(min(16 * MIB, headroom // 8), 4096))
    model.micro_batch_size = whole
    timer = _common.step_timer()
    started = time.perf_counter()
    model.fit(data, verbose=0, callbacks=[timer, backoff])
    epoch = time.perf_counter() - started
    wait = failing_allocation(tf, device, total + 2**30)
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

    import keras_memopt as kmo
    from keras_memopt._keras import keras

    ready = set_up(task, memory_limit=LOGICAL_LIMIT_MIB * MIB, logical_devices=2, gpus=[0],
                   allocator="bfc")
    if ready is None:
        return dict(status="skipped: no GPU visible to TensorFlow")
    tf, kind, limit = ready
    devices = [d.name for d in tf.config.list_logical_devices(kind)][:2]
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
                nvml_used_mib=device_memory(tf, f"{kind}:0", limit)[0] / MIB)


def variable_device(variable):
    """Where a Keras 3 variable (its `value`, a `tf.Variable`) or a tf_keras one lives."""
    value = getattr(variable, "value", None)
    return (variable if value is None or callable(value) else value).device
