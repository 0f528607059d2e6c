"""Saving, loading, cloning and pickling an `AccumulatingModel`, its setting included.

The setting goes into the model's config and its compile config (what Keras 3's `clone_model` passes
on); `functional_class` is the form that is saved and revived."""

from __future__ import annotations

from keras_memopt import _keras, distribute, placement
from keras_memopt._step import shares as _shares

SETTING_ARGS = (
    "micro_batch_size", "accumulation_steps", "remat", "replica_shares", "devices", "device_cuts",
    "whole_batch_loss",
)

_FUNCTIONAL_CLASSES: dict[type, type] = {}


def functional_class(cls, *mixins):
    """`cls` with Keras's functional model class mixed in (after `mixins`, which only the functional
    form has). Keras would otherwise rewrite the class's bases in place, breaking every later
    subclassed use of `AccumulatingModel`."""
    if cls not in _FUNCTIONAL_CLASSES:
        functional = type(
            cls.__name__, (cls, *mixins, _keras.Functional), {"__module__": cls.__module__}
        )
        _FUNCTIONAL_CLASSES[cls] = functional
    return _FUNCTIONAL_CLASSES[cls]


def class_to_build(cls, base, args, kwargs, *mixins):
    """The class `base.__new__` builds for `cls(*args, **kwargs)`: as in Keras, (inputs, outputs)
    make a functional model only when they reach `base`'s own constructor; a subclass's may take two
    positional arguments (`Distiller(teacher, student)`). `mixins`: as for `functional_class`."""
    own_constructor = cls.__init__ is not base.__init__
    functional = issubclass(cls, _keras.Functional)
    if not own_constructor and not functional and _keras.is_functional_call(args, kwargs):
        return functional_class(cls, *mixins)
    return cls


class SerializationMixin:
    """The config and pickling of `AccumulatingModel` (a mixin: see that class)."""

    def _setting_config(self):
        shares = self.replica_shares
        return dict(
            micro_batch_size=self.micro_batch_size,
            accumulation_steps=self.accumulation_steps,
            remat=self.remat,
            replica_shares=list(shares) if shares is not None else None,
            whole_batch_loss=self.whole_batch_loss,
            **placement.config(self._placement),
        )

    def _apply_setting(self, setting):
        """Sets what `_setting_config` returned (from a config, or a clone's compile config)."""
        setting = dict(setting)
        remat, shares = setting.pop("remat", None), setting.pop("replica_shares", None)
        devices, device_cuts = setting.pop("devices", None), setting.pop("device_cuts", None)
        whole_batch_loss = setting.pop("whole_batch_loss", None) or False
        self._run.setting.set(**setting)
        self._set_placement(devices, device_cuts)
        self._plan_segments(remat)
        self._run.replica_shares = _shares.resolve_shares(shares, self.distribute_strategy)
        self.whole_batch_loss = whole_batch_loss

    def save(self, filepath, *args, **kwargs):
        # Keras 3 makes every worker write the same file (`ModelCheckpoint` too): the chief writes.
        if distribute.writes_files(self.distribute_strategy):
            return super().save(filepath, *args, **kwargs)
        return None

    def save_weights(self, filepath, *args, **kwargs):
        if distribute.writes_files(self.distribute_strategy):
            return super().save_weights(filepath, *args, **kwargs)
        return None

    def get_config(self):
        return {**_keras.functional_config(self, super().get_config()), **self._setting_config()}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        setting = {name: config.pop(name, None) for name in SETTING_ARGS}
        model = super().from_config(config, custom_objects=custom_objects)
        model._apply_setting(setting)
        return model

    def get_compile_config(self):
        # Keras 3's `clone_model` rebuilds a functional model from its inputs and outputs and passes
        # on only the compile config: the micro-batch setting travels with it.
        config = super().get_compile_config()
        if not config:  # not compiled
            return config
        return {**config, "micro_batch": self._setting_config()}

    def compile_from_config(self, config):
        # Keras skips an overridden `compile` when loading; this one only adds checks: compiled.
        config = dict(config)
        setting = config.pop("micro_batch", None)
        if setting:
            self._apply_setting(setting)
        self.compile(**_keras.keras.saving.deserialize_keras_object(config))
        if self.built and self.optimizer is not None:
            self.optimizer.build(self.trainable_variables)

    def __reduce__(self):
        # Keras 3 pickles a model as `type(model)._unpickle_model`, found by the class's name: the
        # functional form, named after the class it extends, is pickled as it (`cls` is ignored).
        function, args = super().__reduce__()
        owner = getattr(function, "__self__", None)
        if owner in _FUNCTIONAL_CLASSES.values():
            function = getattr(owner.__bases__[0], function.__name__)
        return function, args
