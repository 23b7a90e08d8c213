"""The split-K decode attention kernel (flash-decoding), Pallas with the Triton lowering.

One program per (split, KV head, batch row). Its rows are the KV head's G query heads times the
T new tokens (row r = g * T + t, padded to a power of two >= 16), so one matmul serves the whole
GQA group. It streams its split's keys `block_k` at a time from a dense cache (B, S, K, H) or
from the pages a block table names ((pages, page_size, K, H); a block is a whole number of
pages gathered by their ids), decodes 8-bit entries to the query's dtype, folds the scales into
the logits (keys) and the probabilities (values), and keeps a running max and sum (online
softmax, base 2). It writes its normalised partial output and base-2 log-sum-exp. Blocks
outside the row's visible range are never read; a split with none writes sum 0 (lse -inf) and
exits. The head dim is read through a power-of-two block whose lanes past H are masked loads,
so the cache is never padded or copied.

A second kernel (`merge`) weighs the splits' partials by their log-sum-exp and writes the
output in q's layout and dtype: one program per (batch row, KV head, query row, slice of the
head dim), so a long row cut into hundreds of splits is merged by many programs at once, in one
launch instead of XLA's separate reductions, slice and transpose.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import _device, _operands
from pallas_kernels._operands import Operands
from pallas_kernels.attention import common
from pallas_kernels.kv_cache import quantization


@dataclasses.dataclass(frozen=True)
class Static:
    """What the kernel knows of a call besides its arrays (hashable)."""

    tokens: int  # T, new tokens per row
    capacity: int  # keys a row can hold; longer lengths are clipped to it
    rows: int  # G * T padded to a power of two >= 16
    head_dim: int  # H
    head_dim_pad: int  # H padded to a power of two
    scale: float  # with logits_soft_cap, read by attention's `common.base2_logits`
    logits_soft_cap: float | None
    window_left: int | None
    key_format: quantization.Format
    value_format: quantization.Format
    page_size: int | None  # None: a dense cache
    block_k: int
    gather_rows: bool  # these two: tuning.DecodeBlocks'
    zero_int8_past_length: bool
    blocks_per_split: int
    interpret: bool


def _pages(refs, b, j, static):
    """The page ids of block j of row b, (block_k // page_size,) int32, or None for a dense
    cache; a j past the table's last block (the loop's lookahead) reads that last block. A
    block's last pages may lie past the row's length, where a table may hold anything (-1,
    say): clamped to a real page, whose entries the masks then ignore."""
    if static.page_size is None:
        return None
    per_block = static.block_k // static.page_size
    j = jnp.minimum(j, refs.block_table.shape[1] // per_block - 1)
    return jnp.clip(refs.block_table[b, _device.block_slice(j, per_block)],
                    0, refs.k.shape[0] - 1)


def _read(cache, scales, j, pages, static):
    """Block j of a row's keys or values: (block_k, H_pad) entries (zeros past H) and
    (block_k,) scales or None, from the dense row (pages None) or from the block's `pages`,
    gathered row by row or read page by page (`static.gather_rows`). Lanes past H are masked
    loads, never read: the last head's would lie past the cache."""
    bk, h_pad = static.block_k, static.head_dim_pad
    lanes = jax.lax.broadcasted_iota(jnp.int32, (1, h_pad), 1)
    if pages is None:
        rows = _device.block_slice(j, bk)
        if h_pad == static.head_dim:
            entries = cache[rows, :]
        else:
            entries = plt.load(cache.at[rows, :], other=0,
                               mask=jnp.broadcast_to(lanes < static.head_dim, (bk, h_pad)))
        return entries, None if scales is None else scales[rows]
    if not static.gather_rows:
        return _read_pages(cache, scales, pages, lanes, static)
    # One (block_k, H_pad) gather, each key's row from its page (tuning's table says why).
    key_pages = jnp.broadcast_to(pages[:, None], (pages.shape[0], static.page_size))
    key_pages = key_pages.reshape(bk, 1)
    slots = jax.lax.broadcasted_iota(jnp.int32, (bk, 1), 0) % static.page_size
    mask = other = None
    if h_pad != static.head_dim:
        mask, other = jnp.broadcast_to(lanes < static.head_dim, (bk, h_pad)), 0
    entries = plt.load(cache.at[key_pages, slots, lanes], mask=mask, other=other)
    return entries, None if scales is None else plt.load(scales.at[key_pages[:, 0], slots[:, 0]])


def _read_pages(cache, scales, pages, lanes, static):
    """`_read` of a paged block with `gather_rows` off: (pages, page_size, H_pad) entries and
    (pages, page_size) scales, reshaped to a block's."""
    bk, h_pad = static.block_k, static.head_dim_pad
    if h_pad == static.head_dim:
        entries = cache[pages, :, :]
    else:
        slots = jax.lax.broadcasted_iota(jnp.int32, (1, static.page_size, 1), 1)
        shape = (pages.shape[0], static.page_size, h_pad)
        entries = plt.load(cache.at[pages[:, None, None], slots, lanes[None]], other=0,
                           mask=jnp.broadcast_to(lanes[None] < static.head_dim, shape))
    return (entries.reshape(bk, h_pad),
            None if scales is None else scales[pages, :].reshape(bk))


def _decode_kernel(refs, *, static):
    split, b = pl.program_id(0), pl.program_id(2)
    bk, rows = static.block_k, static.rows
    length = jnp.clip(refs.seqlens[b], 0, static.capacity)
    # Row r is new token t = r % T, at position length - T + t; it sees keys in
    # [position - window, position].
    position = length - static.tokens + jax.lax.broadcasted_iota(
        jnp.int32, (rows, 1), 0) % static.tokens
    first_key = 0
    if static.window_left is not None:
        first_key = jnp.maximum(length - static.tokens - static.window_left, 0)
    lo = jnp.maximum(split * static.blocks_per_split, first_key // bk)
    hi = jnp.minimum((split + 1) * static.blocks_per_split, _device.cdiv(length, bk))
    q = refs.q[...]

    def step(j, carry):
        # The block's page ids come from the step before (the loop's carry): upstream Triton
        # then double-buffers the cache reads as a dense cache's; jaxlib 0.11.2's schedules
        # the ids' load in the reads' step all the same, and still runs faster (ids read in
        # their own step: int8 0.34 against 0.31-0.33 ms on an H100, benchmarks/NOTES.md).
        acc, row_max, row_sum, pages = carry
        next_pages = _pages(refs, b, j + 1, static)
        k, k_scale = _read(refs.k, refs.k_scale, j, pages, static)
        key_ids = j * bk + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0)
        keys = key_ids[None, :]
        k = quantization.decode(k, static.key_format, q.dtype)
        scores = jnp.dot(q, k.T, preferred_element_type=jnp.float32)
        if k_scale is not None:
            scores = scores * k_scale[None, :]
        visible = keys <= position
        if static.window_left is not None:
            visible &= keys >= position - static.window_left
        logits = jnp.where(visible, common.base2_logits(scores, static), -jnp.inf)
        new_max = jnp.maximum(row_max, jnp.max(logits, axis=1))
        rescale = jnp.exp2(row_max - new_max)
        probs = jnp.exp2(logits - new_max[:, None])
        row_sum = row_sum * rescale + jnp.sum(probs, axis=1)
        v, v_scale = _read(refs.v, refs.v_scale, j, pages, static)
        present = key_ids < length  # slots past the length may hold NaN
        if v_scale is not None:
            probs = probs * jnp.where(present, v_scale, 0.0)[None, :]
        v = quantization.decode(v, static.value_format, q.dtype)
        # Slots past the length may hold NaN, which a probability of 0 does not cancel: zeroed.
        # An int8 value is never NaN (tuning's table says where its select is kept).
        if (static.value_format is not quantization.INT8
                or static.zero_int8_past_length):
            v = jnp.where(present[:, None], v, 0)
        acc = acc * rescale[:, None] + jnp.dot(probs.astype(q.dtype), v,
                                               preferred_element_type=jnp.float32)
        return acc, new_max, row_sum, next_pages

    # A finite start for the running max keeps exp2(-inf - start) = 0 for masked entries.
    carry = (jnp.zeros((rows, static.head_dim_pad), jnp.float32),
             jnp.full((rows,), jnp.finfo(jnp.float32).min, jnp.float32),
             jnp.zeros((rows,), jnp.float32),
             _pages(refs, b, lo, static))
    acc, row_max, row_sum, _ = jax.lax.fori_loop(lo, hi, step, carry)
    empty = row_sum == 0.0
    safe_sum = jnp.where(empty, 1.0, row_sum)
    refs.out[...] = acc / safe_sum[:, None]
    refs.lse[...] = jnp.where(empty, -jnp.inf, row_max + jnp.log2(safe_sum))


def partials(q, k, v, seqlens, block_table, k_scale, v_scale, *, static, splits, num_warps,
             num_stages):
    """The kernel's per-split outputs.

    q (B, K, R, H_pad) packed query rows; k, v the caches as stored (dense (B, S, K, H) with
    S % block_k == 0, or paged (pages, page_size, K, H)); seqlens (B,) int32; block_table
    (B, max_pages) int32 with max_pages a multiple of block_k // page_size, or None; k_scale,
    v_scale float32 (B, K, S) or (pages, K, page_size), or None. Returns out (splits, B, K, R,
    H_pad) float32, normalised per split, and lse (splits, B, K, R) float32 in base 2 (-inf
    where a split saw no key).
    """
    batch, kv_heads, rows, h_pad = q.shape
    paged = static.page_size is not None
    if paged:
        cache_block = (k.shape[0], static.page_size, None, h_pad)
        scale_block = (k.shape[0], None, static.page_size)

        def cache_map(s, h, b):
            return 0, 0, h, 0

        def scale_map(s, h, b):
            return 0, h, 0
    else:
        cache_block = (None, k.shape[1], None, h_pad)
        scale_block = (None, None, k.shape[1])

        def cache_map(s, h, b):
            return b, 0, h, 0

        def scale_map(s, h, b):
            return b, h, 0

    table_spec = None if block_table is None else pl.BlockSpec(block_table.shape,
                                                              lambda s, h, b: (0, 0))
    inputs = (Operands()
              .add("seqlens", pl.BlockSpec(seqlens.shape, lambda s, h, b: (0,)), seqlens)
              .add("block_table", table_spec, block_table)
              .add("q", pl.BlockSpec((None, None, rows, h_pad), lambda s, h, b: (b, h, 0, 0)), q)
              .add("k", pl.BlockSpec(cache_block, cache_map), k)
              .add("v", pl.BlockSpec(cache_block, cache_map), v)
              .add("k_scale", pl.BlockSpec(scale_block, scale_map), k_scale)
              .add("v_scale", pl.BlockSpec(scale_block, scale_map), v_scale))
    out_spec = pl.BlockSpec((None, None, None, rows, h_pad), lambda s, h, b: (s, b, h, 0, 0))
    lse_spec = pl.BlockSpec((None, None, None, rows), lambda s, h, b: (s, b, h, 0))
    outputs = (Operands()
               .add("out", out_spec, jax.ShapeDtypeStruct((splits, batch, kv_heads, rows, h_pad),
                                                         jnp.float32))
               .add("lse", lse_spec, jax.ShapeDtypeStruct((splits, batch, kv_heads, rows),
                                                         jnp.float32)))
    result = _operands.call(
        functools.partial(_decode_kernel, static=static), inputs, outputs,
        grid=(splits, kv_heads, batch), num_warps=num_warps, num_stages=num_stages,
        interpret=static.interpret, name="attention_with_kv_cache",
        masks_edges=static.head_dim_pad != static.head_dim)
    return result["out"], result["lse"]


# The most partial entries (splits x head-dim slice) one merge program reads.
_MERGE_ENTRIES = 4096


def merge(out, lse, *, tokens, groups, head_dim, dtype, interpret):
    """The splits' partial outputs merged by their log-sum-exp, in q's layout (B, T, N, H) of
    `dtype`.

    out (S, B, K, R, H_pad) float32, normalised per split, and lse (S, B, K, R) base 2, as
    `partials` writes them, with S a power of two (empty splits carry lse -inf); row r of KV
    head k is query head k * groups + r // tokens at token r % tokens. Rows that saw no key in
    any split get output 0. One program per (b, k, r < groups * tokens, slice of the head dim):
    the slice is a power of two dividing H, at most `_MERGE_ENTRIES` // S wide.
    """
    splits, batch, kv_heads, _, _ = out.shape
    width = min(head_dim & -head_dim, max(1, _MERGE_ENTRIES // splits))
    inputs = (Operands()
              .add("out", pl.BlockSpec((splits, None, None, None, width),
                                       lambda b, k, r, c: (0, b, k, r, c)), out)
              .add("lse", pl.BlockSpec((splits, None, None, None),
                                       lambda b, k, r, c: (0, b, k, r)), lse))

    def output_map(b, k, r, c):
        return b, r % tokens, k * groups + r // tokens, c

    outputs = Operands().add(
        "merged", pl.BlockSpec((None, None, None, width), output_map),
        jax.ShapeDtypeStruct((batch, tokens, kv_heads * groups, head_dim), dtype))
    result = _operands.call(
        _merge_kernel, inputs, outputs,
        grid=(batch, kv_heads, groups * tokens, head_dim // width), num_warps=1, num_stages=1,
        interpret=interpret, name="attention_with_kv_cache_merge")
    return result["merged"]


def _merge_kernel(refs):
    lse = refs.lse[...]
    top = jnp.max(lse)
    weights = jnp.exp2(lse - jnp.where(top == -jnp.inf, 0.0, top))  # 0 for empty splits
    total = jnp.sum(weights)
    merged = jnp.sum(weights[:, None] * refs.out[...], axis=0)
    refs.merged[...] = (merged / jnp.where(total > 0, total, 1.0)).astype(refs.merged.dtype)


def merged_lse(lse):
    """The splits' base-2 log-sum-exps (S, ...rows) merged: (...rows), -inf for rows that saw
    no key."""
    top = jnp.max(lse, axis=0)
    safe_top = jnp.where(jnp.isneginf(top), 0.0, top)
    total = jnp.sum(jnp.exp2(lse - safe_top), axis=0)
    return jnp.where(total > 0, safe_top + jnp.log2(total), -jnp.inf)
