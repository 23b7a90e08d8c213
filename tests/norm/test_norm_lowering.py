"""The gated RMSNorm lowers to its two Triton kernels (forward, backward) for GPUs that are not
attached (NVIDIA H200, AMD gfx942), at the zamba2-like mixer's width and in groups
(`lowering_cases`); a group size that is not a power of two runs the reference."""

import functools

import jax
import jax.numpy as jnp
import pytest
from lowering_cases import CASES, TARGETS, TRITON_CALL, lower

import pallas_kernels
from pallas_kernels import _compat


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("case", [name for name in CASES if name.startswith("norm-")])
def test_norm_lowers_to_a_forward_and_a_backward_kernel(case, target):
    _, lowered = lower(case, target)
    text = lowered.as_text()
    assert text.count(TRITON_CALL) == 2
    assert "rms_norm_gated_forward" in text and "rms_norm_gated_backward" in text


@pytest.mark.parametrize("target", list(TARGETS))
def test_a_group_size_that_is_not_a_power_of_two_runs_the_reference(target):
    """Mamba2-2.7B's 5120 channels would be read as 8192 (0.76x of XLA on the H200)."""
    device_kind, platform = TARGETS[target]
    x = jax.ShapeDtypeStruct((2, 64, 5120), jnp.bfloat16)
    norm = functools.partial(pallas_kernels.rms_norm_gated, implementation="pallas")
    with jax.sharding.use_abstract_mesh(_compat.abstract_gpu_mesh(device_kind, platform)):
        lowered = jax.jit(norm).trace(x, jax.ShapeDtypeStruct((5120,), jnp.float32), x).lower(
            lowering_platforms=(platform,))
    assert TRITON_CALL not in lowered.as_text()
