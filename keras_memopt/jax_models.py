"""`AccumulatingModel` on Keras 3's JAX backend (`KERAS_BACKEND=jax`).

`import keras_memopt` exports this class in place of the TensorFlow one
(`keras_memopt.models`) when Keras runs on JAX. Its train step is
`keras_memopt._step.jax_step.train_step`: the micro-batches inside Keras's one
compiled, stateless step, one optimizer update. What the TensorFlow line does
that this one does not do yet is refused, naming the feature, before any
update.
"""

from __future__ import annotations

from keras_memopt import _keras, _validation

if _keras.BACKEND != "jax":
    # Checked first: its class would replace the TensorFlow one in Keras's
    # registry of saved classes.
    raise ImportError(
        "keras_memopt.jax_models is AccumulatingModel for Keras 3's JAX backend, and "
        "Keras runs on another here: use `keras_memopt.AccumulatingModel`, which is "
        f"this backend's. Received: backend={_keras.BACKEND!r}"
    )

from keras_memopt._keras.wrapping import wrapped_inputs_outputs  # noqa: E402
from keras_memopt._oom import run_settings as _run_settings  # noqa: E402
from keras_memopt._oom.jax_runner import StepFunctions  # noqa: E402
from keras_memopt._remat import segments as _segments  # noqa: E402
from keras_memopt._remat.jax_segments import Recomputation  # noqa: E402
from keras_memopt._serialization import class_to_build, functional_class  # noqa: E402
from keras_memopt._step import jax_step, jax_whole_batch  # noqa: E402
from keras_memopt._step.jax_custom_steps import JaxCustomSteps  # noqa: E402
from keras_memopt._step.losses import check_reduction  # noqa: E402
from keras_memopt.remat import Remat, check_target, validate_remat  # noqa: E402

__all__ = ["AccumulatingModel"]

_SETTING = ("micro_batch_size", "accumulation_steps")

keras = _keras.keras

# The TensorFlow line's constructor arguments that JAX does not take yet, with
# the value that means "not used".
_NOT_ON_JAX = {
    "replica_shares": None,
    "devices": None,
    "device_cuts": None,
}


class AccumulatingModel(JaxCustomSteps, keras.Model):
    """A `keras.Model` whose train step accumulates gradients over micro-batches (JAX).

    The batch that the input pipeline delivers is the *effective* batch. The
    compiled train step splits it along its first axis into micro-batches,
    runs them one after another inside the step (`jax.lax.scan` over the
    equal ones, then the uneven last one at its own shape), adds up their
    gradients, each weighted by its exact fraction of the batch's loss, and
    applies **one** optimizer update: plain Keras's update on the whole
    batch. The loss, the per-output losses and the compiled metrics are
    plain Keras's figures for the whole batch. BatchNormalization normalises
    each micro-batch with its own statistics and advances its moving
    statistics once per micro-batch, as on the TensorFlow line. A masked
    output's loss is split by its unmasked elements, counted before the loop;
    where no functional model of the inputs alone computes the mask (a
    subclassed or nested model, a mask that needs weights), by one forward
    pass per micro-batch more, which leaves the model's state as it was.

    On JAX a micro-batch size is a static shape: each size is compiled once.
    `evaluate` and `predict` split large batches the same way (the whole
    batch's loss and metrics, the outputs in order).

    Under `keras.distribution.DataParallel`, each device splits its share
    of the batch: `micro_batch_size` counts samples per device (as it counts
    them per replica under a TensorFlow strategy), and each micro-batch
    holds a part of every device's share, each device running its own rows.
    The update, loss and metrics are those of the same model on one device.

    A custom `train_step(self, state, data)` takes its gradients over the
    micro-batches with `self.accumulate_gradients(loss_fn, data, variables,
    state=...)`, where Keras's guide calls `jax.value_and_grad`.

    `remat=[layer names]` cuts a functional model after each named layer
    and, in training, recomputes every segment but the last in the backward
    pass (`jax.checkpoint`, through `keras_memopt.Remat`): the same weights
    and figures, less activation memory. `remat="auto"` chooses the segments
    among the TensorFlow line's candidates by XLA's memory analysis of the
    train step compiled with each (at the micro-batch; nothing runs), before
    the first step of each micro-batch setting; `remat_choice` says what it
    chose and why.

    `whole_batch_loss=True` evaluates the loss once on the whole batch's
    outputs, for losses that couple the samples (a contrastive loss whose
    negatives are the batch's other rows, a Dice loss over the batch):
    every micro-batch forward, the loss and its gradient with respect to the
    outputs, then every micro-batch forward again back-propagating its rows
    of that gradient, from the random state its first pass started from
    (`keras_memopt._step.jax_whole_batch`; docs/whole-batch-loss.md).

    `keras_memopt.callbacks.OOMBackoff` backs it off on XLA's
    `RESOURCE_EXHAUSTED` (the same batch again at a smaller micro-batch, the
    state untouched by the failed attempt), and `MemoryLogger` reads JAX's
    memory figures; see "On JAX" in docs/oom-backoff.md and docs/memory.md.

    The terms of `model.losses` (`add_loss`, activity and weight
    regularisers, in any model) count as on the TensorFlow line: before the
    first step that splits a batch, each is evaluated on two samples and on
    them repeated; one that sums over the samples counts as it is in each
    micro-batch, any other with the micro-batch's fraction of the batch, and
    one that does neither is refused with a `ValueError` naming it.

    Not yet on JAX (refused, naming the feature, before any update):
    `replica_shares`, `devices`, `device_cuts`,
    `micro_batch_size="auto"` or one size per
    replica, a term of `model.losses`
    added only in training, terms other than weight regularisers and Keras's
    L1, L2 and L1L2 activity regularisers on a functional model's layers in
    a custom `train_step` around the model's own (both where the batch is
    split), an overridden `compute_loss`, a `keras.distribution` other than
    `DataParallel` (`ModelParallel`), an optimizer with its own
    `gradient_accumulation_steps`, `accumulate_gradients`'s `forward`
    and loss-scale optimizers (the first step's check of a custom `loss_fn`
    does not run on JAX), a sparse input (where the batch is split), and a
    `SpectralNormalization` with `whole_batch_loss=True`.

    Args:
        micro_batch_size: int, the number of samples in each micro-batch
            (on each device, under `DataParallel`). The last micro-batch of
            a batch may be smaller; a batch smaller than `micro_batch_size`
            is one micro-batch.
        accumulation_steps: int, the number of micro-batches to split each
            batch into (each of `ceil(batch / accumulation_steps)` samples,
            the last one smaller where it does not divide). Give at most one
            of the two; with neither, each batch is one micro-batch.
        remat: None, `"auto"`, or a list of the names of the layers of a
            functional model after which its recomputed segments end (as on
            the TensorFlow line; `"auto"` chooses them from the compiled
            step's memory, see docs/remat.md). Defaults to None.
        whole_batch_loss: bool. `True` evaluates the loss and the compiled
            metrics once, on the whole batch's outputs (see above). Defaults
            to False.
        *args, **kwargs: passed on to `keras.Model` (`inputs`, `outputs`,
            `name`, ...).

    Attributes:
        oom_policy: the out-of-memory policy the steps follow, or None (an
            out-of-memory error then reaches the caller as in plain Keras).
            `OOMBackoff` sets its own for the length of `fit`, `evaluate` or
            `predict`; the one before is back when the call ends, also when
            it raises.

    Example:

    ```python
    import os
    os.environ["KERAS_BACKEND"] = "jax"
    import keras
    from keras_memopt import AccumulatingModel

    inputs = keras.Input((784,))
    x = keras.layers.Dense(512, activation="relu")(inputs)
    outputs = keras.layers.Dense(10)(x)
    model = AccumulatingModel(inputs, outputs, micro_batch_size=32)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(x_train, y_train, batch_size=256)  # 8 micro-batches, 1 update
    ```

    Raises:
        ValueError: if both `micro_batch_size` and `accumulation_steps` are
            given, or one is not a positive integer; for `remat`, as on the
            TensorFlow line (a name that is not a layer of the model, a layer
            whose output does not separate its graph, a subclassed model);
            if `whole_batch_loss` is not True or False; at the first step that
            splits a batch, before any update, for a term of `model.losses`
            that neither averages nor sums over the samples.
        NotImplementedError: for an argument or feature not supported on JAX
            yet (see above).
    """

    def __new__(cls, *args, **kwargs):
        return super().__new__(
            class_to_build(cls, AccumulatingModel, args, kwargs, _SegmentedCall), *args, **kwargs
        )

    def __init__(
        self,
        *args,
        micro_batch_size: int | None = None,
        accumulation_steps: int | None = None,
        remat: str | list[str] | None = None,
        whole_batch_loss: bool = False,
        **kwargs,
    ):
        split = _validated_split(micro_batch_size, accumulation_steps)
        remat = validate_remat(remat)
        whole_batch_loss = _validation.whole_batch_loss(whole_batch_loss)
        for name, unused in _NOT_ON_JAX.items():
            if kwargs.get(name, unused) != unused:
                raise NotImplementedError(_not_on_jax(f"`{name}`", f"{name}={kwargs[name]!r}"))
            kwargs.pop(name, None)
        functional = _keras.is_functional_call(args, kwargs)
        check_target(remat, functional, self)
        if functional and not isinstance(self, _keras.Functional):
            object.__setattr__(self, "__class__", _functional_class(type(self)))
        super().__init__(*args, **kwargs)
        self._split = split
        self._whole_batch_loss = whole_batch_loss
        self._recomputation = Recomputation(self, remat, Remat)
        # A plain holder: Keras does not track it.
        self._steps = StepFunctions(self, before_train=self._before_train_step)
        self.oom_policy = None

    @classmethod
    def from_model(
        cls,
        model: keras.Model,
        *,
        micro_batch_size: int | None = None,
        accumulation_steps: int | None = None,
        name: str | None = None,
        **kwargs,
    ) -> AccumulatingModel:
        """Wraps an existing model; the result shares its layers and weights.

        A functional or `Sequential` model is rebuilt as a functional
        `AccumulatingModel` over the same layers; a subclassed model is called
        as one layer, so it must have been built (called once) first.
        """
        _validated_split(micro_batch_size, accumulation_steps)
        inputs, outputs = wrapped_inputs_outputs(model)
        return cls(
            inputs, outputs, name=name or model.name, micro_batch_size=micro_batch_size,
            accumulation_steps=accumulation_steps, **kwargs,
        )

    # -- the micro-batch setting ------------------------------------------------

    @property
    def micro_batch_size(self) -> int | None:
        """Samples per micro-batch, or None. Settable; the step is compiled anew."""
        return self._split[0]

    @micro_batch_size.setter
    def micro_batch_size(self, value):
        self._set_split(value, "micro_batch_size", "accumulation_steps")

    @property
    def accumulation_steps(self) -> int | None:
        """Micro-batches per batch, or None. Settable; the step is compiled anew."""
        return self._split[1]

    @accumulation_steps.setter
    def accumulation_steps(self, value):
        self._set_split(value, "accumulation_steps", "micro_batch_size")

    def _set_split(self, value, name, other):
        _validation.check_one_split(self, name, value, other)
        self._split = _validated_split(**{name: value, other: None})
        # A micro-batch size is a static shape: the step functions look up the
        # compiled steps of this setting (compiled at their first step, kept).
        self._retrace()

    def _retrace(self):
        for kind in ("train", "test", "predict"):
            if getattr(self, f"{kind}_function", None) is not None:
                getattr(self, f"make_{kind}_function")(force=True)

    def micro_batch_size_for(self, batch_size: int) -> int:
        """The micro-batch size a step on a batch of `batch_size` samples runs with
        (per device under `DataParallel`, where `batch_size` is a device's share)."""
        size, steps = self._split
        if size is not None:
            return min(size, batch_size)
        return max(1, -(-batch_size // (steps or 1)))

    @property
    def whole_batch_loss(self) -> bool:
        """Whether the loss is evaluated once on the whole batch's outputs.

        Settable between fits, like `micro_batch_size` (checked first: a bad
        value leaves it as it was); the steps are compiled anew."""
        return self._whole_batch_loss

    @whole_batch_loss.setter
    def whole_batch_loss(self, value):
        value = _validation.whole_batch_loss(value)
        if value != self._whole_batch_loss:
            if getattr(self, "_compile_loss", None) is not None:
                check_reduction(self.loss, whole_batch_loss=value)
            self._whole_batch_loss = value
            self._steps.forget()
            self._retrace()

    # -- recomputation -------------------------------------------------------------

    @property
    def remat(self) -> str | list[str] | None:
        """The recomputed segments: None, "auto" or the cut layers' names.

        Setting it plans the segments anew (checked first: a bad value leaves
        them as they were); the next step is traced with them.
        """
        names = self._recomputation.names
        return names if names is None or names == "auto" else list(names)

    @remat.setter
    def remat(self, value):
        value = validate_remat(value)
        check_target(value, isinstance(self, _keras.Functional), self)
        self._recomputation = Recomputation(self, value, Remat)
        self._steps.forget()
        self._retrace()

    @property
    def recomputed_segments(self) -> list[list[str]]:
        """The names of the layers in each segment recomputed in the backward pass
        (with `"auto"`, of its choice for the micro-batch setting of the last train
        step; none before the first)."""
        return _segments.recomputed_layer_names(self._recomputation.plan)

    @property
    def remat_choice(self) -> str:
        """What `remat="auto"` chose and why (the temporaries of the compiled train
        step with and without recomputation, from XLA's memory analysis), for the
        micro-batch setting of the last train step; "" otherwise and before it."""
        return self._recomputation.note

    def _before_train_step(self, state, data):
        # `remat="auto"` chooses its segments before a setting's first compiled step.
        self._recomputation.prepare(state, data)

    # -- compile and the step ----------------------------------------------------

    def compile(self, *args, **kwargs):
        optimizer = kwargs.get("optimizer", args[0] if args else "rmsprop")
        loss = kwargs.get("loss", args[1] if len(args) > 1 else None)
        check_reduction(loss, whole_batch_loss=self.whole_batch_loss)
        _refuse_unsupported(self, optimizer, loss)
        super().compile(*args, **kwargs)
        self._steps.forget()

    # The step functions (`keras_memopt._oom.jax_runner`) keep each micro-batch
    # setting's compiled step and retry a step out of memory where a policy is
    # attached; each puts the model's state back when the step is refused while
    # traced (Keras's JAX loops take the state out of the variables first).
    def make_train_function(self, force=False):
        return self._make_function("train", force)

    def make_test_function(self, force=False):
        return self._make_function("test", force)

    def make_predict_function(self, force=False):
        return self._make_function("predict", force)

    def _make_function(self, kind, force):
        name = f"{kind}_function"
        if getattr(self, name) is None or force:
            # The model's own train and test steps split the terms of `model.losses`
            # as the first step finds them (`jax_terms`); a custom one's are not probed.
            own = kind != "predict" and (
                getattr(type(self), f"{kind}_step") is getattr(AccumulatingModel, f"{kind}_step")
            )
            function = self._steps.function(kind, finds_terms=own)
            setattr(self, name, jax_step.restored_on_refusal(self, function))
        return getattr(self, name)

    # `fit`, `evaluate` and `predict` leave `oom_policy` (which `OOMBackoff`
    # sets for their length) as they found it, however they end.
    def fit(self, *args, **kwargs):
        with _run_settings.kept(self):
            try:
                return super().fit(*args, **kwargs)
            except jax_step.Refused as error:
                # Keras's JAX `fit` ends, even when it raises, by setting the weights to
                # the optimizer's moving averages where it keeps them (`use_ema`; zeros
                # before any update): the refused step's state goes back once more
                # (where a step function refused it: `jax_step.restored_on_refusal`).
                getattr(error, "put_back", lambda: None)()
                raise

    def evaluate(self, *args, **kwargs):
        with _run_settings.kept(self):
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        with _run_settings.kept(self):
            return super().predict(*args, **kwargs)

    # A batch of one micro-batch runs Keras's own step (traced per batch shape).
    def train_step(self, state, data):
        self._splits_in_step = True  # a custom step calling this one splits its batch
        if not jax_step.splits(self.micro_batch_size_for, data):
            return super().train_step(state, data)
        steps = jax_whole_batch if self.whole_batch_loss else jax_step
        return steps.train_step(self, self.micro_batch_size_for, state, data)

    def test_step(self, state, data):
        if not jax_step.splits(self.micro_batch_size_for, data):
            return super().test_step(state, data)
        steps = jax_whole_batch if self.whole_batch_loss else jax_step
        return steps.test_step(self, self.micro_batch_size_for, state, data)

    def predict_step(self, state, data):
        if not jax_step.splits(self.micro_batch_size_for, data):
            return super().predict_step(state, data)
        return jax_step.predict_step(self, self.micro_batch_size_for, state, data)

    def get_config(self):
        config = super().get_config()
        return {**config, "micro_batch_size": self.micro_batch_size,
                "accumulation_steps": self.accumulation_steps, "remat": self.remat,
                "whole_batch_loss": self.whole_batch_loss}

    def compile_from_config(self, config):
        # Keras skips an overridden `compile` when loading; this one only adds
        # checks, so a loaded model comes back compiled.
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            self.optimizer.build(self.trainable_variables)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        split = {name: config.pop(name, None) for name in _SETTING}
        remat = config.pop("remat", None)
        whole_batch_loss = config.pop("whole_batch_loss", False)
        model = super().from_config(config, custom_objects=custom_objects)
        model._split = _validated_split(**split)
        model.whole_batch_loss = whole_batch_loss
        if remat is not None:
            model.remat = remat
        return model


def _validated_split(micro_batch_size=None, accumulation_steps=None):
    """The TensorFlow line's checks (same errors), less what JAX does not take yet."""
    size, steps = _validation.micro_batch_split(micro_batch_size, accumulation_steps)
    if size == "auto":
        raise NotImplementedError(
            _not_on_jax('`micro_batch_size="auto"` (a search by real steps)',
                        f"micro_batch_size={micro_batch_size!r}")
        )
    if isinstance(size, tuple):
        raise NotImplementedError(
            _not_on_jax("one micro-batch size per replica",
                        f"micro_batch_size={micro_batch_size!r}")
        )
    return size, steps


class _SegmentedCall:
    """The functional form's `call` (a mixin before Keras's functional class;
    a subclassed model keeps its own): in training, with `remat`, the model
    runs as its chain of segments, each but the last recomputed; otherwise as
    Keras runs it."""

    def call(self, inputs, training=None, mask=None, **kwargs):
        recomputation = getattr(self, "_recomputation", None)  # None while Keras builds it
        stages = recomputation.stages if recomputation is not None else None
        if not (training and stages):
            return super().call(inputs, training=training, mask=mask, **kwargs)
        x = inputs
        with _keras.mask_warning_silenced():
            for stage in stages:
                x = stage(x, training=training)
        return x


def _functional_class(cls):
    return functional_class(cls, _SegmentedCall)


def _not_on_jax(feature, received):
    return (
        f"AccumulatingModel does not support {feature} on the JAX backend yet; use the "
        f"TensorFlow backend (KERAS_BACKEND=tensorflow) for it. Received: {received}"
    )


def _refuse_unsupported(model, optimizer, loss):
    """Refuses, at `compile` (before it changes the model), what the JAX step
    cannot do exactly yet."""
    if type(model).compute_loss is not keras.Model.compute_loss:
        raise NotImplementedError(
            _not_on_jax("an overridden `compute_loss`", f"{type(model).__name__}.compute_loss")
        )
    jax_step.refuse_other_distributions()
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    if steps:
        raise ValueError(
            "AccumulatingModel accumulates gradients itself; the optimizer's own "
            "`gradient_accumulation_steps` would accumulate them a second time. Leave it "
            f"unset. Received: gradient_accumulation_steps={steps!r}"
        )


# The functional form is the one saved and revived, as on the TensorFlow line.
_keras.register_serializable(package="keras_memopt", name="AccumulatingModel")(
    _functional_class(AccumulatingModel)
)
