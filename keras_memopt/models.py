"""`AccumulatingModel`: exact gradient accumulation inside one train step."""

from __future__ import annotations

import tensorflow as tf

from keras_memopt import _keras as K
from keras_memopt import _oom
from keras_memopt import pruning as _pruning
from keras_memopt import remat as _remat
from keras_memopt._validation import positive_int

keras = K.keras

_SPLIT_ARGS = ("micro_batch_size", "accumulation_steps")


def _validate_split(micro_batch_size, accumulation_steps):
    """Checks the micro-batch setting; returns it as a validated pair."""
    if micro_batch_size is not None and accumulation_steps is not None:
        raise ValueError(
            "Pass at most one of `micro_batch_size` (samples per micro-batch) "
            "and `accumulation_steps` (micro-batches per batch). Received: "
            f"micro_batch_size={micro_batch_size!r}, "
            f"accumulation_steps={accumulation_steps!r}"
        )
    if micro_batch_size == "auto":  # resolved by `_oom.AutoSearch` at the first step
        return "auto", None
    if micro_batch_size is not None:
        return positive_int("micro_batch_size", micro_batch_size), None
    if accumulation_steps is None:
        return None, 1
    return None, positive_int("accumulation_steps", accumulation_steps)


def _check_splittable(data):
    for leaf in tf.nest.flatten(data):
        if isinstance(leaf, (tf.RaggedTensor, tf.SparseTensor)):
            raise TypeError(
                "AccumulatingModel splits each batch into micro-batches along "
                "its first axis, which it cannot do for ragged or sparse "
                "tensors. Convert them to dense tensors (for example with "
                "`.to_tensor()` or `tf.sparse.to_dense`) in the input "
                f"pipeline. Received: a batch containing {type(leaf).__name__}"
            )


def _slice(structure, start, size):
    return tf.nest.map_structure(
        lambda t: None if t is None else t[start : start + size], structure
    )


def _check_remat_target(remat, functional, model):
    if remat is not None and not functional:
        raise ValueError(
            "`remat` picks segments in a functional model's graph; a "
            "subclassed model wraps its blocks in `keras_memopt.Remat` "
            f"instead. Received: remat={remat!r} for {type(model).__name__}"
        )


def _accumulator_dtype(variable):
    dtype = tf.as_dtype(variable.dtype)
    return tf.float32 if dtype.is_floating and dtype.size < 4 else dtype


class AccumulatingModel(K.keras.Model):
    """A `keras.Model` whose train step accumulates gradients over micro-batches.

    The batch that the input pipeline delivers is the *effective* batch. The
    train step splits it along its first axis into micro-batches, runs them
    one after another (so only one micro-batch's activations are alive at a
    time), sums their gradients weighted by each micro-batch's share of the
    batch, and applies **one** optimizer update. The update equals the one
    plain Keras computes on the whole batch: losses, metrics, sample and class
    weights, regularisation losses, learning-rate schedules and
    `optimizer.iterations` all see one update per batch. `evaluate` and
    `predict` split large batches the same way.

    Use it in one of three ways:

    - subclass it instead of `keras.Model` and pass `micro_batch_size` (or
      `accumulation_steps`) to `super().__init__`;
    - build it functionally, `AccumulatingModel(inputs, outputs, ...)`;
    - wrap an existing model with `AccumulatingModel.from_model(model, ...)`.

    Notes on semantics:

    - Losses must average over samples (Keras's default reduction,
      `"sum_over_batch_size"`); other reductions are refused at `compile`.
    - `BatchNormalization` normalises each micro-batch with that micro-batch's
      statistics and updates its moving statistics once per micro-batch, in
      order: exactly what plain Keras does when trained on the micro-batches
      one after another.
    - With `jit_compile=True` (or `"auto"` resolving to XLA, as on GPUs), the
      forward and backward pass of each micro-batch is compiled with XLA while
      the loop over micro-batches is not: compiling the whole step would let
      XLA keep every micro-batch's activations alive at once, which undoes the
      memory saving. `model.jit_compile` then reads `False` and
      `model.micro_batch_jit_compile` `True`.
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
        *args, **kwargs: passed on to `keras.Model` (`inputs`, `outputs`,
            `name`, ...).

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
            given, or one is not a positive integer.
    """

    def __new__(cls, *args, **kwargs):
        if K.is_functional_call(args, kwargs) and not issubclass(cls, K.Functional):
            cls = _functional_class(cls)
        return super().__new__(cls, *args, **kwargs)

    def __init__(
        self,
        *args,
        micro_batch_size: int | None = None,
        accumulation_steps: int | None = None,
        remat: str | list[str] | None = None,
        **kwargs,
    ):
        split = _validate_split(micro_batch_size, accumulation_steps)
        remat = _remat.validate_remat(remat)
        _check_remat_target(remat, K.is_functional_call(args, kwargs), self)
        super().__init__(*args, **kwargs)
        self._micro_batch_size, self._accumulation_steps = split
        self._micro_batch_jit_compile = False
        self._remat, self._remat_plan = None, None
        self._set_remat(remat)

    @classmethod
    def from_model(
        cls,
        model: keras.Model,
        *,
        micro_batch_size: int | None = None,
        accumulation_steps: int | None = None,
        remat: str | list[str] | None = None,
        name: str | None = None,
    ) -> AccumulatingModel:
        """Wraps an existing model; the result shares its layers and weights.

        A functional or `Sequential` model is rebuilt as a functional
        `AccumulatingModel` over the same layers; a subclassed model is called
        as one layer, so it must have been built (called once) first.

        Args:
            model: a built `keras.Model`.
            micro_batch_size, accumulation_steps, remat: as for the
                constructor.
            name: the new model's name. Defaults to the wrapped model's name.

        Returns:
            An `AccumulatingModel` that trains, evaluates and predicts exactly
            as `model` would, in micro-batches.
        """
        split = dict(micro_batch_size=micro_batch_size, accumulation_steps=accumulation_steps)
        _validate_split(**split)
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
        return cls(inputs, outputs, name=name or model.name, remat=remat, **split)

    # -- the micro-batch setting ------------------------------------------------

    @property
    def micro_batch_size(self) -> int | None:
        """Samples per micro-batch, or None when `accumulation_steps` is set.

        Setting it (for example from a callback) takes effect at the next
        step: the train, test and predict functions are rebuilt.
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
    def micro_batch_jit_compile(self) -> bool:
        """Whether each micro-batch's step is compiled with XLA."""
        return self._micro_batch_jit_compile

    def _set_split(self, micro_batch_size=None, accumulation_steps=None):
        split = _validate_split(micro_batch_size, accumulation_steps)
        if split != (self._micro_batch_size, self._accumulation_steps):
            self._micro_batch_size, self._accumulation_steps = split
            # Python numbers baked into traced step functions go stale; the
            # ones already made are rebuilt now, since `fit` looks them up
            # again at every step.
            self._rebuild_step_functions()

    def _rebuild_step_functions(self):
        for kind in ("train", "test", "predict"):
            if getattr(self, f"{kind}_function", None) is not None:
                getattr(self, f"make_{kind}_function")(force=True)

    @property
    def remat(self) -> str | list[str] | None:
        """The recomputed segments: None, "auto" or the cut layers' names.

        Setting it re-plans the segments and rebuilds the step functions.
        """
        return self._remat if not isinstance(self._remat, tuple) else list(self._remat)

    @remat.setter
    def remat(self, value):
        self._set_remat(value)

    def _set_remat(self, remat):
        remat = _remat.validate_remat(remat)
        _check_remat_target(remat, isinstance(self, K.Functional), self)
        plan = _remat.build_plan(self, remat)
        # Plain holders: Keras must not track the segments as sublayers.
        self._remat = remat if remat is None or isinstance(remat, str) else tuple(remat)
        self._remat_plan = plan
        if getattr(self, "train_function", None) is not None:
            self.make_train_function(force=True)

    def _micro_size(self, batch_size):
        if self._micro_batch_size is not None:
            return tf.constant(self._micro_batch_size, batch_size.dtype)
        steps = tf.constant(self._accumulation_steps, batch_size.dtype)
        return tf.maximum((batch_size + steps - 1) // steps, 1)

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
        super().compile(*args, **K.compile_kwargs(jit_compile), **kwargs)
        self._micro_batch_jit_compile = K.resolve_jit_compile(self, jit_compile)
        self._jit_compile_requested = jit_compile  # OOMBackoff treats "auto" apart
        if not K.LEGACY:
            self.jit_compile = False

    def compile_from_config(self, config):
        # Keras skips an overridden `compile` when loading a model; this one
        # only adds checks, so a loaded model comes back compiled.
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built and self.optimizer is not None:
            self.optimizer.build(self.trainable_variables)

    # -- the step functions: wrapped so that OOMBackoff can retry a batch ----------

    def make_train_function(self, force=False):
        return _oom.make_function(self, "train", super().make_train_function, force)

    def make_test_function(self, force=False):
        return _oom.make_function(self, "test", super().make_test_function, force)

    def make_predict_function(self, force=False):
        return _oom.make_function(self, "predict", super().make_predict_function, force)

    # -- the steps ----------------------------------------------------------------

    def _forward(self, x, training):
        if training and self._remat_plan is not None:
            return self._remat_plan(x, training=training)
        return self(x, training=training)

    def _build_before_loop(self, x):
        """Builds a model that has not been called yet on a one-sample batch.

        Keras builds such (subclassed) models in their first traced step, but
        TensorFlow cannot create variables inside the micro-batch loop, and
        the loop needs the variables to size its accumulators.
        """
        if self.built:
            return

        def one_sample(t):
            shape = [1, *t.shape[1:]]
            if None in shape:
                raise ValueError(
                    "AccumulatingModel could not build the model from the "
                    "input's shape, which has unknown dimensions. Build it "
                    "first by calling it once on a batch. Received: an input "
                    f"of shape {t.shape}"
                )
            return tf.zeros(shape, t.dtype)

        with tf.init_scope():
            self(tf.nest.map_structure(one_sample, x), training=False)

    def _micro_gradients(self, x, y, sample_weight, fraction):
        """Loss share and (loss-scaled) gradients of one micro-batch."""
        with tf.GradientTape() as tape:
            y_pred = self._forward(x, training=True)
            loss = K.compute_loss(self, x, y, y_pred, sample_weight, training=True)
            share = loss * tf.cast(fraction, loss.dtype)
            scaled = K.scale_loss(self.optimizer, share)
        gradients = tape.gradient(scaled, self.trainable_variables)
        K.update_metrics(self, x, y, y_pred, sample_weight)
        return share, gradients

    def _loop(self, data, body, initial):
        """Runs `body(x, y, sample_weight, fraction, *state)` per micro-batch.

        Micro-batches run strictly one after another (`parallel_iterations=1`)
        so that TensorFlow cannot keep two micro-batches' activations alive.
        """
        _check_splittable(data)
        x, y, sample_weight = K.unpack_x_y_sample_weight(data)
        self._build_before_loop(x)
        leaves = [t for t in tf.nest.flatten(x) if t is not None]
        batch_size = tf.shape(leaves[0])[0]
        size = self._micro_size(batch_size)
        count = (batch_size + size - 1) // size

        def step(i, *state):
            start = i * size
            fraction = tf.cast(tf.minimum(size, batch_size - start), tf.float32) / (
                tf.cast(batch_size, tf.float32)
            )
            parts = (_slice(x, start, size), _slice(y, start, size))
            parts += (_slice(sample_weight, start, size),)
            return (i + 1, *body(*parts, fraction, *state))

        _, *state = tf.while_loop(
            lambda i, *_: i < count,
            step,
            (tf.constant(0, batch_size.dtype), *initial),
            parallel_iterations=1,
        )
        return batch_size, state

    def train_step(self, data):
        _check_splittable(data)
        self._build_before_loop(K.unpack_x_y_sample_weight(data)[0])
        variables = self.trainable_variables
        micro_gradients = self._micro_gradients
        if self._micro_batch_jit_compile:
            micro_gradients = tf.function(micro_gradients, jit_compile=True)
        missing = set()  # variables the loss does not depend on
        # Update counters that layers advance at each training call (tfmot's
        # `pruning_step`) restart from the same value in every micro-batch, so
        # they advance once per update.
        counters = _pruning.step_counters(self)
        starts = [c.read_value() for c in counters]

        def body(x, y, sample_weight, fraction, loss, sums):
            restarts = [c.assign(s) for c, s in zip(counters, starts, strict=True)]
            with tf.control_dependencies(restarts):
                share, gradients = micro_gradients(x, y, sample_weight, fraction)
            new_sums = []
            for index, (total, gradient) in enumerate(zip(sums, gradients, strict=True)):
                if gradient is None:
                    missing.add(index)
                    new_sums.append(total)
                else:
                    gradient = tf.convert_to_tensor(gradient)  # IndexedSlices
                    new_sums.append(total + tf.cast(gradient, total.dtype))
            return loss + tf.cast(share, tf.float32), new_sums

        zeros = [tf.zeros(v.shape, _accumulator_dtype(v)) for v in variables]
        batch_size, (loss, sums) = self._loop(data, body, (tf.constant(0.0), zeros))
        K.track_loss(self, loss, batch_size)
        if variables:
            gradients = [
                None if i in missing else tf.cast(g, v.dtype)
                for i, (g, v) in enumerate(zip(sums, variables, strict=True))
            ]
            K.apply_gradients(self.optimizer, gradients, variables)
        return self.get_metrics_result()

    def test_step(self, data):
        def body(x, y, sample_weight, fraction, loss):
            y_pred = self._forward(x, training=False)
            micro_loss = K.compute_loss(self, x, y, y_pred, sample_weight, training=False)
            K.update_metrics(self, x, y, y_pred, sample_weight)
            return (loss + tf.cast(micro_loss, tf.float32) * fraction,)

        batch_size, (loss,) = self._loop(data, body, (tf.constant(0.0),))
        K.track_loss(self, loss, batch_size)
        return self.get_metrics_result()

    def predict_step(self, data):
        x, _, _ = K.unpack_x_y_sample_weight(data)
        _check_splittable(x)
        self._build_before_loop(x)
        leaves = [t for t in tf.nest.flatten(x) if t is not None]
        batch_size = tf.shape(leaves[0])[0]
        size = self._micro_size(batch_size)
        count = (batch_size + size - 1) // size
        # The first micro-batch runs outside the loop to learn the outputs'
        # structure and dtypes.
        first = self._forward(_slice(x, 0, size), training=False)
        flat = tf.nest.flatten(first)
        arrays = [
            tf.TensorArray(t.dtype, size=count, infer_shape=False).write(0, t)
            for t in flat
        ]

        def step(i, arrays):
            outputs = tf.nest.flatten(self._forward(_slice(x, i * size, size), training=False))
            return i + 1, [a.write(i, t) for a, t in zip(arrays, outputs, strict=True)]

        _, arrays = tf.while_loop(
            lambda i, _: i < count, step, (tf.constant(1, batch_size.dtype), arrays),
            parallel_iterations=1,
        )
        return tf.nest.pack_sequence_as(first, [a.concat() for a in arrays])

    # -- serialisation ---------------------------------------------------------------

    def get_config(self):
        config = K.functional_config(self, super().get_config())
        config["micro_batch_size"] = self._micro_batch_size
        config["accumulation_steps"] = self._accumulation_steps
        config["remat"] = self.remat
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        split = {name: config.pop(name, None) for name in _SPLIT_ARGS}
        remat = config.pop("remat", None)
        model = super().from_config(config, custom_objects=custom_objects)
        model._set_split(**split)
        model._set_remat(remat)
        return model


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
