"""Planning the memory of a micro-batched train step.

One idea per module:

- `estimate`: what a train step holds, counted from shapes and dtypes;
- `measure`: real train steps, in this process or in a fresh one per size;
- `calibration`: measured peaks by size, and how to read between them;
- `plan`: `MemoryPlan`, the recommendation, and how a size is chosen;
- `planner`: `MemoryPlanner`, which estimates, measures and recommends.

The figures are one train step's, not the data set's: see `MemoryPlanner`.
"""

from keras_memopt.planning.estimate import MemoryEstimate
from keras_memopt.planning.plan import MemoryPlan
from keras_memopt.planning.planner import MemoryPlanner

__all__ = ["MemoryEstimate", "MemoryPlan", "MemoryPlanner"]
