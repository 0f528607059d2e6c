"""Recognising out-of-memory errors in all their forms, and reading what failed."""


import pytest
import tensorflow as tf
from conftest import last_json, run_python

from keras_memopt._oom import errors as _oom_errors


class TestDetection:
    @pytest.mark.parametrize(
        "error",
        [
            tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor"),
            tf.errors.UnknownError(None, None, "Status: RESOURCE_EXHAUSTED: ran out"),
            tf.errors.InternalError(None, None, "ResourceExhausted: failed to allocate"),
            tf.errors.InternalError(None, None, "Dst tensor is not initialized."),
            tf.errors.UnknownError(None, None, "CUDA_ERROR_OUT_OF_MEMORY: out of memory"),
            tf.errors.InvalidArgumentError(
                None, None, "Cannot parse tensor from proto: goo.gle/debugstr [[{{node zeros}}]]"
            ),
        ],
        ids=["resource_exhausted", "unknown", "internal", "dst_tensor", "cuda", "constant"],
    )
    def test_oom_and_its_disguised_forms_are_detected(self, error):
        assert _oom_errors.is_oom(error)

    @pytest.mark.parametrize(
        "error",
        [
            tf.errors.InvalidArgumentError(None, None, "Incompatible shapes"),
            tf.errors.InternalError(None, None, "Failed to call ThenRnnForward"),
            tf.errors.UnknownError(None, None, "a Python exception in a py_function"),
            ValueError("OOM when allocating tensor"),
        ],
    )
    def test_other_errors_are_not_oom(self, error):
        assert not _oom_errors.is_oom(error)

    @pytest.mark.slow
    @pytest.mark.line_independent
    def test_a_constant_that_cannot_be_allocated_is_detected(self):
        """The real error: a 4 MiB constant, folded into a step, under a 16 MiB limit."""
        output = run_python(CONSTANT_OOM, memory_limit_mb=16)
        figures = last_json(output)
        assert figures["type"] == "InvalidArgumentError", figures
        assert "Cannot parse tensor from proto" in figures["message"]
        assert figures["is_oom"] is True

    def test_oom_raised_from_another_error_is_detected(self):
        try:
            try:
                raise tf.errors.ResourceExhaustedError(None, None, "OOM")
            except tf.errors.ResourceExhaustedError as inner:
                raise RuntimeError("step failed") from inner
        except RuntimeError as outer:
            assert _oom_errors.is_oom(outer)

    def test_report_parses_shape_type_op_and_device(self):
        info = _oom_errors.parse_oom(
            "Graph execution error:\n\nOOM when allocating tensor with "
            "shape[4096,512] and type float on /job:localhost/replica:0/"
            "task:0/device:GPU:1 by allocator GPU_1_bfc\n\t [[{{node "
            "gradient_tape/while/dense_7/MatMul/MatMul_1}}]]"
        )
        assert info["shape"] == (4096, 512)
        assert info["dtype"] == "float"
        assert info["device"] == "GPU:1"
        assert info["allocator"] == "GPU_1_bfc"
        assert info["op"] == "gradient_tape/while/dense_7/MatMul/MatMul_1"

    def test_report_parses_a_byte_count(self):
        info = _oom_errors.parse_oom(
            "failed to allocate 1.50G (1610612736 bytes) from device: "
            "CUDA_ERROR_OUT_OF_MEMORY: out of memory"
        )
        assert info["bytes"] == 1610612736 and info["shape"] is None

    def test_report_parses_an_xla_allocation_size(self):
        info = _oom_errors.parse_oom("Out of memory while trying to allocate 34.12MiB.")
        assert info["bytes"] == int(34.12 * 2**20)


class TestReport:
    def _error(self):
        return tf.errors.ResourceExhaustedError(
            None, None,
            "OOM when allocating tensor with shape[1024,1024] and type float on "
            "/job:localhost/replica:0/task:0/device:CPU:0 by allocator cpu "
            "[[{{node adam/Sub_3}}]]",
        )

    def test_a_phase_no_micro_batch_helps_says_so_with_the_bytes(self):
        memory = _oom_errors.StepMemory(
            weights=13 * 2**20, optimizer_state=26 * 2**20, gradient_sum=13 * 2**20,
            largest_gradient=4 * 2**20, update=None, step_peak=20 * 2**20,
            micro_batch_size=64, device_total=50 * 2**20,
        )
        text = _oom_errors.report(self._error(), _oom_errors.Phase.UPDATE, memory, 64, 1)
        assert text.startswith("Out of memory in the optimizer update (micro_batch_size=64): "
                               "a smaller micro-batch needs no less memory there")
        assert ("weights 13.00 MiB, optimizer state 26.00 MiB, gradient sum 13.00 MiB "
                "(its largest variable 4.00 MiB)") in text
        assert "the device can hand out 50.00 MiB" in text
        assert "the optimizer update's own memory: not measured yet" in text
        assert ("the failed attempt at micro_batch_size=64 peaked at 20.00 MiB above its "
                "start, 7.00 MiB of it beyond the gradient sum") in text
        assert "an optimizer that keeps less state per weight" in text
        assert "bfloat16" in text and "remat" not in text
        assert "Failed to allocate: a tensor of shape [1024, 1024] and type float " \
               "in op adam/Sub_3 on CPU:0." in text

    def test_a_micro_batch_phase_at_the_minimum_advises_on_activations(self):
        text = _oom_errors.report(self._error(), _oom_errors.Phase.MICRO_BATCH, None, 4, 4)
        assert "at the smallest micro-batch allowed (micro_batch_size=4, " \
               "min_micro_batch_size=4)" in text
        assert "remat" in text and "mixed_float16" in text
        assert text.endswith("Original error: ResourceExhaustedError: OOM when allocating "
                             "tensor with shape[1024,1024] and type float on "
                             "/job:localhost/replica:0/task:0/device:CPU:0 by allocator cpu "
                             "[[{{node adam/Sub_3}}]]")

    def test_phases_say_whether_a_smaller_micro_batch_helps(self):
        helps = {phase for phase in _oom_errors.Phase if phase.micro_batch_helps}
        assert helps == {_oom_errors.Phase.MICRO_BATCH, _oom_errors.Phase.EVALUATION}


CONSTANT_OOM = """
import json
import numpy as np
import tensorflow as tf
from keras_memopt._oom import errors as _oom_errors

# Folding would try (and wait for) the allocation several times over; the
# constant's own kernel fails the same way with it off, in a third of the time.
tf.config.optimizer.set_experimental_options({"constant_folding": False})
hold = tf.fill([10 * 2**18], 1.0)  # 10 MiB of the 16, made at run time


@tf.function
def step(x):
    # A constant of 4 MiB in the graph, allocated when its kernel is made.
    return tf.reduce_sum(tf.constant(np.zeros(2**20, np.float32)) + x)


try:
    step(tf.constant(1.0))
    figures = dict(type=None, message="", is_oom=None)
except tf.errors.OpError as error:
    figures = dict(type=type(error).__name__, message=str(error), is_oom=_oom_errors.is_oom(error))
print(json.dumps(figures))
"""
