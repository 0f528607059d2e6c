"""Oracles for the exactness tests: plain Keras, made right where it is not.

Keras 3's optimizers apply an Embedding's `tf.IndexedSlices` gradient slice by
slice, so a row looked up several times has each part squared on its own by
Adam and the like (docs/accumulation.md, "Sparse gradients"): plain sparse
Keras 3 is not the whole batch's update. The oracle is plain Keras with the
gradient made dense before the optimizer sees it, which is the batch's
mathematical gradient (tf_keras sums the rows itself, so there it changes
nothing).

Keras 3's `ScheduleFreeAdamW` sets its momentum to the weights in `build`,
which plain Keras's `fit` runs in a symbolic trace that loses the assignment
(its momentum starts at zero: the first step moves every weight to about
`-learning_rate`). The oracle builds it before `fit` (`build_first`), as
`AccumulatingModel` does.
"""

import contextlib

import tensorflow as tf

from keras_memopt._keras import LEGACY


def _dense(gradient):
    if isinstance(gradient, tf.IndexedSlices):
        return tf.convert_to_tensor(gradient)
    return gradient


def dense_gradients(optimizer):
    """`optimizer`, applying every `tf.IndexedSlices` gradient as a dense tensor."""
    if LEGACY:
        apply_gradients = optimizer.apply_gradients

        def dense_apply_gradients(grads_and_vars, *args, **kwargs):
            pairs = [(_dense(g), v) for g, v in grads_and_vars]
            return apply_gradients(pairs, *args, **kwargs)

        optimizer.apply_gradients = dense_apply_gradients
        return optimizer
    apply = optimizer.apply

    def dense_apply(grads, trainable_variables=None):
        return apply([_dense(g) for g in grads], trainable_variables)

    optimizer.apply = dense_apply
    return optimizer


def build_first(model):
    """Builds the compiled `model`'s optimizer now, outside any trace, where its
    `build` assigns more than zeros (Keras 3's `ScheduleFreeAdamW`)."""
    if type(model.optimizer).__name__ == "ScheduleFreeAdamW":
        # (Keras 3 on JAX has no strategy.)
        strategy = getattr(model, "distribute_strategy", None)
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            model.optimizer.build(model.trainable_variables)
