"""`OOMBackoff`: survive out-of-memory errors by shrinking the micro-batch."""

from __future__ import annotations

import gc

from keras_memopt import _io, _keras
from keras_memopt._keras import keras
from keras_memopt._oom.backoff import BackoffPolicy


class OOMBackoff(keras.callbacks.Callback):
    """Shrinks the micro-batch and retries the batch when memory runs out.

    Attach it to `fit` (and `evaluate` or `predict`) of a `keras_memopt.AccumulatingModel`. When a
    micro-batch's pass runs out of device memory, the failed step is put back, `micro_batch_size` is
    multiplied by `factor` and the *same* batch runs again: the result of training never changes;
    the smaller micro-batch stays after `fit`. Where a smaller micro-batch cannot help it stops with
    one `ResourceExhaustedError` (on JAX a `JaxRuntimeError`) naming the phase and the bytes held,
    the model as it was before the step. Each backoff prints a line (`verbose`) and goes into
    `backoffs`; each epoch's last micro-batch into `logs` as `"micro_batch_size"`. What is put
    back, costs, XLA, JAX: docs/oom-backoff.md.

    Args:
        factor: float in (0, 1), what the micro-batch is multiplied by at each backoff (rounded
            down, and always at least one sample smaller). Defaults to `0.5`.
        min_micro_batch_size: int, the smallest micro-batch to try. Defaults to `1`.
        verbose: int, 0 for quiet, 1 to print a line per backoff. Defaults to `1`.

    Example:

    ```python
    model = keras_memopt.AccumulatingModel(inputs, outputs, micro_batch_size=256)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    backoff = keras_memopt.callbacks.OOMBackoff(factor=0.5, min_micro_batch_size=8)
    history = model.fit(x, y, batch_size=1024, callbacks=[backoff])
    history.history["micro_batch_size"]  # e.g. [128, 128]
    backoff.backoffs  # [{'kind': 'train', 'failed_micro_batch_size': 256, ...}]
    ```

    Raises:
        ValueError: if `factor` is not in (0, 1) or `min_micro_batch_size` is not a positive
            integer.
        TypeError: at the start of `fit`, `evaluate` or `predict`, if the model is not an
            `AccumulatingModel` (a plain `keras.Model` cannot split a batch).
        ValueError: at the start of `fit`, `evaluate` or `predict`, if the model was compiled with
            `jit_compile=True` (an out-of-memory error inside TensorFlow's XLA cannot be
            recovered from); with `jit_compile="auto"` choosing XLA, the micro-batches run
            without XLA while it is attached.
    """

    def __init__(
        self, factor: float = 0.5, min_micro_batch_size: int = 1, verbose: int = 1
    ):
        super().__init__()
        self.policy = BackoffPolicy(factor, min_micro_batch_size, verbose)
        self._in_fit = False

    @property
    def factor(self) -> float:
        """What the micro-batch is multiplied by at each backoff."""
        return self.policy.factor

    @property
    def min_micro_batch_size(self) -> int:
        """The smallest micro-batch tried."""
        return self.policy.min_micro_batch_size

    @property
    def verbose(self) -> int:
        """0 for quiet, 1 to print a line per backoff."""
        return self.policy.verbose

    @property
    def backoffs(self) -> list[dict]:
        """One dict per backoff of the last `fit` (and the `evaluate` and `predict` since)."""
        return self.policy.backoffs

    # -- attaching to the model --------------------------------------------------------

    def _attach(self):
        if _keras.BACKEND == "jax":
            from keras_memopt.jax_models import AccumulatingModel
        else:
            from keras_memopt.models import AccumulatingModel

        model = self.model
        if not isinstance(model, AccumulatingModel):
            raise TypeError(
                "OOMBackoff shrinks the micro-batch of a "
                "`keras_memopt.AccumulatingModel`; a plain Keras model runs "
                "each batch whole and cannot retry a batch, so there is "
                "nothing to back off. Wrap the model and compile it again: "
                "`model = keras_memopt.AccumulatingModel.from_model(model)`, "
                "`model.compile(...)`, then pass OOMBackoff to its `fit`. "
                f"Received: a model of type {type(model).__name__}"
            )
        # Attached for the call (and `evaluate` inside `fit`): the model puts back the policy and
        # XLA however the call ends (`_oom.run_settings`, the one owner of that).
        if model.oom_policy is not self.policy:
            # On JAX every step is XLA's, and XLA's runtime there recovers.
            if getattr(model, "micro_batch_jit_compile", False):
                self._leave_xla(model)
            model.oom_policy = self.policy

    def _leave_xla(self, model):
        # After an OOM inside XLA the allocator is corrupt (docs/oom-backoff.md): no rollback helps.
        if _keras.jit_compile_requested(model):
            raise ValueError(
                "OOMBackoff cannot recover from an out-of-memory error inside "
                "an XLA-compiled step: TensorFlow's allocator is left corrupt "
                "and the process aborts later. Compile without XLA to use "
                "OOMBackoff (`model.compile(..., jit_compile=False)`), or keep "
                "XLA and drop OOMBackoff. Received: jit_compile=True"
            )
        model.micro_batch_jit_compile = False
        if self.verbose:
            _io.print_msg(
                "OOMBackoff: running micro-batches without XLA while attached "
                '(jit_compile="auto" chose XLA), since an out-of-memory error inside XLA '
                "cannot be recovered from."
            )

    def on_train_begin(self, logs=None):
        self.policy.reset()
        self._attach()
        self._in_fit = True

    def on_epoch_begin(self, epoch, logs=None):
        if _keras.ITERATORS_IN_CYCLES:
            # Each epoch's iterator's prefetched batches stay allocated until the collector
            # runs: a size that trained one epoch would fail the next (docs/oom-backoff.md).
            gc.collect()

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None and self.policy.trained_micro_batch_size is not None:
            logs["micro_batch_size"] = self.policy.trained_micro_batch_size

    def on_train_end(self, logs=None):
        self._in_fit = False

    def on_test_begin(self, logs=None):
        self._attach()

    def on_test_end(self, logs=None):
        if self._in_fit:
            _keras.drop_cached_validation(self.model)

    def on_predict_begin(self, logs=None):
        self._attach()
