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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike

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
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    scale: float | jax.Array | None = None,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    q_segment_ids: ArrayLike | None = None,
    kv_segment_ids: ArrayLike | None = None,
    logits_soft_cap: float | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
    block_sizes: tuning.AttentionBlocks | None = None,
    interpret: bool | None = None,
    sharding: NamedSharding | P | None = None,
    context_parallelism: str = "all_gather",
    sequence_order: str = "contiguous",
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Scaled dot-product attention, softmax(q k^T * scale) v, as `jax.nn.dot_product_attention`.

    Takes everything `jax.nn.dot_product_attention` takes, by position and by name, and more.
    Where the meaning differs from jax.nn's:

    * a query that sees no key (all masked) gets output 0, lse -inf and zero gradients, where
      jax.nn averages the values of the masked keys;
    * the residual (`return_residual`) is the natural-log log-sum-exp, float32;
    * `bias` is added after `logits_soft_cap` (jax.nn has no soft cap); a bias entry of -inf
      or below about -2.3e38 (`finfo(float32).min`) hides its key as a mask does, so a row
      biased so at every key gets 0;
    * `scale` must be known when the call is traced (jax.nn also takes a traced one).

    Args:
      query: (B, T, N, H), with several batch dims (..., T, N, H), or without batch (T, N, H);
        bfloat16, float16 or float32.
      key, value: (B, S, K, H) (the query's batch dims) or (S, K, H), the query's dtype, with
        N % K == 0 (K < N is GQA, K == 1 MQA; key/value heads are never repeated in memory).
      bias: an additive float bias of the logits, broadcastable to (B, N, T, S) (each dim 1 or
        full), or None. Read tile by tile in the kernels. Its gradient (computed only where it
        is used) is the logits' gradient summed over the bias's broadcast dims: over the batch
        rows in the kernel when the bias's batch dim is 1 ((1, N, T, S) float32 in memory),
        else (B, N, T, S) float32 summed by XLA.
      mask: a boolean mask broadcastable to (B, N, T, S) (True: the query sees the key), or
        None. Read tile by tile in the kernels, packed 8 keys a byte where it has a key dim
        (one int8 entry a pair on AMD); blocks it masks whole at the start or end of a row of
        blocks are skipped, and blocks it leaves whole run unmasked.
      scale: logit scale, a finite number > 0 (a Python number or a concrete scalar array);
        default 1/sqrt(H).
      is_causal: query i sees keys j <= i, aligned top-left as in jax.nn (when T != S, query 0
        sees key 0), not bottom-right as in FlashAttention's own API.
      local_window_size: int w or (left, right), >= 0: query i sees keys in [i - left,
        i + right] (w means (w, w)); combined with `is_causal` the right side is at most 0.
      q_segment_ids, kv_segment_ids: (B, T) and (B, S) integers of any width, given together:
        a query sees only keys of the same segment (packed documents).
      query_seq_lengths, key_value_seq_lengths: (B,) integers (a scalar without batch): only
        the first q_len queries and kv_len keys of each batch row take part. The rest are never
        read into a product, so they may hold anything (stale cache slots, NaN): they get
        output 0 and zero gradients.
      logits_soft_cap: a finite c > 0 replaces each logit x by c * tanh(x / c) (after scaling).
      implementation: "pallas" (the kernels), "xla" (the pure-jnp reference, quadratic memory),
        "cudnn" (`jax.nn.dot_product_attention`'s cuDNN path, for the arguments jax.nn has) or
        None (the kernels on GPU, the reference elsewhere).
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
    lead = checks.check_arrays(query, key, value)  # the batch dims: (), (B,) or several
    if implementation == "cudnn":
        return _cudnn(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                      query_seq_lengths=query_seq_lengths,
                      key_value_seq_lengths=key_value_seq_lengths,
                      local_window_size=local_window_size, others=dict(
                          q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                          logits_soft_cap=logits_soft_cap,
                          return_residual=return_residual or None, block_sizes=block_sizes,
                          interpret=interpret, sharding=sharding,
                          context_parallelism=None if context_parallelism == "all_gather"
                          else context_parallelism,
                          sequence_order=None if sequence_order == "contiguous"
                          else sequence_order))
    if len(lead) > 1:  # merged into one batch dim below, which a mesh's layout cannot follow
        own = getattr(jax.typeof(query), "sharding", None)
        if sharding is not None or (own is not None and any(own.spec)):
            raise ValueError(f"sharding needs query rank 4 (B, T, N, H), got several batch "
                             f"dims {lead}: merge them first")
    batched = len(lead) > 0
    placement = (None if len(lead) > 1 else
                 _sharding.find("query", query, sharding, feature_dims=(3,), batched=batched))
    context.strategy(context_parallelism)  # checked before anything is traced
    _sharding.check_order(sequence_order)
    query, key, value = (x.reshape(-1, *x.shape[-3:]) for x in (query, key, value))
    batch, t, n, h = query.shape
    s = key.shape[1]
    segments = checks.check_segment_ids(q_segment_ids, kv_segment_ids, lead, t, s)
    q_len = checks.check_lengths("query_seq_lengths", query_seq_lengths, lead, t)
    kv_len = checks.check_lengths("key_value_seq_lengths", key_value_seq_lengths, lead, s)
    mask = checks.check_pair("mask", mask, lead, n, t, s)
    bias = checks.check_pair("bias", bias, lead, n, t, s)
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

    def compute(query, key, value, q_seg, kv_seg, q_len, kv_len, shift=None, mask=None,
                bias=None):
        """(out, lse) of checked, batched arrays (a shard's, on a mesh); `shift` as in
        `masking` (context parallelism)."""
        if implementation == "xla":
            return reference.banded_attention(
                query, key, value, scale=scale, band=band, q_segment_ids=q_seg,
                kv_segment_ids=kv_seg, query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
                logits_soft_cap=logits_soft_cap, return_residual=True, shift=shift, mask=mask,
                bias=bias,
            )
        return _pallas_attention(query, key, value, q_seg, kv_seg, q_len, kv_len, shift,
                                 block_sizes, mask=mask, bias=bias, **options)

    arrays = (query, key, value, *((None, None) if segments is None else segments), q_len,
              kv_len)
    if placement is None:
        out, lse = compute(*arrays, mask=mask, bias=bias)
    else:
        placement.check_divides("query", "the batch", batch, placement.batch)
        placement.check_divides("query", "the heads", n, placement.heads)
        placement.check_divides("key", "the key/value heads", key.shape[2], placement.heads)
        def local(*arrays):  # the checked arrays, then the mask and the bias
            return compute(*arrays[:7], mask=arrays[7], bias=arrays[8])

        if placement.sequence is not None:
            for name, pair in (("mask", mask), ("bias", bias)):
                if pair is not None:
                    raise ValueError(f"{name} is not supported with a sharded sequence "
                                     "(context parallelism); use segment ids, lengths or the "
                                     "window instead")
            placement.check_sequence("query", t, sequence_order)
            placement.check_sequence("key", s, sequence_order)
            parts = placement.size(placement.sequence)
            gradients = None if implementation == "xla" else functools.partial(
                _pallas_gradients, block_sizes=block_sizes, **options)
            strategy = functools.partial(
                context.strategy(context_parallelism), compute, gradients, placement.sequence,
                parts, sequence_order)

            def local(*arrays):  # the mask and the bias are None here
                return strategy(*arrays[:7])
        spec = P(placement.batch, placement.sequence, placement.heads)
        rows, lengths = P(placement.batch, placement.sequence), P(placement.batch)
        pair_specs = [None if p is None else P(placement.batch if p.shape[0] > 1 else None,
                                               placement.heads if p.shape[1] > 1 else None)
                      for p in (mask, bias)]
        out, lse = _sharding.run(placement, local, (*arrays, mask, bias),
                                 (spec, spec, spec, rows, rows, lengths, lengths, *pair_specs),
                                 (spec, spec))
    out, lse = out.reshape(*lead, *out.shape[1:]), lse.reshape(*lead, *lse.shape[1:])
    return (out, lse) if return_residual else out


def _cudnn(query, key, value, bias, mask, *, others, **arguments):
    """`jax.nn.dot_product_attention(..., implementation="cudnn")`, for the arguments it has;
    `others` (name -> value) must all be None."""
    given = [name for name, value in others.items() if value is not None]
    if given:
        raise ValueError(f"implementation='cudnn' (jax.nn's cuDNN attention) does not take "
                         f"{', '.join(given)}")
    return jax.nn.dot_product_attention(query, key, value, bias, mask, implementation="cudnn",
                                        **arguments)


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

    def pad_pair(self, pair):
        """A user's mask or bias (B', N', T', S') padded to (Tp, Sp) where not broadcast (a mask
        packed by `masking.pack_mask`, its padding masked); None stays None."""
        if pair is None:
            return None
        t_pad, s_pad, _ = self.padded
        if pair.dtype == jnp.bool_:
            return masking.pack_mask(pair, t_pad, s_pad,
                                     packed=tuning.packs_masks(_device.target()[0]))
        return _device.pad_end(pair, (None, None, t_pad if pair.shape[2] > 1 else None,
                                      s_pad if pair.shape[3] > 1 else None))


def _configure(query, key, has_segments, q_len, kv_len, shift, block_sizes, *, scale, band,
               logits_soft_cap, interpret, has_mask=False, has_pairs=False):
    """The `_Config` of a call: the tuned blocks fitted to its shapes and what may be masked."""
    batch, t, n, h = query.shape
    s, k_heads = key.shape[1], key.shape[2]
    d_pad = tuning.padded_head_dim(h)
    if block_sizes is None:
        block_sizes = tuning.blocks_for(_device.target()[0], d_pad, groups=n // k_heads,
                                        causal=band[1] is not None)
    blocks = block_sizes.fit(t, s, has_pairs=has_pairs)
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
            band != (None, None) or has_segments or has_mask or q_len is not None
            or kv_len is not None or t_pad != t or s_pad != s
        ),
        interpret=interpret,
        has_q_len=q_len is not None,
        has_kv_len=kv_len is not None,
        shifted=shift is not None and band != (None, None),
    )
    return _Config(static, blocks, (batch, t, s), (t_pad, s_pad, d_pad))


def _pallas_attention(query, key, value, q_seg, kv_seg, q_len, kv_len, shift, block_sizes, *,
                      mask=None, bias=None, **options):
    """(out (B, T, N, H), lse (B, T, N)): pads to whole blocks and a power-of-two head dim,
    runs the kernels, slices back. `shift`: None, or the band's int32 scalar shift
    (`masking`) when the query and key are pieces of longer sequences (context parallelism);
    mask and bias: (B', N', T', S'), each dim 1 or full, or None; `options`: `_configure`'s
    keywords."""
    config = _configure(query, key, q_seg is not None, q_len, kv_len, shift, block_sizes,
                        has_mask=mask is not None,
                        has_pairs=mask is not None or bias is not None, **options)
    shift = jnp.asarray(shift, jnp.int32) if config.static.shifted else None
    out, lse = _flash_attention(config, *config.pad(query, key, value, q_seg, kv_seg), q_len,
                                kv_len, shift, config.pad_pair(mask), config.pad_pair(bias))

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


def _tables(config, t_pad, s_pad, q_seg, kv_seg, q_len, kv_len, shift, mask, kernel):
    """`masking.block_table` of one kernel: "forward"/"dq" (query blocks), "dkv" (key blocks),
    narrowed to the blocks a user's `mask` (from `masking.pack_mask`, or None) leaves.

    Without segments, lengths, shift or mask the table depends on shapes alone; it is then
    computed on the host with numpy and enters the program as a constant, costing no launch
    per call.
    """
    batch, t, s = config.shape
    traced = (q_seg, q_len, kv_len, shift)
    xp = np if all(x is None for x in traced) else jnp
    q_len = xp.full((batch,), t, np.int32) if q_len is None else q_len
    kv_len = xp.full((batch,), s, np.int32) if kv_len is None else kv_len
    blocks = getattr(config.blocks, kernel)
    num_q_blocks, num_k_blocks = t_pad // blocks.block_q, s_pad // blocks.block_k
    if kernel == "dkv":  # rows are key blocks, columns query blocks
        table = masking.block_table(
            num_row_blocks=num_k_blocks, row_block=blocks.block_k,
            num_col_blocks=num_q_blocks, col_block=blocks.block_q,
            band=masking.transpose_band(config.static.band), row_len=kv_len, col_len=q_len,
            row_segments=kv_seg, col_segments=q_seg, shift=None if shift is None else -shift,
            xp=xp,
        )
    else:
        table = masking.block_table(
            num_row_blocks=num_q_blocks, row_block=blocks.block_q,
            num_col_blocks=num_k_blocks, col_block=blocks.block_k,
            band=config.static.band, row_len=q_len, col_len=kv_len,
            row_segments=q_seg, col_segments=kv_seg, shift=shift, xp=xp,
        )
    if mask is None:
        return table
    rows, cols = (num_k_blocks, num_q_blocks) if kernel == "dkv" else (num_q_blocks,
                                                                       num_k_blocks)
    row_block, col_block = ((blocks.block_k, blocks.block_q) if kernel == "dkv"
                            else (blocks.block_q, blocks.block_k))
    visible = masking.pair_blocks(mask, num_row_blocks=rows, row_block=row_block,
                                  num_col_blocks=cols, col_block=col_block,
                                  transpose=kernel == "dkv")
    return masking.narrow_to_pairs(table, *visible)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash_attention(config, q, k, v, q_seg, kv_seg, q_len, kv_len, shift, mask, bias):
    """(out (B, Tp, N, Dp), lse (B, N, Tp)) of padded inputs; see `forward.forward`."""
    return _kernel_forward(config, q, k, v, q_seg, kv_seg, q_len, kv_len, shift, mask, bias)


def _flash_attention_fwd(config, q, k, v, q_seg, kv_seg, q_len, kv_len, shift, mask, bias):
    out, lse = _kernel_forward(config, q, k, v, q_seg, kv_seg, q_len, kv_len, shift, mask, bias)
    return (out, lse), (q, k, v, q_seg, kv_seg, q_len, kv_len, shift, mask, bias, out, lse)


# Second order (`_derivatives`): the forward rule and the backward keep their kernel values and
# take the tangents of the reference (`_reference_attention`, quadratic memory). In the
# backward's, out and lse (functions of q, k, v) get zero partials: the reference recomputes
# them, so every total derivative is still exact.


def _forward_kernel(config, q, k, v, q_seg, kv_seg, q_len, kv_len, shift, mask, bias):
    """(out, lse) of `_flash_attention` from the forward kernel."""
    table = _tables(config, q.shape[1], k.shape[1], q_seg, kv_seg, q_len, kv_len, shift, mask,
                    "forward")
    return forward.forward(
        q, k, v, q_seg, kv_seg, table, static=config.static, blocks=config.blocks.forward,
        mask=mask, bias=bias,
    )


def _reference_attention(config, q, k, v, q_seg, kv_seg, q_len, kv_len, shift, mask, bias):
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
        mask=None if mask is None else masking.unpack_mask(mask), bias=bias,
    )
    return out, jnp.swapaxes(lse, 1, 2)


def _flash_attention_bwd(config, residuals, cotangents):
    return tuple(map(_sharding.cotangent_like, _kernel_gradients(config, residuals, cotangents),
                     residuals[:10]))


def _backward_kernels(config, residuals, cotangents):
    """The gradients of `_flash_attention`'s q, k, v and bias, from the backward kernels."""
    q, k, v, q_seg, kv_seg, q_len, kv_len, shift, mask, bias, out, lse = residuals
    dout, dlse = cotangents
    delta = jnp.swapaxes(common.softmax_delta(out, dout), 1, 2) - dlse  # (B, N, Tp)
    if bias is not None:  # a row a -inf bias hides entirely: exp2(-inf - (+inf)) = 0, not NaN
        lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)
    arrays = (config, q, k, v, q_seg, kv_seg, q_len, kv_len, shift, dout.astype(q.dtype), lse,
              delta)
    dbias = None if bias is None else _bias_gradient(*arrays, mask, bias)
    return (*_gradient_kernels(*arrays, mask=mask, bias=bias), None, None, None, None, None,
            None, dbias)


def _gradient_kernels(config, q, k, v, q_seg, kv_seg, q_len, kv_len, shift, dout, lse, delta, *,
                      mask=None, bias=None):
    """(dq, dk, dv) of padded arrays from the dK/dV and dQ kernels; lse and delta (B, N, Tp)."""
    t_pad, s_pad = q.shape[1], k.shape[1]
    arrays = (q, k, v, dout, lse, delta, q_seg, kv_seg)
    pairs = dict(mask=mask, bias=bias)
    dk, dv = backward.dkv(
        *arrays, _tables(config, t_pad, s_pad, q_seg, kv_seg, q_len, kv_len, shift, mask, "dkv"),
        static=config.static, blocks=config.blocks.dkv, **pairs,
    )
    dq = backward.dq(
        *arrays, _tables(config, t_pad, s_pad, q_seg, kv_seg, q_len, kv_len, shift, mask, "dq"),
        static=config.static, blocks=config.blocks.dq, **pairs,
    )
    return dq, dk, dv


def _bias_gradient(config, q, k, v, q_seg, kv_seg, q_len, kv_len, shift, dout, lse, delta, mask,
                   bias):
    """The gradient of the padded bias (B', N', T', S'): the logits' gradient summed over the
    bias's broadcast dims, the batch rows in the kernel (`backward.dbias_over_rows`) when the
    bias is shared by several, else by the dQ kernel's `emit="dbias"` and XLA."""
    t_pad, s_pad = q.shape[1], k.shape[1]
    arrays = (q, k, v, dout, lse, delta, q_seg, kv_seg,
              _tables(config, t_pad, s_pad, q_seg, kv_seg, q_len, kv_len, shift, mask, "dq"))
    options = dict(static=config.static, blocks=config.blocks.dq, mask=mask, bias=bias)
    if bias.shape[0] == 1 and q.shape[0] > 1:
        dlogits = backward.dbias_over_rows(*arrays, **options)
    else:
        dlogits = backward.dq(*arrays, **options, emit="dbias")
    broadcast = tuple(i for i, size in enumerate(bias.shape) if size == 1)
    return jnp.sum(dlogits, axis=broadcast, keepdims=True).astype(bias.dtype)


def _reference_gradients(config, residuals, cotangents):
    """`_backward_kernels` by differentiating `_reference_attention`."""
    q, k, v, q_seg, kv_seg, q_len, kv_len, shift, mask, bias, _, _ = residuals

    def attention(q, k, v, bias):
        return _reference_attention(config, q, k, v, q_seg, kv_seg, q_len, kv_len, shift, mask,
                                    bias)

    _, vjp = jax.vjp(attention, q, k, v, bias)
    dq, dk, dv, dbias = vjp(cotangents)
    return dq, dk, dv, None, None, None, None, None, None, dbias


_kernel_forward = _derivatives.reference_tangents(_forward_kernel, _reference_attention)
_kernel_gradients = _derivatives.reference_tangents(_backward_kernels, _reference_gradients)
_flash_attention.defvjp(_flash_attention_fwd, _flash_attention_bwd)
