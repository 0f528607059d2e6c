"""Recomputation: a functional model's graph, its segments, and their custom gradient."""
