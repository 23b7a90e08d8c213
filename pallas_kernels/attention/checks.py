"""`dot_product_attention`'s argument checks: each raises a TypeError (wrong kind) or
ValueError (wrong value) naming the argument, before anything is traced. `check_window` and
`check_soft_cap` are shared with the Flax attention layer (through `pallas_kernels.arguments`).
"""

import jax.numpy as jnp
import numpy as np

from pallas_kernels import _dispatch
from pallas_kernels.attention import masking


def check_arrays(query, key, value):
    """Checks the query, key and value; returns their batch dims (the query's shape[:-3])."""
    names = ("query", "key", "value")
    arrays = (query, key, value)
    for name, x in zip(names, arrays, strict=True):
        if x.ndim < 3:
            raise ValueError(
                f"{name} must be (B, T, N, H), (..., T, N, H) or (T, N, H), got {x.shape}"
            )
        _dispatch.check_floats({name: x}, _dispatch.HALF_AND_SINGLE,
                               "bfloat16, float16 or float32")
    if not query.ndim == key.ndim == value.ndim:
        raise ValueError(
            f"query, key and value must have the same rank, got {query.shape}, {key.shape}, "
            f"{value.shape}"
        )
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(
            f"key and value must have the query's dtype {query.dtype}, "
            f"got {key.dtype}, {value.dtype}"
        )
    if key.shape != value.shape:
        raise ValueError(f"key and value must have the same shape, got {key.shape}, {value.shape}")
    if query.shape[:-3] != key.shape[:-3]:
        raise ValueError(f"query and key batch dims differ: {query.shape[:-3]} vs "
                         f"{key.shape[:-3]}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key head dims differ: {query.shape[-1]} vs {key.shape[-1]}")
    n, k_heads = query.shape[-2], key.shape[-2]
    if k_heads == 0 or n % k_heads:
        raise ValueError(f"query heads ({n}) must be a multiple of key/value heads ({k_heads})")
    if 0 in query.shape or 0 in key.shape:
        raise ValueError(f"query and key must not be empty, got {query.shape}, {key.shape}")
    return query.shape[:-3]


def _check_int_array(name, x, shape, lead):
    """x, of shape (*lead, *shape), as a (B, *shape) integer array of its own width (the batch
    dims `lead` merged into one); a TypeError or ValueError naming it."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got {x.dtype}")
    want = (*lead, *shape)
    if x.shape != want:
        raise ValueError(f"{name} must have shape {want}, got {x.shape}")
    return x.reshape(-1, *shape)


def check_segment_ids(q_segment_ids, kv_segment_ids, lead, t, s):
    """(q ids, kv ids) as int32, or None. Ids wider than int32 (int64 under x64) are replaced
    by their ranks among the row's ids, which keeps equality and order exactly (a cast would
    merge 2**32 with 0)."""
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    if q_segment_ids is None:
        return None
    q_ids = _check_int_array("q_segment_ids", q_segment_ids, (t,), lead)
    kv_ids = _check_int_array("kv_segment_ids", kv_segment_ids, (s,), lead)
    if max(q_ids.dtype.itemsize, kv_ids.dtype.itemsize) <= 4:
        return q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)
    dtype = jnp.promote_types(q_ids.dtype, kv_ids.dtype)
    ranks = _dense_ranks(jnp.concatenate([q_ids.astype(dtype), kv_ids.astype(dtype)], axis=1))
    return ranks[:, :t], ranks[:, t:]


def _dense_ranks(ids):
    """(B, L) int32 ranks of each row's distinct values: equal ids get equal ranks, in order."""
    order = jnp.argsort(ids, axis=1)
    ordered = jnp.take_along_axis(ids, order, axis=1)
    new = jnp.concatenate(
        [jnp.zeros_like(ordered[:, :1], bool), ordered[:, 1:] != ordered[:, :-1]], axis=1)
    ranks_in_order = jnp.cumsum(new, axis=1, dtype=jnp.int32)
    return jnp.zeros(ids.shape, jnp.int32).at[jnp.arange(ids.shape[0])[:, None], order].set(
        ranks_in_order)


def check_lengths(name, lengths, lead, length):
    """Lengths of shape `lead` (the batch dims; a scalar without batch) as (B,), clipped to
    [0, length] at their own width, then int32; or None."""
    if lengths is None:
        return None
    return jnp.clip(_check_int_array(name, lengths, (), lead), 0, length).astype(jnp.int32)


def check_window(window):
    """`local_window_size` checked and normalised: None or a (left, right) pair of ints >= 0.

    Sides beyond `masking.MAX_WINDOW` (longer than any sequence the kernels take) are clipped
    to it, which sees the same keys.
    """
    if window is None:
        return None
    sides = (window, window) if isinstance(window, int | np.integer) else window
    if (
        not isinstance(sides, tuple | list)
        or len(sides) != 2
        or not all(isinstance(w, int | np.integer) and not isinstance(w, bool | np.bool_)
                   for w in sides)
    ):
        raise TypeError(f"local_window_size must be an int or a (left, right) pair, got {window!r}")
    if min(sides) < 0:
        raise ValueError(f"local_window_size must not be negative, got {window!r}")
    return tuple(min(int(w), masking.MAX_WINDOW) for w in sides)


def check_soft_cap(logits_soft_cap):
    """`logits_soft_cap` checked: None or a finite float > 0."""
    return _dispatch.check_positive("logits_soft_cap", logits_soft_cap, default=None)


def check_pair(name, pair, lead, n, t, s):
    """A `mask` (boolean) or `bias` (float) broadcastable to (*lead, N, T, S) as a rank-4
    (B', N', T', S') array whose dims are each 1 (broadcast) or full, the leading batch dims
    `lead` (several, one or none) merged into B'; or None."""
    if pair is None:
        return None
    pair = jnp.asarray(pair)
    if name == "mask" and pair.dtype != jnp.bool_:
        raise TypeError(f"mask must be a boolean array (True: attend), got {pair.dtype}")
    if name == "bias":
        _dispatch.check_floats({name: pair}, _dispatch.HALF_AND_SINGLE,
                               "bfloat16, float16 or float32")
    full = (*lead, n, t, s)
    if not lead and pair.ndim == 4 and pair.shape[0] == 1:  # jax.nn's batch of one
        pair = pair[0]
    if pair.ndim > len(full):
        raise ValueError(f"{name} must broadcast to {full}, got {pair.shape}")
    shape = (1,) * (len(full) - pair.ndim) + pair.shape
    bad = [i for i, (d, f) in enumerate(zip(shape, full, strict=True)) if d not in (1, f)]
    if bad:
        raise ValueError(f"{name} must broadcast to {full} (each dim 1 or full), got "
                         f"{pair.shape}")
    pair = pair.reshape(shape)
    batch_dims = shape[:len(lead)]
    if any(d > 1 for d in batch_dims):
        pair = jnp.broadcast_to(pair, (*lead, *shape[len(lead):]))
    return pair.reshape(-1 if any(d > 1 for d in batch_dims) else 1, *shape[len(lead):])
