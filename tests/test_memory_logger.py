import csv
import os
import warnings

import numpy as np
import pytest
import tensorflow as tf
from conftest import without_gpu

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

    @without_gpu
    def test_unavailable_figure_is_said_once(self, keras_module):
        logger = MemoryLogger(devices=["GPU:0"])
        x, y = _data()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _model(keras_module).fit(x, y, batch_size=32, epochs=3, verbose=0,
                                     callbacks=[logger])
        said = [w for w in caught if "no memory figures for GPU:0" in str(w.message)]
        assert len(said) == 1

    def test_plot_draws_each_series(self, keras_module, tmp_path):
        import matplotlib.image

        plot = tmp_path / "memory.png"
        logger = MemoryLogger(plot=str(plot), every_n_batches=1, devices=["CPU:0"])
        _fit(_model(keras_module), [logger])
        image = matplotlib.image.imread(str(plot))
        assert image.shape == (450, 800, 4)  # 8 x 4.5 inches at 100 dpi
        pixels = (image[..., :3] * 255).round().astype(int).reshape(-1, 3)
        # One line per series in matplotlib's colour cycle: the CPU's peak
        # (C0, #1f77b4) and the host RSS (C1, #ff7f0e), each a polyline
        # across the plot, hundreds of pixels long.
        for colour in ((0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)):
            assert np.sum(np.all(np.abs(pixels - colour) <= 8, axis=1)) > 300, colour
        # Nothing else is plotted: no third colour of the cycle (C2, #2ca02c).
        assert not np.any(np.all(np.abs(pixels - (0x2C, 0xA0, 0x2C)) <= 8, axis=1))
        assert len(logger.rows) == 8 and {"memory_cpu0_peak_mib", "memory_host_rss_mib"} <= set(
            logger.rows[0]
        )

    def test_tensorboard_scalars_are_the_rows(self, keras_module, tmp_path):
        board = tmp_path / "board"
        logger = MemoryLogger(tensorboard_dir=str(board), every_n_batches=2, devices=["CPU:0"])
        _fit(_model(keras_module), [logger])
        (events,) = [board / name for name in os.listdir(board)]
        points = {}
        for event in tf.compat.v1.train.summary_iterator(str(events)):
            for value in event.summary.value:
                assert value.metadata.plugin_data.plugin_name == "scalars"
                points.setdefault(value.tag, []).append(
                    (event.step, float(tf.make_ndarray(value.tensor)))
                )
        expected = [(row["step"], row["memory_cpu0_peak_mib"]) for row in logger.rows]
        assert [step for step, _ in points["memory_cpu0_peak_mib"]] == [2, 4, 6, 8]
        np.testing.assert_allclose(points["memory_cpu0_peak_mib"], expected, rtol=1e-6)
        assert set(points) == set(logger.rows[0]) - {"epoch", "batch", "step"}


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

    def test_a_failed_fit_lets_go_of_its_files(self, keras_module, tmp_path):
        path = tmp_path / "memory.csv"

        class Fails(keras_module.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                raise RuntimeError("the run broke")

        model = _model(keras_module)
        with pytest.raises(RuntimeError, match="the run broke"):
            _fit(model, [MemoryLogger(str(path)), Fails()])
        # Keras called no on_train_end; another logger may now take the file.
        _fit(model, [MemoryLogger(str(path), overwrite=True)], epochs=1)
        assert len(path.read_text().splitlines()) == 1 + 1
        # Two loggers in one fit are still refused.
        with pytest.raises(FileExistsError, match="Another MemoryLogger"):
            _fit(model, [MemoryLogger(str(path), overwrite=True),
                         MemoryLogger(str(path), overwrite=True)])

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
