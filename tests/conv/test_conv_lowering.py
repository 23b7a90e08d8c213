"""The causal conv lowers to its two Triton kernels (forward, backward) for GPUs that are not
attached (NVIDIA H200, AMD gfx942) at the zamba2-like mixer's channels (`lowering_cases`)."""

import pytest
from lowering_cases import TARGETS, TRITON_CALL, lower


@pytest.mark.parametrize("target", list(TARGETS))
def test_conv_lowers_to_a_forward_and_a_backward_kernel(target):
    _, lowered = lower("conv-mixer", target)
    text = lowered.as_text()
    assert text.count(TRITON_CALL) == 2
    assert "causal_conv1d_forward" in text and "causal_conv1d_backward" in text
