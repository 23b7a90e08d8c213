"""Pure-jnp decode attention over a KV cache, with the meaning and signature of the Pallas kernel.

It gathers each row's pages into a dense float32 copy, (B, capacity, K, H), and materialises the
(B, N, T, capacity) logits: the ground truth for the tests and the `implementation="xla"` path of
`attention_with_kv_cache`.
"""

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def attention_with_kv_cache(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    *,
    block_table=None,
    k_scale=None,
    v_scale=None,
    scale=None,
    local_window_size=None,
    logits_soft_cap=None,
    return_residual=False,
):
    """Softmax attention of T new queries over each row's cached keys, in float32.

    q (B, T, N, H); the caches dense (B, S, K, H), or with `block_table` (B, max_pages) int32
    paged (num_pages, page_size, K, H), N % K == 0. `cache_seqlens` (B,) int32 counts the valid
    keys of each row, the T new tokens included: query t of row b sits at position
    p = cache_seqlens[b] - T + t and sees the keys j <= p, and with `local_window_size` (w, or
    (left, right), whose right side the causal bound makes moot) only those with j >= p - left.
    Quantised caches (int8, float8_e4m3fn, or uint8 holding float8_e4m3fnuz bits) are read as
    stored value * scale, `k_scale`/`v_scale` float32 (B, K, S) or (num_pages, K, page_size).
    The arguments are assumed valid (the public API checks them).

    Returns the output (B, T, N, H) in q's dtype and, with `return_residual`, the natural-log
    log-sum-exp of the logits, (B, T, N) float32. A query that sees no key (p < 0, or a window
    that holds none) gets output 0 and lse -inf.
    """
    batch, t, n, h = q.shape
    keys = read_cache(k_cache, cache_seqlens, block_table=block_table, scale=k_scale)
    values = read_cache(v_cache, cache_seqlens, block_table=block_table, scale=v_scale)
    capacity, k_heads = keys.shape[1], keys.shape[2]

    position = cache_seqlens.astype(jnp.int32)[:, None] - t + jnp.arange(t, dtype=jnp.int32)
    key_index = jnp.arange(capacity, dtype=jnp.int32)
    visible = key_index <= position[:, :, None]  # (B, T, capacity); implies j < cache_seqlens
    left = _window_left(local_window_size)
    if left is not None:
        visible &= key_index >= position[:, :, None] - min(left, capacity)

    scale = h**-0.5 if scale is None else scale
    grouped = q.astype(jnp.float32).reshape(batch, t, k_heads, n // k_heads, h)
    logits = jnp.einsum("btkgh,bskh->bkgts", grouped, keys, precision=_HIGHEST) * scale
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    logits = jnp.where(visible[:, None, None], logits, -jnp.inf)  # (B, K, G, T, capacity)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(logits - row_max)
    row_sum = jnp.sum(weights, axis=-1, keepdims=True)
    empty = row_sum == 0.0
    probs = weights / jnp.where(empty, 1.0, row_sum)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, values, precision=_HIGHEST)
    out = out.reshape(batch, t, n, h).astype(q.dtype)
    if not return_residual:
        return out
    lse = jnp.where(empty, -jnp.inf, jnp.log(row_sum) + row_max)[..., 0]  # (B, K, G, T)
    return out, jnp.moveaxis(lse.reshape(batch, n, t), 1, 2)


def read_cache(cache, cache_seqlens, *, block_table=None, scale=None):
    """Each row's dequantised keys or values, (B, capacity, K, H) float32, zero (selected, so
    whatever the slot or its scale holds, NaN included) at and past cache_seqlens (B,).

    `cache` is dense (B, S, K, H), or paged (num_pages, page_size, K, H) with `block_table`
    (B, max_pages), capacity max_pages * page_size; `scale` is None or float32, (B, K, S) or
    (num_pages, K, page_size). A uint8 cache holds the bits of float8_e4m3fnuz.
    """
    if scale is not None:
        scale = jnp.swapaxes(scale, 1, 2)  # as the cache's axes: (rows or pages, slots, K)
    if block_table is not None:
        cache = _gather_pages(cache, block_table)
        scale = None if scale is None else _gather_pages(scale, block_table)
    if cache.dtype == jnp.uint8:
        cache = jax.lax.bitcast_convert_type(cache, jnp.float8_e4m3fnuz)
    values = cache.astype(jnp.float32)
    if scale is not None:
        values = values * scale[..., None]
    valid = jnp.arange(values.shape[1]) < cache_seqlens[:, None]  # (B, capacity)
    return jnp.where(valid[:, :, None, None], values, 0.0)


def _gather_pages(paged, block_table):
    """paged (num_pages, page_size, ...) read through block_table (B, max_pages) as
    (B, max_pages * page_size, ...)."""
    rows = paged[block_table]  # (B, max_pages, page_size, ...)
    return rows.reshape(rows.shape[0], rows.shape[1] * rows.shape[2], *rows.shape[3:])


def _window_left(local_window_size):
    """The window's left side as a Python int, or None for no bound on the left."""
    if local_window_size is None:
        return None
    window = local_window_size
    left = window[0] if isinstance(window, tuple | list) else window
    return None if left is None else int(left)
