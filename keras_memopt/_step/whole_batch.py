"""`whole_batch_loss=True`: a loss of the whole batch's outputs, exact, in micro-batches.

Gradient caching (GradCache) around Keras's own loss, in three steps (docs/whole-batch-loss.md):
`outputs`, every micro-batch forward without a tape, keeping its outputs and the random state it
started from; `loss_and_output_gradients`, the loss once on the whole batch's outputs (float16 and
bfloat16 cast to float32 first, so no loss scale is needed) and its gradient to them; `backward`,
each micro-batch forward again under a tape with that random state, what it changes put back,
back-propagating its rows of the gradient."""

from __future__ import annotations

import functools

import tensorflow as tf

from keras_memopt import _dtypes, _keras
from keras_memopt._keras import losses as _keras_losses
from keras_memopt._keras import replay as _replay
from keras_memopt._step import loop as _loop
from keras_memopt._step.scopes import WHOLE_BATCH_LOSS_SCOPE


def _floating(tensor) -> bool:
    return tensor.dtype.is_floating


def _differentiated(outputs) -> list:
    """What the loss's gradient is taken with respect to: each floating output, then the logits
    behind softmax and sigmoid ones, which Keras's cross-entropies read (`_keras.logits_of`)."""
    floats = [t for t in tf.nest.flatten(outputs) if _floating(t)]
    logits = [_keras.logits_of(t) for t in floats]
    return floats + [t for t in logits if t is not None]


class WholeBatch:
    """The three steps for one model and one forward function.

    `forward(micro)` returns `(outputs, penalty)`: the outputs and a scalar added to the loss (its
    fraction of the `model.losses` terms). `rerun` runs step 3's pass (a function of no arguments),
    leaving the layers' own metrics as they were."""

    def __init__(self, model, forward, jit_compile=False, rerun=None):
        self.model = model
        self.forward = forward
        self.jit_compile = jit_compile
        self.rerun = rerun or (lambda fn: fn())

    def outputs(self, data, size):
        """Step 1: `(outputs, penalty, states)`, outputs concatenated over the batch."""
        structure, state_shapes = [], []

        def first(micro):
            state = _replay.random_state(self.model)
            with _replay.Replay(self.model, state, recompute=False):
                outputs, penalty = self.forward(micro)
            structure.append(outputs)
            state_shapes[:] = [s.shape for s in state]
            flat = tf.nest.flatten(outputs)
            masks = [_keras.get_mask(t) for t in flat]
            logits = [_keras.logits_of(t) for t in flat]
            return (
                flat,
                [m for m in masks if m is not None],
                [t for t in logits if t is not None],
                [s[None] for s in state],
                tf.reshape(_dtypes.widened(penalty), [1]),
            )

        flat, masks, logits, states, penalties = _loop.concatenate(
            first, data, size, jit_compile=self.jit_compile
        )
        for state, shape in zip(states, state_shapes, strict=True):
            state.set_shape([None, *shape])
        rows = _loop.static_batch_size(data)
        traced = tf.nest.flatten(structure[-1])
        masks, logits = iter(masks), iter(logits)
        outputs = []
        for tensor, like in zip(flat, traced, strict=True):
            tensor.set_shape([rows, *like.shape[1:]])
            if _floating(tensor):
                tensor = _dtypes.widened(tensor)
            if _keras.logits_of(like) is not None:
                tensor = _keras.carry_logits(
                    tensor, _dtypes.widened(tf.ensure_shape(next(logits), tensor.shape)), like
                )
            if _keras.get_mask(like) is not None:
                mask = next(masks)
                mask.set_shape([rows, *_keras.get_mask(like).shape[1:]])
                _keras.set_mask(tensor, mask)
            outputs.append(tensor)
        return tf.nest.pack_sequence_as(structure[-1], outputs), tf.reduce_sum(penalties), states

    @staticmethod
    def loss_and_output_gradients(loss_fn, outputs, variables, optimizer):
        """Step 2: `(loss, output_gradients, direct_gradients)`. `output_gradients`: one per tensor
        of `_differentiated(outputs)`, unscaled (None for an output the loss does not read, as in
        plain Keras, not a zero that Ftrl or a weight decay would act on); `direct_gradients`: per
        variable, of what the loss reads of the variables itself, loss-scaled."""
        floats = _differentiated(outputs)
        # Named, so that an OOM here is told from a micro-batch's: a smaller one cannot help it.
        with tf.name_scope(WHOLE_BATCH_LOSS_SCOPE):
            with tf.GradientTape(persistent=True) as tape:
                tape.watch(floats)
                loss = loss_fn(outputs)
                scaled = _keras.scale_loss(optimizer, loss)
            output_gradients = tape.gradient(loss, floats)
            direct = tape.gradient(scaled, list(variables))
        del tape
        return loss, output_gradients, direct

    def backward(self, data, output_gradients, states, size, variables, optimizer):
        """Step 3: the gradients of `variables`, summed over the micro-batches."""
        model = self.model
        positions = tf.range(_loop.batch_size_of(data)) // tf.cast(size, tf.int32)

        def second(micro):
            return self.rerun(functools.partial(gradients_of, micro))

        def gradients_of(micro):
            micro_data, gradients, micro_positions = micro
            index = micro_positions[0]
            state = [s[index] for s in states]
            with tf.GradientTape() as tape:
                with _replay.Rerun(model, state):
                    outputs, penalty = self.forward(micro_data)
                floats = _differentiated(outputs)
                parts = [
                    tf.reduce_sum(tf.cast(output, gradient.dtype) * gradient)
                    for output, gradient in zip(floats, gradients, strict=True)
                    if gradient is not None
                ]
                penalty = _keras_losses.additional_loss(model, penalty)
                dtype = parts[0].dtype if parts else penalty.dtype
                surrogate = tf.add_n([tf.cast(p, dtype) for p in [*parts, penalty]])
                scaled = _keras.scale_loss(optimizer, surrogate)
            return tape.gradient(scaled, variables)

        return _loop.accumulate(
            second, (data, output_gradients, positions), size, jit_compile=self.jit_compile,
            reductions=_loop.gradient_folds(variables),
        )

    def gradients(self, loss_fn, data, size, variables, optimizer):
        """The three steps: `(loss, gradients, outputs)`; `loss_fn(outputs, penalty)` is the
        batch's loss, `penalty` step 1's summed terms (their gradient comes from step 3)."""
        outputs, penalty, states = self.outputs(data, size)
        loss, output_gradients, direct = self.loss_and_output_gradients(
            lambda outputs: loss_fn(outputs, penalty), outputs, variables, optimizer
        )
        gradients = self.backward(data, output_gradients, states, size, variables, optimizer)
        return loss, [_add(g, d) for g, d in zip(gradients, direct, strict=True)], outputs


def _add(gradient, direct):
    if direct is None:
        return gradient
    if gradient is None:
        return direct
    return tf.convert_to_tensor(gradient) + tf.convert_to_tensor(direct)
