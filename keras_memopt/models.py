"""`AccumulatingModel`: exact gradient accumulation inside one train step."""

from __future__ import annotations

import tensorflow as tf

from keras_memopt import _io, _keras, _validation, placement
from keras_memopt import remat as _remat
from keras_memopt._keras import losses as _keras_losses
from keras_memopt._keras.wrapping import wrapped_inputs_outputs
from keras_memopt._oom import run_settings as _run_settings
from keras_memopt._oom import runner as _runner
from keras_memopt._oom.supervised import max_micro_batch_size
from keras_memopt._oom.update_guard import UpdateGuard
from keras_memopt._serialization import SerializationMixin, class_to_build, functional_class
from keras_memopt._step import batch_dependence as _batch_dependence
from keras_memopt._step import losses as _losses
from keras_memopt._step import shares as _shares
from keras_memopt._step import update as _update
from keras_memopt._step.custom_steps import CustomSteps
from keras_memopt._step.setting import MicroBatchSetting
from keras_memopt._step.state import RunState
from keras_memopt._step.steps import MicroBatchSteps

__all__ = ["AccumulatingModel"]

keras = _keras.keras


class AccumulatingModel(
    MicroBatchSteps,
    CustomSteps,
    _remat.RematMixin,
    placement.PlacementMixin,
    SerializationMixin,
    keras.Model,
):
    """A `keras.Model` whose train step accumulates gradients over micro-batches.

    The train step splits the batch the input pipeline delivers (the *effective* batch) along its
    first axis into micro-batches, runs them one after another, adds up their gradients, each
    weighted by its fraction of the batch's loss, and applies **one** optimizer update: the one
    plain Keras computes on the whole batch. `evaluate` and `predict` split large batches the same
    way. What is exact and what is not: docs/accumulation.md.

    Build it functionally, subclass it, or wrap a model with `from_model` (the example shows each).
    Changing the micro-batch setting retraces nothing; changing `remat` traces anew.

    Args:
        micro_batch_size: int, the number of samples in each micro-batch (per replica under a
            distribution strategy). The last micro-batch of a batch may be smaller; a batch smaller
            than `micro_batch_size` is one micro-batch. `"auto"`: the largest size that trains,
            found at the first step by trying real steps (failed attempts rolled back), kept in
            `model.micro_batch_search`; see docs/oom-backoff.md.
        accumulation_steps: int, the number of micro-batches to split each batch into, as evenly as
            possible. Give at most one of `micro_batch_size` and `accumulation_steps`; with neither,
            each batch is one micro-batch (until, say, `OOMBackoff` shrinks it).
        remat: recomputed segments of a functional model: `"auto"`, or the names of the layers to
            cut after (each output must separate the graph); every segment but the last is
            recomputed. Subclassed models use `keras_memopt.Remat`. See docs/remat.md. Defaults to
            `None`.
        replica_shares: under a `MirroredStrategy`, each replica's share of every batch (positive
            numbers, or `"auto"` for each device's memory). Defaults to `None` (even parts).
        devices: list of device names (`["/GPU:0", "/GPU:1"]`): one segment of a functional model
            per device, run one after another (docs/distributed.md). Defaults to `None`.
        device_cuts: `"auto"` (balanced by memory) or the names of the `len(devices) - 1` layers
            whose outputs end the segments. See `keras_memopt.placement`. Defaults to `"auto"`.
        whole_batch_loss: bool. `True` evaluates the loss and the compiled metrics once, on the
            whole batch's outputs, for losses that couple the samples of a batch (contrastive,
            listwise ranking), for about one more forward pass; see docs/whole-batch-loss.md.
            Defaults to `False` (the loss must be a mean of per-sample terms; one that is not is
            refused at the first step).
        *args, **kwargs: passed on to `keras.Model` (`inputs`, `outputs`, `name`, ...).

    Attributes:
        oom_policy: the out-of-memory policy the step runner follows, or None: an out-of-memory
            error then stops training as it would in plain Keras. A
            `keras_memopt.callbacks.OOMBackoff` sets its own policy here for the length of `fit`,
            `evaluate` or `predict`; the one before is back when the call ends, also when it raises.

    Example:

    ```python
    inputs = keras.Input((784,))
    x = keras.layers.Dense(512, activation="relu")(inputs)
    outputs = keras.layers.Dense(10)(x)
    model = AccumulatingModel(inputs, outputs, micro_batch_size=32)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(x_train, y_train, batch_size=256)  # 8 micro-batches, 1 update

    class MyModel(AccumulatingModel):
        def __init__(self):
            super().__init__(accumulation_steps=4)
            self.dense = keras.layers.Dense(10)

        def call(self, x):
            return self.dense(x)

    base = keras.applications.MobileNetV2(weights=None, input_shape=(96, 96, 3))
    model = AccumulatingModel.from_model(base, micro_batch_size=16)
    ```

    Raises:
        ValueError: if both `micro_batch_size` and `accumulation_steps` are given, or one is not a
            positive integer; for `remat`, `devices` or `device_cuts` that do not fit the model.
    """

    def __new__(cls, *args, **kwargs):
        return super().__new__(class_to_build(cls, AccumulatingModel, args, kwargs),
                               *args, **kwargs)

    def __init__(
        self,
        *args,
        micro_batch_size: int | str | None = None,
        accumulation_steps: int | None = None,
        remat: str | list[str] | None = None,
        replica_shares: list[float] | str | None = None,
        devices: list[str] | None = None,
        device_cuts: str | list[str] | None = None,
        whole_batch_loss: bool = False,
        **kwargs,
    ):
        strategy = tf.distribute.get_strategy()
        # Every argument is checked before anything is built.
        setting = MicroBatchSetting(
            strategy.num_replicas_in_sync,
            micro_batch_size,
            accumulation_steps,
            cap=max_micro_batch_size(),
        )
        remat = _remat.validate_remat(remat)
        shares = _shares.resolve_shares(replica_shares, strategy)
        whole_batch_loss = _validation.whole_batch_loss(whole_batch_loss, shares)
        functional = _keras.is_functional_call(args, kwargs)
        if functional:
            _keras.check_line("inputs", kwargs.get("inputs", args[0] if args else None))
        _remat.check_target(remat, functional, self)
        placement.validate(devices, device_cuts, self, functional)
        if functional and not isinstance(self, _keras.Functional):
            # A subclass's constructor passing (inputs, outputs) on: become its functional form
            # here, before Keras would rewrite the bases of all classes up to `keras.Model`.
            object.__setattr__(self, "__class__", functional_class(type(self)))
        super().__init__(*args, **kwargs)
        # A plain holder: Keras must not track (nor save) its variables.
        self._run = RunState(setting, shares, whole_batch_loss, guard=UpdateGuard())
        self._run.loss_split = _losses.LossSplit(self)
        self.oom_policy = None
        self._set_placement(devices, device_cuts)
        self._remat = None
        self._plan_segments(remat)

    @classmethod
    def from_model(
        cls,
        model: keras.Model,
        *,
        micro_batch_size: int | str | None = None,
        accumulation_steps: int | None = None,
        remat: str | list[str] | None = None,
        name: str | None = None,
        devices: list[str] | None = None,
        device_cuts: str | list[str] | None = None,
        whole_batch_loss: bool = False,
    ) -> AccumulatingModel:
        """Wraps an existing model; the result shares its layers and weights.

        A functional or `Sequential` model is rebuilt over the same layers; a subclassed model is
        called as one layer, so it must have been built (called once) first.

        Args:
            model: a built `keras.Model`.
            micro_batch_size, accumulation_steps, remat, devices, device_cuts, whole_batch_loss: as
                for the constructor.
            name: the new model's name. Defaults to the wrapped model's name.

        Returns:
            An `AccumulatingModel` that trains, evaluates and predicts as `model`, in micro-batches.
        """
        _keras.check_line("model", model)
        inputs, outputs = wrapped_inputs_outputs(model)
        return cls(
            inputs, outputs, name=name or model.name, micro_batch_size=micro_batch_size,
            accumulation_steps=accumulation_steps, remat=remat, devices=devices,
            device_cuts=device_cuts, whole_batch_loss=whole_batch_loss,
        )

    # -- the micro-batch setting ------------------------------------------------

    @property
    def micro_batch_size(self) -> int | tuple | str | None:
        """Samples per micro-batch, `"auto"` before its search, or None.

        None when `accumulation_steps` is set, or when neither is (each batch is one micro-batch).
        Setting it, also in the middle of `fit` (from a callback), takes effect at the next step and
        retraces nothing; while `accumulation_steps` is set, set that to None first."""
        return self._run.setting.micro_batch_size

    @micro_batch_size.setter
    def micro_batch_size(self, value):
        self._set_split(value, "micro_batch_size", "accumulation_steps")

    @property
    def accumulation_steps(self) -> int | None:
        """Micro-batches per batch, or None when `micro_batch_size` is set.

        Set it as `micro_batch_size`; while that is set, set it to None first."""
        return self._run.setting.accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, value):
        self._set_split(value, "accumulation_steps", "micro_batch_size")

    def _set_split(self, value, name, other):
        _validation.check_one_split(self, name, value, other)
        self._run.setting.set(**{name: value, other: None})

    @property
    def whole_batch_loss(self) -> bool:
        """Whether the loss is evaluated once on the whole batch's outputs.

        Settable between fits, like `micro_batch_size`; the step is traced anew, and the loss is
        checked again at the next step."""
        return self._run.whole_batch_loss

    @whole_batch_loss.setter
    def whole_batch_loss(self, value):
        value = _validation.whole_batch_loss(value, self._run.replica_shares)
        if value != self._run.whole_batch_loss:
            if _keras_losses.compiled_loss_container(self) is not None:
                _losses.check_reduction(self.loss, value)
            self._run.whole_batch_loss = value
            self._run.loss_split = _losses.LossSplit(self)
            self._run.retrace()

    @property
    def replica_shares(self) -> tuple[float, ...] | None:
        """Each replica's share of every batch, or None (even parts, as Keras splits)."""
        return self._run.replica_shares

    @property
    def micro_batch_jit_compile(self) -> bool:
        """Whether each micro-batch's step is compiled with XLA."""
        return self._run.jit_compile

    @micro_batch_jit_compile.setter
    def micro_batch_jit_compile(self, value: bool):
        if bool(value) != self._run.jit_compile:
            self._run.jit_compile = bool(value)
            self._run.retrace()

    def micro_batch_size_for(self, batch_size: int | None) -> int | tuple | None:
        """The micro-batch size a step on a batch of `batch_size` samples runs with.

        Per replica under a distribution strategy; None when `batch_size` is None and the size
        depends on it."""
        return self._run.setting.in_use(batch_size)

    # -- compile and the step functions ------------------------------------------

    def compile(self, *args, jit_compile="auto", **kwargs):
        loss = kwargs.get("loss", args[1] if len(args) > 1 else None)
        _losses.check_reduction(loss, self.whole_batch_loss)
        _batch_dependence.refuse_stateful(self)
        jit = placement.jit_compile(self._placement, jit_compile)
        super().compile(*args, **_keras.compile_kwargs(jit), **kwargs)
        self._run.jit_compile = _keras.resolve_jit_compile(self, jit)
        self._run.loss_split = _losses.LossSplit(self)
        _keras.leave_step_uncompiled(self)
        _update.chain_updates(self.optimizer, place_on_variable_device=self.devices is not None)
        if self._placement is not None:
            # Outside a trace, each slot is made on its variable's device (in one, the default).
            _keras.build_optimizer(self.optimizer, self.trainable_variables)

    def _make_runner(self, kind, force):
        attribute = f"{kind}_function"
        if getattr(self, attribute, None) is None or force:
            runner = _runner.StepRunner(self, self._step_functions(kind), self._run)
            setattr(self, attribute, runner)
        return getattr(self, attribute)

    def make_train_function(self, force=False):
        return self._make_runner("train", force)

    def make_test_function(self, force=False):
        return self._make_runner("test", force)

    def make_predict_function(self, force=False):
        return self._make_runner("predict", force)

    # `fit`, `evaluate` and `predict` leave the settings callbacks may change (`oom_policy`,
    # `micro_batch_jit_compile`) as they found them, however they end (`_oom.run_settings`).
    def fit(self, *args, **kwargs):
        with _run_settings.kept(self):
            return super().fit(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        with _run_settings.kept(self):
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        with _run_settings.kept(self):
            return super().predict(*args, **kwargs)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras 3 builds here from a batch it takes out of the user's data; the
        # step runner builds from the first step's own batch (`_prepare_step`).
        return

    def summary(self, *args, **kwargs):
        """Keras's summary, then how each batch is split, recomputed and its loss taken."""
        super().summary(*args, **kwargs)
        print_fn = kwargs.get("print_fn") or (args[2] if len(args) > 2 else None)
        (print_fn or _io.print_msg)(self._split_summary())

    def _split_summary(self) -> str:
        segments = self.recomputed_segments
        remat = "none" if not segments else (
            f"{len(segments)} recomputed segment(s) (remat={self.remat!r}): "
            + "; ".join(", ".join(names) for names in segments)
        )
        if self.remat_choice:
            remat += f"\n   remat='auto' chose {self.remat_choice}"
        loss = "once on the whole batch's outputs" if self.whole_batch_loss else "per micro-batch"
        return (
            f" Micro-batches: {self._run.setting.describe()}\n"
            f" Recomputation: {remat}\n"
            f" Loss: {loss} (whole_batch_loss={self.whole_batch_loss})"
        )


# An `AccumulatingModel` instance is functional (the subclassed form is the
# user's own class), so the functional form is the one saved and revived.
_keras.register_serializable(package="keras_memopt", name="AccumulatingModel")(
    functional_class(AccumulatingModel)
)
