"""`OOMBackoff`: survive out-of-memory errors by shrinking the micro-batch."""

from __future__ import annotations

from keras_memopt import _oom
from keras_memopt._keras import keras
from keras_memopt._validation import backoff_factor, positive_int


class OOMBackoff(keras.callbacks.Callback):
    """Shrinks the micro-batch and retries the batch when memory runs out.

    Attach it to `fit` (and to `evaluate` or `predict`, which back off the
    same way) of a `keras_memopt.AccumulatingModel`. When a step runs out of
    device memory, everything the failed step may have changed (weights,
    BatchNormalization statistics, optimizer variables and iterations, metric
    state, random seed state) is put back as it was, `micro_batch_size` is
    multiplied by `factor`, and the *same* batch runs again. The effective
    batch (the batch the input pipeline delivers) never changes, so neither
    does the result of training: no
    sample is lost or seen twice and `optimizer.iterations` counts updates.

    The micro-batch size is run-time state of the step, so a retry traces
    nothing: it costs the failed attempt (with TensorFlow's own wait before it
    reports the error) and the rollback.

    When the micro-batch cannot shrink any further (it is already
    `min_micro_batch_size`), training stops with one
    `tf.errors.ResourceExhaustedError` whose message says what failed to
    allocate, how much device memory was in use, and what to try; the model
    is left as it was before the failed step.

    Each backoff prints one line when `verbose` is on and is recorded in
    `backoffs`; the micro-batch in use is added to the training `logs` as
    `"micro_batch_size"`, so `History`, `CSVLogger` and `TensorBoard` record
    it. While attached, the model takes a snapshot of its state before each
    step: no copy is made up front (TensorFlow tensors are immutable), but the
    state a step rewrites (weights and optimizer slots) is held twice until
    the step returns.

    Args:
        factor: float in (0, 1), what the micro-batch is multiplied by at each
            backoff (rounded down, and always at least one sample smaller).
            Defaults to `0.5`.
        min_micro_batch_size: int, the smallest micro-batch to try. Defaults
            to `1`.
        verbose: int, 0 for quiet, 1 to print a line per backoff. Defaults to
            `1`.

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
        ValueError: if `factor` is not in (0, 1) or `min_micro_batch_size` is
            not a positive integer.
        TypeError: at the start of `fit`, `evaluate` or `predict`, if the model
            is not an `AccumulatingModel` (a plain `keras.Model` cannot split
            a batch, so there is nothing to shrink).
        ValueError: at the start of `fit`, `evaluate` or `predict`, if the
            model was compiled with `jit_compile=True`: an out-of-memory error
            inside XLA leaves TensorFlow's allocator corrupt, so it cannot be
            recovered from. With `jit_compile="auto"` resolving to XLA (as on
            GPUs), OOMBackoff runs the micro-batches without XLA instead.
    """

    def __init__(
        self, factor: float = 0.5, min_micro_batch_size: int = 1, verbose: int = 1
    ):
        super().__init__()
        factor = backoff_factor(factor)
        positive_int("min_micro_batch_size", min_micro_batch_size)
        self.factor = float(factor)
        self.min_micro_batch_size = min_micro_batch_size
        self.verbose = verbose
        self.backoffs: list[dict] = []
        self.policy = _oom.BackoffPolicy(self.factor, min_micro_batch_size, self._report)
        self._depth = 0

    # -- attaching the policy to the model -------------------------------------------

    def _attach(self):
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
        if model.micro_batch_jit_compile:
            self._leave_xla(model)
        if self._depth == 0:
            model.oom_policy = self.policy
        self._depth += 1

    def _leave_xla(self, model):
        # Measured on TF 2.21 (CPU): after an out-of-memory error inside an
        # XLA-compiled micro-batch, the allocator's bookkeeping is corrupt and
        # the process aborts when a buffer is freed later ("Check failed:
        # h != kInvalidChunkHandle"). No rollback can make that safe.
        if getattr(model, "_jit_compile_requested", None) != "auto":
            raise ValueError(
                "OOMBackoff cannot recover from an out-of-memory error inside "
                "an XLA-compiled step: TensorFlow's allocator is left corrupt "
                "and the process aborts later. Compile without XLA to use "
                "OOMBackoff (`model.compile(..., jit_compile=False)`), or keep "
                "XLA and drop OOMBackoff. Received: jit_compile=True"
            )
        model.micro_batch_jit_compile = False
        if self.verbose:
            print(
                "OOMBackoff: running micro-batches without XLA (jit_compile="
                '"auto" chose XLA), since an out-of-memory error inside XLA '
                "cannot be recovered from."
            )

    def _detach(self):
        self._depth = max(0, self._depth - 1)
        if self._depth == 0 and self.model is not None:
            if getattr(self.model, "oom_policy", None) is self.policy:
                self.model.oom_policy = None

    def on_train_begin(self, logs=None):
        self.backoffs = []
        self._depth = 0
        self._attach()

    def on_train_end(self, logs=None):
        self._detach()

    def on_test_begin(self, logs=None):
        self._attach()

    def on_test_end(self, logs=None):
        self._detach()

    def on_predict_begin(self, logs=None):
        self._attach()

    def on_predict_end(self, logs=None):
        self._detach()

    # -- reporting (the policy calls it at each backoff) -----------------------------

    def _report(self, event):
        self.backoffs.append(event)
        if self.verbose:
            print(
                f"OOMBackoff: out of memory in a {event['kind']} step at "
                f"micro_batch_size={event['failed_micro_batch_size']}"
                f"{event['allocation']}; retrying the same batch "
                f"with micro_batch_size={event['micro_batch_size']}."
            )
