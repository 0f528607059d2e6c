"""Planning the memory of a micro-batched train step: `MemoryPlanner` (docs/memory.md)."""

from keras_memopt.planning.estimate import MemoryEstimate
from keras_memopt.planning.plan import MemoryPlan
from keras_memopt.planning.planner import MemoryPlanner
from keras_memopt.planning.remat_plan import RematCandidate

__all__ = ["MemoryEstimate", "MemoryPlan", "MemoryPlanner", "RematCandidate"]
