import csv
import os
import sys
import warnings

import numpy as np
import pytest
import tensorflow as tf
from _helpers import IDENTICAL, assert_same_weights
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

    def test_plot_puts_the_host_rss_on_a_panel_of_its_own(self, keras_module, tmp_path):
        import matplotlib.image

        from keras_memopt._memory.plot import memory_figure

        plot = tmp_path / "memory.png"
        logger = MemoryLogger(plot=str(plot), every_n_batches=1, devices=["CPU:0"])
        _fit(_model(keras_module), [logger])
        assert matplotlib.image.imread(str(plot)).shape == (600, 800, 4)  # 8 x 6 in, 100 dpi
        assert len(logger.rows) == 8
        device, host = memory_figure(logger.rows).get_axes()
        assert [line.get_label() for line in device.get_lines()] == ["cpu0 peak"]
        assert [line.get_label() for line in host.get_lines()] == ["host rss"]
        # Each panel is scaled to its own series: the device's curve is not
        # pressed flat under the host's hundreds of MiB.
        peaks = [row["memory_cpu0_peak_mib"] for row in logger.rows]
        rss = [row["memory_host_rss_mib"] for row in logger.rows]
        assert max(rss) > 10 * max(peaks)
        assert device.get_ylim()[1] < 2 * max(peaks) and host.get_ylim()[0] > max(peaks)
        np.testing.assert_allclose(device.get_lines()[0].get_ydata(), peaks, rtol=0)
        assert list(device.get_lines()[0].get_xdata()) == list(range(1, 9))

    def test_plot_without_device_figures_has_the_host_panel_only(self):
        from keras_memopt._memory.plot import memory_figure

        rows = [{"step": step, "memory_host_rss_mib": 400.0 + step} for step in (1, 2)]
        (host,) = memory_figure(rows).get_axes()
        assert [line.get_label() for line in host.get_lines()] == ["host rss"]

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
    def test_a_second_fit_replaces_the_file_as_csvlogger_does(self, keras_module, tmp_path):
        path = tmp_path / "memory.csv"
        _fit(_model(keras_module), [MemoryLogger(str(path))], epochs=2)
        _fit(_model(keras_module), [MemoryLogger(str(path))], epochs=1)
        with open(path) as handle:
            rows = list(csv.DictReader(handle))
        assert [row["epoch"] for row in rows] == ["0"]  # the second run only

    def test_append_adds_to_the_file(self, keras_module, tmp_path):
        path = tmp_path / "memory.csv"
        _fit(_model(keras_module), [MemoryLogger(str(path))], epochs=1)
        _fit(_model(keras_module), [MemoryLogger(str(path), append=True)], epochs=2)
        with open(path) as handle:
            assert [row["epoch"] for row in csv.DictReader(handle)] == ["0", "0", "1"]

    def test_a_reused_logger_starts_its_file_anew_each_fit(self, keras_module, tmp_path):
        path = tmp_path / "memory.csv"
        logger = MemoryLogger(str(path))
        model = _model(keras_module)
        _fit(model, [logger], epochs=2)
        _fit(model, [logger], epochs=1)
        assert len(path.read_text().splitlines()) == 1 + 1
        assert len(logger.rows) == 1

    def test_an_existing_plot_is_replaced(self, keras_module, tmp_path):
        path = tmp_path / "memory.png"
        path.write_bytes(b"old")
        _fit(_model(keras_module), [MemoryLogger(plot=str(path))], epochs=1)
        assert path.read_bytes().startswith(b"\x89PNG")

    @pytest.mark.parametrize("argument", ["filename", "plot"])
    def test_a_missing_folder_fails_before_the_first_update(
        self, keras_module, tmp_path, argument
    ):
        path = str(tmp_path / "no_such_folder" / "memory.out")
        model = _model(keras_module)
        before = [w.copy() for w in model.get_weights()]
        with pytest.raises(ValueError, match=rf"folder that exists.*Received: {argument}="):
            _fit(model, [MemoryLogger(**{argument: path})])
        assert int(model.optimizer.iterations.numpy()) == 0
        assert_same_weights(before, model, IDENTICAL)
        assert not (tmp_path / "no_such_folder").exists()

    def test_a_folder_is_not_a_file(self, keras_module, tmp_path):
        with pytest.raises(ValueError, match="is a folder.*Received: filename="):
            _fit(_model(keras_module), [MemoryLogger(str(tmp_path))])

    def test_two_loggers_cannot_share_a_file(self, keras_module, tmp_path):
        path = tmp_path / "memory.csv"
        path.write_text("precious\n")
        with pytest.raises(FileExistsError, match="Another MemoryLogger"):
            _fit(_model(keras_module), [MemoryLogger(str(path)), MemoryLogger(str(path))])
        # The first logger replaced the file it held; the second wrote nothing.
        assert path.read_text() == ""

    def test_a_failed_fit_lets_go_of_its_files(self, keras_module, tmp_path):
        path = tmp_path / "memory.csv"

        class Fails(keras_module.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                raise RuntimeError("the run broke")

        model = _model(keras_module)
        with pytest.raises(RuntimeError, match="the run broke"):
            _fit(model, [MemoryLogger(str(path)), Fails()])
        # Keras called no on_train_end; another logger may now take the file.
        _fit(model, [MemoryLogger(str(path))], epochs=1)
        assert len(path.read_text().splitlines()) == 1 + 1
        # Two loggers in one fit are still refused.
        with pytest.raises(FileExistsError, match="Another MemoryLogger"):
            _fit(model, [MemoryLogger(str(path)), MemoryLogger(str(path))])

    def test_bad_arguments(self, tmp_path):
        with pytest.raises(ValueError, match="Received: every_n_batches=0"):
            MemoryLogger(every_n_batches=0)
        with pytest.raises(ValueError, match="must be two files"):
            MemoryLogger(str(tmp_path / "m"), plot=str(tmp_path / "m"))
        with pytest.raises(ValueError, match="Received: filename=3"):
            MemoryLogger(3)


class TestWithoutExtras:
    def test_plot_without_matplotlib_names_the_extra(self, monkeypatch):
        monkeypatch.setitem(sys.modules, "matplotlib", None)
        with pytest.raises(ImportError, match=r'pip install "keras_memopt\[plot\]"'):
            MemoryLogger(plot="memory.png")

    @without_gpu
    def test_no_nvml_warning_on_a_machine_without_gpus(self, keras_module):
        x, y = _data()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _model(keras_module).fit(x, y, batch_size=32, epochs=1, verbose=0,
                                     callbacks=[MemoryLogger(devices=["CPU:0"])])
        assert not [w for w in caught if "MemoryLogger" in str(w.message)]
