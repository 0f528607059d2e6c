"""Planning the memory of a micro-batched train step.

One idea per module:

- `estimate`: what a train step holds, counted from shapes and dtypes;
- `measure`: real train steps, in this process or in a fresh one per size;
- `calibration`: measured peaks by size, and how to read between them;
- `planner`: `MemoryPlanner`, which estimates, measures and recommends.
"""

from keras_memopt.planning.estimate import MemoryEstimate
from keras_memopt.planning.planner import MemoryPlan, MemoryPlanner

__all__ = ["MemoryEstimate", "MemoryPlan", "MemoryPlanner"]
