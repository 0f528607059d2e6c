import numpy as np
import pytest

from keras_memopt import AccumulatingModel
from keras_memopt.planning import MemoryPlanner


def _mlp(keras, width=64):
    inputs = keras.Input((32,))
    hidden = keras.layers.Dense(width, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(4)(hidden))


# Dense(32->64) + Dense(64->4): (32*64 + 64) + (64*4 + 4) float32 parameters.
PARAM_BYTES = ((32 * 64 + 64) + (64 * 4 + 4)) * 4


class TestEstimate:
    def test_counts_parameters_gradients_and_adam_slots(self, keras_module):
        estimate = MemoryPlanner(_mlp(keras_module), optimizer="adam").estimate(256, 32)
        assert estimate.parameters == PARAM_BYTES
        assert estimate.gradient_accumulators == PARAM_BYTES
        assert estimate.micro_gradients == PARAM_BYTES
        assert estimate.optimizer_slots == 2 * PARAM_BYTES
        # 32 float32 inputs and one int32 label per sample, for the whole batch.
        assert estimate.input_batch == 256 * (32 * 4 + 4)
        # Dense outputs kept for the backward pass, one micro-batch of 32.
        assert estimate.activations == 32 * (64 + 4) * 4

    @pytest.mark.parametrize(
        "optimizer, copies", [("sgd", 0), ("rmsprop", 1), ("adagrad", 1), ("adamw", 2)]
    )
    def test_slots_follow_the_optimizer(self, keras_module, optimizer, copies):
        estimate = MemoryPlanner(_mlp(keras_module), optimizer=optimizer).estimate(8)
        assert estimate.optimizer_slots == copies * PARAM_BYTES

    def test_sgd_momentum_has_one_slot(self, keras_module):
        optimizer = keras_module.optimizers.SGD(momentum=0.9)
        estimate = MemoryPlanner(_mlp(keras_module), optimizer=optimizer).estimate(8)
        assert estimate.optimizer_slots == PARAM_BYTES

    def test_activations_grow_with_the_micro_batch_not_the_batch(self, keras_module):
        planner = MemoryPlanner(_mlp(keras_module))
        small, large = planner.estimate(512, 16), planner.estimate(512, 64)
        assert large.activations == 4 * small.activations
        assert large.input_batch == small.input_batch

    def test_unbuilt_model_is_refused(self, keras_module):
        model = keras_module.Sequential([keras_module.layers.Dense(4)])
        with pytest.raises(ValueError, match="must be built"):
            MemoryPlanner(model)

    def test_not_a_model_is_refused(self):
        with pytest.raises(TypeError, match="must be a `keras.Model`"):
            MemoryPlanner("model.keras")


class TestPlan:
    def test_recommends_the_largest_micro_batch_that_fits(self, keras_module):
        planner = MemoryPlanner(_mlp(keras_module, width=512))
        budget = planner.estimate(256, 64).peak / 0.9  # room for exactly 64 samples
        plan = planner.plan(256, int(budget) + 1)
        assert plan.fits and plan.micro_batch_size == 64
        assert plan.estimate.peak <= plan.budget * 0.9
        assert planner.estimate(256, 65).peak > plan.budget * 0.9
        assert "micro_batch_size=64" in plan.table()

    def test_whole_batch_when_it_fits(self, keras_module):
        plan = MemoryPlanner(_mlp(keras_module)).plan(64, "1GiB")
        assert plan.micro_batch_size == 64 and plan.remat is None

    def test_budget_below_the_parameters_is_refused(self, keras_module):
        with pytest.raises(ValueError, match="below what the parameters alone need"):
            MemoryPlanner(_mlp(keras_module)).plan(64, "10KiB")

    def test_unknown_unit_is_refused(self, keras_module):
        with pytest.raises(ValueError, match="Received: budget='8GiBs'"):
            MemoryPlanner(_mlp(keras_module)).plan(64, "8GiBs")

    def test_nothing_fits_says_so(self, keras_module):
        planner = MemoryPlanner(_mlp(keras_module, width=4096))
        one = planner.estimate(64, 1)
        tight = (one.peak - one.activations - one.input_batch // 2) / 0.9
        plan = planner.plan(64, int(tight))
        assert not plan.fits and plan.micro_batch_size == 1
        assert "Not even a micro-batch of one sample fits" in plan.note

    def test_bad_batch_size_is_refused(self, keras_module):
        with pytest.raises(ValueError, match="Received: batch_size=0"):
            MemoryPlanner(_mlp(keras_module)).plan(0, "1GiB")


class TestProfile:
    def test_profile_calibrates_without_touching_the_model(self, keras_module):
        model = _mlp(keras_module, width=256)
        weights = [w.copy() for w in model.get_weights()]
        planner = MemoryPlanner(model, optimizer="adam", device="CPU:0")
        measured = planner.profile((8, 32))
        for before, after in zip(weights, model.get_weights(), strict=True):
            np.testing.assert_array_equal(before, after)
        # At a measured size the calibrated estimate is the measurement (bytes, 1% slack).
        for size, peak in measured.items():
            estimate = planner.estimate(size, size)
            assert estimate.calibrated
            np.testing.assert_allclose(estimate.peak, peak, rtol=0.01)
        # Measured peaks include at least parameters, slots and one set of gradients.
        assert min(measured.values()) >= 4 * planner.estimate(8).parameters * 0.95

    def test_profile_needs_two_sizes(self, keras_module):
        with pytest.raises(ValueError, match="at least two distinct"):
            MemoryPlanner(_mlp(keras_module)).profile((16, 16))

    def test_accumulating_model_is_planned_too(self, keras_module):
        inputs = keras_module.Input((32,))
        model = AccumulatingModel(inputs, keras_module.layers.Dense(4)(inputs), micro_batch_size=8)
        assert MemoryPlanner(model).estimate(16).parameters == (32 * 4 + 4) * 4
