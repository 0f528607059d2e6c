"""Test session set-up.

TensorFlow reads its allocator settings once, when it initialises, so they are
set here before anything imports it: the BFC allocator on the CPU gives real,
deterministic current/peak memory figures (`tf.config.experimental.
get_memory_info("CPU:0")`), and oneDNN is off because it bypasses that
allocator. The CPU is split into two logical devices for MirroredStrategy.
Tests that need a memory *limit* run in a subprocess (`run_python`).
"""

import gc
import json
import os
import textwrap

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ.setdefault("TF_CPU_BFC_MEM_LIMIT_IN_MB", "16384")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

from keras_memopt import _keras, _subprocess  # noqa: E402, F401

# What every test shares is imported now (TensorFlow, the Keras line, the package): each
# full garbage collection traversed it again, 0.18 s of CPU here (a single-file
# tf_keras session of test_oom_backoff.py ran 32 of them: 8.0 s of its 49). Frozen, the
# collector leaves these objects alone; what tests make is collected as before.
gc.collect()
gc.freeze()

LEGACY = os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true")
# A child process on the same Keras line as the tests.
KERAS_LINE = {"TF_USE_LEGACY_KERAS": "1" if LEGACY else "0"}

# Tests that read the CPU's allocator as "the device", or expect a machine
# without GPUs (no figures for "GPU:0", configure_devices warning), say so.
HAS_GPU = bool(tf.config.list_physical_devices("GPU"))
without_gpu = pytest.mark.skipif(
    HAS_GPU, reason="expects a machine without GPUs (reads the CPU as the device)"
)


def last_json(output):
    """What a child printed last, as JSON: its result."""
    return json.loads(output.stdout.strip().splitlines()[-1])


def run_python(code, memory_limit_mb=None, timeout=600, env=None):
    """Runs `code` in a fresh Python with a memory-limited TF CPU allocator,
    on the tests' Keras line (`env` may say otherwise).

    Returns the child's `Output` (`.stdout`, `.stderr`, `.returncode`);
    fails the test with its output if the child exits non-zero or runs past
    `timeout` seconds (it is killed).
    """
    child_env = {**_subprocess.tensorflow_env(memory_limit_mb or 16384), **KERAS_LINE,
                 **(env or {})}
    try:
        output = _subprocess.run(["-c", textwrap.dedent(code)], env=child_env, timeout=timeout)
    except _subprocess.ChildFailed as error:
        pytest.fail(str(error))
    if output.returncode != 0:
        pytest.fail(f"subprocess exited with {output.returncode}\n{output.tail(4000)}")
    return output


def peak_bytes_of_fit(model, x, y, batch_size, lowest_of=1):
    """Allocator peak above the resting memory during one epoch, after a warm-up.

    With `lowest_of=n`, the lowest of n epochs' peaks: the executor's parallel
    scheduling moves a step's peak from run to run, most on a loaded machine.
    """
    model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)  # trace and warm up
    peaks = []
    for _ in range(lowest_of):
        tf.config.experimental.reset_memory_stats("CPU:0")
        start = tf.config.experimental.get_memory_info("CPU:0")["current"]
        model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - start)
    return min(peaks)


def pytest_collection_modifyitems(config, items):
    """Runs `slow` tests first; on the tf_keras pass, skips `line_independent` ones.

    First, so that with pytest-xdist no long test starts when the others are
    done and leaves one worker running alone at the end.

    `line_independent` marks a test that exercises no Keras code, or one whose
    Keras-line-specific path another test runs on tf_keras: a repeat there
    would check the same code again. The second kind says which test, as
    `pytest.mark.line_independent(reason=...)`; the skip reports it.
    """
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable
    if not LEGACY:
        return
    for item in items:
        marker = item.get_closest_marker("line_independent")
        if marker:
            reason = marker.kwargs.get("reason", "the same on both Keras lines")
            item.add_marker(pytest.mark.skip(reason=f"{reason}: the Keras 3 pass runs it"))


@pytest.fixture
def keras_module():
    from keras_memopt._keras import keras

    return keras


@pytest.fixture
def floatx_float64():
    """Keras's floatx float64 for the test, and no dtype policy: the JAX test modules'
    oracle is float64 Keras on JAX, and their memory tests build float32 layers by hand
    (`JAX_MODULE` applies it)."""
    from keras_memopt._keras import keras

    before = keras.backend.floatx()
    keras.backend.set_floatx("float64")
    yield
    keras.backend.set_floatx(before)


def _jax_module_marks():
    from keras_memopt._keras import BACKEND

    return [pytest.mark.skipif(BACKEND != "jax", reason="runs on Keras 3's JAX backend"),
            pytest.mark.usefixtures("floatx_float64")]


# `pytestmark` of a module of tests of the JAX line: skipped on TensorFlow, floatx float64.
JAX_MODULE = _jax_module_marks()


@pytest.fixture
def float64_keras():
    """Keras's float type float64 for the test (`_fuzz.float64`): for modules whose
    oracle is plain Keras in float64, `pytest.mark.usefixtures("float64_keras")`."""
    from _fuzz import float64

    with float64():
        yield


@pytest.fixture(autouse=True)
def _clear_session():
    from keras_memopt._keras import keras

    if LEGACY:
        keras.backend.clear_session()
    else:
        # Keras 3 would also run a full garbage collection, which took about
        # a second per test in a worker holding many traced graphs (a quarter
        # of the pass); Python's own collector runs as usual.
        keras.backend.clear_session(free_memory=False)
    yield
    # What the test dropped is collected now, and what stays is frozen: TensorFlow keeps
    # each traced graph alive (about 25,000 objects a fuzzer case) with no Python root to
    # drop it, so every full collection traversed them all again. test_exactness and
    # test_fuzz on Keras 3 in one process (two at once, on the same load): 324 -> 281 CPU-s,
    # the same peak resident memory (2.34 GB).
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def mirrored_strategy():
    """One MirroredStrategy over the two logical CPUs for the whole session.

    Strategies created one after another in one process can hand out clashing
    collective-op keys (tf_keras: "Shape mismatch in the collective instance"),
    so the tests share one.
    """
    return tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
