"""Attention's forward and backward lower to Triton for GPUs that are not attached (NVIDIA H200,
AMD gfx942): head dims 128 and 80 with each mask feature, 64 and 256 at T 4096 and 77, 128 as
a context-parallel shard and with a user's mask and bias (`lowering_cases`)."""

import pytest
from lowering_cases import CASES, TARGETS, TRITON_CALL, lower


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("case", [name for name in CASES if name.startswith("attn-")])
def test_forward_and_backward_lower_to_triton(case, target):
    _, lowered = lower(case, target)
    # One Triton kernel each: forward, dK/dV, dQ (and the bias's gradient).
    assert lowered.as_text().count(TRITON_CALL) == (4 if "bias" in case else 3)
