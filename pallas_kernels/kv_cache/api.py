"""Decoding over a KV cache: `attention_with_kv_cache` (FlashAttention's
`flash_attn_with_kvcache` in jax.nn's layout) and `update_kv_cache`, its write.

A call flows: argument checks (`checks`, before anything is traced) -> implementation choice
("xla" runs `reference.py`, "pallas" the split-K kernel) -> the tile (`tuning`) and the number
of splits, chosen on the host from the batch, the KV heads, the cache's capacity and the
multiprocessor count -> the query packed per KV head (G heads x T tokens as the rows of one
matmul) -> `forward.partials` and `forward.merge`. The caches are read in place: never padded,
cast or copied.
"""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from pallas_kernels import _device, _dispatch
from pallas_kernels.attention import checks as attention_checks
from pallas_kernels.attention import common
from pallas_kernels.kv_cache import checks, forward, quantization, reference, tuning


def attention_with_kv_cache(
    q: ArrayLike,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_seqlens: ArrayLike,
    *,
    block_table: ArrayLike | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    scale: float | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    num_splits: int | None = None,
    return_residual: bool = False,
    implementation: str | None = None,
    interpret: bool | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of a few new tokens over a KV cache, causal to each row's end.

    Args:
      q: (B, T, N, H), the queries of T <= 16 new tokens, bfloat16, float16 or float32.
      k_cache, v_cache: a dense cache (B, S, K, H), or a paged one (pages, page_size, K, H) with
        `block_table`; N % K == 0 (GQA, MQA). Their dtype: bfloat16, float16, float32, int8
        (with scales), float8_e4m3fn (NVIDIA) or uint8 holding float8_e4m3fnuz bits (AMD; a
        float8_e4m3fnuz cache is viewed as such) with optional scales
        (`pallas_kernels.kv_cache.quantization`).
      cache_seqlens: (B,) integers, each row's keys including the T new ones (already written,
        `update_kv_cache`): query t of row b sits at position cache_seqlens[b] - T + t and
        sees the keys at positions up to its own. From 0 to the row's capacity (values outside
        are clipped to it).
      block_table: (B, max_pages) integers: row b's key j lies in page block_table[b, j //
        page_size], slot j % page_size. Pages may be shared and in any order.
      k_scale, v_scale: float32, one per token and KV head, each head's along its keys: (B, K,
        S) for a dense cache, (pages, K, page_size) for a paged one. Stored entry * scale is
        the key or value.
      scale: logit scale, default 1/sqrt(H).
      local_window_size: an int w or (left, right): a query also sees no key more than `left`
        positions before its own (causality bounds the right side).
      logits_soft_cap: c > 0 replaces each logit x by c * tanh(x / c) (after scaling).
      num_splits: how many pieces each row's keys are cut into (split-K, merged by the
        log-sum-exp); None chooses from the batch, the KV heads, the capacity and the GPU.
      return_residual: also return the log-sum-exp, (B, T, N) float32, natural log.
      implementation: "pallas" (the kernel), "xla" (the reference) or None (the kernel on a
        GPU, the reference elsewhere).
      interpret: run the kernel in interpret mode; None: when not on a GPU.

    Returns:
      The output (B, T, N, H) in q's dtype (and with `return_residual`, (output, lse)). A query
      that sees no key (a row of length 0) gets output 0 and lse -inf. Slots past a row's
      length and pages it does not name are never read into a product: they may hold anything,
      NaN included.
    """
    checks.check_query(q)
    batch, t, n, h = q.shape
    layout = checks.check_cache(k_cache, v_cache, block_table, k_scale, v_scale, batch)
    checks.check_heads(q, layout)
    seqlens = checks.check_seqlens(cache_seqlens, batch)
    scale = _dispatch.check_positive("scale", scale, default=h**-0.5)
    window = attention_checks.check_window(local_window_size)
    window_left = None if window is None else window[0]
    logits_soft_cap = attention_checks.check_soft_cap(logits_soft_cap)
    num_splits = checks.check_splits(num_splits)
    return_residual = _dispatch.check_bool("return_residual", return_residual)
    implementation, interpret = _dispatch.choose(implementation, interpret)
    k_cache, v_cache = quantization.as_stored(k_cache), quantization.as_stored(v_cache)
    if implementation == "xla":
        # A length past the capacity counts as the capacity (the kernel clips it too).
        return reference.attention_with_kv_cache(
            q, k_cache, v_cache, jnp.clip(seqlens, 0, layout.capacity), block_table=block_table,
            k_scale=k_scale, v_scale=v_scale, scale=scale, local_window_size=window,
            logits_soft_cap=logits_soft_cap, return_residual=return_residual)

    plan = tuning.plan(_device.target()[0], batch, layout.kv_heads, layout.capacity,
                       layout.page_size, num_splits,
                       key_row_bytes=tuning.row_bytes(h, k_cache.dtype))
    block_k = plan.blocks.block_k
    groups = n // layout.kv_heads
    static = forward.Static(
        tokens=t, capacity=layout.capacity, rows=_device.pow2_at_least(groups * t), head_dim=h,
        head_dim_pad=_device.pow2_at_least(h), scale=scale, logits_soft_cap=logits_soft_cap,
        window_left=window_left, key_format=layout.key_format,
        value_format=layout.value_format, page_size=layout.page_size, block_k=block_k,
        gather_rows=plan.blocks.gather_rows,
        zero_int8_past_length=plan.blocks.zero_int8_past_length,
        blocks_per_split=plan.blocks_per_split, interpret=interpret)
    table = None
    if block_table is not None:  # whole blocks of pages (the padding lies past every row)
        per_block = block_k // layout.page_size
        table = _device.pad_end(jnp.asarray(block_table, jnp.int32),
                                (None, _device.cdiv(block_table.shape[1], per_block) * per_block))
    out, lse = forward.partials(
        _pack(q, layout.kv_heads, static), k_cache, v_cache, seqlens, table, k_scale, v_scale,
        static=static, splits=plan.splits, num_warps=plan.blocks.num_warps,
        num_stages=plan.blocks.num_stages)
    merged = forward.merge(out, lse, tokens=t, groups=groups, head_dim=h, dtype=q.dtype,
                           interpret=interpret)
    if not return_residual:
        return merged
    return merged, _unpack(forward.merged_lse(lse)[..., None], q.shape)[..., 0] * common.LN2


def _pack(q, kv_heads, static):
    """q (B, T, N, H) -> (B, K, R, H_pad): KV head k's rows g * T + t (zero-padded)."""
    batch, t, n, h = q.shape
    groups = n // kv_heads
    rows = q.reshape(batch, t, kv_heads, groups, h).transpose(0, 2, 3, 1, 4)
    rows = rows.reshape(batch, kv_heads, groups * t, h)
    return _device.pad_end(rows, (None, None, static.rows, static.head_dim_pad))


def _unpack(rows, shape):
    """(B, K, R, X) packed rows -> (B, T, N, X)."""
    batch, t, n, _ = shape
    _, kv_heads, _, x = rows.shape
    groups = n // kv_heads
    rows = rows[:, :, :groups * t].reshape(batch, kv_heads, groups, t, x)
    return rows.transpose(0, 3, 1, 2, 4).reshape(batch, t, n, x)


def update_kv_cache(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k: ArrayLike,
    v: ArrayLike,
    cache_seqlens: ArrayLike,
    *,
    block_table: ArrayLike | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
    """Writes T new tokens' keys and values into a cache, quantising them to its dtype.

    Args:
      k_cache, v_cache, block_table, k_scale, v_scale: as for `attention_with_kv_cache`.
      k, v: (B, T, K, H) float, the new tokens'.
      cache_seqlens: (B,) integers, each row's length BEFORE the write: token t of row b goes
        to position cache_seqlens[b] + t. Positions past the row's capacity, or in a page the
        block table names outside the pool (-1), are dropped.

    Returns:
      (k_cache, v_cache, k_scale, v_scale) updated (scales None where they were None: an 8-bit
      cache without scales stores the values clipped to its range). 8-bit caches with scales
      get one scale per token and KV head: its largest magnitude over H / the largest
      storable value. Donate the caches to the jit that calls this (`donate_argnums`) and XLA
      writes them in place.
    """
    for name, x in (("k", k), ("v", v)):
        _dispatch.check_floats({name: x}, _dispatch.HALF_AND_SINGLE,
                               "bfloat16, float16 or float32")
        if x.ndim != 4:
            raise ValueError(f"{name} must be rank 4 (B, T, K, H), got {x.shape}")
    batch, t = k.shape[:2]
    layout = checks.check_cache(k_cache, v_cache, block_table, k_scale, v_scale, batch)
    if k.shape != v.shape or k.shape[2:] != (layout.kv_heads, layout.head_dim):
        raise ValueError(f"k and v must be (B, T, {layout.kv_heads}, {layout.head_dim}), got "
                         f"{k.shape}, {v.shape}")
    seqlens = checks.check_seqlens(cache_seqlens, batch)
    positions = seqlens[:, None] + jnp.arange(t, dtype=jnp.int32)  # (B, T)
    inside = positions < layout.capacity
    if block_table is None:
        index = (jnp.where(inside, jnp.arange(batch)[:, None], batch), positions)
    else:
        pages = jnp.take_along_axis(jnp.asarray(block_table, jnp.int32),
                                    jnp.minimum(positions // layout.page_size,
                                                block_table.shape[1] - 1), axis=1)
        # A page id outside the pool (-1 for a page not allocated yet) drops the write; jnp
        # would wrap a negative one onto the pool's last page.
        inside &= (pages >= 0) & (pages < k_cache.shape[0])
        index = (jnp.where(inside, pages, k_cache.shape[0]), positions % layout.page_size)

    def write(cache, scales, values):
        stored = quantization.as_stored(cache)
        entries, new_scales = quantization.encode(values, stored.dtype, scales is not None)
        if cache.dtype == jnp.float8_e4m3fnuz:
            entries = jax.lax.bitcast_convert_type(entries, cache.dtype)
        cache = cache.at[index].set(entries, mode="drop")
        if scales is not None:  # (rows or pages, K, slots): the token's K scales at once
            scales = scales.at[index[0], :, index[1]].set(new_scales, mode="drop")
        return cache, scales

    k_cache, k_scale = write(k_cache, k_scale, k)
    v_cache, v_scale = write(v_cache, v_scale, v)
    return k_cache, v_cache, k_scale, v_scale

