"""Ahead-of-time lowering to Triton for GPUs that are not attached (NVIDIA H200, AMD gfx942).

Interpret mode does not check Triton's rules (power-of-two arrays, supported primitives); the real
lowering does, and it runs on a CPU under an abstract mesh of the target device.
"""

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels
from pallas_kernels import _compat

TARGETS = [("NVIDIA H200", "cuda"), ("gfx942", "rocm")]
TRITON_CALL = "__gpu$xla.gpu.triton"

FEATURES = {
    "causal": dict(is_causal=True),
    "window-softcap": dict(local_window_size=(256, 0), logits_soft_cap=30.0),
    "segments-lengths": dict(segments=True, lengths=True),
}


def _lower_forward_backward(device_kind, platform, head_dim, features, t=4096):
    b, n, k = 2, 16, 4
    q = jax.ShapeDtypeStruct((b, t, n, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, t, k, head_dim), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((b, t), jnp.int32)
    lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
    features = dict(features)
    segments, with_lengths = features.pop("segments", False), features.pop("lengths", False)

    def train_step(q, k, v, ids, lengths):
        kw = dict(features)
        if segments:
            kw.update(q_segment_ids=ids, kv_segment_ids=ids)
        if with_lengths:
            kw.update(query_seq_lengths=lengths, key_value_seq_lengths=lengths)
        out, vjp = jax.vjp(
            lambda q, k, v: pallas_kernels.dot_product_attention(q, k, v, **kw), q, k, v
        )
        return out, vjp(out)

    with jax.sharding.use_abstract_mesh(_compat.abstract_gpu_mesh(device_kind, platform)):
        traced = jax.jit(train_step).trace(q, kv, kv, ids, lengths)
        return traced.lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("head_dim", [128, 80])
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("device_kind,platform", TARGETS, ids=[t[1] for t in TARGETS])
def test_forward_and_backward_lower_to_triton(device_kind, platform, feature, head_dim):
    text = _lower_forward_backward(device_kind, platform, head_dim, FEATURES[feature])
    # One Triton kernel each: forward, dK/dV, dQ.
    assert text.count(TRITON_CALL) == 3


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("device_kind,platform", TARGETS, ids=[t[1] for t in TARGETS])
def test_other_head_dims_and_short_sequences_lower(device_kind, platform, head_dim):
    for t in (4096, 77):
        text = _lower_forward_backward(device_kind, platform, head_dim, FEATURES["causal"], t=t)
        assert text.count(TRITON_CALL) == 3
