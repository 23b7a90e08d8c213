"""Pure-jnp attention with the same meaning and signature as the Pallas kernels.

It materialises the (B, N, T, S) logits, so its memory is quadratic in the sequence length; it is
the ground truth for the tests and the `implementation="xla"` path of `dot_product_attention`.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.attention import masking


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal=False,
    local_window_size=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    logits_soft_cap=None,
    return_residual=False,
    upcast=True,
):
    """Softmax attention, computed densely in float32.

    Shapes and meaning are those of `pallas_kernels.dot_product_attention` (query (B, T, N, H),
    key/value (B, S, K, H), N % K == 0); the arguments are assumed valid (the public API checks
    them). Returns the output in the query's dtype and, with `return_residual`, the natural-log
    log-sum-exp of the logits, (B, T, N) float32 (-inf for rows that see no key, whose output is 0).

    With `upcast` (the default) every step runs in float32 at HIGHEST precision: the ground truth.
    `upcast=False` mirrors a kernel's rounding instead: matmul operands in the input dtype with
    float32 accumulation and the probabilities rounded to it, the baseline that a low-precision
    kernel's error is measured against.
    """
    return banded_attention(
        query, key, value, scale=query.shape[-1] ** -0.5 if scale is None else scale,
        band=masking.band(is_causal, local_window_size), q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, logits_soft_cap=logits_soft_cap,
        return_residual=return_residual, upcast=upcast, mask=mask, bias=bias,
    )


def banded_attention(
    query, key, value, *, scale, band, q_segment_ids=None, kv_segment_ids=None,
    query_seq_lengths=None, key_value_seq_lengths=None, logits_soft_cap=None,
    return_residual=False, upcast=True, shift=None, mask=None, bias=None,
):
    """`dot_product_attention` with the causal mask and window given as `masking.band`'s band,
    shifted by `shift` (see `masking`: the keys' first global position minus the queries').

    Queries past `query_seq_lengths` and keys past `key_value_seq_lengths` are selected away
    before any product (as the kernels do), so whatever they hold, even NaN, never reaches an
    output or a gradient. `mask` (boolean, True: visible) and `bias` (added to the logits after
    the soft cap) broadcast to (B, N, T, S).
    """
    batch, t, n, h = query.shape
    s, k_heads = key.shape[1], key.shape[2]
    operand_dtype = jnp.float32 if upcast else query.dtype
    matmul = functools.partial(
        jnp.einsum, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )
    if query_seq_lengths is not None:
        query = _zero_past(query, query_seq_lengths)
    if key_value_seq_lengths is not None:
        key, value = (_zero_past(x, key_value_seq_lengths) for x in (key, value))
    q = query.astype(operand_dtype).reshape(batch, t, k_heads, n // k_heads, h)
    logits = matmul("btkgh,bskh->bkgts", q, key.astype(operand_dtype)) * scale
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    if bias is not None:
        logits = logits + _grouped(bias, k_heads).astype(jnp.float32)
    visible = masking.dense_mask(
        t, s,
        band=band,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        shift=shift,
    )[:, None, None]  # (B, 1, 1, T, S)
    if mask is not None:
        visible = visible & _grouped(mask, k_heads)
    logits = jnp.where(visible, logits, -jnp.inf)
    row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(logits - row_max)
    row_sum = jnp.sum(weights, axis=-1, keepdims=True)
    empty = row_sum == 0.0
    row_sum = jnp.where(empty, 1.0, row_sum)
    probs = weights / row_sum
    out = matmul("bkgts,bskh->btkgh", probs.astype(operand_dtype), value.astype(operand_dtype))
    out = out.reshape(batch, t, n, h).astype(query.dtype)
    if query_seq_lengths is not None:  # a NaN cotangent of a masked row stays there too
        out = _zero_past(out, query_seq_lengths)
    if not return_residual:
        return out
    lse = jnp.where(empty, -jnp.inf, jnp.log(row_sum) + row_max)[..., 0]  # (B, K, G, T)
    return out, jnp.moveaxis(lse.reshape(batch, n, t), 1, 2)


def _zero_past(x, lengths):
    """x (B, L, ...) with the positions at or past lengths (B,) set to zero (selected)."""
    valid = jnp.arange(x.shape[1])[None, :] < lengths[:, None]
    return jnp.where(valid.reshape(*valid.shape, *[1] * (x.ndim - 2)), x, jnp.zeros_like(x))


def _grouped(pair, k_heads):
    """A mask or bias broadcastable to (B, N, T, S) as (B', K', G', T', S') against the logits'
    (B, K, G, T, S) (the query heads of each key/value head together)."""
    pair = jnp.reshape(pair, (1,) * (4 - jnp.ndim(pair)) + jnp.shape(pair))
    b, n, t, s = pair.shape
    return pair[:, None] if n == 1 else pair.reshape(b, k_heads, n // k_heads, t, s)
