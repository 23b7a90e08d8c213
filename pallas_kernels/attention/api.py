"""`dot_product_attention`: FlashAttention with jax.nn's layout, checks, dispatch and custom_vjp.

A call flows: argument checks (`checks`, before anything is traced) -> implementation choice
("xla" runs `reference.py`, "pallas" the kernels) -> the tuned blocks (`tuning`) -> padding to
whole blocks and a power-of-two head dim -> `_flash_attention`, a `jax.custom_vjp` whose forward
saves q, k, v, out and lse and whose backward runs the dK/dV and dQ kernels. The backward is
itself differentiable: its derivatives (second order) are those of the reference's backward
(`_kernel_gradients`).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from pallas_kernels import _derivatives, _device, _dispatch, _sharding
from pallas_kernels.attention import (
    backward,
    checks,
    common,
    forward,
    masking,
    reference,
    tuning,
)

MAX_HEAD_DIM = 256


def dot_product_attention(
    query,
    key,
    value,
    *,
    scale=None,
    is_causal=False,
    local_window_size=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    logits_soft_cap=None,
    implementation=None,
    return_residual=False,
    block_sizes=None,
    interpret=None,
    sharding=None,
):
    """Scaled dot-product attention, softmax(q k^T * scale) v, as `jax.nn.dot_product_attention`.

    Args:
      query: (B, T, N, H) or, without batch, (T, N, H); bfloat16, float16 or float32.
      key, value: (B, S, K, H) or (S, K, H), the query's dtype, with N % K == 0 (K < N is GQA,
        K == 1 MQA; key/value heads are never repeated in memory).
      scale: logit scale, a finite number > 0; default 1/sqrt(H).
      is_causal: query i sees keys j <= i, aligned top-left as in jax.nn (when T != S, query 0
        sees key 0), not bottom-right as in FlashAttention's own API.
      local_window_size: int w or (left, right), >= 0: query i sees keys in [i - left,
        i + right] (w means (w, w)); combined with `is_causal` the right side is at most 0.
      q_segment_ids, kv_segment_ids: (B, T) and (B, S) integers of any width, given together:
        a query sees only keys of the same segment (packed documents).
      query_seq_lengths, key_value_seq_lengths: (B,) integers: only the first q_len queries and
        kv_len keys of each batch row take part. The rest are never read into a product, so
        they may hold anything (stale cache slots, NaN): they get output 0 and zero gradients.
      logits_soft_cap: a finite c > 0 replaces each logit x by c * tanh(x / c) (after scaling).
      implementation: "pallas" (the kernels), "xla" (the pure-jnp reference, quadratic memory)
        or None (the kernels on GPU, the reference elsewhere).
      return_residual: also return the log-sum-exp of the logits, (B, T, N) float32, natural log.
      block_sizes: a `tuning.AttentionBlocks` (`pallas_kernels.AttentionBlocks`) to use instead
        of the tuned table.
      interpret: run the Pallas kernels in interpret mode (on CPU); None: when not on a GPU.
      sharding: how the query is sharded on a mesh, a `jax.sharding.NamedSharding` or a
        `PartitionSpec` (on the mesh of `jax.set_mesh`), for classic meshes; on meshes with
        Explicit axes (`jax.make_mesh`) the query's own sharding is used. Batch and heads may
        be sharded (key/value heads shard with the query heads); the kernels then run per
        shard under `jax.shard_map`, with no collective on their inputs.

    Returns:
      The output, shaped and typed as the query (accumulation is float32), and with
      `return_residual` the tuple (output, lse). A query that sees no key gets output 0, lse
      -inf and zero gradients.

    Second-order derivatives (grad of grad, `jax.hessian`) work on both paths; on the Pallas
    path the first derivatives come from the kernels and the second from the reference
    (quadratic memory).
    """
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    batched = checks.check_arrays(query, key, value)
    placement = _sharding.find("query", query, sharding, sequence_dim=1, feature_dims=(3,),
                               batched=batched)
    if not batched:
        query, key, value = (x[None] for x in (query, key, value))
    batch, t, n, h = query.shape
    s = key.shape[1]
    segments = checks.check_segment_ids(q_segment_ids, kv_segment_ids, batch, t, s, batched)
    q_len = checks.check_lengths("query_seq_lengths", query_seq_lengths, batch, t, batched)
    kv_len = checks.check_lengths("key_value_seq_lengths", key_value_seq_lengths, batch, s,
                                  batched)
    scale = _dispatch.check_positive("scale", scale, default=h**-0.5)
    is_causal = _dispatch.check_bool("is_causal", is_causal)
    return_residual = _dispatch.check_bool("return_residual", return_residual)
    local_window_size = checks.check_window(local_window_size)
    band = masking.band(is_causal, local_window_size)
    logits_soft_cap = checks.check_soft_cap(logits_soft_cap)
    implementation, interpret = _dispatch.choose(implementation, interpret)
    if block_sizes is not None and not isinstance(block_sizes, tuning.AttentionBlocks):
        raise TypeError(
            f"block_sizes must be a tuning.AttentionBlocks, got {type(block_sizes)}")
    if implementation == "pallas" and h > MAX_HEAD_DIM:
        raise ValueError(f"the Pallas kernels support head dims up to {MAX_HEAD_DIM}, got {h}")

    def compute(query, key, value, q_seg, kv_seg, q_len, kv_len):
        """(out, lse) of checked, batched arrays (a shard's, on a mesh)."""
        if implementation == "xla":
            return reference.dot_product_attention(
                query, key, value, scale=scale, is_causal=is_causal,
                local_window_size=local_window_size, q_segment_ids=q_seg,
                kv_segment_ids=kv_seg, query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
                logits_soft_cap=logits_soft_cap, return_residual=True,
            )
        return _pallas_attention(
            query, key, value, None if q_seg is None else (q_seg, kv_seg), q_len, kv_len,
            block_sizes, scale=scale, band=band, logits_soft_cap=logits_soft_cap,
            interpret=interpret,
        )

    arrays = (query, key, value, *((None, None) if segments is None else segments), q_len,
              kv_len)
    if placement is None:
        out, lse = compute(*arrays)
    else:
        placement.check_divides("query", "the batch", batch, placement.batch)
        placement.check_divides("query", "the heads", n, placement.heads)
        placement.check_divides("key", "the key/value heads", key.shape[2], placement.heads)
        heads = P(placement.batch, None, placement.heads, None)
        rows, lengths = P(placement.batch, None), P(placement.batch)
        out, lse = _sharding.run(placement, compute, arrays,
                                 (heads, heads, heads, rows, rows, lengths, lengths),
                                 (heads, P(placement.batch, None, placement.heads)))
    if not batched:
        out, lse = out[0], lse[0]
    return (out, lse) if return_residual else out


# ---------------------------------------------------------------------------------------------
# The Pallas path.


@dataclasses.dataclass(frozen=True)
class _Config:
    """What the kernels know of a call besides its arrays (hashable: keys custom_vjp and jit)."""

    static: common.Static
    blocks: tuning.AttentionBlocks  # fitted to the call
    shape: tuple  # (B, T, S) before padding


def _pallas_attention(
    query, key, value, segments, q_len, kv_len, block_sizes, *, scale, band, logits_soft_cap,
    interpret,
):
    """Pads to whole blocks and a power-of-two head dim, runs the kernels, slices back."""
    batch, t, n, h = query.shape
    s, k_heads = key.shape[1], key.shape[2]
    d_pad = tuning.padded_head_dim(h)
    if block_sizes is None:
        block_sizes = tuning.blocks_for(_device.target()[0], d_pad)
    blocks = block_sizes.fit(t, s)
    block_q = max(b.block_q for b in (blocks.forward, blocks.dkv, blocks.dq))
    block_k = max(b.block_k for b in (blocks.forward, blocks.dkv, blocks.dq))
    t_pad = _device.cdiv(t, block_q) * block_q
    s_pad = _device.cdiv(s, block_k) * block_k
    static = common.Static(
        scale=scale,
        band=band,
        logits_soft_cap=logits_soft_cap,
        groups=n // k_heads,
        has_segments=segments is not None,
        may_mask=(
            band != (None, None) or segments is not None or q_len is not None
            or kv_len is not None or t_pad != t or s_pad != s
        ),
        interpret=interpret,
        has_q_len=q_len is not None,
        has_kv_len=kv_len is not None,
    )
    config = _Config(static, blocks, (batch, t, s))

    pad = _device.pad_end
    q = pad(query, (None, t_pad, None, d_pad))
    k = pad(key, (None, s_pad, None, d_pad))
    v = pad(value, (None, s_pad, None, d_pad))
    q_seg, kv_seg = (None, None) if segments is None else (
        pad(segments[0], (None, t_pad)), pad(segments[1], (None, s_pad))
    )
    out, lse = _flash_attention(config, q, k, v, q_seg, kv_seg, q_len, kv_len)
    return out[:, :t, :, :h], jnp.swapaxes(lse[:, :, :t], 1, 2)


def _tables(config, t_pad, s_pad, q_seg, kv_seg, q_len, kv_len, kernel):
    """`masking.block_table` of one kernel: "forward"/"dq" (query blocks), "dkv" (key blocks).

    Without segments or lengths the table depends on shapes alone; it is then computed on the
    host with numpy and enters the program as a constant, costing no launch per call.
    """
    batch, t, s = config.shape
    xp = jnp if q_seg is not None or q_len is not None or kv_len is not None else np
    q_len = xp.full((batch,), t, np.int32) if q_len is None else q_len
    kv_len = xp.full((batch,), s, np.int32) if kv_len is None else kv_len
    blocks = getattr(config.blocks, kernel)
    if kernel == "dkv":  # rows are key blocks, columns query blocks
        return masking.block_table(
            num_row_blocks=s_pad // blocks.block_k, row_block=blocks.block_k,
            num_col_blocks=t_pad // blocks.block_q, col_block=blocks.block_q,
            band=masking.transpose_band(config.static.band), row_len=kv_len, col_len=q_len,
            row_segments=kv_seg, col_segments=q_seg, xp=xp,
        )
    return masking.block_table(
        num_row_blocks=t_pad // blocks.block_q, row_block=blocks.block_q,
        num_col_blocks=s_pad // blocks.block_k, col_block=blocks.block_k,
        band=config.static.band, row_len=q_len, col_len=kv_len,
        row_segments=q_seg, col_segments=kv_seg, xp=xp,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash_attention(config, q, k, v, q_seg, kv_seg, q_len, kv_len):
    """(out (B, Tp, N, Dp), lse (B, N, Tp)) of padded inputs; see `forward.forward`."""
    return _kernel_forward(config, q, k, v, q_seg, kv_seg, q_len, kv_len)


def _flash_attention_fwd(config, q, k, v, q_seg, kv_seg, q_len, kv_len):
    out, lse = _kernel_forward(config, q, k, v, q_seg, kv_seg, q_len, kv_len)
    return (out, lse), (q, k, v, q_seg, kv_seg, q_len, kv_len, out, lse)


# Second order (`_derivatives`): the forward rule and the backward keep their kernel values and
# take the tangents of the reference (`_reference_attention`, quadratic memory). In the
# backward's, out and lse (functions of q, k, v) get zero partials: the reference recomputes
# them, so every total derivative is still exact.


def _forward_kernel(config, q, k, v, q_seg, kv_seg, q_len, kv_len):
    """(out, lse) of `_flash_attention` from the forward kernel."""
    table = _tables(config, q.shape[1], k.shape[1], q_seg, kv_seg, q_len, kv_len, "forward")
    return forward.forward(
        q, k, v, q_seg, kv_seg, table, static=config.static, blocks=config.blocks.forward
    )


def _reference_attention(config, q, k, v, q_seg, kv_seg, q_len, kv_len):
    """What `_flash_attention` computes, by `reference.banded_attention` on the padded
    arguments, whose padding rows lie past the lengths (as in the kernels' tables)."""
    batch, t, s = config.shape
    static = config.static
    out, lse = reference.banded_attention(
        q, k, v, scale=static.scale, band=static.band, q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
        query_seq_lengths=jnp.full((batch,), t, jnp.int32) if q_len is None else q_len,
        key_value_seq_lengths=jnp.full((batch,), s, jnp.int32) if kv_len is None else kv_len,
        logits_soft_cap=static.logits_soft_cap, return_residual=True,
    )
    return out, jnp.swapaxes(lse, 1, 2)


def _flash_attention_bwd(config, residuals, cotangents):
    return _kernel_gradients(config, residuals, cotangents)


def _backward_kernels(config, residuals, cotangents):
    """The gradients of `_flash_attention`'s q, k, v, from the backward kernels."""
    q, k, v, q_seg, kv_seg, q_len, kv_len, out, lse = residuals
    dout, dlse = cotangents
    t_pad, s_pad = q.shape[1], k.shape[1]
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    delta = jnp.swapaxes(delta, 1, 2) - dlse  # (B, N, Tp)
    arrays = (q, k, v, dout.astype(q.dtype), lse, delta, q_seg, kv_seg)
    dk, dv = backward.dkv(
        *arrays, _tables(config, t_pad, s_pad, q_seg, kv_seg, q_len, kv_len, "dkv"),
        static=config.static, blocks=config.blocks.dkv,
    )
    dq = backward.dq(
        *arrays, _tables(config, t_pad, s_pad, q_seg, kv_seg, q_len, kv_len, "dq"),
        static=config.static, blocks=config.blocks.dq,
    )
    return dq, dk, dv, None, None, None, None


def _reference_gradients(config, residuals, cotangents):
    """`_backward_kernels` by differentiating `_reference_attention`."""
    q, k, v, q_seg, kv_seg, q_len, kv_len, _, _ = residuals
    _, vjp = jax.vjp(lambda q, k, v: _reference_attention(config, q, k, v, q_seg, kv_seg,
                                                          q_len, kv_len), q, k, v)
    return (*vjp(cotangents), None, None, None, None)


_kernel_forward = _derivatives.reference_tangents(_forward_kernel, _reference_attention)
_kernel_gradients = _derivatives.reference_tangents(_backward_kernels, _reference_gradients)
_flash_attention.defvjp(_flash_attention_fwd, _flash_attention_bwd)
