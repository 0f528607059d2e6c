"""Planning the memory of a micro-batched train step.

One idea per module:

- `estimate`: what a train step holds, counted without running it (the traced step);
- `measure`: real train steps, in this process or in a fresh one per size;
- `calibration`: measured peaks by size, and how to read between them;
- `plan`: `MemoryPlan`, the recommendation, and how a size is chosen;
- `remat_plan`: `RematCandidate`, recomputation settings measured against each other;
- `planner`: `MemoryPlanner`, which estimates, measures and recommends.

The figures are one train step's, not the data set's: see `MemoryPlanner`.
"""

from keras_memopt.planning.estimate import MemoryEstimate
from keras_memopt.planning.plan import MemoryPlan
from keras_memopt.planning.planner import MemoryPlanner
from keras_memopt.planning.remat_plan import RematCandidate

__all__ = ["MemoryEstimate", "MemoryPlan", "MemoryPlanner", "RematCandidate"]
