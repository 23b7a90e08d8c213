"""`dot_product_attention`: FlashAttention with jax.nn's layout, checks, dispatch and custom_vjp.

A call flows: argument checks (`checks`, before anything is traced) -> implementation choice
("xla" runs `reference.py`, "pallas" the kernels) -> on a mesh, per shard (`_sharding`; a sharded
sequence through `context`) -> the tuned blocks (`tuning`) -> padding to
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
    context,
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
    context_parallelism="all_gather",
    sequence_order="contiguous",
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
        be sharded (key/value heads shard with the query heads) with no collective on the
        kernels' inputs; the kernels run per shard under `jax.shard_map`. A sharded sequence
        (key and value sharded as the query) is context parallelism: each device computes
        its own queries' rows, at their global positions.
      context_parallelism: how a sharded sequence's devices share keys and values:
        "all_gather" (gather K and V; reduce-scatter their gradients) or "ring" (pass K and V
        around the sequence axis, n - 1 collective-permutes each, overlapping the kernels;
        the backward passes dK and dV along with them, so nothing is stored whole). On the
        Pallas path ring's second derivatives are not available.
      sequence_order: how the sequence's tokens lie on the devices, "contiguous" or "zigzag"
        (`pallas_kernels.zigzag`, which balances causal work; T and S then divide by twice the
        sequence axis's size).

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
    placement = _sharding.find("query", query, sharding, feature_dims=(3,), batched=batched)
    context.strategy(context_parallelism)  # checked before anything is traced
    _sharding.check_order(sequence_order)
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

    options = dict(scale=scale, band=band, logits_soft_cap=logits_soft_cap,
                   interpret=interpret)

    def compute(query, key, value, q_seg, kv_seg, q_len, kv_len, shift=None):
        """(out, lse) of checked, batched arrays (a shard's, on a mesh); `shift` as in
        `masking` (context parallelism)."""
        if implementation == "xla":
            return reference.banded_attention(
                query, key, value, scale=scale, band=band, q_segment_ids=q_seg,
                kv_segment_ids=kv_seg, query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
                logits_soft_cap=logits_soft_cap, return_residual=True, shift=shift,
            )
        return _pallas_attention(query, key, value, q_seg, kv_seg, q_len, kv_len, shift,
                                 block_sizes, **options)

    arrays = (query, key, value, *((None, None) if segments is None else segments), q_len,
              kv_len)
    if placement is None:
        out, lse = compute(*arrays)
    else:
        placement.check_divides("query", "the batch", batch, placement.batch)
        placement.check_divides("query", "the heads", n, placement.heads)
        placement.check_divides("key", "the key/value heads", key.shape[2], placement.heads)
        local = compute
        if placement.sequence is not None:
            placement.check_sequence("query", t, sequence_order)
            placement.check_sequence("key", s, sequence_order)
            parts = placement.size(placement.sequence)
            gradients = None if implementation == "xla" else functools.partial(
                _pallas_gradients, block_sizes=block_sizes, **options)
            local = functools.partial(
                context.strategy(context_parallelism), compute, gradients, placement.sequence,
                parts, sequence_order)
        spec = P(placement.batch, placement.sequence, placement.heads)
        rows, lengths = P(placement.batch, placement.sequence), P(placement.batch)
        out, lse = _sharding.run(placement, local, arrays,
                                 (spec, spec, spec, rows, rows, lengths, lengths), (spec, spec))
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
    padded: tuple  # (Tp, Sp, Dp): whole blocks and a power-of-two head dim

    def pad(self, query, key, value, q_seg, kv_seg):
        """The arrays padded to `padded` (zeros); None stays None."""
        t_pad, s_pad, d_pad = self.padded
        pad = _device.pad_end
        return (pad(query, (None, t_pad, None, d_pad)), pad(key, (None, s_pad, None, d_pad)),
                pad(value, (None, s_pad, None, d_pad)),
                None if q_seg is None else pad(q_seg, (None, t_pad)),
                None if kv_seg is None else pad(kv_seg, (None, s_pad)))


def _configure(query, key, has_segments, q_len, kv_len, shift, block_sizes, *, scale, band,
               logits_soft_cap, interpret):
    """The `_Config` of a call: the tuned blocks fitted to its shapes and what may be masked."""
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
        has_segments=has_segments,
        may_mask=(
            band != (None, None) or has_segments or q_len is not None
            or kv_len is not None or t_pad != t or s_pad != s
        ),
        interpret=interpret,
        has_q_len=q_len is not None,
        has_kv_len=kv_len is not None,
        shifted=shift is not None and band != (None, None),
    )
    return _Config(static, blocks, (batch, t, s), (t_pad, s_pad, d_pad))


def _pallas_attention(query, key, value, q_seg, kv_seg, q_len, kv_len, shift, block_sizes,
                      **options):
    """(out (B, T, N, H), lse (B, T, N)): pads to whole blocks and a power-of-two head dim,
    runs the kernels, slices back. `shift`: None, or the band's int32 scalar shift
    (`masking`) when the query and key are pieces of longer sequences (context parallelism);
    `options`: `_configure`'s keywords."""
    config = _configure(query, key, q_seg is not None, q_len, kv_len, shift, block_sizes,
                        **options)
    shift = jnp.asarray(shift, jnp.int32) if config.static.shifted else None
    out, lse = _flash_attention(config, *config.pad(query, key, value, q_seg, kv_seg), q_len,
                                kv_len, shift)
    t, h = query.shape[1], query.shape[3]
    return out[:, :t, :, :h], jnp.swapaxes(lse[:, :, :t], 1, 2)


def _pallas_gradients(query, key, value, q_seg, kv_seg, q_len, kv_len, shift, dout, lse, delta,
                      block_sizes, **options):
    """(dq, dk, dv) of the loss whose output cotangent is dout (B, T, N, H), for the pairs of
    this call, from the backward kernels; lse (B, T, N) and delta = rowsum(dO * O) - dlse
    (B, T, N) are those of the whole softmax rows (context parallelism: every key, not only
    this call's). Arguments otherwise as in `_pallas_attention`."""
    config = _configure(query, key, q_seg is not None, q_len, kv_len, shift, block_sizes,
                        **options)
    shift = jnp.asarray(shift, jnp.int32) if config.static.shifted else None
    t_pad, _, d_pad = config.padded
    q, k, v, q_seg, kv_seg = config.pad(query, key, value, q_seg, kv_seg)
    rows = [_device.pad_end(jnp.swapaxes(x, 1, 2), (None, None, t_pad)) for x in (lse, delta)]
    dout = _device.pad_end(dout.astype(q.dtype), (None, t_pad, None, d_pad))
    dq, dk, dv = _gradient_kernels(config, q, k, v, q_seg, kv_seg, q_len, kv_len, shift, dout,
                                   *rows)
    t, s, h = query.shape[1], key.shape[1], query.shape[3]
    return dq[:, :t, :, :h], dk[:, :s, :, :h], dv[:, :s, :, :h]


def _tables(config, t_pad, s_pad, q_seg, kv_seg, q_len, kv_len, shift, kernel):
    """`masking.block_table` of one kernel: "forward"/"dq" (query blocks), "dkv" (key blocks).

    Without segments, lengths or shift the table depends on shapes alone; it is then computed
    on the host with numpy and enters the program as a constant, costing no launch per call.
    """
    batch, t, s = config.shape
    traced = (q_seg, q_len, kv_len, shift)
    xp = np if all(x is None for x in traced) else jnp
    q_len = xp.full((batch,), t, np.int32) if q_len is None else q_len
    kv_len = xp.full((batch,), s, np.int32) if kv_len is None else kv_len
    blocks = getattr(config.blocks, kernel)
    if kernel == "dkv":  # rows are key blocks, columns query blocks
        return masking.block_table(
            num_row_blocks=s_pad // blocks.block_k, row_block=blocks.block_k,
            num_col_blocks=t_pad // blocks.block_q, col_block=blocks.block_q,
            band=masking.transpose_band(config.static.band), row_len=kv_len, col_len=q_len,
            row_segments=kv_seg, col_segments=q_seg, shift=None if shift is None else -shift,
            xp=xp,
        )
    return masking.block_table(
        num_row_blocks=t_pad // blocks.block_q, row_block=blocks.block_q,
        num_col_blocks=s_pad // blocks.block_k, col_block=blocks.block_k,
        band=config.static.band, row_len=q_len, col_len=kv_len,
        row_segments=q_seg, col_segments=kv_seg, shift=shift, xp=xp,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash_attention(config, q, k, v, q_seg, kv_seg, q_len, kv_len, shift):
    """(out (B, Tp, N, Dp), lse (B, N, Tp)) of padded inputs; see `forward.forward`."""
    return _kernel_forward(config, q, k, v, q_seg, kv_seg, q_len, kv_len, shift)


def _flash_attention_fwd(config, q, k, v, q_seg, kv_seg, q_len, kv_len, shift):
    out, lse = _kernel_forward(config, q, k, v, q_seg, kv_seg, q_len, kv_len, shift)
    return (out, lse), (q, k, v, q_seg, kv_seg, q_len, kv_len, shift, out, lse)


# Second order (`_derivatives`): the forward rule and the backward keep their kernel values and
# take the tangents of the reference (`_reference_attention`, quadratic memory). In the
# backward's, out and lse (functions of q, k, v) get zero partials: the reference recomputes
# them, so every total derivative is still exact.


def _forward_kernel(config, q, k, v, q_seg, kv_seg, q_len, kv_len, shift):
    """(out, lse) of `_flash_attention` from the forward kernel."""
    table = _tables(config, q.shape[1], k.shape[1], q_seg, kv_seg, q_len, kv_len, shift,
                    "forward")
    return forward.forward(
        q, k, v, q_seg, kv_seg, table, static=config.static, blocks=config.blocks.forward
    )


def _reference_attention(config, q, k, v, q_seg, kv_seg, q_len, kv_len, shift):
    """What `_flash_attention` computes, by `reference.banded_attention` on the padded
    arguments, whose padding rows lie past the lengths (as in the kernels' tables)."""
    batch, t, s = config.shape
    static = config.static
    out, lse = reference.banded_attention(
        q, k, v, scale=static.scale, band=static.band, q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
        query_seq_lengths=jnp.full((batch,), t, jnp.int32) if q_len is None else q_len,
        key_value_seq_lengths=jnp.full((batch,), s, jnp.int32) if kv_len is None else kv_len,
        logits_soft_cap=static.logits_soft_cap, return_residual=True, shift=shift,
    )
    return out, jnp.swapaxes(lse, 1, 2)


def _flash_attention_bwd(config, residuals, cotangents):
    return tuple(map(_sharding.cotangent_like, _kernel_gradients(config, residuals, cotangents),
                     residuals[:8]))


def _backward_kernels(config, residuals, cotangents):
    """The gradients of `_flash_attention`'s q, k, v, from the backward kernels."""
    q, k, v, q_seg, kv_seg, q_len, kv_len, shift, out, lse = residuals
    dout, dlse = cotangents
    delta = jnp.swapaxes(common.softmax_delta(out, dout), 1, 2) - dlse  # (B, N, Tp)
    return (*_gradient_kernels(config, q, k, v, q_seg, kv_seg, q_len, kv_len, shift,
                               dout.astype(q.dtype), lse, delta), None, None, None, None, None)


def _gradient_kernels(config, q, k, v, q_seg, kv_seg, q_len, kv_len, shift, dout, lse, delta):
    """(dq, dk, dv) of padded arrays from the dK/dV and dQ kernels; lse and delta (B, N, Tp)."""
    t_pad, s_pad = q.shape[1], k.shape[1]
    arrays = (q, k, v, dout, lse, delta, q_seg, kv_seg)
    dk, dv = backward.dkv(
        *arrays, _tables(config, t_pad, s_pad, q_seg, kv_seg, q_len, kv_len, shift, "dkv"),
        static=config.static, blocks=config.blocks.dkv,
    )
    dq = backward.dq(
        *arrays, _tables(config, t_pad, s_pad, q_seg, kv_seg, q_len, kv_len, shift, "dq"),
        static=config.static, blocks=config.blocks.dq,
    )
    return dq, dk, dv


def _reference_gradients(config, residuals, cotangents):
    """`_backward_kernels` by differentiating `_reference_attention`."""
    q, k, v, q_seg, kv_seg, q_len, kv_len, shift, _, _ = residuals
    _, vjp = jax.vjp(lambda q, k, v: _reference_attention(config, q, k, v, q_seg, kv_seg,
                                                          q_len, kv_len, shift), q, k, v)
    return (*vjp(cotangents), None, None, None, None, None)


_kernel_forward = _derivatives.reference_tangents(_forward_kernel, _reference_attention)
_kernel_gradients = _derivatives.reference_tangents(_backward_kernels, _reference_gradients)
_flash_attention.defvjp(_flash_attention_fwd, _flash_attention_bwd)
