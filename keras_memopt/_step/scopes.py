"""The names that mark a phase of the step in its op names.

The step opens these name scopes (and names the update's reservation op); an out-of-memory error's
op is read by them (`keras_memopt._oom.errors.scoped_phase`)."""

GRADIENT_SUM_SCOPE = "gradient_sum"
WHOLE_BATCH_LOSS_SCOPE = "whole_batch_loss"
UPDATE_RESERVATION_OP = "update_reservation"
