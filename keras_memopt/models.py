"""`AccumulatingModel`: exact gradient accumulation inside one train step."""

from __future__ import annotations

import tensorflow as tf

from keras_memopt import _keras as K
from keras_memopt import _loop, _losses, _oom, _runner, distribute, placement, supervise
from keras_memopt import remat as _remat
from keras_memopt._steps import MicroBatchSteps
from keras_memopt._validation import micro_batch_split

keras = K.keras

_SETTING_ARGS = (
    "micro_batch_size", "accumulation_steps", "remat", "replica_shares", "devices", "device_cuts"
)


class AccumulatingModel(MicroBatchSteps, placement.Placed, K.keras.Model):
    """A `keras.Model` whose train step accumulates gradients over micro-batches.

    The batch that the input pipeline delivers is the *effective* batch. The
    train step splits it along its first axis into micro-batches, runs them
    one after another (so only one micro-batch's activations are alive at a
    time), adds up their gradients, each micro-batch weighted by its share of
    the batch's loss, and applies **one** optimizer update: the update plain
    Keras computes on the whole batch. Losses, per-output losses and metrics,
    sample and class weights, masks, regularisation, learning-rate schedules
    and `optimizer.iterations` all see one update per batch. `evaluate` and
    `predict` split large batches the same way.

    Use it in one of three ways:

    - subclass it instead of `keras.Model` and pass `micro_batch_size` (or
      `accumulation_steps`) to `super().__init__`;
    - build it functionally, `AccumulatingModel(inputs, outputs, ...)`;
    - wrap an existing model with `AccumulatingModel.from_model(model, ...)`.

    Notes on semantics:

    - A micro-batch's share of the loss is its count over the batch's, as
      Keras counts: samples, or, for an output with a mask
      (`Embedding(mask_zero=True)`), unmasked elements (counted in a forward
      pass over the batch before the loop, in inference mode). A term of
      `model.losses` (`add_loss`) that sums over samples counts once per
      micro-batch; one that averages counts with the micro-batch's share; a
      term that does neither is refused at the first step, and so is a loss
      function that does not average over samples (a `keras.losses.Loss` with
      a reduction other than the default is refused at `compile`). The user
      guide's accumulation page states the rules.
    - Sparse gradients (an `Embedding`'s) stay sparse: the optimizer gets one
      `tf.IndexedSlices` with every micro-batch's rows, as from one tape over
      the whole batch.
    - `BatchNormalization` normalises each micro-batch with that micro-batch's
      statistics and updates its moving statistics once per micro-batch, in
      order: exactly what plain Keras does when trained on the micro-batches
      one after another.
    - The micro-batch size is run-time state of the step: changing it (by
      hand, from a callback, by `OOMBackoff`) retraces nothing. Changing
      `remat`, or compiling again, traces the step anew.
    - With `jit_compile=True` (or `"auto"` resolving to XLA, as on GPUs), the
      forward and backward pass of each micro-batch is compiled with XLA while
      the loop over micro-batches is not: compiling the whole step would let
      XLA keep every micro-batch's activations alive at once, which undoes the
      memory saving. XLA compiles once per micro-batch shape (the last
      micro-batch of a batch may be a second shape). `model.jit_compile` then
      reads `False` and `model.micro_batch_jit_compile` `True`.
    - Under a `tf.distribute` strategy, `micro_batch_size` counts samples per
      replica (each replica splits its share of the batch).
    - Mixed precision: gradients are accumulated in float32; with a
      loss-scale optimizer (`mixed_float16`), one non-finite micro-batch makes
      the whole update non-finite, so it is skipped and the loss scale lowered,
      as `LossScaleOptimizer` does for a plain batch.

    Args:
        micro_batch_size: int, the number of samples in each micro-batch. The
            last micro-batch of a batch may be smaller; a batch smaller than
            `micro_batch_size` is one micro-batch. `"auto"`: at the first step,
            the largest size that runs, found by trying real steps (failed
            attempts rolled back), starting from the whole batch and shrinking
            by half (or by an attached `OOMBackoff`'s factor); the choice and
            its cost are printed and kept in `model.micro_batch_search`.
        accumulation_steps: int, the number of micro-batches to split each
            batch into, as evenly as possible. Give at most one of
            `micro_batch_size` and `accumulation_steps`; with neither, each
            batch is one micro-batch (until, say, `OOMBackoff` shrinks it).
        remat: recomputed ("rematerialised") segments of a functional model:
            their activations are freed after the forward pass and recomputed
            in the backward pass, exactly (same dropout masks, BatchNorm
            statistics updated once). `"auto"` chooses the segments from the
            graph and its activation sizes (see `keras_memopt.remat.
            plan_segments`); a list of layer names cuts the model after each
            named layer, whose output must separate the graph, and recomputes
            every segment but the last. Subclassed models wrap blocks in
            `keras_memopt.Remat` instead. Defaults to `None` (no
            recomputation).
        devices: list of device names (`["/GPU:0", "/GPU:1"]`): cuts a
            functional model into one segment per device, each segment's
            variables and computation on its device (model parallelism; the
            segments run one after another). Defaults to `None` (one device).
        device_cuts: `"auto"` (balanced by memory) or the names of the
            `len(devices) - 1` layers whose outputs end the segments, as for
            `remat`. See `keras_memopt.placement`. Defaults to `"auto"`.
        *args, **kwargs: passed on to `keras.Model` (`inputs`, `outputs`,
            `name`, ...).

    Attributes:
        oom_policy: the out-of-memory policy the step runner follows (a
            `keras_memopt.callbacks.OOMBackoff` attaches one for the length of
            `fit`, `evaluate` or `predict`), or None: an out-of-memory error
            then stops training as it would in plain Keras.

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
        ValueError: if both `micro_batch_size` and `accumulation_steps` are
            given, or one is not a positive integer; for `remat`, `devices` or
            `device_cuts` that do not fit the model (before it changes).
    """

    def __new__(cls, *args, **kwargs):
        # As in Keras: (inputs, outputs) make a functional model only when they
        # reach this constructor; a subclass's own constructor may take two
        # positional arguments of its own (`Distiller(teacher, student)`).
        own_constructor = cls.__init__ is not AccumulatingModel.__init__
        functional = issubclass(cls, K.Functional)
        if not own_constructor and not functional and K.is_functional_call(args, kwargs):
            cls = _functional_class(cls)
        return super().__new__(cls, *args, **kwargs)

    def __init__(
        self,
        *args,
        micro_batch_size: int | str | None = None,
        accumulation_steps: int | None = None,
        remat: str | list[str] | None = None,
        replica_shares: list[float] | str | None = None,
        devices: list[str] | None = None,
        device_cuts: str | list[str] | None = None,
        **kwargs,
    ):
        split = micro_batch_split(micro_batch_size, accumulation_steps)
        remat = _remat.validate_remat(remat)
        shares = distribute.resolve_shares(replica_shares, tf.distribute.get_strategy())
        functional = K.is_functional_call(args, kwargs)
        _remat.check_target(remat, functional, self)
        placement.validate(devices, device_cuts, self, functional)
        if functional and not isinstance(self, K.Functional):
            # A subclass's constructor passing (inputs, outputs) on: become its
            # functional form here, before Keras would rewrite the bases of
            # every class up to `keras.Model` (AccumulatingModel's included).
            object.__setattr__(self, "__class__", _functional_class(type(self)))
        super().__init__(*args, **kwargs)
        # A plain holder: Keras must not track (nor save) the setting's variables.
        self._setting = _loop.MicroBatchSetting(
            tf.distribute.get_strategy().num_replicas_in_sync,
            cap=supervise.max_micro_batch_size(),
        )
        self._micro_batch_size = self._accumulation_steps = None
        self._set_split(*split)
        self._replica_shares = shares
        self._micro_batch_jit_compile = False
        self._loss_split = _losses.LossSplit(self)
        self._accumulating = False
        self.oom_policy = None
        self._set_placement(devices, device_cuts)
        self._remat, self._segment_plan = None, None
        self._set_remat(remat)

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
    ) -> AccumulatingModel:
        """Wraps an existing model; the result shares its layers and weights.

        A functional or `Sequential` model is rebuilt as a functional
        `AccumulatingModel` over the same layers; a subclassed model is called
        as one layer, so it must have been built (called once) first.

        Args:
            model: a built `keras.Model`.
            micro_batch_size, accumulation_steps, remat, devices, device_cuts: as
                for the constructor.
            name: the new model's name. Defaults to the wrapped model's name.

        Returns:
            An `AccumulatingModel` that trains, evaluates and predicts exactly
            as `model` would, in micro-batches.
        """
        split = dict(micro_batch_size=micro_batch_size, accumulation_steps=accumulation_steps)
        micro_batch_split(**split)
        _remat.validate_remat(remat)
        if not isinstance(model, keras.Model):
            raise TypeError(
                "`model` must be a `keras.Model`. "
                f"Received: model={model!r} of type {type(model).__name__}"
            )
        try:
            inputs, outputs = model.inputs, model.outputs
        except (AttributeError, ValueError):
            inputs = outputs = None
        if not inputs:
            shape = K.built_input_shape(model) if model.built else None
            if shape is None:
                raise ValueError(
                    "`model` must be built on a single input before it can be "
                    "wrapped: call it once on a batch (or call "
                    "`model.build(input_shape)`), or subclass AccumulatingModel "
                    f"instead. Received: model={model.name!r} (built={model.built})"
                )
            inputs = keras.Input(batch_shape=shape)
            outputs = model(inputs)
        placed = dict(devices=devices, device_cuts=device_cuts)
        return cls(inputs, outputs, name=name or model.name, remat=remat, **split, **placed)

    # -- the micro-batch setting ------------------------------------------------

    @property
    def micro_batch_size(self) -> int | str | None:
        """Samples per micro-batch, `"auto"` before its search, or None.

        None when `accumulation_steps` is set, or when neither is (each batch
        is one micro-batch). Setting it, also in the middle of `fit` (from a
        callback), takes effect at the next step and retraces nothing.
        """
        return self._micro_batch_size

    @micro_batch_size.setter
    def micro_batch_size(self, value):
        self._set_split(micro_batch_size=value)

    @property
    def accumulation_steps(self) -> int | None:
        """Micro-batches per batch, or None when `micro_batch_size` is set."""
        return self._accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, value):
        self._set_split(accumulation_steps=value)

    @property
    def replica_shares(self) -> tuple[float, ...] | None:
        """Each replica's share of every batch, or None (even parts, as Keras splits)."""
        return self._replica_shares

    @property
    def micro_batch_jit_compile(self) -> bool:
        """Whether each micro-batch's step is compiled with XLA."""
        return self._micro_batch_jit_compile

    @micro_batch_jit_compile.setter
    def micro_batch_jit_compile(self, value: bool):
        if bool(value) != self._micro_batch_jit_compile:
            self._micro_batch_jit_compile = bool(value)
            self._retrace()

    def _set_split(self, micro_batch_size=None, accumulation_steps=None):
        split = micro_batch_split(micro_batch_size, accumulation_steps)
        replicas = self._setting.replicas
        if isinstance(split[0], tuple) and len(split[0]) != replicas:
            raise ValueError(
                "`micro_batch_size` as a list gives one size per replica, and the "
                f"model's strategy has {replicas} replica(s). Received: "
                f"micro_batch_size={list(split[0])!r}"
            )
        self._micro_batch_size, self._accumulation_steps = split
        size = split[0] if split[0] != "auto" else None
        self._setting.assign(size, split[1])

    def micro_batch_size_for(self, batch_size: int | None) -> int | None:
        """The micro-batch size a step on a batch of `batch_size` samples runs with.

        Per replica under a distribution strategy; None when `batch_size` is
        None and the size depends on it.
        """
        return self._setting.in_use(batch_size)

    def _retrace(self):
        """Makes the step functions trace again at their next step."""
        for kind in ("train", "test", "predict"):
            function = getattr(self, f"{kind}_function", None)
            if isinstance(function, _runner.StepRunner):
                function.reset()

    @property
    def remat(self) -> str | list[str] | None:
        """The recomputed segments: None, "auto" or the cut layers' names.

        Setting it re-plans the segments; the next training step runs with
        them (the train step is traced again).
        """
        return self._remat if not isinstance(self._remat, tuple) else list(self._remat)

    @remat.setter
    def remat(self, value):
        self._set_remat(value)

    def _set_remat(self, remat):
        remat = _remat.validate_remat(remat)
        _remat.check_target(remat, isinstance(self, K.Functional), self)
        plan = placement.build_plan(self, remat, self._placement)
        # Plain holders: Keras must not track the segments as sublayers.
        self._remat = remat if remat is None or isinstance(remat, str) else tuple(remat)
        self._segment_plan = plan
        self._retrace()

    # -- compile ------------------------------------------------------------------

    def compile(self, *args, jit_compile="auto", **kwargs):
        loss = kwargs.get("loss", args[1] if len(args) > 1 else None)
        for item in tf.nest.flatten(loss):
            reduction = K.loss_reduction(item)
            if not K.mean_reduction(reduction):
                raise ValueError(
                    "AccumulatingModel needs losses that average over the "
                    "samples of a batch (reduction='sum_over_batch_size', "
                    "Keras's default) so that micro-batches weighted by their "
                    "share of the batch add up to the batch's loss. Received: "
                    f"loss={item!r} with reduction={reduction!r}"
                )
        jit = placement.jit_compile(self._placement, jit_compile)
        super().compile(*args, **K.compile_kwargs(jit), **kwargs)
        self._micro_batch_jit_compile = K.resolve_jit_compile(self, jit)
        self._jit_compile_requested = jit_compile  # OOMBackoff treats "auto" apart
        self._loss_split = _losses.LossSplit(self)
        if not K.LEGACY:
            self.jit_compile = False
        if self._placement is not None:
            placement.build_optimizer(self.optimizer, self.trainable_variables)

    def get_compile_config(self):
        # Keras 3's `clone_model` rebuilds a functional model from its inputs
        # and outputs and passes on only the compile config: the micro-batch
        # setting travels with it.
        config = super().get_compile_config()
        if not config:  # not compiled
            return config
        return {**config, "micro_batch": self._setting_config()}

    def compile_from_config(self, config):
        # Keras skips an overridden `compile` when loading a model; this one
        # only adds checks, so a loaded model comes back compiled.
        config = dict(config)
        setting = config.pop("micro_batch", None)
        if setting:
            self._apply_setting(setting)
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built and self.optimizer is not None:
            self.optimizer.build(self.trainable_variables)

    # -- the step functions: one runner each --------------------------------------

    def _make_runner(self, kind, force):
        attribute = f"{kind}_function"
        if getattr(self, attribute, None) is None or force:
            # The loss check is about the steps' own loss: not a custom step's.
            step_name = f"{kind}_step"
            own_step = getattr(type(self), step_name) is getattr(MicroBatchSteps, step_name)
            first = self._loss_split.check if kind != "predict" and own_step else None
            step = self._checked_train_step if kind == "train" else None
            runner = _runner.StepRunner(
                self, kind, step=step, halves=self._split_step(kind), first_batch=first,
                chose=self._record_search,
            )
            setattr(self, attribute, runner)
        return getattr(self, attribute)

    def make_train_function(self, force=False):
        return self._make_runner("train", force)

    def make_test_function(self, force=False):
        return self._make_runner("test", force)

    def make_predict_function(self, force=False):
        return self._make_runner("predict", force)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras 3 only (see `_keras.symbolic_build`).
        if iterator is not None:
            data_batch = distribute.first_local_batch(self.distribute_strategy, iterator)
        with _oom.state_must_fit():
            K.symbolic_build(self, data_batch)

    def save(self, filepath, *args, **kwargs):
        # Under several workers Keras 3 makes every worker write the same file
        # (`ModelCheckpoint` included): the chief writes, the others skip.
        if distribute.writes_files(self.distribute_strategy):
            return super().save(filepath, *args, **kwargs)
        return None

    def save_weights(self, filepath, *args, **kwargs):
        if distribute.writes_files(self.distribute_strategy):
            return super().save_weights(filepath, *args, **kwargs)
        return None

    def _record_search(self, report):
        # A plain dict: Keras would otherwise track (and wrap) it as model state.
        object.__setattr__(self, "micro_batch_search", report)

    # -- serialisation ---------------------------------------------------------------

    def _setting_config(self):
        shares = self._replica_shares
        return dict(
            micro_batch_size=self._micro_batch_size,
            accumulation_steps=self._accumulation_steps,
            remat=self.remat,
            replica_shares=list(shares) if shares is not None else None,
            **placement.config(self._placement),
        )

    def get_config(self):
        return {**K.functional_config(self, super().get_config()), **self._setting_config()}

    def __reduce__(self):
        # Keras 3 pickles a model as `type(model)._unpickle_model`, found by the
        # class's name: the functional form is named after the class it
        # extends, so it is pickled as that class (the method ignores `cls`).
        function, args = super().__reduce__()
        owner = getattr(function, "__self__", None)
        if owner in _FUNCTIONAL_CLASSES.values():
            function = getattr(owner.__bases__[0], function.__name__)
        return function, args

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        setting = {name: config.pop(name, None) for name in _SETTING_ARGS}
        model = super().from_config(config, custom_objects=custom_objects)
        model._apply_setting(setting)
        return model

    def _apply_setting(self, setting):
        """Sets what `_setting_config` returned (from a config, or a clone's compile config)."""
        setting = dict(setting)
        remat, shares = setting.pop("remat", None), setting.pop("replica_shares", None)
        devices, device_cuts = setting.pop("devices", None), setting.pop("device_cuts", None)
        self._set_split(**setting)
        self._set_placement(devices, device_cuts)
        self._set_remat(remat)
        self._replica_shares = distribute.resolve_shares(shares, self.distribute_strategy)


_FUNCTIONAL_CLASSES: dict[type, type] = {}


def _functional_class(cls):
    """`cls` with Keras's functional model class mixed in.

    Keras turns a `Model` subclass built from inputs and outputs into a
    functional model by rewriting the class's bases in place, which would
    break every later subclassed use of `AccumulatingModel`. A dedicated
    subclass per class keeps `AccumulatingModel` itself untouched.
    """
    if cls not in _FUNCTIONAL_CLASSES:
        functional = type(cls.__name__, (cls, K.Functional), {"__module__": cls.__module__})
        _FUNCTIONAL_CLASSES[cls] = functional
    return _FUNCTIONAL_CLASSES[cls]


# An `AccumulatingModel` instance is functional (the subclassed form is the
# user's own class), so the functional form is the one saved and revived.
K.register_serializable(package="keras_memopt", name="AccumulatingModel")(
    _functional_class(AccumulatingModel)
)
