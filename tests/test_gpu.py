"""The package's GPU claims on a real NVIDIA GPU (`pytest -m gpu`); skipped without one.

Written on 2026-11-29 on a machine without a GPU and not run yet: the first GPU session runs them
(with `benchmarks/gpu_check.py`). Each test runs in a fresh process, because what it checks is
read when TensorFlow starts its devices (the allocator, memory limits, logical devices), and
asserts only what the GPU itself decides: where an out-of-memory error comes from, which allocator
TensorFlow created, what NVML reports. Every test is written to fail, not to pass quietly, where a
claim does not hold. TensorFlow's INFO log lines (`TF_CPP_MIN_LOG_LEVEL=0`) are read where they
are the only evidence (the allocator TensorFlow created).
"""

import json

import pytest
from conftest import HAS_GPU, last_json, run_python

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.line_independent,
    pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU that TensorFlow sees"),
]

# TensorFlow's own log lines, and no allocator inherited from the shell.
_LOGGED = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_GPU_ALLOCATOR": None}


def test_oom_from_the_gpu_allocator_is_recovered_by_oom_backoff():
    # 13 M weights (52 MiB; with Adam's slots and the gradient sums about 260 MiB) under a 1 GiB
    # limit: a micro-batch of 32768 samples keeps at least 1 GiB of activations for the backward
    # pass (4 Dense outputs of 32768 x 2048 floats), so it cannot fit, and a sixteenth of it
    # (four halvings) needs less than 100 MiB.
    output = run_python("""
        import json
        import numpy as np
        import keras_memopt as kmo
        from keras_memopt._keras import keras

        assert kmo.configure_devices(memory_limit="1GiB"), "no GPU configured"
        inputs = keras.Input((256,))
        x = inputs
        for _ in range(4):
            x = keras.layers.Dense(2048, activation="relu")(x)
        model = kmo.AccumulatingModel(inputs, keras.layers.Dense(10)(x), micro_batch_size=32768)
        model.compile(optimizer="adam", jit_compile=False,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        rng = np.random.default_rng(0)
        x = rng.standard_normal((65536, 256)).astype("float32")
        y = rng.integers(0, 10, 65536)
        backoff = kmo.callbacks.OOMBackoff(verbose=0)
        history = model.fit(x, y, batch_size=32768, epochs=1, callbacks=[backoff], verbose=0)
        print(json.dumps(dict(
            backoffs=[{k: e[k] for k in ("kind", "failed_micro_batch_size", "micro_batch_size",
                                          "allocation")} for e in backoff.backoffs],
            iterations=int(model.optimizer.iterations.numpy()),
            loss=history.history["loss"],
            finite=all(bool(np.isfinite(w).all()) for w in model.get_weights()),
            weights_on=model.weights[0].value.device,  # a Keras 3 variable's tf.Variable
        )))
    """, timeout=300)
    result = last_json(output)
    events = result["backoffs"]
    assert events, "no out-of-memory error under a 1 GiB limit: the model no longer exceeds it"
    assert events[0]["failed_micro_batch_size"] == 32768
    assert all(e["kind"] == "train" for e in events)
    # The error came from the GPU's allocator, not from the host.
    assert all("GPU:0" in e["allocation"] for e in events), events
    assert events[-1]["micro_batch_size"] >= 2048
    # Both batches updated the weights once each; nothing was lost or repeated.
    assert result["iterations"] == 2
    assert result["finite"] and all(loss == loss for loss in result["loss"])
    assert "GPU:0" in result["weights_on"]


def test_configure_devices_sets_cuda_malloc_async_before_tensorflow_starts():
    output = run_python("""
        import json, os
        import tensorflow as tf
        import keras_memopt as kmo

        before = os.environ.get("TF_GPU_ALLOCATOR")
        kmo.configure_devices(allocator="cuda_malloc_async")
        after = os.environ.get("TF_GPU_ALLOCATOR")
        with tf.device("GPU:0"):
            x = tf.random.normal([2048, 2048])
            total = float(tf.reduce_sum(x @ x))  # TensorFlow creates its GPU allocator here
        info = tf.config.experimental.get_memory_info("GPU:0")
        try:
            kmo.configure_devices(allocator="bfc")
            refused = False
        except RuntimeError:
            refused = True
        print(json.dumps(dict(before=before, after=after, device=x.device, current=info["current"],
                              refused=refused, total=total)))
    """, env=_LOGGED, timeout=180)
    result = last_json(output)
    assert result["before"] is None and result["after"] == "cuda_malloc_async"
    # TensorFlow says which allocator it created (gpu_process_state.cc, an INFO line).
    assert "Using CUDA malloc Async allocator for GPU: 0" in output.stderr, output.tail(2000)
    assert "GPU:0" in result["device"]
    assert result["current"] >= 2048 * 2048 * 4  # x is held: the async allocator counts it
    # Once TensorFlow runs, the allocator cannot change: configure_devices says so.
    assert result["refused"]


def test_the_default_allocator_is_bfc_when_configure_devices_says_bfc():
    output = run_python("""
        import json, os
        import tensorflow as tf
        import keras_memopt as kmo

        kmo.configure_devices(allocator="bfc")
        with tf.device("GPU:0"):
            x = tf.ones([1024])
        print(json.dumps(dict(allocator=os.environ.get("TF_GPU_ALLOCATOR"), device=x.device)))
    """, env={**_LOGGED, "TF_GPU_ALLOCATOR": "cuda_malloc_async"}, timeout=180)
    result = last_json(output)
    assert result["allocator"] is None and "GPU:0" in result["device"]
    assert "CUDA malloc Async" not in output.stderr


def test_nvml_figures_beside_tensorflows():
    # With memory growth TensorFlow takes GPU memory as it needs it, so NVML's "used" grows by
    # what TensorFlow's allocator holds (rounded up to its regions), plus the CUDA context.
    # NVML's device 0 is TensorFlow's GPU:0 on a machine with one GPU (the check's H200).
    output = run_python("""
        import json
        import tensorflow as tf
        import keras_memopt as kmo

        assert kmo.configure_devices(memory_growth=True), "no GPU configured"
        reader = kmo.MemoryReader(devices=["GPU:0"])
        with tf.device("GPU:0"):
            tf.ones([16]).numpy()  # the CUDA context and TensorFlow's pool exist from here
        before = reader.read()
        with tf.device("GPU:0"):
            held = tf.ones([256, 2**20])  # 1 GiB
            float(held[0, 0])  # waits for it
        after = reader.read()
        print(json.dumps(dict(before=before, after=after, unavailable=reader.unavailable,
                              total=kmo.memory.device_total("GPU:0"))))
    """, timeout=180)
    result = last_json(output)
    before, after = result["before"], result["after"]
    assert not result["unavailable"], result["unavailable"]
    assert after["memory_gpu0_current_mib"] - before["memory_gpu0_current_mib"] >= 1024
    # NVML sees the same gigabyte arrive, and at least all that TensorFlow holds.
    assert after["memory_nvml0_used_mib"] - before["memory_nvml0_used_mib"] >= 1024
    assert after["memory_nvml0_used_mib"] >= after["memory_gpu0_current_mib"]
    assert after["memory_nvml0_total_mib"] >= after["memory_nvml0_used_mib"]
    assert result["total"] == pytest.approx(after["memory_nvml0_total_mib"] * 2**20, rel=1e-6)


def test_two_logical_devices_each_hold_to_their_limit():
    output = run_python("""
        import json
        import tensorflow as tf
        import keras_memopt as kmo

        kmo.configure_devices(memory_limit="2GiB", logical_devices=2, gpus=[0])
        names = [d.name for d in tf.config.list_logical_devices("GPU")]
        totals = [kmo.memory.device_total(n) for n in names]
        with tf.device(names[1]):
            fits = tf.ones([256, 2**20])  # 1 GiB on the second part
            float(fits[0, 0])
        try:
            with tf.device(names[1]):
                float(tf.ones([768, 2**20])[0, 0])  # 3 GiB, more than its 2
            error = None
        except tf.errors.ResourceExhaustedError as exhausted:
            error = str(exhausted)[:300]
        print(json.dumps(dict(names=names, totals=totals, device=fits.device, error=error)))
    """, timeout=180)
    result = last_json(output)
    assert len(result["names"]) >= 2
    assert result["totals"][:2] == [2 * 2**30, 2 * 2**30]
    assert result["device"].endswith("GPU:1")
    assert result["error"] is not None, "3 GiB fit on a logical device limited to 2 GiB"
    assert "GPU:1" in result["error"] or "GPU_1" in result["error"], result["error"]


def test_the_gpu_check_runs_its_gpu_parts(tmp_path):
    # The small mode on a GPU: every part runs (none skipped), within its limits.
    import pathlib

    from keras_memopt import _subprocess

    script = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
    path = tmp_path / "gpu_check.json"
    output = _subprocess.run([str(script), "--small", "--json", str(path)], timeout=480)
    assert output.returncode == 0, output.tail()
    rows = json.loads(path.read_text())["rows"]
    failed = [(r["part"], r["config"], r["status"]) for r in rows if r["status"] != "ok"]
    assert not failed, failed
