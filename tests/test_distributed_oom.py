"""Out of memory in the collective part of a step, with two real local workers.

Under MultiWorkerMirroredStrategy a step runs in two parts: each worker's own
(the micro-batch loop) and the collective one (the gradients' all-reduce and
the optimizer update). Worker 1 alone runs out of memory in its update, two
ways: where its measured need is not free (refused before the workers agree:
none of them starts the collective part), and inside the update itself, after
the all-reduce, at a micro-batch size whose update was not measured yet. Both
workers must stop together, neither waiting for the other, with every weight
and optimizer variable as before the step; then train on alike.
"""

import json
import textwrap

import numpy as np
import pytest
from _helpers import SAME_COMPUTATION
from conftest import KERAS_LINE
from test_distribution import _free_ports

from keras_memopt import _subprocess

pytestmark = pytest.mark.slow

WORKER = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import tensorflow as tf
    import keras_memopt as kmo
    from keras_memopt._keras import keras

    folder = sys.argv[1]
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    MIB = 2**20
    LIMIT = int(os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"]) * MIB
    EXTRA = dict(mib=0)  # what worker 1's update allocates after each variable's


    def extra_words():
        return np.int32(EXTRA["mib"] * MIB // 4 if index == 1 else 0)


    def sgd_that_allocates():
        class SGDThatAllocates(keras.optimizers.SGD):
            def update_step(self, gradient, variable, *args):
                result = super().update_step(gradient, variable, *args)
                with tf.control_dependencies([result] if result is not None else []):
                    words = tf.py_function(extra_words, [], tf.int32)
                    block = tf.random.stateless_uniform(tf.reshape(words, [1]), [0, 0])
                variable.assign_add(tf.fill(tf.shape(variable), 0.0 * tf.reduce_sum(block)))
                return result

        return SGDThatAllocates(0.1)


    rng = np.random.RandomState(0)
    x = rng.normal(size=(256, 64)).astype("float32")
    y = rng.randint(0, 4, 256)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(64).with_options(options)
    with strategy.scope():
        optimizer = sgd_that_allocates()
        keras.utils.set_random_seed(0)
        inputs = keras.Input((64,))
        hidden = keras.layers.Dense(512, activation="tanh")(inputs)
        model = kmo.AccumulatingModel(inputs, keras.layers.Dense(4)(hidden), micro_batch_size=16)
        model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))


    def state():
        return [np.array(v) for v in model.variables + list(model.optimizer.variables)]


    def fit(steps=None):
        backoff = kmo.callbacks.OOMBackoff(verbose=0)
        try:
            model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[backoff])
            return dict(error=None)
        except tf.errors.OpError as error:
            return dict(error=type(error).__name__, message=error.message.splitlines()[0],
                        backoffs=len(backoff.backoffs))


    def in_use():
        return tf.config.experimental.get_memory_info("CPU:0")["current"]


    out = {}
    EXTRA["mib"] = 16  # worker 1's update needs 16 MiB more than its loop
    out["first"] = fit()  # the update's need at micro-batch 16 is measured
    before = state()

    # 1. The update's measured need is not free on worker 1: refused before agreeing.
    # One step on both (without OOMBackoff, the update allocating nothing more):
    # worker 1 reads its peak, then fills the device but what the loop needs.
    EXTRA["mib"] = 0
    tf.config.experimental.reset_memory_stats("CPU:0")
    step_start = in_use()
    model.train_on_batch(x[:64], y[:64])
    EXTRA["mib"] = 16
    held = []
    if index == 1:
        step = tf.config.experimental.get_memory_info("CPU:0")["peak"] - step_start
        left = LIMIT - in_use() - (step + 4 * MIB)  # the loop fits, the update does not
        held = [tf.fill([min(MIB, left - at) // 4], 1.0) for at in range(0, left, MIB)]
    before = state()
    out["check"] = fit()
    out["check_changed"] = [i for i, (a, b) in enumerate(zip(before, state())) if
                            not np.array_equal(a, b)]
    del held

    # 2. Out of memory inside worker 1's update, after the all-reduce, at micro-batch 32
    # (its update not measured yet: both keep the weights and slots in host memory).
    model.micro_batch_size = 32
    EXTRA["mib"] = 1024
    out["collective"] = fit()
    out["collective_changed"] = [i for i, (a, b) in enumerate(zip(before, state())) if
                                 not np.array_equal(a, b)]

    # 3. Both train on alike.
    EXTRA["mib"] = 16
    out["after"] = fit()
    out["iterations"] = int(model.optimizer.iterations.numpy())
    np.savez(os.path.join(folder, f"weights{index}.npz"), *model.get_weights())
    with open(os.path.join(folder, f"worker{index}.json"), "w") as handle:
        json.dump(out, handle)
    """
)


def test_an_out_of_memory_error_in_the_collective_part_stops_both_workers_unchanged(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in _free_ports(2)]}
    children = []
    for index in (0, 1):
        config = {"cluster": cluster, "task": {"type": "worker", "index": index}}
        env = {**_subprocess.tensorflow_env(64), **KERAS_LINE, "TF_CONFIG": json.dumps(config)}
        children.append(_subprocess.start([str(script), str(tmp_path)], env=env,
                                          name=f"worker {index}"))
    for child, output in zip(children, _subprocess.wait_all(children, timeout=300), strict=True):
        assert output.returncode == 0, f"{child.name}:\n{output.tail()}"
    first, second = (json.loads((tmp_path / f"worker{i}.json").read_text()) for i in (0, 1))
    for worker in (first, second):
        assert worker["first"]["error"] is None and worker["after"]["error"] is None, worker
        # Nothing changed on either worker, by either failure.
        assert worker["check_changed"] == [] and worker["collective_changed"] == [], worker
        assert worker["iterations"] == 4 + 1 + 4, worker  # first fit, one step, last fit
    # Refused before agreeing: worker 1 reports, worker 0 learns that it stopped.
    assert second["check"]["error"] == "ResourceExhaustedError", second
    assert second["check"]["message"].startswith(
        "Out of memory in the optimizer update (micro_batch_size=16)"), second
    assert first["check"]["error"] == "AbortedError", first
    assert "every worker stops here, with the model as it was before the step" in (
        first["check"]["message"]), first
    # Inside the update, after the all-reduce: both put it back and report.
    for worker in (first, second):
        assert worker["collective"]["error"] == "ResourceExhaustedError", worker
        assert worker["collective"]["message"].startswith(
            "Out of memory in the optimizer update (micro_batch_size=32)"), worker
        assert worker["collective"]["backoffs"] == 0, worker
    with np.load(tmp_path / "weights0.npz") as a, np.load(tmp_path / "weights1.npz") as b:
        for name in a.files:
            np.testing.assert_allclose(a[name], b[name], **SAME_COMPUTATION, err_msg=name)
