"""What custom train steps use: `accumulate_gradients`, and the warning when one splits nothing.

A custom step that calls neither `accumulate_gradients` nor `super().train_step` saves no memory,
and is told so. Before the first step, one that does runs once eagerly on two samples as far as that
call (`_check_custom_loss`, state put back): a `loss_fn` that is no mean of per-sample terms is
warned about; one that draws random numbers is not checked."""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import tensorflow as tf

from keras_memopt import _dtypes, _keras
from keras_memopt._step import loop as _loop
from keras_memopt._step import rollback as _rollback
from keras_memopt._step import whole_batch as _whole_batch
from keras_memopt._step.probe import pairs, repeat, sample, tolerance
from keras_memopt._step.seen import Seen

_WARNED_CUSTOM_STEPS: set[type] = set()
_CHECKED_CUSTOM_LOSSES: set[type] = set()


class _Probed(Exception):  # noqa: N818 - not an error: the probe's way out of the step
    """Ends the probe run of a custom step where it first splits its batch: `seen`, the
    `loss_fn`'s `Seen` or None; `error`, the own loss probe's refusal, raised once put back."""

    def __init__(self, seen, error=None):
        super().__init__()
        self.seen = seen
        self.error = error


def _splits_its_batch(cls) -> bool:
    """Whether the user's classes call `accumulate_gradients` or `super().train_step`: only such
    a custom step is run for the probe, which stops it there."""
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] in ("keras_memopt", "keras", "tf_keras", "builtins"):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if "accumulate_gradients" in source or ".train_step(" in source:
            return True
    return False


class CustomSteps:
    """`accumulate_gradients` and the custom-step warning (a mixin of `AccumulatingModel`)."""

    def _checked_train_step(self, data):
        """`train_step`, warning once when a custom one splits nothing."""
        run = self._run
        run.accumulating = False
        outputs = self.train_step(data)
        if not run.accumulating and run.setting.splits():
            warn_whole_batch_step(self, "super().train_step(data)")
        return outputs

    def _check_custom_loss(self, data):
        """Checks, once per class, the loss of a custom step's first split of its batch (the
        own loss check, or a warning for a `loss_fn` that couples the samples)."""
        cls = type(self)
        if (
            cls in _CHECKED_CUSTOM_LOSSES
            or tf.distribute.has_strategy()
            or not _splits_its_batch(cls)
        ):
            return
        _CHECKED_CUSTOM_LOSSES.add(cls)
        for pair in pairs(data):
            seen, error = self._probe_run(pair)
            if error is not None:
                raise error
            if seen is None:
                return
            if not seen.negligible:
                break
        changed = None if seen.random else seen.not_a_mean()  # random draws: not checked
        if changed is not None:
            _warn_at(
                cls.train_step,
                f"{cls.__name__}.train_step: the `loss_fn` given to "
                "`accumulate_gradients` is not a mean of per-sample terms: it "
                f"{changed}. Its micro-batches' losses do not add up to the batch's (a "
                "contrastive loss whose negatives are the batch's other rows, a Dice "
                "loss), so the gradients are not the batch's. Pass "
                "`forward=lambda micro_batch: outputs` and a `loss_fn(outputs, data)` of "
                "the whole batch's outputs to `accumulate_gradients`.",
            )

    def _probe_run(self, pair):
        """`(seen, error)` of one probe run of the step on two samples `pair`
        (both None: it did not split the batch, or cannot run eagerly)."""
        # What the step may change before it splits its batch (a plain tape's update, a second
        # optimizer's, a tf_keras optimizer's first variables), put back from host memory.
        state = _rollback.HostCopy(_rollback.state_variables(self), self.distribute_strategy)
        made = _rollback.MadeVariables()
        self._run.probing = True
        try:
            with made.recording():
                self.train_step(pair)
            return None, None  # it did not split the batch after all
        except _Probed as probed:
            return probed.seen, probed.error
        except Exception:  # noqa: BLE001 - a step that cannot run eagerly goes unchecked
            return None, None
        finally:
            self._run.probing = False
            state.restore()
            made.restore()

    def _probe_own_step(self, data):
        """In the probe run, at `super().train_step(data)`: the model's own loss probe, then out."""
        try:
            self._probe_loss_split(data)
        except ValueError as error:
            raise _Probed(None, error) from None
        raise _Probed(None)

    def _probe_loss(self, loss_fn, data, forward):
        """In the probe run: the loss values `_check_custom_loss` compares, then out."""
        if forward is not None:
            raise _Probed(None)  # a loss of the whole batch: nothing to check
        count = _loop.static_batch_size(data) or 0
        alone = [sample(data, index) for index in range(count)] if count > 1 else []
        losses = [loss_fn(part) for part in (data, data, repeat(data), *alone)]
        once, again, twice, *alone = (float(loss) for loss in losses)
        rtol = tolerance(getattr(losses[0], "dtype", tf.float32))
        parts = (float(np.mean(alone)), float(np.mean(np.abs(alone)))) if alone else (np.nan, 0.0)
        raise _Probed(Seen(once, twice, again, *parts, rtol=rtol))

    def accumulate_gradients(self, loss_fn, data, variables, optimizer=None, forward=None):
        """The batch's loss and gradients, computed micro-batch by micro-batch.

        What one `tf.GradientTape` over the whole batch gives when `loss_fn` returns a mean over
        samples; call it as often as a step needs. See docs/custom-train-steps.md.

        Args:
            loss_fn: a function of one micro-batch (a slice of `data`) returning its mean loss.
            data: the batch: a tensor or a nest of tensors whose first axis is the batch.
            variables: the variables to differentiate.
            optimizer: the optimizer that will apply the gradients (a loss-scale one unscales
                them). Defaults to the model's.
            forward: a function of one micro-batch returning its outputs; then `loss_fn(outputs,
                data)` is the loss of the whole batch's outputs, concatenated, and the gradients are
                its, exactly. Defaults to None.

        Returns:
            `(loss, gradients)`: the batch's loss (float32, or float64 for a float64 loss) and one
            gradient per variable (None where the loss does not depend on it; `tf.IndexedSlices`
            for an Embedding's).

        Example:

        ```python
        def train_step(self, data):
            real, _ = data

            def discriminator_loss(real):
                fake = self.generator(tf.random.normal([tf.shape(real)[0], 64]))
                ...
                return loss

            variables = self.discriminator.trainable_variables
            loss, grads = self.accumulate_gradients(
                discriminator_loss, real, variables, optimizer=self.d_optimizer
            )
            self.d_optimizer.apply(grads, variables)
        ```
        """
        self._run.accumulating = True
        if self._run.probing:
            self._probe_loss(loss_fn, data, forward)
        _loop.check_splittable(data)
        variables = list(variables)
        optimizer = getattr(self, "optimizer", None) if optimizer is None else optimizer
        batch_size = _loop.batch_size_of(data)
        size = self._run.setting.size_tensor(batch_size)
        jit = self._run.jit_compile
        if forward is not None:
            whole = _whole_batch.WholeBatch(self, lambda micro: (forward(micro), tf.zeros([])), jit)
            loss, gradients, _ = whole.gradients(
                lambda outputs, _: loss_fn(outputs, data), data, size, variables, optimizer
            )
            return _dtypes.widened(loss), gradients

        def micro_step(micro):
            fraction = _loop.fraction_of(_loop.batch_size_of(micro), batch_size)
            with tf.GradientTape() as tape:
                loss = loss_fn(micro)
                loss = loss * tf.cast(fraction, loss.dtype)
                scaled = _keras.scale_loss(optimizer, loss)
            return _dtypes.widened(loss), tape.gradient(scaled, variables)

        folds = ("sum", _loop.gradient_folds(variables))
        return _loop.accumulate(micro_step, data, size, jit_compile=jit, reductions=folds)


def warn_whole_batch_step(model, own_step):
    """Warns, once per class, that `model`'s custom `train_step` called neither
    `accumulate_gradients` nor `own_step` (the model's own), though its setting splits."""
    cls = type(model)
    if cls in _WARNED_CUSTOM_STEPS:
        return
    _WARNED_CUSTOM_STEPS.add(cls)
    _warn_at(
        cls.train_step,
        f"{cls.__name__}.train_step runs the whole batch at once: it calls "
        f"neither `self.accumulate_gradients(...)` nor `{own_step}`, so the "
        f"micro-batch setting (micro_batch_size={model.micro_batch_size!r}, "
        f"accumulation_steps={model.accumulation_steps!r}) saves no memory. Compute "
        "the gradients with `self.accumulate_gradients(loss_fn, data, variables)`.",
    )


def _warn_at(function, message):
    """A `UserWarning` attributed to where `function` is defined (a user's step)."""
    function = inspect.unwrap(function)
    try:
        filename = inspect.getsourcefile(function) or "<unknown>"
        lineno = inspect.getsourcelines(function)[1]
    except (OSError, TypeError):
        filename, lineno = "<unknown>", 0
    warnings.warn_explicit(message, UserWarning, filename, lineno, module=function.__module__)
