"""Surviving out-of-memory errors: phases, the backoff rule and policy, rollback, agreement. Light
to import (`rule` is read by the process supervisor before TensorFlow)."""
