"""Registers the markers that Keras's own test modules use (see Keras's conftest.py)."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "requires_trainable_backend: Keras's marker; TensorFlow trains"
    )
    config.addinivalue_line("markers", "multi_device: Keras's marker for multi-device tests")
