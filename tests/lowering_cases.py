"""The public calls that the lowering tests and the machine-code check lower ahead of time for
GPUs that are not attached (NVIDIA H200, AMD gfx942), on a CPU: one case per name in `CASES`.

Interpret mode does not check Triton's rules (power-of-two arrays, supported primitives); the
real lowering does, and it runs on a CPU under an abstract mesh of the target device.
"""

import functools

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels import _compat
from pallas_kernels.mamba2 import mixer

TRITON_CALL = "__gpu$xla.gpu.triton"
# Target name -> (abstract device kind, lowering platform).
TARGETS = {"gfx942": ("gfx942", "rocm"), "sm_90a": ("NVIDIA H200", "cuda")}


def _attention(head_dim, t=4096, feature="causal"):
    """Attention forward and backward (vjp), bf16, b 2, 16 query / 4 key-value heads.
    "context": causal, as one device's share of ring context parallelism (the sequence on the
    target's one-device mesh axis), so the kernels take the band's shift from their tables.
    "mask-bias": causal with a (B, 1, T, T) mask and a (1, N, T, T) bias, differentiated."""
    def make():
        b, n, k = 2, 16, 4
        q = jax.ShapeDtypeStruct((b, t, n, head_dim), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((b, t, k, head_dim), jnp.bfloat16)
        ids = jax.ShapeDtypeStruct((b, t), jnp.int32)
        lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
        mask = jax.ShapeDtypeStruct((b, 1, t, t), jnp.bool_)
        bias = jax.ShapeDtypeStruct((1, n, t, t), jnp.bfloat16)

        def train_step(q, k, v, ids, lengths, mask, bias):
            if feature == "mask-bias":  # the bias's gradient too: a fourth kernel
                out, vjp = jax.vjp(lambda q, k, v, bias: pallas_kernels.dot_product_attention(
                    q, k, v, bias, mask, is_causal=True), q, k, v, bias)
                return out, vjp(out)
            kw = {
                "causal": dict(is_causal=True),
                "window-softcap": dict(local_window_size=(256, 0), logits_soft_cap=30.0),
                "segments-lengths": dict(q_segment_ids=ids, kv_segment_ids=ids,
                                         query_seq_lengths=lengths,
                                         key_value_seq_lengths=lengths),
                "context": dict(is_causal=True, sharding=jax.sharding.PartitionSpec(None, "x"),
                                context_parallelism="ring"),
            }[feature]
            out, vjp = jax.vjp(
                lambda q, k, v: pallas_kernels.dot_product_attention(q, k, v, **kw), q, k, v)
            return out, vjp(out)

        return "attention", train_step, (q, kv, kv, ids, lengths, mask, bias)

    return make


def _ssd(t=4096, groups=1, seq_idx=False, n=128, context=False):
    """The SSD's gradient at the Mamba2-2.7B mixer shape: H 80 heads of P 64, state N 128 (or
    `n`), chunk 256, bf16, with D, z, dt_bias and initial states; with `context`, the sequence
    over the target mesh's axis (`MESH_SHAPES`: 2 devices), the kernels' state passing."""
    def make():
        b, h, p = 2, 80, 64
        bf16, f32 = jnp.bfloat16, jnp.float32
        args = dict(
            x=jax.ShapeDtypeStruct((b, t, h, p), bf16),
            dt=jax.ShapeDtypeStruct((b, t, h), bf16),
            A=jax.ShapeDtypeStruct((h,), f32),
            B=jax.ShapeDtypeStruct((b, t, groups, n), bf16),
            C=jax.ShapeDtypeStruct((b, t, groups, n), bf16),
            D=jax.ShapeDtypeStruct((h,), f32),
            z=jax.ShapeDtypeStruct((b, t, h, p), bf16),
            dt_bias=jax.ShapeDtypeStruct((h,), f32),
            initial_states=jax.ShapeDtypeStruct((b, h, p, n), f32),
        )
        seq = jax.ShapeDtypeStruct((b, t), jnp.int32) if seq_idx else None

        def train_step(args, seq):
            def loss(args):
                y, final = pallas_kernels.mamba_chunk_scan_combined(
                    **args, chunk_size=256, seq_idx=seq, dt_softplus=True,
                    return_final_states=True,
                    sharding=jax.sharding.PartitionSpec(None, "x") if context else None)
                return jnp.sum(y.astype(jnp.float32)) + jnp.sum(final)

            return jax.grad(loss)(args)

        return "ssd", train_step, (args, seq)

    return make


def _state_update():
    """One decode step at the same mixer shape, batch 8."""
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
            state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)

    return "state_update", step, args


def _decode(kv_dtype, paged=True, head_dim=128, t=1):
    """Decode attention over a KV cache: batch 8, 32 query / 4 KV heads, capacity 8192 (pages
    of 16), `t` new tokens; 8-bit caches with per token-head scales."""
    def make():
        b, n, k, capacity, page = 8, 32, 4, 8192, 16
        shape = (b * capacity // page, page, k, head_dim) if paged else (b, capacity, k, head_dim)
        scaled = jnp.dtype(kv_dtype).itemsize == 1
        scale_shape = (shape[0], k, shape[1])  # each KV head's scales along its keys
        args = dict(
            q=jax.ShapeDtypeStruct((b, t, n, head_dim), jnp.bfloat16),
            k_cache=jax.ShapeDtypeStruct(shape, kv_dtype),
            v_cache=jax.ShapeDtypeStruct(shape, kv_dtype),
            cache_seqlens=jax.ShapeDtypeStruct((b,), jnp.int32),
            block_table=jax.ShapeDtypeStruct((b, capacity // page), jnp.int32) if paged else None,
            k_scale=jax.ShapeDtypeStruct(scale_shape, jnp.float32) if scaled else None,
            v_scale=jax.ShapeDtypeStruct(scale_shape, jnp.float32) if scaled else None,
        )

        def step(args):
            return pallas_kernels.attention_with_kv_cache(**args)

        return "decode", step, (args,)

    return make


def _norm(channels, norm_before_gate, group_size=None, z_width=None):
    """The gated RMSNorm forward and backward (vjp) over B 2 x T 4096 rows of `channels`, bf16:
    the zamba2-like mixer (4096, gate first, z read in place from in_proj's 8384 columns) and 8
    groups of 1024 (gate after)."""
    def make():
        x = jax.ShapeDtypeStruct((2, 4096, channels), jnp.bfloat16)
        weight = jax.ShapeDtypeStruct((channels,), jnp.float32)
        z = x if z_width is None else jax.ShapeDtypeStruct((2, 4096, z_width), jnp.bfloat16)

        def train_step(x, weight, z):
            norm = functools.partial(pallas_kernels.rms_norm_gated, group_size=group_size,
                                     norm_before_gate=norm_before_gate,
                                     z_column_offset=None if z_width is None else 0)
            out, vjp = jax.vjp(norm, x, weight, z)
            return out, vjp(out)

        return "norm", train_step, (x, weight, z)

    return make


def _conv():
    """The causal conv + SiLU forward and backward (vjp) as the zamba2-like mixer calls it: over
    x, B and C's 4224 channels (4096 + 2 x 64) read in place from in_proj's output (B 2 x T
    4096 x 8384, from column 4096), written as x and [B, C]; width 4, bf16."""
    zxbcdt = jax.ShapeDtypeStruct((2, 4096, 8384), jnp.bfloat16)
    weight = jax.ShapeDtypeStruct((4, 4224), jnp.float32)
    bias = jax.ShapeDtypeStruct((4224,), jnp.float32)

    def train_step(zxbcdt, weight, bias):
        out, vjp = jax.vjp(functools.partial(pallas_kernels.causal_conv1d, column_offset=4096,
                                             split=4096), zxbcdt, weight, bias)
        return out, vjp(out)

    return "conv", train_step, (zxbcdt, weight, bias)


def _mixer():
    """The fused Mamba2 mixer (`mixer.split_conv_scan_norm`) forward and backward (vjp) at the
    zamba2-like shape: in_proj's output B 2 x T 4096 x 8384 (z 4096, xBC 4096 + 2 x 64, dt 64
    heads of 64), bf16; float32 parameters."""
    shape = mixer.MixerShape(d_ssm=4096, ngroups=1, d_state=64, nheads=64,
                             norm_group_size=4096)
    f32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
    args = (jax.ShapeDtypeStruct((2, 4096, shape.width), jnp.bfloat16),
            jax.ShapeDtypeStruct((4, shape.conv_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((shape.conv_dim,), jnp.bfloat16), f32((64,)), f32((64,)),
            f32((64,)), f32((4096,)))

    def train_step(*args):
        out, vjp = jax.vjp(functools.partial(
            mixer.split_conv_scan_norm, shape=shape, chunk_size=256, dt_limit=(0.0, jnp.inf),
            norm_eps=1e-5, norm_before_gate=False, interpret=False), *args)
        return out, vjp(out)

    return "mixer", train_step, args


def _decode_step():
    """The Mamba2 mixer's decode step (`mixer.split_conv_step`: the conv update and the state
    update reading in_proj's output in place) at the zamba2-like shape, batch 64: in_proj's
    output 8384 wide (z 4096, xBC 4096 + 2 x 64, dt 64 heads of 64), bf16 states, float32
    parameters."""
    shape = mixer.MixerShape(d_ssm=4096, ngroups=1, d_state=64, nheads=64,
                             norm_group_size=4096)
    f32, bf16 = (functools.partial(jax.ShapeDtypeStruct, dtype=d)
                 for d in (jnp.float32, jnp.bfloat16))
    b = 64
    args = (bf16((b, shape.width)), bf16((b, 3, shape.conv_dim)), bf16((b, 64, 64, 64)),
            f32((4, shape.conv_dim)), f32((shape.conv_dim,)), f32((64,)), f32((64,)),
            f32((64,)))
    step = functools.partial(mixer.split_conv_step, shape=shape, column_offset=0,
                             dt_limit=(0.0, float("inf")), interpret=False)
    return "decode_step", step, args


# Name -> make() returning (family, fn, args), args jax.ShapeDtypeStructs.
CASES = {
    **{f"attn-h{hd}-{f}": _attention(hd, feature=f)
       for hd in (128, 80) for f in ("causal", "window-softcap", "segments-lengths")},
    **{f"attn-h{hd}-t{t}": _attention(hd, t=t) for hd in (64, 256) for t in (4096, 77)},
    "attn-h128-context": _attention(128, feature="context"),
    "attn-h128-mask-bias": _attention(128, feature="mask-bias"),
    "ssd-t4096": _ssd(),
    "ssd-t4096-seq_idx": _ssd(seq_idx=True),
    "ssd-t1000-g8": _ssd(t=1000, groups=8),
    "ssd-t4096-n64": _ssd(n=64),
    "ssd-t4096-context": _ssd(context=True),
    "ssd-state-update": _state_update,
    **{f"decode-{jnp.dtype(d).name}-paged": _decode(d)
       for d in (jnp.bfloat16, jnp.float32, jnp.int8, jnp.uint8, jnp.float8_e4m3fn)},
    "decode-bfloat16-dense-h80-t4": _decode(jnp.bfloat16, paged=False, head_dim=80, t=4),
    "norm-gated-d4096": _norm(4096, False, z_width=8384),
    "norm-gated-d8192-g8": _norm(8192, True, group_size=1024),
    "conv-mixer": _conv,
    "mamba2-mixer": _mixer,
    "mamba2-decode-step": _decode_step,
}


# The abstract mesh's shape (axis "x") where a case needs more than one device.
MESH_SHAPES = {"ssd-t4096-context": (2,)}


def lower(case, target):
    """(family, the jax.stages.Lowered) of `CASES[case]` for `target` (a key of TARGETS)."""
    device_kind, platform = TARGETS[target]
    family, fn, args = CASES[case]()
    mesh = _compat.abstract_gpu_mesh(device_kind, platform, MESH_SHAPES.get(case, (1,)))
    with jax.sharding.use_abstract_mesh(mesh):
        return family, jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))
