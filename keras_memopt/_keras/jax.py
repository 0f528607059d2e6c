"""What the JAX step reads of Keras 3's JAX trainer beyond its public API."""

import contextlib


def put_state_back(model, names, state):
    """Writes the step's `state` (values in the order of `names`) back into the
    model's variables, as Keras's JAX `fit` does when it ends."""
    model._jax_state = dict(zip(names, state, strict=True))
    model._jax_state_synced = False
    model.jax_state_sync()


def update_metrics(model, metrics_variables, loss, x, y, y_pred, sample_weight):
    """`(logs, metrics_variables)`: the compiled metrics and the loss tracker
    updated statelessly, as Keras's JAX train and test steps update them."""
    return model._update_metrics_variables(metrics_variables, loss, x, y, y_pred, sample_weight)


@contextlib.contextmanager
def losses_replaced(model, terms):
    """Within it, `model.losses` is `terms` (Keras's stateless loss reads them
    there); the model's own afterwards."""
    saved = model._losses_override
    model._losses_override = terms
    try:
        yield
    finally:
        model._losses_override = saved


def stateless_call_with_losses(model, trainable, non_trainable, x, **kwargs):
    """`model.stateless_call(trainable, non_trainable, x, return_losses=True, **kwargs)`,
    each term of `model.losses` kept. Keras 3.15 gives each layer the terms of a stateless
    call by their `id`s, and a layer entered in a call first drops from the call's terms those
    whose `id` it recorded in its last call: an array of a term added before it in this call
    can have the `id` of a freed one of the last call (CPython reuses the address), and was
    dropped (a subclassed model's third term, now and then). The records are cleared first."""
    for layer in model._flatten_layers(include_self=True, recursive=True):
        layer._loss_ids.clear()
    return model.stateless_call(trainable, non_trainable, x, return_losses=True, **kwargs)


def called_once(layer) -> bool:
    """Whether `layer` is called once in the functional graph it belongs to."""
    return len(layer._inbound_nodes) == 1


def state_shardings(model, kind):
    """The shardings of the state a `kind` step returns under a `keras.distribution`,
    as Keras's JAX trainer gives them to `jax.jit` (`out_shardings`)."""
    trainable, non_trainable, optimizer, metrics = model._get_state_sharding_spec()
    return {
        "train": (trainable, non_trainable, optimizer, metrics),
        "test": (trainable, non_trainable, metrics),
        "predict": (trainable, non_trainable),
    }[kind]


def mask_of(tensor):
    """The Keras mask a JAX array carries, or None: a traced array takes no
    attribute, so Keras keeps its mask in a table by the array's id."""
    from keras.src.backend import get_keras_mask

    return get_keras_mask(tensor)


def with_mask(tensor, mask):
    """Attaches the Keras mask `mask` to the JAX array `tensor` (a traced one by its
    id, as Keras's layers attach theirs)."""
    from keras.src.backend import set_keras_mask

    set_keras_mask(tensor, mask)
