"""Flax NNX attention on the FlashAttention kernels.

* `flash_attention_fn`: a drop-in `attention_fn` for `nnx.MultiHeadAttention` and
  `linen.MultiHeadDotProductAttention`.
* `FlashMultiHeadAttention`: `nnx.MultiHeadAttention`'s projections with GQA, rotary embeddings,
  causal / local / soft-capped attention, packed segments and a KV cache for decoding.
"""

import warnings
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.nn.initializers import Initializer
from jax.typing import DTypeLike

import pallas_kernels
from flax_layers._checks import (
    check_callables,
    check_dtypes,
    check_flags,
    check_implementation,
    check_mappings,
    check_positive_numbers,
    check_precision,
    check_sizes,
)
from flax_layers._sharding import logical, on_whole_sequence, sequence_parts, token_features
from pallas_kernels import arguments, zigzag
from pallas_kernels.kv_cache import checks as kv_cache_checks

_WARNED = set()
DEFAULT_KERNEL_INIT = nnx.initializers.lecun_normal()
DEFAULT_BIAS_INIT = nnx.initializers.zeros_init()


def _warn_once(reason):
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(
            f"flash_attention_fn: {reason} is not supported by the FlashAttention kernel; "
            "falling back to flax's dot_product_attention (quadratic memory).",
            stacklevel=3,
        )


def flash_attention_fn(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: DTypeLike | None = None,
    precision: jax.lax.PrecisionLike = None,
    module: nnx.Module | None = None,
    is_causal: bool = False,
    input_positions: jax.Array | None = None,
    rope: nnx.RoPE | None = None,
) -> jax.Array:
    """FlashAttention with flax's `attention_fn` signature (every parameter named: Linen passes
    only those in the signature), for `nnx.MultiHeadAttention` (decode mode included) and
    `linen.MultiHeadDotProductAttention`.

    query (..., T, N, H), key/value (..., S, K, H) with N % K == 0, promoted to `dtype` (default
    their common dtype); `bias` and boolean `mask` broadcastable to (..., N, T, S). Returns
    (..., T, N, H).

    It runs `pallas_kernels.dot_product_attention` (causal when `is_causal`) with the mask and
    the bias, read tile by tile in the kernels; `nnx.MultiHeadAttention(decode=True)`'s cache
    mask skips the cache's empty blocks. One difference from flax: a query whose mask hides
    every key gets 0 here, the mean of the values in flax. Active dropout or a module to sow
    weights into fall back to `flax.nnx.dot_product_attention`, with a warning once per reason.

    With `rope` (an `nnx.RoPE`: `functools.partial(flash_attention_fn, rope=rope)` in place of
    `nnx.dot_product_attention_with_rope`) the query and the key are rotated first, at
    `input_positions` (..., T) (self-attention, T == S) or by default at 0..T-1 and 0..S-1.
    `input_positions` without `rope` is a ValueError: they place tokens for rotary embeddings.
    """
    if rope is not None:
        query, key = (_rotate(rope, x, input_positions) for x in (query, key))
    elif input_positions is not None:
        raise ValueError("input_positions place the tokens for rotary embeddings; pass the "
                         "nnx.RoPE too: functools.partial(flash_attention_fn, rope=rope)")
    dtype = jnp.result_type(query, key, value) if dtype is None else dtype
    query, key, value = (x.astype(dtype) for x in (query, key, value))
    dropout_active = dropout_rate > 0.0 and not deterministic
    reason = ("dropout" if dropout_active
              else "sow_weights (module)" if module is not None
              else None)
    if reason is not None:
        _warn_once(reason)
        return nnx.dot_product_attention(
            query, key, value, bias=bias, mask=mask, broadcast_dropout=broadcast_dropout,
            dropout_rng=dropout_rng, dropout_rate=dropout_rate, deterministic=deterministic,
            dtype=dtype, precision=precision, module=module, is_causal=is_causal)
    return pallas_kernels.dot_product_attention(  # flax's masks may be 0/1 floats
        query, key, value, None if bias is None else bias.astype(dtype),
        None if mask is None else mask.astype(bool), is_causal=is_causal)


def _rotate(rope, x, positions):
    """x (..., T, heads, H) through `rope` (an `nnx.RoPE`) head by head, at positions (T,) or
    (..., T), or None (its default)."""
    per_head = jax.vmap(rope, in_axes=(-2, None), out_axes=-2)
    if positions is None or positions.ndim == 1:
        return per_head(x, positions)
    positions = jnp.broadcast_to(positions, x.shape[:-2])  # RoPE takes one row's positions
    for _ in range(positions.ndim - 1):
        per_head = jax.vmap(per_head)
    return per_head(x, positions)


def rotary_embedding(x, positions, theta):
    """Rotates (..., T, heads, H) by positions (..., T): pairs (i, i + H/2), frequencies
    theta^(-2i/H) (the "rotate half" convention)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[..., None, None].astype(jnp.float32) * freqs  # (..., T, 1, H/2)
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def segment_positions(segment_ids):
    """Position of each token within its segment, (B, T) int32, for packed documents."""
    t = segment_ids.shape[-1]
    index = jnp.arange(t, dtype=jnp.int32)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[..., :1], bool), segment_ids[..., 1:] != segment_ids[..., :-1]],
        axis=-1,
    )
    start_index = jax.lax.cummax(jnp.where(starts, index, 0), axis=segment_ids.ndim - 1)
    return index - start_index


class KVCache(NamedTuple):
    """A decode cache: keys and values, dense (B, L, K, H) or paged (pages, page_size, K, H)
    with `block_table` (B, pages per row); how many positions of each row are filled,
    `lengths` (B,) int32; for 8-bit caches the float32 scales per token and KV head, `k_scale`
    and `v_scale` ((B, K, L) or (pages, K, page_size)), else None. See
    `pallas_kernels.attention_with_kv_cache`.

    The batch and the capacity are static: the arrays' shapes.
    """

    keys: jax.Array
    values: jax.Array
    lengths: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    block_table: jax.Array | None = None

    @property
    def batch(self):
        return self.lengths.shape[0]

    @property
    def capacity(self):
        if self.block_table is None:
            return self.keys.shape[1]
        return self.block_table.shape[1] * self.keys.shape[1]

    def check_fits(self, batch, new):
        """A ValueError unless `new` tokens of `batch` rows fit after the filled positions.

        The batch and the capacity are static and always checked; the lengths only where their
        values are known (eager use). Under jit see `FlashMultiHeadAttention.attend_cached`.
        """
        if batch != self.batch:
            raise ValueError(f"batch {batch} does not match the KV cache's batch {self.batch}")
        if new > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions; {new} new tokens do not "
                             "fit")
        filled = arguments.known_value(self.lengths)
        if filled is not None and int(filled.max()) + new > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions; {int(filled.max())} are "
                             f"filled and {new} new tokens do not fit")


def empty_kv_cache(batch, max_length, kv_heads, head_dim, dtype=jnp.float32, page_size=None):
    """An empty KVCache for `batch` rows of at least `max_length` positions: dense, its capacity
    rounded up to a multiple of 16 (the kernel reads it in place), or in pages of `page_size`
    (a power of two >= 16), each row owning its own run of pages. 8-bit dtypes (int8,
    float8_e4m3fn, float8_e4m3fnuz) get per token-head scales."""
    check_sizes(batch=batch, max_length=max_length)
    block_table = None
    if page_size is None:
        shape = (batch, -(-max_length // 16) * 16, kv_heads, head_dim)
    else:
        if not isinstance(page_size, int) or page_size < 16 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 16, got {page_size!r}")
        per_row = -(-max_length // page_size)
        shape = (batch * per_row, page_size, kv_heads, head_dim)
        block_table = jnp.arange(batch * per_row, dtype=jnp.int32).reshape(batch, per_row)
    scaled = jnp.dtype(dtype).itemsize == 1
    scales = [jnp.zeros(kv_cache_checks.scale_shape(shape), jnp.float32) if scaled else None
              for _ in range(2)]
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                   jnp.zeros((batch,), jnp.int32), *scales, block_table)


class FlashMultiHeadAttention(nnx.Module):
    """Multi-head attention on the FlashAttention kernels, mirroring `nnx.MultiHeadAttention`.

    Projections: query (in_features -> num_heads x head_dim), key and value (in_kv_features,
    default in_features, -> num_kv_heads x head_dim, GQA when num_kv_heads < num_heads), output
    (-> out_features), with head_dim = qkv_features // num_heads; as nnx's, with biases unless
    `use_bias=False`, `kernel_init` and `bias_init` (`out_kernel_init` and `out_bias_init` for
    the output where given), `precision` for the projections, and `kernel_metadata` and
    `bias_metadata` (`out_*` likewise) added to the parameters' logical axis names. Attention:
    logits scaled by `scale` (default 1/sqrt(head_dim)), `is_causal`, `local_window_size`,
    `logits_soft_cap` (as `pallas_kernels.dot_product_attention`, checked here with the
    kernel's own checks so that the forward and the decode path reject the same values) and
    rotary embeddings with base `rope_theta`; `implementation` as the kernels' (or "cudnn":
    jax.nn's cuDNN attention for the forward and its gradient, the kernels for decoding). On a
    mesh whose sequence axis shards the tokens, `context_parallelism` ("all_gather" or "ring")
    picks how the devices share keys and values, and `sequence_order` says how the tokens lie
    on the devices ("contiguous", or "zigzag": put in `pallas_kernels.zigzag` order once, with
    their segment ids; positions follow). Every argument is checked at construction
    (ValueError or TypeError naming it). nnx's dropout and QK normalisation are not offered
    (the kernels have no dropout).

    `__call__(inputs_q (B, T, F), inputs_kv=None, *, q_segment_ids=None, kv_segment_ids=None,
    decode=None, adapter_outputs=None)` returns (B, T, out_features); `adapter_outputs`
    (query, key, value) are added to the projections before the rotary embedding (the
    outputs of per-use low-rank adapters of a shared layer, as Zamba2's). With `decode=True`
    (after `init_cache`) each call takes the next tokens (self-attention, no segment ids),
    appends their keys and values to the cache and attends over the filled part, continuing the
    positions where the last call stopped; `attend_cached` says what happens to tokens that do
    not fit. A call with `decode` False never touches the cache; `decode=None` takes the
    layer's `decode` (the constructor's, or `nnx.view(layer, decode=...)`'s).
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        qkv_features: int | None = None,
        out_features: int | None = None,
        num_kv_heads: int | None = None,
        in_kv_features: int | None = None,
        *,
        is_causal: bool = False,
        local_window_size: int | tuple[int, int] | None = None,
        logits_soft_cap: float | None = None,
        rope_theta: float | None = None,
        scale: float | None = None,
        use_bias: bool = True,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        precision: jax.lax.PrecisionLike = None,
        kernel_init: Initializer = DEFAULT_KERNEL_INIT,
        out_kernel_init: Initializer | None = None,
        bias_init: Initializer = DEFAULT_BIAS_INIT,
        out_bias_init: Initializer | None = None,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        out_kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        out_bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        decode: bool = False,
        implementation: str | None = None,
        context_parallelism: str = "all_gather",
        sequence_order: str = "contiguous",
        rngs: nnx.Rngs,
    ):
        qkv_features = in_features if qkv_features is None else qkv_features
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        out_features = in_features if out_features is None else out_features
        in_kv_features = in_features if in_kv_features is None else in_kv_features
        check_sizes(in_features=in_features, out_features=out_features,
                    in_kv_features=in_kv_features)
        self.head_dim = check_heads(num_heads, num_kv_heads, qkv_features, rope_theta)
        check_flags(is_causal=is_causal, use_bias=use_bias, decode=decode)
        check_positive_numbers(scale=scale)
        check_dtypes(dtype=dtype, param_dtype=param_dtype)
        check_precision(precision)
        check_callables(kernel_init=kernel_init, out_kernel_init=out_kernel_init,
                        bias_init=bias_init, out_bias_init=out_bias_init)
        check_mappings(kernel_metadata=kernel_metadata, out_kernel_metadata=out_kernel_metadata,
                       bias_metadata=bias_metadata, out_bias_metadata=out_bias_metadata)
        check_implementation(implementation, attention=True)
        self.context_parallelism = arguments.check_context_parallelism(context_parallelism)
        self.sequence_order = arguments.check_sequence_order(sequence_order)
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.in_features, self.in_kv_features = in_features, in_kv_features
        self.out_features = out_features
        self.is_causal, self.scale, self.decode = is_causal, scale, decode
        self.local_window_size = arguments.check_window(local_window_size)
        self.logits_soft_cap = arguments.check_soft_cap(logits_soft_cap)
        self.rope_theta = rope_theta
        self.dtype, self.implementation = dtype, implementation

        def projection(features_in, out_shape, axis, in_names, out_names, *, kernel_init,
                       bias_init, kernel_metadata, bias_metadata):
            return nnx.LinearGeneral(
                features_in, out_shape, axis=axis, use_bias=use_bias, dtype=dtype,
                param_dtype=param_dtype, precision=precision, kernel_init=kernel_init,
                bias_init=bias_init, kernel_metadata=logical(*in_names, *out_names) | dict(
                    kernel_metadata), bias_metadata=logical(*out_names) | dict(bias_metadata),
                rngs=rngs,
            )

        inits = dict(kernel_init=kernel_init, bias_init=bias_init,
                     kernel_metadata=kernel_metadata, bias_metadata=bias_metadata)
        out_inits = dict(kernel_init=out_kernel_init or kernel_init,
                         bias_init=out_bias_init or bias_init,
                         kernel_metadata=out_kernel_metadata or kernel_metadata,
                         bias_metadata=out_bias_metadata or bias_metadata)
        heads, kv_heads = ("heads", "head_dim"), ("kv_heads", "head_dim")
        self.query = projection(in_features, (num_heads, self.head_dim), -1, ("embed",), heads,
                                **inits)
        self.key = projection(in_kv_features, (num_kv_heads, self.head_dim), -1, ("embed",),
                              kv_heads, **inits)
        self.value = projection(in_kv_features, (num_kv_heads, self.head_dim), -1, ("embed",),
                                kv_heads, **inits)
        self.out = projection((num_heads, self.head_dim), self.out_features, (-2, -1), heads,
                              ("embed",), **out_inits)
        self.cache = nnx.data(None)

    def empty_cache(self, batch: int, max_length: int, dtype: DTypeLike = jnp.float32,
                    page_size: int | None = None) -> KVCache:
        """An empty KVCache of this layer's KV heads for `attend_cached` (a cache held outside
        this module); see `empty_kv_cache` for `dtype` and `page_size`."""
        return empty_kv_cache(batch, max_length, self.num_kv_heads, self.head_dim, dtype,
                              page_size)

    def init_cache(self, input_shape: tuple[int, ...], dtype: DTypeLike = jnp.float32,
                   page_size: int | None = None) -> None:
        """Allocates the module's KV cache for input_shape = (batch, max_length, features)."""
        self.cache = KVCacheSlot(self.empty_cache(input_shape[0], input_shape[1], dtype,
                                                  page_size))

    def set_view(self, decode: bool | None = None, batch_size: int | None = None,
                 max_length: int | None = None) -> None:
        """For `nnx.view(model, decode=..., batch_size=..., max_length=...)`, as
        `nnx.MultiHeadAttention`'s: `decode` becomes the default of `__call__`'s; batch_size
        and max_length (together) allocate an empty cache (`init_cache`)."""
        if decode is not None:
            check_flags(decode=decode)
            self.decode = decode
        if (batch_size is None) != (max_length is None):
            raise ValueError("set_view allocates a cache from batch_size and max_length "
                             f"together, got batch_size={batch_size}, max_length={max_length}")
        if batch_size is not None:
            self.init_cache((batch_size, max_length, self.in_features))

    def __call__(self, inputs_q: jax.Array, inputs_kv: jax.Array | None = None, *,
                 q_segment_ids: jax.Array | None = None,
                 kv_segment_ids: jax.Array | None = None,
                 decode: bool | None = None,
                 adapter_outputs: tuple[jax.Array, jax.Array, jax.Array] | None = None,
                 ) -> jax.Array:
        if self.decode if decode is None else decode:
            if adapter_outputs is not None:
                raise ValueError("adapter_outputs is for a forward or attend_cached, not the "
                                 "module's own decode cache")
            return self._decode(inputs_q, inputs_kv, q_segment_ids, kv_segment_ids)
        inputs_kv = inputs_q if inputs_kv is None else inputs_kv
        query, key, value = self._project(inputs_q, inputs_kv, adapter_outputs)
        if self.rope_theta is not None:
            query = rotary_embedding(query, self._positions(inputs_q, q_segment_ids),
                                     self.rope_theta)
            key = rotary_embedding(key, self._positions(inputs_kv, kv_segment_ids),
                                   self.rope_theta)
        out = pallas_kernels.dot_product_attention(
            query, key, value, scale=self.scale, is_causal=self.is_causal,
            local_window_size=self.local_window_size, logits_soft_cap=self.logits_soft_cap,
            q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
            implementation=self.implementation, context_parallelism=self.context_parallelism,
            sequence_order=self.sequence_order,
        )
        return self.out(out, out_sharding=token_features(inputs_q))

    def _project(self, inputs_q, inputs_kv, adapter_outputs):
        """The query (B, T, N, H), key and value (B, S, K, H) projections, each plus its
        `adapter_outputs` entry (the same shape, or flat over heads x head_dim) where given."""
        projections = [self.query(inputs_q), self.key(inputs_kv), self.value(inputs_kv)]
        if adapter_outputs is None:
            return projections
        if len(adapter_outputs) != 3:
            raise ValueError(f"adapter_outputs must be (query, key, value) additions, got "
                             f"{len(adapter_outputs)} arrays")
        for name, projection, extra in zip(("query", "key", "value"), projections,
                                           adapter_outputs, strict=True):
            if extra.shape not in (projection.shape, (*projection.shape[:-2],
                                                      projection.shape[-2] * projection.shape[-1])):
                raise ValueError(f"adapter_outputs' {name} has shape {extra.shape}; the {name} "
                                 f"projection has {projection.shape}")
        return [projection + extra.reshape(projection.shape).astype(projection.dtype)
                for projection, extra in zip(projections, adapter_outputs, strict=True)]

    def _decode(self, inputs, inputs_kv, q_segment_ids, kv_segment_ids):
        """`attend_cached` on the module's own cache, which it updates."""
        if inputs_kv is not None or q_segment_ids is not None or kv_segment_ids is not None:
            raise ValueError("decode=True is self-attention of one sequence per row: it takes no "
                             "inputs_kv, q_segment_ids or kv_segment_ids")
        if self.cache is None:
            raise ValueError("decode=True needs init_cache(input_shape) first")
        out, cache = self.attend_cached(inputs, self.cache.get())
        self.cache.set(cache)
        return out

    def _positions(self, inputs, segment_ids):
        """(B, T) positions of the tokens, in their order on the devices."""
        if segment_ids is not None:
            return on_whole_sequence(segment_positions, segment_ids, self.sequence_order)
        positions = jnp.arange(inputs.shape[1], dtype=jnp.int32)
        if self.sequence_order == "zigzag":
            positions = zigzag(positions, sequence_parts(inputs), axis=0)
        return jnp.broadcast_to(positions, inputs.shape[:2])

    def attend_cached(self, inputs: jax.Array, cache: KVCache, *,
                      new_lengths: jax.Array | None = None, fresh: bool = False,
                      adapter_outputs: tuple[jax.Array, jax.Array, jax.Array] | None = None,
                      ) -> tuple[jax.Array, KVCache]:
        """Self-attention of new tokens (B, n, F) that continue `cache`: writes their keys and
        values after each row's filled positions (`pallas_kernels.update_kv_cache`, which
        quantises for 8-bit caches) and attends over the row's keys up to each token
        (`pallas_kernels.attention_with_kv_cache`, in pieces of 16 tokens). Returns (out (B, n,
        out_features), new cache).

        `new_lengths` (B,) says how many of the n tokens of each row are real (a ragged prompt,
        padded at the end; clipped to [0, n]); the rest are written but not counted, so the
        next tokens overwrite them, and their outputs mean nothing. All n must fit the cache.
        Default: all n real. With `fresh` the cache is known to be empty (a prefill): the
        tokens attend to each other through the FlashAttention kernel instead, over their keys
        and values as computed (an 8-bit or lower-precision cache rounds them only for the
        tokens after).

        Decoding is causal self-attention: a layer without `is_causal`, or with in_kv_features
        other than in_features, raises a ValueError. A batch other than
        the cache's, or more than its capacity of new tokens, is a ValueError; so is a call past
        the capacity where the lengths are known (eager). Under jit they are not: a row whose
        tokens do not fit keeps its keys and values and gets NaN outputs, and its length still
        advances, so its later calls give NaN too (never a silently wrong value).
        """
        if not self.is_causal:
            raise ValueError("decode=True needs a causal layer (is_causal=True)")
        if self.in_kv_features != self.in_features:
            raise ValueError(f"decode=True is self-attention: it needs in_kv_features "
                             f"({self.in_kv_features}) == in_features ({self.in_features})")
        batch, new = inputs.shape[:2]
        cache.check_fits(batch, new)
        real = (jnp.full((batch,), new, jnp.int32) if new_lengths is None
                else jnp.clip(new_lengths, 0, new))
        query, key, value = self._project(inputs, inputs, adapter_outputs)
        if self.rope_theta is not None:
            positions = cache.lengths[:, None] + jnp.arange(new, dtype=jnp.int32)
            query = rotary_embedding(query, positions, self.rope_theta)
            key = rotary_embedding(key, positions, self.rope_theta)
        fits = cache.lengths + new <= cache.capacity  # (B,)
        keys, values, k_scale, v_scale = pallas_kernels.update_kv_cache(
            cache.keys, cache.values, key, value,
            jnp.where(fits, cache.lengths, cache.capacity),  # a row that does not fit: dropped
            block_table=cache.block_table, k_scale=cache.k_scale, v_scale=cache.v_scale)
        written = KVCache(keys, values, cache.lengths + real, k_scale, v_scale,
                          cache.block_table)
        options = dict(scale=self.scale, local_window_size=self.local_window_size,
                       logits_soft_cap=self.logits_soft_cap,
                       implementation=_kernels_or(self.implementation))
        if fresh:
            out = pallas_kernels.dot_product_attention(
                query, key, value, is_causal=True, query_seq_lengths=real,
                key_value_seq_lengths=real, **options)
        else:
            out = _attention_over_cache(query, written, jnp.minimum(cache.lengths + new,
                                                                    cache.capacity), options)
        out = jnp.where(fits[:, None, None], self.out(out), jnp.nan)
        return out, written


def _kernels_or(implementation):
    """The implementation of the decode path's kernels: jax.nn's cuDNN attention has no KV
    cache, so a "cudnn" layer decodes through the kernels (as None picks them)."""
    return None if implementation == "cudnn" else implementation


class KVCacheSlot(nnx.Module):
    """A KVCache held as nnx.Cache variables (its None fields stay None)."""

    def __init__(self, cache):
        self.fields = nnx.data(tuple(name for name, value in cache._asdict().items()
                                     if value is not None))
        for name in self.fields:
            setattr(self, name, nnx.Cache(getattr(cache, name)))

    def get(self):
        return KVCache(**{name: getattr(self, name)[...] for name in self.fields})

    def set(self, cache):
        for name in self.fields:
            getattr(self, name)[...] = getattr(cache, name)


_NEW_TOKENS_PER_CALL = 16  # what attention_with_kv_cache takes at once


def _attention_over_cache(query, cache, ends, options):
    """Queries (B, n, N, H) of the last n positions before `ends` (B,) over `cache`: at most 16
    at a time, the pieces aligned to the end (the first piece's extra queries, before the new
    tokens, see only written keys and are dropped)."""
    batch, new = query.shape[:2]
    step = _NEW_TOKENS_PER_CALL
    arrays = dict(k_cache=cache.keys, v_cache=cache.values, block_table=cache.block_table,
                  k_scale=cache.k_scale, v_scale=cache.v_scale)
    if new <= step:
        return pallas_kernels.attention_with_kv_cache(query, cache_seqlens=ends, **arrays,
                                                      **options)
    pieces = -(-new // step)
    padded = jnp.pad(query, ((0, 0), (pieces * step - new, 0), (0, 0), (0, 0)))
    padded = padded.reshape(batch, pieces, step, *query.shape[2:]).swapaxes(0, 1)
    piece_ends = jnp.maximum(ends[None, :] - step * jnp.arange(pieces - 1, -1, -1)[:, None], 0)

    def piece(args):
        q, end = args
        return pallas_kernels.attention_with_kv_cache(q, cache_seqlens=end, **arrays, **options)

    out = jax.lax.map(piece, (padded, piece_ends))  # (pieces, B, step, N, H)
    return out.swapaxes(0, 1).reshape(batch, pieces * step, *query.shape[2:])[:, -new:]


# ---------------------------------------------------------------------------------------------
# Argument checks (the generic ones are in `_checks`): TypeError or ValueError naming the
# argument, before any array is built.


def check_heads(num_heads, num_kv_heads, qkv_features, rope_theta):
    """The head dim qkv_features // num_heads, after checking the head counts (num_kv_heads
    dividing num_heads), qkv_features (a multiple of num_heads) and rope_theta (None or a
    finite number > 0, with an even head dim)."""
    check_sizes(num_heads=num_heads, num_kv_heads=num_kv_heads, qkv_features=qkv_features)
    if qkv_features % num_heads:
        raise ValueError(
            f"qkv_features ({qkv_features}) must be divisible by num_heads ({num_heads})")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
    head_dim = qkv_features // num_heads
    check_positive_numbers(rope_theta=rope_theta)
    if rope_theta is not None and head_dim % 2:
        raise ValueError(f"rotary embeddings (rope_theta) need an even head dim, got "
                         f"{head_dim}")
    return head_dim
