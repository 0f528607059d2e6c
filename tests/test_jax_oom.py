"""`OOMBackoff` and `MemoryLogger` on Keras 3's JAX backend (keras_memopt._oom.jax_runner).

Runs where Keras runs on JAX: CI's JAX pass, `KERAS_BACKEND=jax python -m pytest
tests/test_jax_oom.py` (the TensorFlow passes skip this module). The out-of-memory
errors are XLA's own, raised by its CPU runtime when the step runs: `ExhaustsAbove`, a
layer that past a micro-batch of `limit` samples asks for a buffer of pebibytes, which
no allocator hands out (`RESOURCE_EXHAUSTED: Out of memory allocating ... bytes.`), and,
in a fresh process under an address-space limit, a micro-batch whose own activations do
not fit. The oracle: the same model from the same weights, trained at the smaller size
from the step where the backoff happened, in float64, compared at 1e-9: weights, every
optimizer, metric, BatchNormalization and seed generator variable, and every figure
`fit` logs.
"""

import csv
import textwrap

import numpy as np
import pytest
from _helpers import FLOAT64, IDENTICAL, assert_same_logs
from conftest import JAX_MODULE

from keras_memopt._keras import BACKEND, keras

pytestmark = JAX_MODULE

if BACKEND == "jax":
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)

    from keras_memopt import AccumulatingModel, memory
    from keras_memopt.callbacks import MemoryLogger, OOMBackoff

    class ExhaustsAbove(keras.layers.Layer):
        """The identity, whose forward pass past `limit` samples also sorts a buffer of
        at least 2**50 bytes: XLA refuses the allocation when the step runs. `limit` is
        read when the step is traced (each micro-batch setting and batch shape)."""

        def __init__(self, limit, **kwargs):
            super().__init__(**kwargs)
            self.limit = limit
            self.traced = []  # the micro-batch sizes it was traced at

        def call(self, x):
            size = x.shape[0]
            if size is None:  # Keras's symbolic build
                return x
            self.traced.append(size)
            if size <= self.limit:
                return x
            huge = jnp.broadcast_to(x[:, :1, None], (size, 2**20, 2**24))
            probe = jax.lax.stop_gradient(jax.lax.sort(huge, dimension=2)[:, 0, 0])
            return x + 0.0 * probe[:, None]

        def compute_output_shape(self, shape):
            return shape


SAMPLES, BATCH = 44, 16  # batches of 16, 16 and 12 samples
NO_LIMIT = 10**6


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(SAMPLES, 8)), rng.integers(0, 3, SAMPLES)


def _model(limit=NO_LIMIT, **split):
    """Dense, BatchNormalization, Dropout (a seed generator), `ExhaustsAbove`, Dense;
    the same weights and seeds at every call."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16)(inputs)
    hidden = keras.layers.BatchNormalization()(hidden)
    hidden = keras.layers.Dropout(0.3)(hidden)
    hidden = ExhaustsAbove(limit, name="exhausts")(hidden)
    model = AccumulatingModel(inputs, keras.layers.Dense(3)(hidden), **split)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy", keras.metrics.SparseCategoricalCrossentropy(from_logits=True)],
    )
    return model


_GROUPS = ("trainable", "non_trainable", "optimizer", "metrics")


def _state(model, groups=_GROUPS):
    """Every value a step may advance, named by the model's own variables' paths."""
    variables = dict(
        trainable=model.trainable_variables,
        non_trainable=model.non_trainable_variables,  # BatchNormalization's, seed states
        optimizer=model.optimizer.variables,  # iterations, Adam's slots
        metrics=model.metrics_variables,
    )
    return [
        (f"{group} {variable.path}", np.asarray(variable.value))
        for group in groups
        for variable in variables[group]
    ]


def _assert_same_state(received, expected, tolerance=FLOAT64, groups=_GROUPS):
    received = received if isinstance(received, list) else _state(received, groups)
    expected = expected if isinstance(expected, list) else _state(expected, groups)
    assert len(received) == len(expected)
    for (_, value), (name, wanted) in zip(received, expected, strict=True):
        np.testing.assert_allclose(value, wanted, **tolerance, err_msg=name)
    assert any("seed_generator" in name for name, _ in expected), "no seed state compared"


class _SizeAt(keras.callbacks.Callback):
    """Sets `model.micro_batch_size` (and `limit` of its `ExhaustsAbove`) before a step."""

    def __init__(self, step, size=None, limit=None):
        super().__init__()
        self.step, self.size, self.limit = step, size, limit
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == (0, self.step):
            if self.size is not None:
                self.model.micro_batch_size = self.size
            if self.limit is not None:
                self.model.get_layer("exhausts").limit = self.limit


class TestBackoff:
    def test_the_first_step_backs_off_as_a_run_started_at_the_smaller_size(self):
        x, y = _data()
        ours, oracle = _model(limit=4, micro_batch_size=8), _model(limit=4, micro_batch_size=4)
        backoff = OOMBackoff(verbose=0)
        history = ours.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                           callbacks=[backoff]).history
        expected = oracle.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                              verbose=0).history
        _assert_same_state(ours, oracle)
        assert_same_logs(history, expected, FLOAT64)
        assert history["micro_batch_size"] == [4, 4]
        assert ours.micro_batch_size == 4
        (event,) = backoff.backoffs
        assert (event["kind"], event["phase"]) == ("train", "micro_batch")
        assert (event["failed_micro_batch_size"], event["micro_batch_size"]) == (8, 4)
        assert event["bytes"] >= 2**50  # XLA's message: "Out of memory allocating N bytes."

    def test_a_step_within_an_epoch_backs_off_with_nothing_advanced(self):
        # The limit falls after the first step; the epoch's last batch (12 samples) is
        # a new shape, traced under it: its step runs out of memory at 8 and runs again
        # at 4, after two steps that advanced every variable and metric.
        x, y = _data(seed=3)
        ours, oracle = _model(micro_batch_size=8), _model(micro_batch_size=8)
        backoff = OOMBackoff(verbose=0)
        history = ours.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                           callbacks=[backoff, _SizeAt(1, limit=4)]).history
        expected = oracle.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                              callbacks=[_SizeAt(2, size=4)]).history
        assert [(e["failed_micro_batch_size"], e["micro_batch_size"])
                for e in backoff.backoffs] == [(8, 4)]
        _assert_same_state(ours, oracle)
        assert_same_logs(history, expected, FLOAT64)
        assert history["micro_batch_size"] == [4, 4]

    def test_each_size_is_compiled_once_and_kept(self):
        x, y = _data()
        model = _model(micro_batch_size=8)
        layer = model.get_layer("exhausts")
        traced = []
        for size in (8, 4, 8, 4):
            model.micro_batch_size = size
            model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
            traced.append(len(layer.traced))
        # 8: the batches of 16 and 12, each at 8 (and the rest of 4 of the last);
        # 4: both again at 4; then each size again, with nothing traced anew.
        assert traced[0] < traced[1] == traced[2] == traced[3], traced

    def test_evaluate_and_predict_back_off(self):
        x, y = _data(seed=5)
        ours, oracle = _model(limit=4, micro_batch_size=8), _model(micro_batch_size=4)
        backoff = OOMBackoff(verbose=0)
        received = ours.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True,
                                 callbacks=[backoff])
        assert_same_logs(received, oracle.evaluate(x, y, batch_size=BATCH, verbose=0,
                                                   return_dict=True), FLOAT64)
        ours.micro_batch_size = 8
        np.testing.assert_allclose(
            ours.predict(x, batch_size=BATCH, verbose=0, callbacks=[backoff]),
            oracle.predict(x, batch_size=BATCH, verbose=0), **FLOAT64,
        )
        assert [(e["kind"], e["failed_micro_batch_size"]) for e in backoff.backoffs] == [
            ("test", 8), ("predict", 8)
        ]

    def test_a_backoff_prints_one_line(self, capsys):
        x, y = _data()
        model = _model(limit=4, micro_batch_size=8)
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[OOMBackoff()])
        lines = [line for line in capsys.readouterr().out.splitlines() if "OOMBackoff" in line]
        assert len(lines) == 1
        assert lines[0].startswith("OOMBackoff: out of memory in a train step at "
                                   "micro_batch_size=8 (")
        assert lines[0].endswith("retrying the same batch with micro_batch_size=4.")


class TestAtTheMinimum:
    def test_the_report_leaves_the_model_as_the_last_step_left_it(self):
        x, y = _data(seed=7)
        model = _model(micro_batch_size=8)
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[OOMBackoff()])
        # `fit` resets the metrics when it starts: what a step advances besides them.
        groups = ("trainable", "non_trainable", "optimizer")
        before = _state(model, groups)
        assert dict(before)["optimizer adam/iteration"] == 3
        # A new size is traced under the new limit: 6 runs out, then 4, the minimum.
        model.get_layer("exhausts").limit = 2
        model.micro_batch_size = 6
        backoff = OOMBackoff(min_micro_batch_size=4, verbose=0)
        with pytest.raises(jax.errors.JaxRuntimeError, match=(
            r"^RESOURCE_EXHAUSTED: Out of memory in a micro-batch's forward and backward pass "
            r"at the smallest micro-batch allowed \(micro_batch_size=4, min_micro_batch_size=4\)"
        )) as raised:
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[backoff])
        assert "Original error: JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory " \
            "allocating" in str(raised.value)
        _assert_same_state(model, before, IDENTICAL, groups)
        assert [e["failed_micro_batch_size"] for e in backoff.backoffs] == [6]
        assert (model.micro_batch_size, model.oom_policy) == (4, None)

    def test_without_oom_backoff_nothing_is_retried(self):
        # Plain Keras on JAX: the step is not awaited, and XLA's error reaches the
        # user where its results are read (here, at the latest, the weights).
        x, y = _data()
        model = _model(limit=4, micro_batch_size=8)
        with pytest.raises(jax.errors.JaxRuntimeError, match=r"Out of memory allocating \d+ bytes"):
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
            model.get_weights()
        assert model.micro_batch_size == 8


class TestAttaching:
    def test_a_plain_keras_model_is_refused(self):
        inputs = keras.Input((8,))
        model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
        model.compile(optimizer="sgd", loss="mse")
        with pytest.raises(TypeError, match="Received: a model of type Functional"):
            model.fit(np.zeros((4, 8)), np.zeros((4, 3)), verbose=0, callbacks=[OOMBackoff()])

    def test_the_callbacks_are_exported_and_the_others_named(self):
        import keras_memopt

        assert keras_memopt.callbacks.OOMBackoff is OOMBackoff
        with pytest.raises(AttributeError, match="BackupAndRestore is not available on the JAX"):
            keras_memopt.callbacks.BackupAndRestore  # noqa: B018


# A fresh process, whose address space is limited once the steps at micro-batches of 128
# and 512 are compiled: a batch of 1024 in micro-batches of 512 of Dense(65536) float64
# activations needs 640 MiB of XLA's temporaries, at 128 160 MiB (XLA's analysis),
# and the limit leaves the process `argv[1]` MiB beyond what it has mapped, far from both
# (with 256 against 128, margins that let 128 run, 250 to 310 MiB, let 256 run in one
# environment and not in another). The oracle trains first, without the limit, at the
# sizes the backoff leaves: 128, 512, then 128 (`factor=0.25`). SGD with momentum, linear in the
# gradients: Adam turned the float64 rounding of two compilations (with and without
# buffer donation) into 2e-9 relative after three updates.
_ADDRESS_SPACE_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    import jax
    jax.config.update("jax_enable_x64", True)
    import keras
    from keras_memopt import AccumulatingModel
    from keras_memopt.callbacks import OOMBackoff
    keras.backend.set_floatx("float64")

    def model():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((16,))
        hidden = keras.layers.Dense(65536, activation="tanh")(inputs)
        model = AccumulatingModel(inputs, keras.layers.Dense(2)(hidden), micro_batch_size=128)
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="mse")
        return model

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(1024, 16)), rng.normal(size=(1024, 2))
    ours, oracle = model(), model()
    backoff = OOMBackoff(factor=0.25, verbose=0)
    for size in (128, 512, 128):
        oracle.micro_batch_size = size
        oracle.fit(x, y, batch_size=1024, epochs=1, verbose=0)
    for size in (128, 512):
        ours.micro_batch_size = size
        ours.fit(x, y, batch_size=1024, epochs=1, verbose=0, callbacks=[backoff])
    import gc; gc.collect()  # the 512 step's arrays freed before the mapped size is read
    mapped = open("/proc/self/status").read().split("VmSize:")[1].split()[0]
    limit = int(mapped) * 1024 + int(sys.argv[1]) * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    ours.fit(x, y, batch_size=1024, epochs=1, verbose=0, callbacks=[backoff])

    def values(model):
        return model.get_weights() + [v.numpy() for v in model.optimizer.variables]

    gap = max(float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))  # relative
              for a, b in zip(values(ours), values(oracle)))
    print(json.dumps(dict(
        backoffs=[[e["failed_micro_batch_size"], e["micro_batch_size"], e["bytes"]]
                  for e in backoff.backoffs],
        gap=gap, iterations=int(ours.optimizer.iterations.numpy()),
    )))
""")


@pytest.mark.slow
class TestAddressSpaceLimit:
    def test_a_micro_batch_that_does_not_fit_backs_off(self):
        import json

        from keras_memopt import _subprocess

        # TensorFlow (which Keras imports) without the suite's BFC allocator, whose next
        # region would not fit in the limited address space either; XLA without its
        # YNNPACK fusions, whose own scratch allocations fail first under the limit, as
        # `INTERNAL: YNNPACK operation failed` (measured with 256 against 128 at margins of
        # 250 and 280 MiB).
        # glibc's allocator with two arenas: each thread's own arena reserves 64 MiB of
        # address space, and one C++ allocation that failed for it aborted the child
        # (`std::bad_alloc`) in one run of two; none in three runs with two arenas.
        env = {"KERAS_BACKEND": "jax", "TF_CPU_ALLOCATOR_USE_BFC": None,
               "TF_CPU_BFC_MEM_LIMIT_IN_MB": None,
               "XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=", "MALLOC_ARENA_MAX": "2"}
        # A margin of 300 MiB: the step at 512 needs more than 400 (XLA's figure below), at 128
        # about a quarter. With 400 the step at 512 fitted once in CI (no backoff; the
        # address space mapped when the limit was read was not measured then).
        output = _subprocess.run(["-c", _ADDRESS_SPACE_SCRIPT, "300"], env=env, timeout=300)
        assert output.returncode == 0, output.stderr[-3000:]
        result = json.loads(output.stdout.strip().splitlines()[-1])
        ((failed, retried, allocation),) = result["backoffs"]
        assert (failed, retried) == (512, 128)
        assert allocation > 400 * 2**20  # XLA's own figure, over the limit's margin
        assert result["iterations"] == 3
        assert result["gap"] < 1e-9


class TestMemoryLogger:
    def test_a_cpu_gives_the_processs_rss_under_the_tensorflow_lines_names(self, tmp_path):
        x, y = _data()
        model = _model(micro_batch_size=8)
        logger = MemoryLogger(tmp_path / "memory.csv")
        with pytest.warns(UserWarning, match="JAX gives no memory figures for CPU:0"):
            history = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0,
                                callbacks=[logger]).history
        assert [name for name in history if name.startswith("memory_")] == [
            "memory_host_rss_mib"
        ]
        assert all(value > 50 for value in history["memory_host_rss_mib"])
        with open(tmp_path / "memory.csv") as file:
            rows = list(csv.DictReader(file))
        assert len(rows) == 2 and "memory_host_rss_mib" in rows[0]

    def test_a_device_with_memory_stats_gives_them(self, monkeypatch):
        # No GPU here: a stand-in for JAX's GPU device, whose `memory_stats()` is read.
        class Device:
            platform = "gpu"

            def memory_stats(self):
                return {"bytes_in_use": 3 * 2**20, "peak_bytes_in_use": 5 * 2**20,
                        "bytes_limit": 8 * 2**20}

        real = jax.devices
        monkeypatch.setattr(jax, "devices",
                            lambda kind=None: [Device()] if kind == "gpu" else real(kind))
        figures = memory.MemoryReader(nvml=False).read()
        assert figures["memory_gpu0_current_mib"] == 3.0
        assert figures["memory_gpu0_peak_mib"] == 5.0
        assert memory.device_total("GPU:0") == 8 * 2**20
