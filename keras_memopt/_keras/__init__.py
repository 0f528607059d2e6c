"""The one seam between keras_memopt and the Keras line in use: Keras 3, or tf_keras where
`TF_USE_LEGACY_KERAS` is set (as TensorFlow reads it). What differs between them lives here."""

import contextlib
import os
import warnings

import tensorflow as tf

LEGACY = os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true")

if LEGACY:
    import tf_keras as keras
else:
    import keras

# Keras's backend: "tensorflow" on both lines, or "jax" (Keras 3; then `jax_models` is exported).
BACKEND = "tensorflow" if LEGACY else keras.config.backend()

# Keras hides its functional class; `Model.__new__` returns it (uninitialised) for functional args.
Functional = type(keras.Model.__new__(keras.Model, inputs=[], outputs=[]))
InputLayer = keras.layers.InputLayer

register_serializable = keras.saving.register_keras_serializable
unpack_x_y_sample_weight = keras.utils.unpack_x_y_sample_weight

# What the two lines do differently, named for what the rest of the package needs to know.
# Keras 3's `predict` pulls its batches itself and hands the step function a list of them.
PREDICT_HANDS_A_LIST = not LEGACY
# tf_keras sums the replicas' step outputs (their values agree), Keras 3 averages them.
REPLICA_OUTPUTS_SUMMED = LEGACY
# tf_keras sends a non-chief worker's checkpoint files to temporary paths itself.
REDIRECTS_NON_CHIEF_FILES = LEGACY
# tf_keras cannot move a layer's variables to another device once they exist.
MOVES_VARIABLES = not LEGACY
# tf_keras keeps each epoch's iterator in reference cycles, its prefetched batches held until gc.
ITERATORS_IN_CYCLES = LEGACY
# Keras 3 layers keep their random state in seed generator variables (a backup saves
# them); tf_keras layers draw from stateful random ops by default.
RANDOM_STATE_IN_VARIABLES = not LEGACY
# Keras 3 lets a step replace `model.losses` (`_losses_override`); tf_keras has no such hook.
REPLACES_MODEL_LOSSES = not LEGACY

def check_line(name, value):
    """Raises when `value` holds objects of the other Keras line than the one in use (importing
    tensorflow-model-optimization sets tf_keras while `import keras` stays Keras 3)."""
    ours = "tf_keras" if LEGACY else "keras"
    for leaf in tf.nest.flatten(value):
        line = type(leaf).__module__.split(".")[0]
        if line in ("keras", "tf_keras") and line != ours:
            switch = "set" if LEGACY else "not set"
            raise TypeError(
                f"keras_memopt runs on {ours} in this process (TF_USE_LEGACY_KERAS was "
                f"{switch} when it was imported; importing tensorflow_model_optimization "
                f"sets it), but `{name}` holds {line} objects, which do not mix with "
                f"{ours}'s. Build the "
                f"model with {'`import tf_keras as keras`' if LEGACY else '`import keras`'}, "
                "or set TF_USE_LEGACY_KERAS before anything imports TensorFlow. Received: "
                f"{name} of type {type(leaf).__module__}.{type(leaf).__name__}"
            )


def is_functional_call(args, kwargs):
    """Whether model constructor arguments describe a functional model."""
    return (
        len(args) == 2
        or (len(args) == 1 and "outputs" in kwargs)
        or ("inputs" in kwargs and "outputs" in kwargs)
    )


def resolve_jit_compile(model, jit_compile):
    """What `compile(jit_compile=...)` resolves to for this model."""
    if LEGACY:
        return bool(jit_compile) and jit_compile != "auto"
    return bool(model.jit_compile)


def compile_kwargs(jit_compile):
    """`compile` keyword arguments for the outer step's compilation."""
    return {"jit_compile": False} if LEGACY else {"jit_compile": jit_compile}


def leave_step_uncompiled(model):
    """Keras 3: the outer step is not XLA-compiled (each micro-batch's pass may be)."""
    if not LEGACY:
        model.jit_compile = False


def step_jit_compile(model) -> bool:
    """Whether the outer step function is compiled with XLA (never on tf_keras)."""
    return False if LEGACY else bool(model.jit_compile)


def jit_compile_requested(model) -> bool:
    """Whether XLA was asked for (`jit_compile=True`), not chosen by "auto" (never on tf_keras)."""
    return LEGACY or (model.get_compile_config() or {}).get("jit_compile") is True


def calls_with_training(model) -> bool:
    """Whether the steps call `model` with `training=`: tf_keras always; Keras 3 only
    where its `call` takes it (else its layers run at their defaults, in `fit` too)."""
    return LEGACY or bool(model._call_has_training_arg)


def step_counter(model, kind):
    """tf_keras's own counter of `kind` ("train", "test", "predict") steps, or None."""
    return getattr(model, f"_{kind}_counter", None) if LEGACY else None


def step_counters(model) -> list:
    """tf_keras's own step counters, which its step functions advance."""
    counters = (step_counter(model, kind) for kind in ("train", "test", "predict"))
    return [counter for counter in counters if counter is not None]


def get_mask(tensor):
    """The Keras mask a tensor carries (an `Embedding(mask_zero=True)`'s), or None."""
    return getattr(tensor, "_keras_mask", None)


def set_mask(tensor, mask):
    """Attaches a Keras mask to a tensor, as both lines' layers do."""
    tensor._keras_mask = mask
    return tensor


def masks_of(outputs):
    """The Keras masks of a call's outputs (None where a tensor has none)."""
    return tf.nest.map_structure(get_mask, outputs)


def with_masks(outputs, masks):
    """`outputs` (a custom gradient's new tensors) with the masks `masks_of` read from the call."""
    for tensor, mask in zip(tf.nest.flatten(outputs), tf.nest.flatten(masks), strict=True):
        if mask is not None:
            set_mask(tensor, mask)
    return outputs


def logits_of(tensor):
    """What Keras's cross-entropies read in place of a softmax or sigmoid output (whatever
    `from_logits` says): `_keras_logits`, or a Softmax/Sigmoid op's input, or None."""
    logits = getattr(tensor, "_keras_logits", None)
    if logits is not None:
        return logits
    try:
        op = tensor.op
    except AttributeError:  # an eager tensor: only the attribute counts
        return None
    if op.type in _LOGIT_OPS and len(op.inputs) == 1:
        return op.inputs[0]
    return None


_LOGIT_OPS = {"Softmax": tf.nn.softmax, "Sigmoid": tf.math.sigmoid}


def carry_logits(tensor, logits, like):
    """`tensor`, built from outputs such as `like` (repeated, concatenated), as Keras's losses
    read `like`; `logits` is built from their `logits_of` the same way."""
    if logits is None:
        return tensor
    if getattr(like, "_keras_logits", None) is not None:
        tensor._keras_logits = logits
        return tensor
    return _LOGIT_OPS[like.op.type](logits)


@contextlib.contextmanager
def mask_warning_silenced():
    """Keras 3 warns that a functional model called on a masked tensor "will therefore
    destroy the mask information"; a segment's layers read that mask and give its
    outputs theirs (`keras_memopt._remat.segments`), so for a segment it is wrong."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*will therefore destroy the mask")
        yield


def update_metrics(model, x, y, y_pred, sample_weight):
    """Updates the compiled metrics with one micro-batch; results come later."""
    if LEGACY:
        # tf_keras's `compute_metrics` also reads results: a `merge_call`, not allowed in the loop.
        model.compiled_metrics.update_state(y, y_pred, sample_weight)
    else:
        model.compute_metrics(x, y, y_pred, sample_weight)


def compiled_metric_results(model) -> dict:
    """The compiled metrics' results by name (neither the loss nor the layers' own)."""
    if LEGACY:
        container = model.compiled_metrics
        metrics = container.metrics if container is not None else []
        return {metric.name: metric.result() for metric in metrics}
    compiled = getattr(model, "_compile_metrics", None)
    return dict(compiled.result()) if compiled is not None and compiled.built else {}


def scale_loss(optimizer, loss):
    """Applies the loss scale of a mixed-precision optimizer, if any."""
    if optimizer is None:
        return loss
    if LEGACY:
        if isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer):
            return optimizer.get_scaled_loss(loss)
        return loss
    return optimizer.scale_loss(loss)


def build_optimizer(optimizer, variables):
    """Makes `optimizer`'s variables now, outside any traced step (inside, they cause a retrace)."""
    if optimizer is None or not variables:
        return
    with tf.init_scope():
        if hasattr(optimizer, "build"):
            if not (getattr(optimizer, "built", False) or getattr(optimizer, "_built", False)):
                optimizer.build(variables)
        else:  # tf_keras.optimizers.legacy
            optimizer._create_all_weights(variables)


def symbolic_build(model, data_batch):
    """Keras 3: builds the model, compiled metrics, losses and optimizer from a batch's shapes,
    so that the first step is traced once (Keras does so only under a strategy, and reduces
    the batch across replicas, which fails across workers: `data_batch` is one replica's)."""
    if LEGACY:
        return
    with model.distribute_strategy.scope(), warnings.catch_warnings():
        # Keras says it in the traced step, as often as for a plain model.
        warnings.filterwarnings("ignore", message="The structure of `inputs` doesn't match")
        try:
            model._symbolic_build(data_batch=strip_optionals(data_batch))
        except ValueError as error:
            # Keras builds the loss on symbolic outputs, without `add_loss` terms: a loss of only
            # those (`compile(loss=[None, None])`) is "no loss" there; all but the optimizer built.
            if "No loss to compute" not in str(error) or any(tf.nest.flatten(model.loss)):
                raise
            model.optimizer.build(model.trainable_variables)


def build_step_state(model, x, y):
    """tf_keras: makes the optimizer's variables and compiled metrics from one small batch
    (run in inference mode), so that the first step is traced once (Keras 3: `symbolic_build`)."""
    if not LEGACY:
        return
    build_optimizer(model.optimizer, model.trainable_variables)
    container = model.compiled_metrics
    if container is not None and not container.built and y is not None:
        y_pred = model(x, training=False)
        container.build(y_pred, container._conform_to_outputs(y_pred, y))


def apply_gradients(optimizer, gradients, variables):
    """One update; a loss-scale optimizer unscales, skips non-finite gradients, lowers its scale."""
    if LEGACY and isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer):
        gradients = optimizer.get_unscaled_gradients(gradients)
    optimizer.apply_gradients(zip(gradients, variables, strict=True))


# -- rematerialisation (keras_memopt.remat) ------------------------------------


def functional_nodes(model):
    """A functional model's `(layer, input_tensors, output_tensors)`, inputs first, in
    dependency order (flat lists of symbolic tensors)."""
    nodes = []
    for depth in sorted(model._nodes_by_depth, reverse=True):
        for node in model._nodes_by_depth[depth]:
            if LEGACY:
                layer, inputs = node.layer, list(node.keras_inputs)
            else:
                layer, inputs = node.operation, list(node.input_tensors)
            nodes.append((layer, inputs, tf.nest.flatten(node.outputs)))
    return nodes


def sublayers(layer, include_self=True):
    """`layer` (unless `include_self` is False) and every layer inside it; none for a Keras 3
    operation node (a `keras.ops` call)."""
    if not hasattr(layer, "_flatten_layers"):
        return [layer] if include_self else []
    return layer._flatten_layers(include_self=include_self, recursive=True)


def added_losses(layer) -> list:
    """The terms calls added to `layer` itself with `add_loss` (not weight regularisers)."""
    if LEGACY:
        return [*getattr(layer, "_eager_losses", ()), *getattr(layer, "_losses", ())]
    return list(getattr(layer, "_losses", ()))


def regularised_sublayer(layer):
    """The first layer in `layer` (itself included) with an activity regulariser, or None."""
    return next(
        (s for s in sublayers(layer) if getattr(s, "activity_regularizer", None) is not None),
        None,
    )


def global_random_state() -> list:
    """Keras 3's global seed generator's state (random ops called without a seed), read from
    Keras's global state (no public handle); tf_keras has none."""
    if LEGACY:
        return []
    state = getattr(getattr(keras, "src", None), "backend", None)
    state = getattr(getattr(state, "common", None), "global_state", None)
    generator = state.get_global_attribute("global_seed_generator") if state else None
    return [generator.state] if generator is not None else []


def seed_variables(layer):
    """Keras 3's seed states of `layer` (and layers in it): its variables that are not weights."""
    weights = {id(w) for w in layer.weights}
    return [v for v in layer.variables if id(v) not in weights]


def nested_inputs_outputs(model):
    """A functional model's inputs and outputs in the structure it was built with."""
    if LEGACY:
        return model._nested_inputs, model._nested_outputs
    return model._inputs_struct, model._outputs_struct


def functional_config(model, config):
    """`config` completed with a functional `model`'s layer graph, which tf_keras leaves out
    for a subclass whose constructor differs from `Functional`'s."""
    if not LEGACY or not isinstance(model, Functional) or "layers" in config:
        return config
    view = Functional(*nested_inputs_outputs(model), name=model.name)
    return {**view.get_config(), **config}


# -- the step runner (keras_memopt._oom.runner) --------------------------------------


def optimizers_of(model) -> list:
    """The model's optimizer and any other it holds as an attribute (a GAN's two), each once."""
    kinds = (keras.optimizers.Optimizer,)
    if LEGACY:
        kinds += (keras.optimizers.legacy.Optimizer,)
    found = [getattr(model, "optimizer", None), *vars(model).values()]
    unique = {id(o): o for o in found if isinstance(o, kinds)}
    return list(unique.values())


def optimizer_variables(optimizer):
    """All variables of an optimizer (iterations, slots, loss scale, ...)."""
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def steps_per_execution(model):
    if LEGACY:
        steps = getattr(model, "_steps_per_execution", None)
        return 1 if steps is None else int(steps.numpy().item())
    return int(model.steps_per_execution or 1)


def strip_optionals(data):
    """Keras 3 feeds missing elements as empty `tf.experimental.Optional`s (or their specs)."""
    return tf.nest.map_structure(
        lambda t: None if isinstance(t, (tf.experimental.Optional, tf.OptionalSpec)) else t,
        data,
    )


# -- segments on several devices (keras_memopt.placement) ----------------------


def variable_device(variable):
    """The device of a TensorFlow variable or of the one a Keras 3 variable wraps."""
    if isinstance(variable, tf.Variable):
        return variable.device
    return variable.value.device


def move_variable(variable, device):
    """Re-creates a Keras 3 variable's TensorFlow variable on `device`, value kept; the Keras
    variable stays the same object. tf_keras's cannot be swapped (placement refuses first)."""
    if LEGACY:
        raise NotImplementedError("tf_keras variables cannot be moved to another device")
    old = variable.value
    with tf.init_scope(), tf.device(device):
        variable._initialize(old.read_value())


# Where `fit` keeps validation data between epochs (Keras 3, tf_keras), adapter, steps (None: all).
_CACHED_VALIDATION = (
    ("_eval_epoch_iterator", "data_adapter", "steps_per_epoch"),
    ("_eval_data_handler", "_adapter", "_steps_per_epoch"),
)
_ARRAY_ADAPTERS = {"ArrayDataAdapter", "TensorLikeDataAdapter"}


def drop_cached_validation(model):
    """Lets go of the validation arrays `fit` keeps as tensors between epochs (measured: 4 MiB
    of arrays held 7 MiB, and a size that had trained the first epoch ran out of memory in the
    second); Keras converts them again. Only with `validation_steps=None`, so no batch changes."""
    for name, adapter, steps in _CACHED_VALIDATION:
        cached = getattr(model, name, None)
        if cached is None or getattr(cached, steps, None) is not None:
            continue
        kinds = {kind.__name__ for kind in type(getattr(cached, adapter, None)).__mro__}
        if kinds & _ARRAY_ADAPTERS:
            setattr(model, name, None)
