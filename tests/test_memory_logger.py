import csv
import os
import warnings

import numpy as np
import pytest

from keras_memopt import AccumulatingModel
from keras_memopt.callbacks import MemoryLogger


def _model(keras):
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(256, activation="relu")(inputs)
    model = AccumulatingModel(inputs, keras.layers.Dense(2)(hidden), micro_batch_size=16)
    model.compile(optimizer="adam", loss="mse")
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.random((128, 16), dtype=np.float32), rng.random((128, 2), dtype=np.float32)


def _fit(model, callbacks, epochs=2):
    x, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, callbacks=callbacks)


class TestLogs:
    def test_epoch_figures_reach_history_and_csvlogger(self, keras_module, tmp_path):
        model = _model(keras_module)
        csv_path = tmp_path / "keras.csv"
        history = _fit(model, [MemoryLogger(devices=["CPU:0"]),
                               keras_module.callbacks.CSVLogger(str(csv_path))])
        peaks = history.history["memory_cpu0_peak_mib"]
        assert len(peaks) == 2
        # Parameters, Adam slots and gradients of (16*256+256+256*2+2) floats are in use.
        params_mib = (16 * 256 + 256 + 256 * 2 + 2) * 4 / 2**20
        assert min(peaks) >= 3 * params_mib
        assert "memory_host_rss_mib" in history.history
        with open(csv_path) as handle:
            rows = list(csv.DictReader(handle))
        np.testing.assert_allclose(
            [float(r["memory_cpu0_peak_mib"]) for r in rows], peaks, rtol=1e-6
        )

    def test_every_n_batches_writes_own_csv_rows(self, keras_module, tmp_path):
        path = tmp_path / "memory.csv"
        logger = MemoryLogger(str(path), every_n_batches=2, devices=["CPU:0", "CPU:1"])
        _fit(_model(keras_module), [logger])
        with open(path) as handle:
            rows = list(csv.DictReader(handle))
        assert len(rows) == 4  # 4 batches per epoch, every 2nd, 2 epochs
        assert [int(r["step"]) for r in rows] == [2, 4, 6, 8]
        assert {"memory_cpu0_peak_mib", "memory_cpu1_peak_mib"} <= set(rows[0])

    def test_unavailable_figure_is_said_once(self, keras_module):
        logger = MemoryLogger(devices=["GPU:0"])
        x, y = _data()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _model(keras_module).fit(x, y, batch_size=32, epochs=3, verbose=0,
                                     callbacks=[logger])
        said = [w for w in caught if "no memory figures for GPU:0" in str(w.message)]
        assert len(said) == 1

    def test_plot_and_tensorboard_files(self, keras_module, tmp_path):
        plot, board = tmp_path / "memory.png", tmp_path / "board"
        _fit(_model(keras_module), [MemoryLogger(plot=str(plot), tensorboard_dir=str(board),
                                                 every_n_batches=1)])
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert any(name.startswith("events.out.tfevents") for name in os.listdir(board))


class TestFileSafety:
    def test_existing_file_is_not_overwritten(self, keras_module, tmp_path):
        path = tmp_path / "memory.csv"
        path.write_text("precious\n")
        with pytest.raises(FileExistsError, match="already exists"):
            _fit(_model(keras_module), [MemoryLogger(str(path))])
        assert path.read_text() == "precious\n"

    def test_existing_plot_is_not_overwritten(self, keras_module, tmp_path):
        path = tmp_path / "memory.png"
        path.write_bytes(b"old")
        with pytest.raises(FileExistsError, match="overwrite=True"):
            _fit(_model(keras_module), [MemoryLogger(plot=str(path))])
        assert path.read_bytes() == b"old"

    def test_append_and_overwrite(self, keras_module, tmp_path):
        path = tmp_path / "memory.csv"
        _fit(_model(keras_module), [MemoryLogger(str(path))], epochs=1)
        _fit(_model(keras_module), [MemoryLogger(str(path), append=True)], epochs=2)
        assert len(path.read_text().splitlines()) == 1 + 1 + 2
        _fit(_model(keras_module), [MemoryLogger(str(path), overwrite=True)], epochs=1)
        assert len(path.read_text().splitlines()) == 1 + 1

    def test_two_loggers_cannot_share_a_file(self, keras_module, tmp_path):
        path = str(tmp_path / "memory.csv")
        with pytest.raises(FileExistsError, match="Another MemoryLogger"):
            _fit(_model(keras_module), [MemoryLogger(path), MemoryLogger(path, overwrite=True)])

    def test_reused_logger_continues_its_own_file(self, keras_module, tmp_path):
        path = tmp_path / "memory.csv"
        logger = MemoryLogger(str(path))
        model = _model(keras_module)
        _fit(model, [logger], epochs=1)
        _fit(model, [logger], epochs=2)
        assert len(path.read_text().splitlines()) == 1 + 3

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match="Received: every_n_batches=0"):
            MemoryLogger(every_n_batches=0)
        with pytest.raises(ValueError, match="at most one of `append` and `overwrite`"):
            MemoryLogger("m.csv", append=True, overwrite=True)
