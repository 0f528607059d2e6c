"""keras_memopt.callbacks.BackupAndRestore: resumed training ends as if never stopped."""

import pytest
from _helpers import (
    SAME_COMPUTATION,
    assert_same_weights,
    classification_data,
    compile_classifier,
)
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
    return compile_classifier(model)


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
    x, y = classification_data(64)
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
    assert_same_weights(resumed, uninterrupted, SAME_COMPUTATION)
    if not LEGACY:  # tf_keras keeps the (emptied) directory
        assert not (tmp_path / "backup").exists()  # removed once training ended


class _InterruptMidEpoch(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.epoch == 2 and batch == 2:
            raise RuntimeError("interrupted")


class _BatchesSeen(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.seen = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.seen.append((self.epoch, int(batch)))


def test_an_integer_save_freq_resumes_as_the_keras_line_does(tmp_path):
    """Keras 3 replays the interrupted epoch from its first batch; tf_keras does not."""
    x, y = classification_data(64)
    fit = dict(batch_size=16, epochs=4, shuffle=False, verbose=0)  # 4 batches an epoch
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _model().fit(x, y, callbacks=[BackupAndRestore(backup, save_freq=1), _InterruptMidEpoch()],
                     **fit)
    seen = _BatchesSeen()
    resumed = _model()
    resumed.fit(x, y, callbacks=[BackupAndRestore(backup, save_freq=1), seen], **fit)
    # The backup was taken after batch 1 of epoch 2 (10 updates).
    first = 0 if not LEGACY else 2
    assert seen.seen[0] == (2, first)
    assert len(seen.seen) == 8 - first
    # 16 updates uninterrupted; Keras 3 trains batches 0 and 1 of epoch 2 twice.
    assert int(resumed.optimizer.iterations.numpy()) == (18 if not LEGACY else 16)
