"""`AccumulatingModel.from_model`'s view of a model: the graph it wraps, on both lines."""

from keras_memopt._keras import LEGACY, Functional, keras, nested_inputs_outputs


def wrapped_inputs_outputs(model):
    """The inputs and outputs of a functional model over `model`'s layers, for
    `AccumulatingModel.from_model`: a functional or `Sequential` model's own (a dict of outputs
    stays a dict: losses, metrics and per-output sample weights are matched by their keys), or a
    built subclassed model called once on an input of the shape it was built for."""
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
        shape = built_input_shape(model) if model.built else None
        if shape is None:
            raise ValueError(
                "`model` must be built on a single input before it can be "
                "wrapped: call it once on a batch (or call "
                "`model.build(input_shape)`), or subclass AccumulatingModel "
                f"instead. Received: model={model.name!r} (built={model.built})"
            )
        inputs = keras.Input(batch_shape=shape)
        return inputs, model(inputs)
    if isinstance(model, Functional):
        return nested_inputs_outputs(model)
    return inputs, outputs



def built_input_shape(model):
    """The input shape a built single-input subclassed model was built for (batch open), or None."""
    if LEGACY:
        shape = getattr(model, "_build_input_shape", None)
    else:
        shapes = getattr(model, "_build_shapes_dict", None) or {}
        shape = next(iter(shapes.values())) if len(shapes) == 1 else None
    if shape is None or not all(isinstance(d, (int, type(None))) for d in shape):
        return None
    return (None, *tuple(shape)[1:])
