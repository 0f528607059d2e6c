"""Several machines: real MultiWorkerMirroredStrategy with two local workers on 127.0.0.1.

The tests share one cluster, started once for the module: two worker processes
(`TF_CONFIG` on free ports) and one process alone (the reference: the same
global batch on one worker). The workers run three checks, the process alone
the last two: out of memory in the collective part of a step first (worker 1's
update, under its memory limit, while the device is as a fresh process has it),
then out of memory in the micro-batch loop of worker 1, then a fit that is
interrupted and resumed. Each test compares what each worker reports with the
other worker or with the process alone.
"""

import json
import socket
import textwrap

import numpy as np
import pytest
from _helpers import FLOAT32, SAME_COMPUTATION
from conftest import KERAS_LINE, LEGACY

from keras_memopt import _subprocess

pytestmark = pytest.mark.slow

WORKER = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import tensorflow as tf
    import keras_memopt as kmo
    from keras_memopt._keras import keras

    folder, micro = sys.argv[1], int(sys.argv[2])
    index = json.loads(os.environ.get("TF_CONFIG", '{"task": {"index": 0}}'))["task"]["index"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rng = np.random.RandomState(0)

    def dataset(*parts, batch):
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.DATA)
        return tf.data.Dataset.from_tensor_slices(parts).batch(batch).with_options(options)

    def build(layers, micro, optimizer, metrics=("accuracy",)):
        with strategy.scope():  # the optimizer too: it keeps the strategy it is made under
            optimizer = optimizer()
            keras.utils.set_random_seed(0)
            inputs = keras.Input((layers[0],))
            hidden = inputs
            for units in layers[1:-1]:
                hidden = keras.layers.Dense(units, activation="tanh")(hidden)
            outputs = keras.layers.Dense(layers[-1])(hidden)
            model = kmo.AccumulatingModel(inputs, outputs, micro_batch_size=micro)
            model.compile(optimizer,
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=list(metrics))
        return model

    class StepLogs(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.rows = []

        def on_train_batch_end(self, batch, logs=None):
            self.rows.append([float(logs["loss"]), float(logs["accuracy"])])

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("interrupted")

    def fit(out):
        x = rng.normal(size=(64, 6)).astype("float32")
        y = rng.randint(0, 3, 64)
        model = build([6, 8, 3], 3, lambda: keras.optimizers.Adam(0.01))
        backup = kmo.callbacks.BackupAndRestore(os.path.join(folder, "backup"))
        checkpoint = keras.callbacks.ModelCheckpoint(
            os.path.join(folder, "checkpoints", "e{epoch}.weights.h5"), save_weights_only=True)
        steps = StepLogs()
        callbacks = [backup, checkpoint, steps, kmo.callbacks.OOMBackoff(verbose=0)]
        try:  # interrupted at epoch 2, resumed from the backup
            model.fit(dataset(x, y, batch=16), epochs=4, verbose=0,
                      callbacks=callbacks + [Interrupt()])
        except RuntimeError:
            pass
        history = model.fit(dataset(x, y, batch=16), epochs=4, verbose=0, callbacks=callbacks)
        evaluated = model.evaluate(dataset(x, y, batch=16), verbose=0, return_dict=True)
        out.update(
            steps=np.array(steps.rows),
            epochs=np.array([history.history[k] for k in ("loss", "accuracy")]),
            evaluate=np.array([evaluated[k] for k in ("loss", "accuracy")]),
            predict=np.asarray(model.predict(dataset(x, batch=13), verbose=0)),
            backup_left=os.path.exists(os.path.join(folder, "backup")),
        )
        return model

    def oom(out, micro):  # worker 1 runs under a memory limit the first micro-batch exceeds
        x = rng.normal(size=(4096, 64)).astype("float32")
        y = rng.randint(0, 4, 4096)
        model = build([64, 2048, 64, 2048, 4], micro, lambda: keras.optimizers.SGD(0.1))
        backoff = kmo.callbacks.OOMBackoff(factor=0.25, verbose=0)
        model.fit(dataset(x, y, batch=4096), epochs=2, verbose=0, callbacks=[backoff])
        out["backoffs"] = np.array([b["micro_batch_size"] for b in backoff.backoffs])
        out["iterations"] = int(model.optimizer.iterations.numpy())
        return model

    def save(out, model, name):
        for i, weight in enumerate(model.get_weights()):
            out[f"w{i}"] = weight
        np.savez(os.path.join(folder, f"{name}{index}.npz"), **out)

    def collective():  # worker 1's update runs out of memory, two ways (the workers only)
        MIB = 2**20
        LIMIT = int(os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"]) * MIB
        EXTRA = dict(mib=0)  # what worker 1's update allocates after each variable's

        def extra_words():
            return np.int32(EXTRA["mib"] * MIB // 4 if index == 1 else 0)

        class SGDThatAllocates(keras.optimizers.SGD):
            def update_step(self, gradient, variable, *args):
                result = super().update_step(gradient, variable, *args)
                with tf.control_dependencies([result] if result is not None else []):
                    words = tf.py_function(extra_words, [], tf.int32)
                    block = tf.random.stateless_uniform(tf.reshape(words, [1]), [0, 0])
                variable.assign_add(tf.fill(tf.shape(variable), 0.0 * tf.reduce_sum(block)))
                return result

        own = np.random.RandomState(0)
        x = own.normal(size=(256, 64)).astype("float32")
        y = own.randint(0, 4, 256)
        model = build([64, 512, 4], 16, lambda: SGDThatAllocates(0.1), metrics=())

        def state():
            return [np.array(v) for v in model.variables + list(model.optimizer.variables)]

        def attempt():
            backoff = kmo.callbacks.OOMBackoff(verbose=0)
            try:
                model.fit(dataset(x, y, batch=64), epochs=1, verbose=0, callbacks=[backoff])
                return dict(error=None)
            except tf.errors.OpError as error:
                return dict(error=type(error).__name__, message=error.message.splitlines()[0],
                            backoffs=len(backoff.backoffs))

        def in_use():
            return tf.config.experimental.get_memory_info("CPU:0")["current"]

        out = {}
        EXTRA["mib"] = 16  # worker 1's update needs 16 MiB more than its loop
        out["first"] = attempt()  # the update's need at micro-batch 16 is measured

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
        out["check"] = attempt()
        out["check_changed"] = [i for i, (a, b) in enumerate(zip(before, state())) if
                                not np.array_equal(a, b)]
        del held

        # 2. Out of memory inside worker 1's update, after the all-reduce, at micro-batch 32
        # (its update not measured yet: both keep the weights and slots in host memory).
        model.micro_batch_size = 32
        EXTRA["mib"] = 1024
        out["collective"] = attempt()
        out["collective_changed"] = [i for i, (a, b) in enumerate(zip(before, state())) if
                                     not np.array_equal(a, b)]

        # 3. Both train on alike.
        EXTRA["mib"] = 16
        out["after"] = attempt()
        out["iterations"] = int(model.optimizer.iterations.numpy())
        np.savez(os.path.join(folder, f"collective{index}.npz"), *model.get_weights())
        with open(os.path.join(folder, f"collective{index}.json"), "w") as handle:
            json.dump(out, handle)

    # Every check in one cluster (a fresh one costs three TensorFlow starts): the
    # collective one first, on the device as a fresh process has it, then the
    # out-of-memory one, under the limit it was sized for, then the fit.
    if "TF_CONFIG" in os.environ:
        collective()
    out = dict()
    save(out, oom(out, micro), "oom")
    out = dict()
    save(out, fit(out), "fit")
    """
)


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two workers, worker 1 under a memory limit that micro-batches of 2048 exceed, and one
    process alone at 512; the workers run the three checks, the process alone the last two.
    Their folders (cluster, alone)."""
    tmp_path = tmp_path_factory.mktemp("distribution")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    ports = _free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    keras_line = KERAS_LINE
    children = []
    folder = tmp_path / "cluster"
    folder.mkdir()
    for index, limit in enumerate((None, 40)):
        config = {"cluster": cluster, "task": {"type": "worker", "index": index}}
        env = {**_subprocess.tensorflow_env(limit), **keras_line, "TF_CONFIG": json.dumps(config)}
        command = [str(script), str(folder), "2048"]
        children.append(_subprocess.start(command, env=env, name=f"worker {index}"))
    alone = tmp_path / "alone"
    alone.mkdir()
    env = {**_subprocess.tensorflow_env(), **keras_line, "TF_CONFIG": None}
    children.append(_subprocess.start([str(script), str(alone), "512"], env=env,
                                      name="the process alone"))
    for child, output in zip(children, _subprocess.wait_all(children, timeout=300), strict=True):
        assert output.returncode == 0, f"{child.name}:\n{output.tail()}"
    return folder, alone


def _load(cluster, name):
    """What worker 0, worker 1 and the process alone saved of one check."""
    folder, alone = cluster
    return [np.load(folder / f"{name}{i}.npz") for i in (0, 1)] + [np.load(alone / f"{name}0.npz")]


def test_two_workers_train_evaluate_predict_and_resume_as_one_process(cluster):
    """Keras 3 too (its own fit fails under MultiWorkerMirroredStrategy, keras#20585)."""
    first, second, alone = _load(cluster, "fit")
    for worker in (first, second):
        assert sorted(worker.files) == sorted(alone.files)
        for key in alone.files:
            np.testing.assert_allclose(worker[key], alone[key], **FLOAT32, err_msg=key)
    # The backup is removed at the end (tf_keras keeps the emptied directory);
    # the chief wrote the checkpoints.
    assert LEGACY or not first["backup_left"]
    written = sorted(p.name for p in (cluster[0] / "checkpoints").iterdir())
    assert written == [f"e{epoch}.weights.h5" for epoch in (1, 2, 3, 4)]


def test_an_out_of_memory_error_on_one_worker_is_retried_by_both(cluster):
    """Worker 1 alone has a memory limit that micro-batches of 2048 exceed.

    Neither worker hangs: both roll back, retry the same batch at 512 and end
    with the weights of one process that trains at 512 from the start (the
    process alone, beside them).
    """
    first, second, at_512 = _load(cluster, "oom")
    for worker in (first, second):
        assert list(worker["backoffs"]) == [512] and int(worker["iterations"]) == 2
        for key in (k for k in at_512.files if k.startswith("w")):
            np.testing.assert_allclose(worker[key], at_512[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert list(at_512["backoffs"]) == [] and int(at_512["iterations"]) == 2


def test_an_out_of_memory_error_in_the_collective_part_stops_both_workers_unchanged(cluster):
    """Under MultiWorkerMirroredStrategy a step runs in two parts: each worker's own (the
    micro-batch loop) and the collective one (the gradients' all-reduce and the optimizer
    update). Worker 1 alone runs out of memory in its update, two ways: where its measured need
    is not free (refused before the workers agree: none of them starts the collective part),
    and inside the update itself, after the all-reduce, at a micro-batch size whose update was
    not measured yet. Both workers must stop together, neither waiting for the other, with
    every weight and optimizer variable as before the step; then train on alike."""
    folder = cluster[0]
    first, second = (json.loads((folder / f"collective{i}.json").read_text()) for i in (0, 1))
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
    with np.load(folder / "collective0.npz") as a, np.load(folder / "collective1.npz") as b:
        assert len(a.files) == len(b.files) > 0
        for name in a.files:
            np.testing.assert_allclose(a[name], b[name], **SAME_COMPUTATION, err_msg=name)
