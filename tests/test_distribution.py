"""Several machines: real MultiWorkerMirroredStrategy with two local workers."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import LEGACY

WORKER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import tensorflow as tf
    from keras_memopt import AccumulatingModel
    from keras_memopt._keras import keras

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rng = np.random.RandomState(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = rng.randint(0, 3, size=(64,))
    options = tf.data.Options()
    # Each worker takes every other sample: the two halves of a global batch
    # of 16 are the samples of the single-process batch of 16.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).with_options(options)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(16, activation="tanh")(inputs)
        model = AccumulatingModel(inputs, keras.layers.Dense(3)(hidden), micro_batch_size=3)
        model.compile(
            keras.optimizers.Adam(0.01),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    history = model.fit(dataset, epochs=2, verbose=0)
    np.savez(sys.argv[1], *model.get_weights(), loss=history.history["loss"])
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


@pytest.mark.slow
@pytest.mark.skipif(
    not LEGACY,
    reason="Keras 3's own fit() does not run under MultiWorkerMirroredStrategy "
    "(keras-team/keras#20585); tf_keras does",
)
def test_two_workers_match_one_process(tmp_path):
    cluster = {"worker": [f"127.0.0.1:{port}" for port in _free_ports(2)]}
    workers = []
    for index in range(2):
        env = dict(os.environ)
        task = {"type": "worker", "index": index}
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": task})
        workers.append(
            subprocess.Popen(
                [sys.executable, "-c", WORKER, str(tmp_path / f"worker{index}.npz")],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    for worker in workers:
        output, _ = worker.communicate(timeout=300)
        assert worker.returncode == 0, output[-3000:]

    single = tmp_path / "single.npz"
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    subprocess.run(
        [sys.executable, "-c", WORKER, str(single)], env=env, check=True, timeout=300
    )
    expected = np.load(single)
    for index in range(2):
        received = np.load(tmp_path / f"worker{index}.npz")
        assert sorted(received.files) == sorted(expected.files)
        for key in expected.files:
            np.testing.assert_allclose(received[key], expected[key], rtol=1e-5, atol=1e-6)
