"""`attention_with_kv_cache`'s and `update_kv_cache`'s argument checks: each raises a TypeError
(wrong kind) or ValueError (wrong value) naming the argument, before anything is traced."""

import dataclasses

import jax.numpy as jnp

from pallas_kernels import _dispatch
from pallas_kernels.kv_cache import quantization

MAX_NEW_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class Layout:
    """A cache's layout: `batch` rows of `capacity` keys each, `kv_heads` heads of `head_dim`;
    `page_size` None for a dense cache; the Formats of its keys and values."""

    batch: int
    capacity: int
    kv_heads: int
    head_dim: int
    page_size: int | None
    key_format: quantization.Format
    value_format: quantization.Format


def check_cache(k_cache, v_cache, block_table, k_scale, v_scale, batch):
    """The Layout of a dense cache (B, S, K, H), or of a paged one (pages, page_size, K, H)
    with `block_table` (B, max_pages) integers; scales (`scale_shape`, float32) present where
    the dtype asks for them."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not hasattr(cache, "shape") or cache.ndim != 4:
            raise ValueError(f"{name} must be rank 4, (B, S, K, H) or (pages, page_size, K, H), "
                             f"got {getattr(cache, 'shape', type(cache))}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {k_cache.shape}, "
                         f"{v_cache.shape}")
    formats = [quantization.format_of(name, c.dtype)
               for name, c in (("k_cache", k_cache), ("v_cache", v_cache))]
    for (name, scale), fmt in zip((("k_scale", k_scale), ("v_scale", v_scale)), formats,
                                  strict=True):
        if scale is None and fmt.scales == "required":
            raise ValueError(f"{name} is required for a {fmt.name} cache")
        if scale is not None:
            if fmt.scales == "forbidden":
                raise ValueError(f"{name} must be None for a float cache")
            if scale.dtype != jnp.float32:
                raise TypeError(f"{name} must be float32, got {scale.dtype}")
            if scale.shape != scale_shape(k_cache.shape):
                raise ValueError(f"{name} must be (B, K, S) or (pages, K, page_size), one scale "
                                 f"per token and KV head: {scale_shape(k_cache.shape)} for this "
                                 f"cache, got {scale.shape}")
    slots, size, kv_heads, head_dim = k_cache.shape
    if block_table is None:
        if slots != batch:
            raise ValueError(f"k_cache: a dense cache has one row per batch row ({batch}), got "
                             f"{slots}; pass block_table for a paged cache")
        page_size, capacity = None, size
    else:
        block_table = jnp.asarray(block_table)
        if not jnp.issubdtype(block_table.dtype, jnp.integer):
            raise TypeError(f"block_table must be integers, got {block_table.dtype}")
        if block_table.ndim != 2 or block_table.shape[0] != batch or block_table.shape[1] == 0:
            raise ValueError(f"block_table must be (B={batch}, max_pages >= 1), got "
                             f"{list(block_table.shape)}")
        if size < 16 or size & (size - 1):
            raise ValueError(f"k_cache: the page size (axis 1) must be a power of two >= 16, "
                             f"got {size}")
        page_size, capacity = size, block_table.shape[1] * size
    if head_dim > 256 or 0 in k_cache.shape:
        raise ValueError(f"k_cache: head dim {head_dim} must be in [1, 256] and no axis empty, "
                         f"got {k_cache.shape}")
    return Layout(batch, capacity, kv_heads, head_dim, page_size, *formats)


def scale_shape(cache_shape):
    """The shape of a quantised cache's scales, one per token and KV head: (B, K, S) for a
    dense cache (B, S, K, H), (pages, K, page_size) for a paged one: each head's scales lie
    along its keys, so that the kernel reads a block's as one run, not one sector each."""
    rows, slots, kv_heads, _ = cache_shape
    return rows, kv_heads, slots


def check_query(q):
    """q (B, T, N, H) of a float dtype, T <= MAX_NEW_TOKENS."""
    if not hasattr(q, "shape") or q.ndim != 4:
        raise ValueError(f"q must be rank 4 (B, T, N, H), got {getattr(q, 'shape', type(q))}")
    _dispatch.check_floats({"q": q}, _dispatch.HALF_AND_SINGLE, "bfloat16, float16 or float32")
    if not 1 <= q.shape[1] <= MAX_NEW_TOKENS:
        raise ValueError(f"q: the new tokens T (axis 1) must be in [1, {MAX_NEW_TOKENS}], got "
                         f"{q.shape[1]}")


def check_heads(q, layout):
    """The query's heads are a multiple of the cache's KV heads, with its head dim."""
    n, h = q.shape[2:]
    if n % layout.kv_heads:
        raise ValueError(f"q: its heads ({n}) must be a multiple of the cache's KV heads "
                         f"({layout.kv_heads})")
    if h != layout.head_dim:
        raise ValueError(f"q: its head dim ({h}) differs from the cache's ({layout.head_dim})")


def check_seqlens(cache_seqlens, batch):
    """(B,) integers as int32 (values are not checked: they are traced)."""
    seqlens = jnp.asarray(cache_seqlens)
    if not jnp.issubdtype(seqlens.dtype, jnp.integer):
        raise TypeError(f"cache_seqlens must be integers, got {seqlens.dtype}")
    if seqlens.shape != (batch,):
        raise ValueError(f"cache_seqlens must have shape ({batch},), got {seqlens.shape}")
    return seqlens.astype(jnp.int32)


def check_splits(num_splits):
    """None (chosen on the host) or an int >= 1."""
    if num_splits is None:
        return None
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}")
    return num_splits
