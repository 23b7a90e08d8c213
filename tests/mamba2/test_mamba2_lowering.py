"""Ahead-of-time lowering of the SSD kernels to Triton (NVIDIA H200, AMD gfx942) at the
Mamba2-2.7B mixer shape: H 80 heads of P 64, state N 128, one group, chunk 256, bf16
(`lowering_cases`)."""

import pytest
from lowering_cases import TARGETS, TRITON_CALL, lower

# The dt preprocessing, the forward scan's unit sums and the forward scan, then the backward's
# state recompute and state gradients (one launch), chunk gradients and the dB/dC state terms.
# On the H200, b 2 x 80 heads x one 64-row head-dim block = 160 walks of 64 chunks at T 4096:
# the forward walks halves and splits the 56 first halves beyond its first round (264
# programs), so it needs unit sums; the backward's walks are cut only below 160. On gfx942 the
# 16-row head-dim blocks make 640 walks, more than the 304 compute units run at once (one
# program each, by the table), so the forward splits the last round's 32 walks.
_TRITON_CALLS = 6

EXPECTED = {
    ("ssd-t4096", "gfx942"): _TRITON_CALLS,
    ("ssd-t4096", "sm_90a"): _TRITON_CALLS,
    ("ssd-t4096-seq_idx", "gfx942"): _TRITON_CALLS,
    ("ssd-t4096-seq_idx", "sm_90a"): _TRITON_CALLS,
    # A ragged length with 8 groups. On the H200 the 160 walks of 16 chunks fit one round of
    # programs: no unit sums.
    ("ssd-t1000-g8", "gfx942"): _TRITON_CALLS,
    ("ssd-t1000-g8", "sm_90a"): _TRITON_CALLS - 1,
    # State size 64 (the tables' other SSD row).
    ("ssd-t4096-n64", "gfx942"): _TRITON_CALLS,
    ("ssd-t4096-n64", "sm_90a"): _TRITON_CALLS,
    # The sequence over 2 devices (T 2048 each): the final-state walk before the forward and
    # the entering state's gradient walk before the backward. On gfx942 both forward walks
    # split their last round (unit sums each); on the H200 neither does.
    ("ssd-t4096-context", "gfx942"): _TRITON_CALLS + 3,
    ("ssd-t4096-context", "sm_90a"): _TRITON_CALLS + 1,
    # The decode step: one kernel.
    ("ssd-state-update", "gfx942"): 1,
    ("ssd-state-update", "sm_90a"): 1,
}


@pytest.mark.parametrize("case, target", list(EXPECTED), ids=[f"{c}-{t}" for c, t in EXPECTED])
def test_ssd_lowers_to_triton(case, target):
    assert target in TARGETS
    _, lowered = lower(case, target)
    assert lowered.as_text().count(TRITON_CALL) == EXPECTED[case, target]


@pytest.mark.parametrize("target", list(TARGETS))
def test_fused_mixer_lowers_to_the_three_ops_kernels(target):
    """The fused mixer (`mamba2-mixer`): the conv's and the norm's two kernels each, the SSD's,
    and in_proj's gradient assembled by dynamic-update-slices."""
    _, lowered = lower("mamba2-mixer", target)
    text = lowered.as_text()
    for kernel in ("causal_conv1d_forward", "causal_conv1d_backward", "rms_norm_gated_forward",
                   "rms_norm_gated_backward", "ssd_forward_output", "ssd_chunk_gradients"):
        assert kernel in text, kernel
    assert text.count(TRITON_CALL) == 4 + _TRITON_CALLS + 1  # the T 4096 walks take unit sums
    assert "dynamic_update_slice" in text


@pytest.mark.parametrize("target", list(TARGETS))
def test_decode_step_lowers_to_two_kernels_and_nothing_between(target):
    """The mixer's decode step (`mamba2-decode-step`): the conv update and the state update,
    each reading its operands in place (no slice, no step-size fusion around them), both
    states written over their buffers."""
    _, lowered = lower("mamba2-decode-step", target)
    text = lowered.as_text()
    assert text.count(TRITON_CALL) == 2
    assert "causal_conv1d_update" in text and "ssd_state_update" in text
    assert "stablehlo.slice" not in text and "stablehlo.concatenate" not in text
    assert text.count("output_operand_alias<") == 2
