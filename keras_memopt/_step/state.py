"""An `AccumulatingModel`'s run-time state: what its steps read as they run.

Owned by the model (`model._run`) and handed to its step runners; not tracked by Keras (its
variables are not the model's weights and are not saved)."""

from __future__ import annotations

import dataclasses

from keras_memopt._step.setting import MicroBatchSetting
from keras_memopt._step.update import Unguarded


@dataclasses.dataclass(eq=False)
class RunState:
    """The run-time state of an `AccumulatingModel`'s steps.

    Attributes:
        setting: the micro-batch setting (variables the traced step reads).
        replica_shares: each replica's share of a batch, or None.
        whole_batch_loss: whether the loss is taken once on the whole batch.
        guard: what the update waits for (`Unguarded`, or an `UpdateGuard`).
        jit_compile: whether each micro-batch's step is compiled with XLA.
        loss_split: how the loss splits over micro-batches (`LossSplit`).
        segment_plan: the recomputed or placed segments, or None.
        generation: counts the changes that need a retrace; a runner prepared at an older one
            prepares again.
        accumulating: set by the loop while a step is traced (a custom step that never set it
            splits nothing, and is told so).
        probing: while a custom step runs once eagerly to check its loss.
    """

    setting: MicroBatchSetting
    replica_shares: tuple | None = None
    whole_batch_loss: bool = False
    guard: object = dataclasses.field(default_factory=Unguarded)
    jit_compile: bool = False
    loss_split: object = None
    segment_plan: object = None
    generation: int = 0
    accumulating: bool = False
    probing: bool = False

    def retrace(self):
        """Makes the step functions prepare and trace again at their next step."""
        self.generation += 1
