"""Ahead-of-time lowering of the SSD kernels to Triton (NVIDIA H200, AMD gfx942) at the
Mamba2-2.7B mixer shape: H 80 heads of P 64, state N 128, one group, chunk 256, bf16."""

import jax
import jax.numpy as jnp
import pytest
from test_lowering import TARGETS, TRITON_CALL

import pallas_kernels
from pallas_kernels import _compat


def _lower_train_step(device_kind, platform, *, t=4096, seq_idx=False, groups=1):
    b, h, p, n = 2, 80, 64, 128
    bf16 = jnp.bfloat16
    shapes = dict(
        x=jax.ShapeDtypeStruct((b, t, h, p), bf16),
        dt=jax.ShapeDtypeStruct((b, t, h), bf16),
        A=jax.ShapeDtypeStruct((h,), jnp.float32),
        B=jax.ShapeDtypeStruct((b, t, groups, n), bf16),
        C=jax.ShapeDtypeStruct((b, t, groups, n), bf16),
        D=jax.ShapeDtypeStruct((h,), jnp.float32),
        z=jax.ShapeDtypeStruct((b, t, h, p), bf16),
        dt_bias=jax.ShapeDtypeStruct((h,), jnp.float32),
        initial_states=jax.ShapeDtypeStruct((b, h, p, n), jnp.float32),
        seq_idx=jax.ShapeDtypeStruct((b, t), jnp.int32),
    )

    def train_step(args):
        args = dict(args)
        seq = args.pop("seq_idx") if seq_idx else None
        args.pop("seq_idx", None)

        def loss(args):
            y, final = pallas_kernels.mamba_chunk_scan_combined(
                **args, chunk_size=256, seq_idx=seq, dt_softplus=True, return_final_states=True
            )
            return jnp.sum(y.astype(jnp.float32)) + jnp.sum(final)

        return jax.grad(loss)(args)

    with jax.sharding.use_abstract_mesh(_compat.abstract_gpu_mesh(device_kind, platform)):
        traced = jax.jit(train_step).trace(shapes)
        return traced.lower(lowering_platforms=(platform,)).as_text()


# The dt preprocessing, the forward scan's segment sums and the forward scan, then the
# backward's state recompute and state gradients (one launch), chunk gradients and the dB/dC
# state terms. On the H200, b 2 x 80 heads x one 64-row head-dim block = 160 walks of 64 chunks at
# T 4096: the forward walks halves and splits the 56 first halves beyond its first round (264
# programs), so it needs segment sums; the backward's walks are cut only below 160. On gfx942
# the 16-row head-dim blocks make 640 walks, more than the 304 compute units run at once (one
# program each, by the table), so the forward splits the last round's 32 walks.
_TRITON_CALLS = 6


@pytest.mark.parametrize("seq_idx", [False, True], ids=["plain", "seq_idx"])
@pytest.mark.parametrize("device_kind,platform", TARGETS, ids=[t[1] for t in TARGETS])
def test_ssd_forward_and_backward_lower_to_triton(device_kind, platform, seq_idx):
    text = _lower_train_step(device_kind, platform, seq_idx=seq_idx)
    assert text.count(TRITON_CALL) == _TRITON_CALLS


@pytest.mark.parametrize("device_kind,platform", TARGETS, ids=[t[1] for t in TARGETS])
def test_ragged_length_and_groups_lower(device_kind, platform):
    text = _lower_train_step(device_kind, platform, t=1000, groups=8)
    # On the H200 the 160 walks of 16 chunks fit one round of programs: no segment sums.
    assert text.count(TRITON_CALL) == _TRITON_CALLS - (platform == "cuda")


@pytest.mark.parametrize("device_kind,platform", TARGETS, ids=[t[1] for t in TARGETS])
def test_state_update_lowers(device_kind, platform):
    b, h, p, n, g = 8, 80, 64, 128, 1
    f32, bf16 = jnp.float32, jnp.bfloat16
    args = (
        jax.ShapeDtypeStruct((b, h, p, n), f32), jax.ShapeDtypeStruct((b, h, p), bf16),
        jax.ShapeDtypeStruct((b, h), bf16), jax.ShapeDtypeStruct((h,), f32),
        jax.ShapeDtypeStruct((b, g, n), bf16), jax.ShapeDtypeStruct((b, g, n), bf16),
        jax.ShapeDtypeStruct((h,), f32), jax.ShapeDtypeStruct((b, h, p), bf16),
        jax.ShapeDtypeStruct((h,), f32),
    )

    def step(state, x, dt, A, B, C, D, z, dt_bias):
        return pallas_kernels.selective_state_update(
            state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True
        )

    with jax.sharding.use_abstract_mesh(_compat.abstract_gpu_mesh(device_kind, platform)):
        text = jax.jit(step).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert text.count(TRITON_CALL) == 1
