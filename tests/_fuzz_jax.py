"""What the JAX line of the differential fuzzer expects the JAX `AccumulatingModel` to refuse.

`_fuzz` counts a case apart (REFUSED) where its AccumulatingModel raises an error that
names one of `jax_refusals(spec)`'s features before any update; `_fuzz_sample` leaves
such cases out of CI's JAX sample.
"""

from __future__ import annotations

from _fuzz_cases import JAX, Spec


def jax_refusals(spec: Spec) -> dict:
    """What of `spec` the JAX `AccumulatingModel` refuses where it meets it (before any
    update), as `{feature: what its error names}`; empty on the TensorFlow lines.

    A case that draws one may still train (a refusal where the batch is split: every
    batch one micro-batch); one that raises names a feature of this dict, or fails.
    """
    if not JAX:
        return {}
    refusals = {}
    if dict(spec.optimizer_options).get("gradient_accumulation_steps"):
        refusals["the optimizer's gradient_accumulation_steps"] = "gradient_accumulation_steps"
    if spec.family == "sparse":
        refusals["a sparse input"] = "sparse input"
    return refusals
