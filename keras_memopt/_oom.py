"""Out-of-memory recovery for `AccumulatingModel`: detect, roll back, retry.

A Keras callback cannot catch an error raised inside `fit()`, so the model's
train, test and predict functions are wrapped here (`make_function`). While an
`OOMBackoff` callback is attached to the model, the wrapper pulls each batch
from the iterator itself, takes a snapshot of every variable the step may
touch, and runs the step on that batch. On an out-of-memory error it puts the
snapshot back, lets the callback shrink `micro_batch_size`, rebuilds the step
function (the micro-batch size is baked into the traced graph) and runs the
*same* batch again. The iterator never advances for a failed attempt, so no
sample is lost or seen twice, and the effective batch (so the result) does
not change. Without an `OOMBackoff` the wrapper calls Keras's own function.

Snapshots cost no copy up front: TensorFlow tensors are immutable, so the
values read from the variables stay valid while the step updates the
variables (an in-place update of a buffer that a snapshot still holds copies
it first). The extra memory is the state the step actually rewrites, held
until the step returns, once the step's activations are already freed.
"""

from __future__ import annotations

import re
import time

import tensorflow as tf

from keras_memopt import _keras as K

_KINDS = ("train", "test", "predict")
_DISGUISED = (
    "resourceexhausted",
    "resource exhausted",
    "resource_exhausted",
    "oom when allocating",
    "out of memory",
    "dst tensor is not initialized",
)
_TENSOR = re.compile(
    r"OOM when allocating tensor with shape\s*\[([^\]]*)\]\s*and type (\w+)"
    r"(?: on (\S+))?(?: by allocator (\S+))?"
)
_NODE = re.compile(r"\[\[\{\{node ([^}]+)\}\}\]\]|Detected at node '?([^\s']+)'?")
_BYTES = re.compile(r"(\d+) bytes")
_SIZE = re.compile(r"allocate ([\d.]+)\s*([KMGT]i?B)")  # XLA: "allocate 34.12MiB"
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_DEVICE = re.compile(r"device:([A-Z]+:\d+)")


def is_oom(error: BaseException) -> bool:
    """Whether `error` (or an error it was raised from) means out of memory.

    Besides `tf.errors.ResourceExhaustedError`, TensorFlow reports some
    allocation failures as `UnknownError` or `InternalError` whose message
    names resource exhaustion, or as "Dst tensor is not initialized" (a copy
    to the device whose destination could not be allocated).

    Example:

    ```python
    try:
        model.fit(x, y)
    except tf.errors.OpError as error:
        if not is_oom(error):
            raise
    ```
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, tf.errors.ResourceExhaustedError):
            return True
        if isinstance(error, (tf.errors.UnknownError, tf.errors.InternalError)):
            message = str(error).lower()
            if any(marker in message for marker in _DISGUISED):
                return True
        error = error.__cause__ or error.__context__
    return False


def parse_oom(message: str) -> dict:
    """What failed to allocate, as far as the error message says.

    Returns a dict with the keys `shape` (a tuple of ints, or None), `dtype`,
    `op` (the graph node), `device` (such as `"GPU:0"`), `allocator` and
    `bytes` (when the message gives a byte count instead of a shape); each is
    None when the message does not say.

    Example:

    ```python
    parse_oom("OOM when allocating tensor with shape[64,1024] and type float "
              "on /job:localhost/replica:0/task:0/device:GPU:0 by allocator "
              "GPU_0_bfc [[{{node dense/MatMul}}]]")
    # {'shape': (64, 1024), 'dtype': 'float', 'op': 'dense/MatMul',
    #  'device': 'GPU:0', 'allocator': 'GPU_0_bfc', 'bytes': None}
    ```
    """
    info = dict(shape=None, dtype=None, op=None, device=None, allocator=None, bytes=None)
    match = _TENSOR.search(message)
    if match:
        dims = [d.strip() for d in match.group(1).split(",") if d.strip()]
        try:
            info["shape"] = tuple(int(d) for d in dims)
        except ValueError:
            info["shape"] = tuple(dims)
        info["dtype"] = match.group(2)
        info["allocator"] = match.group(4)
        if match.group(3):
            device = _DEVICE.search(match.group(3))
            info["device"] = device.group(1) if device else match.group(3)
    match = _NODE.search(message)
    if match:
        info["op"] = match.group(1) or match.group(2)
    match = _BYTES.search(message)
    if match:
        info["bytes"] = int(match.group(1))
    elif _SIZE.search(message):
        match = _SIZE.search(message)
        info["bytes"] = int(float(match.group(1)) * _UNITS[match.group(2)[0]])
    if info["device"] is None:
        device = _DEVICE.search(message)
        info["device"] = device.group(1) if device else None
    return info


def memory_info(device: str | None = None) -> dict | None:
    """Current and peak bytes of the TF allocator of `device`, or None.

    Defaults to the first GPU, else `"CPU:0"` (which reports only under the
    BFC CPU allocator, `TF_CPU_ALLOCATOR_USE_BFC=true`).
    """
    if device is None:
        gpus = tf.config.list_logical_devices("GPU")
        device = "GPU:0" if gpus else "CPU:0"
    try:
        info = tf.config.experimental.get_memory_info(device)
    except (ValueError, tf.errors.OpError):
        return None
    return dict(device=device, current=info["current"], peak=info["peak"])


def _mib(nbytes):
    return f"{nbytes / 2**20:.1f} MiB"


def describe_allocation(info):
    if info["shape"] is not None:
        what = "a tensor of shape [" + ", ".join(str(d) for d in info["shape"]) + "]"
        if info["dtype"]:
            what += f" and type {info['dtype']}"
    elif info["bytes"] is not None:
        what = f"{_mib(info['bytes'])} ({info['bytes']} bytes)"
    else:
        what = "memory (the error message does not say how much)"
    if info["op"]:
        what += f" in op {info['op']}"
    if info["device"]:
        what += f" on {info['device']}"
    return what


def oom_report(error: BaseException, micro_batch_size, minimum) -> str:
    """The readable report raised when backing off can go no further."""
    info = parse_oom(str(error))
    memory = memory_info(info["device"] if info["device"] else None)
    if memory is None:
        memory_line = "not available for this device"
    else:
        memory_line = (
            f"{_mib(memory['current'])} in use, peak {_mib(memory['peak'])} "
            f"on {memory['device']}"
        )
    return (
        "Out of memory at the smallest micro-batch allowed "
        f"(micro_batch_size={micro_batch_size}, min_micro_batch_size={minimum}); "
        "the model, optimizer and metrics are as they were before the failed "
        "step.\n"
        f"  Failed to allocate: {describe_allocation(info)}.\n"
        f"  Device memory: {memory_line}.\n"
        "  What to try:\n"
        "  - recompute activations in the backward pass instead of storing "
        "them (rematerialisation, keras_memopt's `remat` option);\n"
        "  - mixed precision: "
        '`keras.mixed_precision.set_global_policy("mixed_float16")` halves '
        "activation memory;\n"
        "  - a smaller model (fewer or narrower layers) or smaller inputs;\n"
        "  - on a GPU, if memory is fragmented (much is free but no large "
        "block), start Python with `TF_GPU_ALLOCATOR=cuda_malloc_async`.\n"
        f"Original error: {type(error).__name__}: {_first_line(error)}"
    )


def _first_line(error):
    for line in str(error).splitlines():
        if "OOM" in line or "memory" in line.lower() or "Dst tensor" in line:
            return line.strip()
    lines = str(error).strip().splitlines()
    return lines[0].strip() if lines else ""


# -- state snapshots ----------------------------------------------------------------


def state_variables(model) -> list:
    """Every variable a train, test or predict step of `model` may update.

    Weights (trainable and not: BatchNormalization statistics, Keras 3 seed
    generator states), optimizer variables (iterations, slots, loss scale),
    metric variables, and tf_keras's step counters; each once.
    """
    groups = [model.variables]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        groups.append(K.optimizer_variables(optimizer))
    groups.extend(metric.variables for metric in model.metrics)
    groups.append(K.step_counters(model))
    seen, variables = set(), []
    for group in groups:
        for variable in group:
            if id(variable) not in seen:
                seen.add(id(variable))
                variables.append(variable)
    return variables


class Snapshot:
    """Takes and restores the values of a model's state variables."""

    def __init__(self, model):
        self.model = model
        self._variables = None
        self._read = self._write = None

    def _refresh(self):
        variables = state_variables(self.model)
        if self._variables is None or [id(v) for v in variables] != [
            id(v) for v in self._variables
        ]:
            self._variables = variables
            self._read = tf.function(lambda: [tf.identity(v) for v in variables])
            self._write = tf.function(
                lambda values: [
                    v.assign(value) for v, value in zip(variables, values, strict=True)
                ]
            )

    def take(self):
        """The current values (no copy is made until a variable changes)."""
        self._refresh()
        return self._variables, self._read()

    def restore(self, taken):
        variables, values = taken
        if variables is not self._variables:
            for variable, value in zip(variables, values, strict=True):
                variable.assign(value)
        else:
            self._write(values)


# -- the wrapped step functions ----------------------------------------------------


def attached_backoff(model):
    """The first `OOMBackoff` attached to `model` (by its `on_*_begin`), if any."""
    backoffs = getattr(model, "_oom_backoffs", None)
    return backoffs[0] if backoffs else None


def batch_size_of(data):
    """The number of samples per replica in a batch of data."""
    for leaf in tf.nest.flatten(data, expand_composites=False):
        if isinstance(leaf, tf.distribute.DistributedValues):
            leaf = leaf.values[0]
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape) and shape[0] is not None:
            return int(shape[0])
    return None


def micro_batch_in_use(model, batch_size):
    """The micro-batch size a step on `batch_size` samples runs with."""
    if isinstance(model.micro_batch_size, int):
        return min(model.micro_batch_size, batch_size or model.micro_batch_size)
    steps = model.accumulation_steps or 1
    if batch_size is None:
        return None
    return max(1, -(-batch_size // steps))


class GuardedFunction:
    """`model.<kind>_function` that can roll back and retry a failed step."""

    def __init__(self, model, kind, make_keras_function):
        self.model = model
        self.kind = kind
        self._make_keras_function = make_keras_function
        self._keras_function = None
        # One snapshot per model: its read and write functions outlive rebuilds.
        self._snapshot = model.__dict__.setdefault("_oom_snapshot", Snapshot(model))

    # Keras looks for these on its own functions in a few places.
    def __getattr__(self, name):
        if name.startswith("__") or self.__dict__.get("_keras_function") is None:
            raise AttributeError(name)
        return getattr(self._keras_function, name)

    def _build(self):
        attr = f"{self.kind}_function"
        built = self._make_keras_function(force=True)
        self._keras_function = getattr(self.model, attr, None) or built
        setattr(self.model, attr, self)
        self._one_step = K.one_step_function(self.model, self.kind)
        self._traced = False

    def _traced_step(self, data):
        if not self._traced and hasattr(self._one_step, "get_concrete_function"):
            # Creates the variables Keras makes lazily (optimizer slots,
            # metrics) before the snapshot is taken, without running a step.
            self._one_step.get_concrete_function(data)
        self._traced = True
        return self._one_step

    def __call__(self, arg):
        model = self.model
        backoff = attached_backoff(model)
        if backoff is None and model.micro_batch_size != "auto":
            return self._keras_function(arg)
        if self.kind == "predict" and not K.LEGACY:
            # Keras 3 pulls the predict data itself: a list of batches.
            outputs = [self._run(data, backoff) for data in arg]
            if len(outputs) == 1:
                return outputs[0]
            return tf.nest.map_structure(lambda *t: tf.concat(t, axis=0), *outputs)
        outputs = None
        for index in range(K.steps_per_execution(model)):
            try:
                data = next(arg)
            except (StopIteration, tf.errors.OutOfRangeError):
                if index == 0:
                    raise
                break
            outputs = self._run(data, backoff)
        return outputs

    def _run(self, data, backoff):
        """Runs one step on `data`, backing off and retrying on out-of-memory."""
        model = self.model
        data = K.strip_optionals(data)
        batch_size = batch_size_of(data)
        search = None
        if model.micro_batch_size == "auto":
            search = AutoSearch(model, batch_size, backoff)
        while True:
            # A backoff rebuilds the model's step functions: use the newest.
            current_function = getattr(model, f"{self.kind}_function", None)
            if not isinstance(current_function, GuardedFunction):
                current_function = self
            one_step = current_function._traced_step(data)
            taken = self._snapshot.take()
            started = time.perf_counter()
            try:
                outputs = one_step(data)
                break
            except tf.errors.OpError as error:
                if not is_oom(error):
                    raise
                failed = error
            failed_seconds = time.perf_counter() - started
            recovery = time.perf_counter()
            self._snapshot.restore(taken)
            del taken
            current = micro_batch_in_use(model, batch_size)
            if search is not None:
                new = search.shrink(current, failed, failed_seconds)
            elif backoff is None:
                raise failed
            else:
                new = backoff._shrink(model, self.kind, current, failed)
            model.micro_batch_size = new  # rebuilds this function's step
            event = dict(
                kind=self.kind,
                failed_micro_batch_size=current,
                micro_batch_size=new,
                failed_step_seconds=failed_seconds,
                recovery_seconds=time.perf_counter() - recovery,
            )
            if backoff is not None:
                backoff.backoffs.append(event)
            del failed
        if search is not None:
            search.finish(micro_batch_in_use(model, batch_size))
        if self.kind == "train" and backoff is not None and isinstance(outputs, dict):
            outputs = dict(outputs)
            outputs["micro_batch_size"] = micro_batch_in_use(model, batch_size)
        return outputs


class AutoSearch:
    """`micro_batch_size="auto"`: the largest micro-batch that runs, by trying.

    Starts with the whole batch as one micro-batch and shrinks it (by the
    attached `OOMBackoff`'s factor, else by half) after each out-of-memory
    error; the failed attempts are rolled back, and the first attempt that
    runs is the real step.
    """

    def __init__(self, model, batch_size, backoff):
        self.model = model
        self.backoff = backoff
        self.factor = backoff.factor if backoff is not None else 0.5
        self.minimum = backoff.min_micro_batch_size if backoff is not None else 1
        self.started = time.perf_counter()
        self.trials = []
        model.micro_batch_size = batch_size or 1

    def shrink(self, current, error, seconds):
        self.trials.append((current, seconds))
        if current <= self.minimum:
            raise tf.errors.ResourceExhaustedError(
                None, None, oom_report(error, current, self.minimum)
            ) from error
        return max(self.minimum, min(current - 1, int(current * self.factor)))

    def finish(self, chosen):
        seconds = time.perf_counter() - self.started
        failed = ", ".join(str(size) for size, _ in self.trials) or "none"
        report = dict(
            micro_batch_size=chosen,
            out_of_memory_trials=[size for size, _ in self.trials],
            seconds=seconds,
        )
        # A plain dict: Keras would otherwise track (and wrap) it as model state.
        object.__setattr__(self.model, "micro_batch_search", report)
        print(
            f'micro_batch_size="auto": chose micro_batch_size={chosen} '
            f"(out of memory at: {failed}; search took {seconds:.1f} s, "
            f"{sum(s for _, s in self.trials):.1f} s of it in failed attempts)"
        )


def make_function(model, kind, make_keras_function, force=False):
    """What `model.make_<kind>_function` returns: a `GuardedFunction`.

    Step functions are kept per micro-batch setting, so that returning to a
    setting (a backoff after the micro-batch was raised again, say) reuses the
    traced function: each retrace costs TensorFlow host and device memory that
    it does not give back. Keras resetting the functions (`compile`, a new
    `remat`) empties the cache.
    """
    attr = f"{kind}_function"
    current = getattr(model, attr, None)
    if current is not None and not force:
        return current
    cache = model.__dict__.setdefault("_oom_functions", {})
    if not force:
        cache.clear()
    key = (
        kind,
        model._micro_batch_size,
        model._accumulation_steps,
        model._micro_batch_jit_compile,
    )
    guarded = cache.get(key)
    if guarded is None:
        guarded = GuardedFunction(model, kind, make_keras_function)
        guarded._build()
        cache[key] = guarded
    setattr(model, attr, guarded)
    return guarded
