"""keras_memopt.callbacks.BackupAndRestore: resumed training ends as if never stopped."""

import numpy as np
import pytest
from conftest import LEGACY

from keras_memopt import AccumulatingModel
from keras_memopt._keras import keras
from keras_memopt.callbacks import BackupAndRestore


class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("interrupted")


def _model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    if LEGACY:
        hidden = keras.layers.Dropout(0.3, seed=1, rng_type="stateless")(hidden)
    else:
        hidden = keras.layers.Dropout(0.3, seed=1)(hidden)
    hidden = keras.layers.BatchNormalization()(hidden)
    model = AccumulatingModel(inputs, keras.layers.Dense(3)(hidden), micro_batch_size=8)
    model.compile(keras.optimizers.Adam(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize(
    "save_freq",
    [
        "epoch",
        pytest.param(
            2,
            marks=pytest.mark.skipif(
                not LEGACY,
                reason="Keras 3 resumes a backup taken inside an epoch from that epoch's "
                "start (it keeps no batch position), so only epoch backups resume exactly",
            ),
        ),
    ],
)
def test_resumed_training_ends_with_the_weights_of_training_never_stopped(tmp_path, save_freq):
    rng = np.random.RandomState(0)
    x, y = rng.normal(size=(64, 6)).astype("float32"), rng.randint(0, 3, 64)
    fit = dict(batch_size=16, epochs=4, shuffle=False, verbose=0)
    uninterrupted = _model()
    uninterrupted.fit(x, y, **fit)

    backup = BackupAndRestore(str(tmp_path / "backup"), save_freq=save_freq)
    model = _model()
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(x, y, callbacks=[backup, Interrupt()], **fit)
    resumed = _model()  # a new process would build the model anew
    resumed.fit(x, y, callbacks=[BackupAndRestore(str(tmp_path / "backup"), save_freq=save_freq)],
                **fit)
    for a, b in zip(uninterrupted.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
    if not LEGACY:  # tf_keras keeps the (emptied) directory
        assert not (tmp_path / "backup").exists()  # removed once training ended
