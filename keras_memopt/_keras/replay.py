"""Replaying a layer's randomness: the same dropout masks in a recomputation.

A recomputation must draw the forward pass's random numbers and not update state again:
`random_state` pins a call's randomness, `Replay` runs a call with it, `Rerun` runs a whole model
again (`whole_batch_loss`'s second pass), state put back and `add_loss` terms kept."""

import tensorflow as tf

from keras_memopt import _keras


def _random_generators(layer):
    """tf_keras `RandomGenerator`s of `layer` and the layers inside it."""
    generators = []
    for sublayer in _keras.sublayers(layer):
        generator = getattr(sublayer, "_random_generator", None)
        if generator is not None and hasattr(generator, "_rng_type"):
            generators.append(generator)
    return generators


def random_state(layer):
    """Tensors that pin down the randomness of `layer`'s next call: Keras 3's seed generator
    states; on tf_keras (stateful random ops, not replayable) a seed per generator drawn here,
    which `Replay` makes them use with stateless ops."""
    if _keras.LEGACY:
        count = len(_random_generators(layer))
        if not count:
            return []
        return [tf.random.uniform([count], 1, 2**31 - 1, dtype=tf.int32)]
    return [tf.identity(v.value) for v in _keras.seed_variables(layer)]


class _StateRestorer:
    """Undoes a recomputation's state updates (tf_keras has no stateless scope)."""

    def __init__(self, layer):
        self.variables = list(layer.non_trainable_weights)
        self.values = [tf.identity(v) for v in self.variables]

    def restore(self):
        for variable, value in zip(self.variables, self.values, strict=True):
            variable.assign(value)


class Replay:
    """Runs `layer` with the randomness pinned by `state`; with `recompute=True` the state
    updates made inside (moving statistics, seed generators) are discarded."""

    def __init__(self, layer, state, recompute):
        self.layer, self.state, self.recompute = layer, state, recompute

    def __enter__(self):
        if not _keras.LEGACY:
            self._scope = None
            if self.recompute:
                mapping = list(zip(_keras.seed_variables(self.layer), self.state, strict=True))
                self._scope = _keras.keras.StatelessScope(state_mapping=mapping)
                self._scope.__enter__()
            return self
        self._restorer = _StateRestorer(self.layer) if self.recompute else None
        self._saved = []
        generators = _random_generators(self.layer)
        for index, generator in enumerate(generators):
            if generator._rng_type == generator.RNG_STATELESS:
                continue  # Seeded per layer, not per call: already replays.
            self._saved.append((generator, dict(generator.__dict__)))
            generator._rng_type = generator.RNG_STATELESS
            generator._seed = self.state[0][index]
            generator._built = True
        return self

    def __exit__(self, *exc_info):
        if not _keras.LEGACY:
            if self._scope is not None:
                self._scope.__exit__(*exc_info)
            return False
        for generator, attributes in self._saved:
            for name in ("_rng_type", "_seed", "_built"):
                setattr(generator, name, attributes.get(name))
        if self._restorer is not None and exc_info[0] is None:
            self._restorer.restore()
        return False


class Rerun(Replay):
    """Runs `layer` again with the randomness pinned by `state`, putting back what it changes
    on exit (Keras 3's `StatelessScope` would also drop the call's `add_loss` terms); on
    tf_keras it is `Replay(recompute=True)`."""

    def __init__(self, layer, state):
        super().__init__(layer, state, recompute=True)

    def __enter__(self):
        if _keras.LEGACY:
            return super().__enter__()
        seeds = _keras.seed_variables(self.layer)
        self._variables = list(self.layer.non_trainable_weights) + seeds
        self._values = [tf.identity(v.value) for v in self._variables]
        for variable, value in zip(seeds, self.state, strict=True):
            variable.assign(value)
        return self

    def __exit__(self, *exc_info):
        if _keras.LEGACY:
            return super().__exit__(*exc_info)
        if exc_info[0] is None:
            for variable, value in zip(self._variables, self._values, strict=True):
                variable.assign(value)
        return False
