"""The steps of `AccumulatingModel`: the micro-batch loop, losses, update, setting and runner.

See docs/architecture.md for the path of one step through these modules."""
