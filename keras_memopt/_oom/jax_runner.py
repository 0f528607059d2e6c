"""The step functions of `AccumulatingModel` on JAX: one compiled step per
micro-batch setting, kept, and the out-of-memory retry around it.

Keras's JAX trainer calls `model.<kind>_function(state, iterator)` once per
step (`steps_per_execution` batches) and keeps the training state as the
values it returns. For the JAX `AccumulatingModel` that function is made here
(`StepFunctions.function`). A micro-batch size is a static shape on JAX: each
setting compiles its own step, and keeps it, so going back to a setting
already seen compiles nothing.

With an out-of-memory policy attached (`OOMBackoff` sets `model.oom_policy`),
a step that XLA reports out of memory (`RESOURCE_EXHAUSTED`, when the step
is compiled or while it runs) is tried again on the same batch once the
policy set a smaller micro-batch, or the policy's report is raised. JAX
returns from a compiled call before the step has run, and an allocation that
fails while it runs is raised where its results are awaited (or, later, as
an `INTERNAL` error of whatever reads them): so each step is awaited
(`jax.block_until_ready`) while a policy is attached, which gives up the
host's running ahead of the device by one step. Nothing needs putting back:
the step is a function
of the state handed to it and changes nothing else, provided that state is
still there. Keras donates it to XLA (`donate_argnums=0`), and a donated
argument is deleted even where the step fails (measured: jax 0.10.2, XLA's CPU
client, a step over an address-space limit), so while a policy is attached
the steps are compiled without donation: the state handed to the failed
attempt is the state the retry gets, and the state the model is left with
when the policy gives up. That costs the state's bytes once more at the
step's end, where the old and the new state are both alive; without a policy
the steps donate, as Keras's do.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from keras_memopt import memory
from keras_memopt._keras import jax as _jax
from keras_memopt._keras import keras
from keras_memopt._memory.sizes import variables_bytes
from keras_memopt._oom import errors as _oom_errors
from keras_memopt._step import jax_step, jax_terms
from keras_memopt._step.jax_custom_steps import warned_when_whole


class StepFunctions:
    """The compiled steps of one JAX `AccumulatingModel`, kept per micro-batch setting.

    Args:
        model: the model, read through its public members (`micro_batch_size`,
            `accumulation_steps`, `oom_policy`, its `*_step` methods).
        before_train: None, or `before_train(state, data)`, called before each
            train step is compiled or run (where `remat="auto"` chooses its segments).
    """

    def __init__(self, model, before_train=None):
        self.model = model
        self._before_train = before_train
        self._compiled = {}
        self._shardings = {}

    def forget(self):
        """Drops every compiled step: what a step traces has changed (`compile`, `remat`)."""
        self._compiled.clear()
        self._shardings.clear()
        jax_terms.forget(self.model)
        jax_step.forget_loss_split(self.model)

    def function(self, kind, finds_terms=False):
        """`model.<kind>_function(state, iterator)`: up to `steps_per_execution` steps;
        where `finds_terms` (the model's own train or test step), the first that splits
        its batch first finds how the terms of `model.losses` split (`jax_terms.find`)."""
        if kind not in self._shardings and keras.distribution.distribution() is not None:
            # Read, as Keras reads them, while the variables hold their values
            # (`fit` takes them out before its first step, and a backoff makes
            # the function anew in the middle of it).
            self._shardings[kind] = _jax.state_shardings(self.model, kind)

        def step_function(state, iterator):
            outputs = []
            for index in range(self.model.steps_per_execution):
                try:
                    data = next(iterator)
                except StopIteration:
                    if index == 0:
                        raise
                    break
                output, state = self.run(kind, state, data, finds_terms)
                outputs.append(output)
            if kind == "predict" and len(outputs) > 1:  # every step's, in order
                return keras.tree.map_structure(lambda *t: jnp.concatenate(t), *outputs), state
            return outputs[-1], state

        return step_function

    def run(self, kind, state, data, finds_terms=False):
        """`(outputs, state)` of one step on `data`, retried on out-of-memory by the policy."""
        model = self.model
        policy = model.oom_policy
        while True:
            x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
            size = model.micro_batch_size_for(jax_step.batch_size_of(x))
            if finds_terms and jax_step.splits(model.micro_batch_size_for, data):
                jax_terms.find(model, state, data)  # at the setting a backoff set, too
                jax_step.check_loss_split(model, state, data)
            if kind == "train" and self._before_train is not None:
                # After `find`: `remat="auto"` compiles the step, which weighs the terms.
                self._before_train(state, data)
            step = self._step(kind, donate=policy is None)
            started = time.perf_counter()
            try:
                outputs, new_state = step(state, data)
                if policy is not None:
                    # JAX dispatches the step and returns: an allocation that
                    # fails while it runs is raised where its results are awaited.
                    jax.block_until_ready((outputs, new_state))
            except Exception as error:  # XLA's: jax.errors.JaxRuntimeError
                if policy is None or not _oom_errors.is_oom(error):
                    raise
                _oom_errors.drop_tracebacks(error)  # their frames hold the batch
                failure = self._failure(kind, error, size, time.perf_counter() - started)
            else:
                if kind == "train" and policy is not None:
                    policy.trained(size)
                return outputs, new_state
            try:
                policy.back_off(model, failure)  # sets the smaller size, or raises its report
            except BaseException:
                jax_step.put_back(model, state)  # Keras took it out of the variables
                raise

    def _step(self, kind, donate):
        """The compiled step of `kind` for the model's micro-batch setting."""
        model = self.model
        key = (kind, model.micro_batch_size, model.accumulation_steps, donate,
               model.jit_compile, model.run_eagerly, keras.distribution.distribution())
        step = self._compiled.get(key)
        if step is None:
            # A function of its own for each setting, so that no two settings
            # share a trace: with a `jax.jit` of the bound `model.train_step`
            # per setting, a second size was seen to run the first one's.
            # Traced (at each new shape of the data) while the model's setting
            # is this key's: it is looked up by the setting in use.
            step = _step_function(model, kind)
            if model.jit_compile and not model.run_eagerly:
                # As Keras's own steps: the state's shardings, under a distribution.
                shardings = self._shardings.get(kind)
                step = jax.jit(step, donate_argnums=0 if donate else (),
                               out_shardings=None if shardings is None else (None, shardings))
            if kind == "train":  # warned at its first call, which traces it
                step = warned_when_whole(model, step)
            self._compiled[key] = step
        return step

    def _failure(self, kind, error, size, seconds):
        """What the policy is told of a step XLA found out of memory."""
        model = self.model
        started = time.perf_counter()
        device = memory.default_device()
        info = memory.allocator_memory(device)
        trainable = [variables_bytes([v]) for v in model.trainable_variables]
        optimizer = getattr(model, "optimizer", None)
        step_memory = _oom_errors.StepMemory(
            weights=variables_bytes(model.variables),
            optimizer_state=variables_bytes(optimizer.variables) if optimizer else None,
            gradient_sum=sum(trainable),  # in the gradients' own dtype on JAX
            largest_gradient=max(trainable, default=0),
            micro_batch_size=size,
            device_total=memory.device_total(device),
        )
        # One compiled program: where in it memory ran out is not said, and a
        # train step is taken as its micro-batch pass (the policy's check of
        # the device's total still reports a gradient sum that cannot fit).
        phase = _oom_errors.Phase.MICRO_BATCH if kind == "train" else _oom_errors.Phase.EVALUATION
        return _oom_errors.OutOfMemory(
            kind=kind,
            phase=phase,
            error=_oom_errors.ErrorText.of(error),
            micro_batch_size=size,
            memory_in_use=None if info is None else info["current"],
            memory=step_memory,
            failed_step_seconds=seconds,
            recovery_seconds=time.perf_counter() - started,
        )


def _step_function(model, kind):
    """A new function `(state, data) -> (outputs, state)` that runs `model.<kind>_step`
    (for predict, Keras's: the outputs, and the state it keeps)."""
    if kind == "predict":

        def step(state, data):
            outputs, non_trainable = model.predict_step(state, data)
            return outputs, (state[0], non_trainable)

    else:
        method = getattr(model, f"{kind}_step")

        def step(state, data):
            return method(state, data)

    return step
