"""Out-of-memory errors: recognise them, report them, and one policy for backing off.

- `is_oom` recognises an out-of-memory error however TensorFlow reports it;
  `parse_oom` and `oom_report` say what failed to allocate and what to try;
  `state_must_fit` says it when the model's state does not fit before the first step.
- `Snapshot` takes and puts back every variable a step may change, so a
  failed step leaves no trace.
- `BackoffPolicy` is the one rule for the next micro-batch size after an
  out-of-memory error, and the final report at the smallest size. `OOMBackoff`
  attaches one to the model; `micro_batch_size="auto"` searches with it.

The runner that uses them to retry a batch is `keras_memopt._runner`.
"""

from __future__ import annotations

import contextlib
import re
import time

import tensorflow as tf

from keras_memopt import _keras as K
from keras_memopt import distribute
from keras_memopt.memory import allocator_memory, format_bytes, parse_bytes

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
_SIZE = re.compile(r"allocate ([\d.]+\s*[KMGT]iB)")  # XLA: "allocate 34.12MiB"
_DEVICE = re.compile(r"device:([A-Z]+:\d+)")


def is_oom(error: BaseException) -> bool:
    """Whether `error` (or an error it was raised from) means out of memory.

    Besides `tf.errors.ResourceExhaustedError`, TensorFlow reports some
    allocation failures otherwise:

    - `InvalidArgumentError: Cannot parse tensor from proto` at a constant
      node: the constant's memory could not be allocated when the step's
      kernels were made (seen on CPU under a memory limit, for a constant the
      graph optimiser folded);
    - `UnknownError` or `InternalError` whose message names resource
      exhaustion, or "Dst tensor is not initialized" (a copy to a device
      whose destination could not be allocated; reported on GPUs).

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
        message = str(error).lower()
        if isinstance(error, (tf.errors.UnknownError, tf.errors.InternalError)):
            if any(marker in message for marker in _DISGUISED):
                return True
        if isinstance(error, tf.errors.InvalidArgumentError):
            if "cannot parse tensor from proto" in message:
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
        info["bytes"] = parse_bytes(_SIZE.search(message).group(1))
    if info["device"] is None:
        device = _DEVICE.search(message)
        info["device"] = device.group(1) if device else None
    return info


def describe_allocation(info):
    if info["shape"] is not None:
        what = "a tensor of shape [" + ", ".join(str(d) for d in info["shape"]) + "]"
        if info["dtype"]:
            what += f" and type {info['dtype']}"
    elif info["bytes"] is not None:
        what = f"{format_bytes(info['bytes'])} ({info['bytes']} bytes)"
    else:
        what = "memory (the error message does not say how much)"
    if info["op"]:
        what += f" in op {info['op']}"
    if info["device"]:
        what += f" on {info['device']}"
    return what


def allocation_note(error) -> str:
    """" (what failed to allocate)", or "" when the message does not say."""
    info = parse_oom(str(error))
    return f" ({describe_allocation(info)})" if any(info.values()) else ""


def oom_report(error: BaseException, micro_batch_size, minimum) -> str:
    """The readable report raised when backing off can go no further."""
    return _report(
        error,
        "Out of memory at the smallest micro-batch allowed "
        f"(micro_batch_size={micro_batch_size}, min_micro_batch_size={minimum}); "
        "the model, optimizer and metrics are as they were before the failed step.",
        [
            "recompute activations in the backward pass instead of storing them "
            "(rematerialisation, keras_memopt's `remat` option);",
            "mixed precision: `keras.mixed_precision.set_global_policy(\"mixed_float16\")` "
            "halves activation memory;",
            "a smaller model (fewer or narrower layers) or smaller inputs;",
            "on a GPU, if memory is fragmented (much is free but no large block), start "
            "Python with `TF_GPU_ALLOCATOR=cuda_malloc_async`.",
        ],
    )


@contextlib.contextmanager
def state_must_fit():
    """Raises a readable report for an out-of-memory error before the first step.

    What runs there makes the optimizer's variables and the metrics'; when
    they do not fit, no micro-batch size can help, and `OOMBackoff` is not
    asked to.
    """
    try:
        yield
    except tf.errors.OpError as error:
        if not is_oom(error):
            raise
        headline = (
            "Out of memory before the first step, while making the variables of the "
            "optimizer and the metrics: the model's state does not fit on the device, "
            "whatever the micro-batch size."
        )
        advice = [
            "an optimizer that keeps less state per weight (Adam and AdamW keep two "
            "slots, RMSprop and SGD with momentum one, plain SGD none);",
            "a smaller model (fewer or narrower layers), or more device memory.",
        ]
        raise tf.errors.ResourceExhaustedError(None, None, _report(error, headline, advice)) \
            from error


def _report(error, headline, advice):
    info = parse_oom(str(error))
    memory = allocator_memory(info["device"])
    if memory is None:
        memory_line = "not available for this device"
    else:
        memory_line = (
            f"{format_bytes(memory['current'])} in use, peak {format_bytes(memory['peak'])} "
            f"on {memory['device']}"
        )
    return (
        f"{headline}\n"
        f"  Failed to allocate: {describe_allocation(info)}.\n"
        f"  Device memory: {memory_line}.\n"
        "  What to try:\n" + "".join(f"  - {line}\n" for line in advice)
        + f"Original error: {type(error).__name__}: {_first_line(error)}"
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
    metric variables, tf_keras's step counters and Keras 3's global seed
    generator; each once.
    """
    groups = [model.variables]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        groups.append(K.optimizer_variables(optimizer))
    groups.extend(metric.variables for metric in model.metrics)
    groups.append(K.step_counters(model))
    groups.append(K.global_random_state())
    seen, variables = set(), []
    for group in groups:
        for variable in group:
            if id(variable) not in seen:
                seen.add(id(variable))
                variables.append(variable)
    return variables


class Snapshot:
    """Takes and puts back the values of a model's state variables.

    Taking costs no copy: TensorFlow tensors are immutable, so the values
    read stay valid while the step updates the variables (an in-place update
    of a buffer that a snapshot still holds copies it first). The extra
    memory is the state the step rewrites, held until the step returns.

    Putting back assigns each variable eagerly: it runs only after a failed
    step, where tracing a function of every assignment would cost more than
    the assignments themselves (about a second on a small MLP).
    """

    def __init__(self, model):
        self.model = model
        self._variables = None
        self._read = None

    def _refresh(self):
        strategy = self.model.distribute_strategy
        variables = distribute.local_variables(state_variables(self.model), strategy)
        if self._variables is None or [id(v) for v in variables] != [
            id(v) for v in self._variables
        ]:
            self._variables = variables
            self._read = tf.function(lambda: [tf.identity(v) for v in variables])

    def take(self):
        """The current values, to give back to `restore`."""
        self._refresh()
        return self._variables, self._read()

    @staticmethod
    def restore(taken):
        for variable, value in zip(*taken, strict=True):
            variable.assign(value)


# -- backing off ------------------------------------------------------------------


class BackoffPolicy:
    """The next micro-batch size after an out-of-memory error, or the final report.

    Args:
        factor: float in (0, 1), what the micro-batch is multiplied by at each
            backoff (rounded down, and always at least one sample smaller).
        min_micro_batch_size: int, the smallest micro-batch to try.
        on_backoff: called with a dict describing each backoff (`kind`,
            `failed_micro_batch_size`, `micro_batch_size`,
            `failed_step_seconds`, `recovery_seconds`), or None.
    """

    def __init__(self, factor=0.5, min_micro_batch_size=1, on_backoff=None):
        self.factor = factor
        self.min_micro_batch_size = min_micro_batch_size
        self.on_backoff = on_backoff

    def next_size(self, current, error):
        """The micro-batch size to retry with after `error` at `current`.

        Raises:
            tf.errors.ResourceExhaustedError: with `oom_report`'s text, when
                `current` is already the smallest size allowed.
        """
        minimum = self.min_micro_batch_size
        sizes = current if isinstance(current, tuple) else (current,)
        if current is None or all(size <= minimum for size in sizes):
            raise tf.errors.ResourceExhaustedError(
                None, None, oom_report(error, current, minimum)
            ) from error
        # Per-replica sizes all shrink: the failed step does not say which
        # replica's memory ran out.
        shrunk = tuple(
            size if size <= minimum else max(minimum, min(size - 1, int(size * self.factor)))
            for size in sizes
        )
        return shrunk if isinstance(current, tuple) else shrunk[0]

    def record(self, event):
        if self.on_backoff is not None:
            self.on_backoff(event)


class AutoSearch:
    """`micro_batch_size="auto"`: the largest micro-batch that runs, by trying.

    Starts with the whole batch as one micro-batch and shrinks it by the
    policy after each out-of-memory error; the failed attempts are rolled
    back, and the first attempt that runs is the real step.
    """

    def __init__(self, model, batch_size):
        self.model = model
        self.started = time.perf_counter()
        self.trials = []
        self.initial = batch_size or 1

    def failed(self, size, seconds):
        self.trials.append((size, seconds))

    def report(self, chosen) -> dict:
        seconds = time.perf_counter() - self.started
        failed = ", ".join(str(size) for size, _ in self.trials) or "none"
        print(
            f'micro_batch_size="auto": chose micro_batch_size={chosen} '
            f"(out of memory at: {failed}; search took {seconds:.1f} s, "
            f"{sum(s for _, s in self.trials):.1f} s of it in failed attempts)"
        )
        return dict(
            micro_batch_size=chosen,
            out_of_memory_trials=[size for size, _ in self.trials],
            seconds=seconds,
        )
