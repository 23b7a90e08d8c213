"""Inputs and comparisons shared by the KV-cache decode tests."""

import jax
import jax.numpy as jnp
import numpy as np
from numerics import rel_error

QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0,
        jnp.dtype(jnp.uint8): 240.0}
"""The largest stored magnitude of each quantised cache dtype (uint8: float8_e4m3fnuz bits)."""

FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)

_DRAW = 1 << 20


def normals(seed, *shapes):
    """Standard normal float32 numpy arrays of `shapes`, cut from one draw of a fixed size from
    jax.random.key(seed), so that every case reuses one compiled sampler (larger cases, a
    power of two that holds them)."""
    sizes = [int(np.prod(shape)) for shape in shapes]
    draw = max(_DRAW, 1 << (sum(sizes) - 1).bit_length())
    flat = np.asarray(jax.random.normal(jax.random.key(seed), (draw,), jnp.float32))
    ends = np.cumsum(sizes)
    return [flat[end - size:end].reshape(shape)
            for end, size, shape in zip(ends, sizes, shapes, strict=True)]


def store(x, dtype, *, scaled):
    """x (..., H) float32 numpy as a cache of `dtype`: numpy (stored, scale (...) float32 or
    None).

    Quantised dtypes with `scaled` get a scale absmax/qmax per vector; without, fp8 is a plain
    cast. uint8 holds the bits of float8_e4m3fnuz.
    """
    dtype = jnp.dtype(dtype)
    if dtype in FLOATS:
        return x.astype(dtype), None
    scale = None
    if scaled:
        scale = np.max(np.abs(x), axis=-1) / np.float32(QMAX[dtype])
        x = np.clip(x / scale[..., None], -QMAX[dtype], QMAX[dtype])
    if dtype == jnp.int8:
        return np.round(x).astype(np.int8), scale
    if dtype == jnp.uint8:
        return x.astype(jnp.float8_e4m3fnuz).view(np.uint8), scale
    return x.astype(dtype), scale


def poison(stored, scale, valid):
    """Numpy stored and scale with every slot outside `valid` (stored.shape[:2]) unreadable: NaN
    where the dtype has one (0x80 is NaN in float8_e4m3fnuz bits), -128 in int8, and NaN
    scales."""
    where = valid[:, :, None, None]
    if stored.dtype == np.int8:
        bad = np.int8(-128)
    elif stored.dtype == np.uint8:
        bad = np.uint8(0x80)
    else:
        bad = np.array(np.nan, stored.dtype)
    stored = np.where(where, stored, bad)
    return stored, None if scale is None else np.where(where[..., 0], scale, np.float32(np.nan))


def make_case(seed, *, b, t, n, k, h, lengths, cache_dtype=jnp.float32, q_dtype=jnp.float32,
              scaled=None, s=None, page_size=None, max_pages=None, shared_pages=0):
    """(q, cache_seqlens, clean, dirty): q (B, T, N, H) and two caches holding the same valid
    keys and values, each (k_cache, v_cache, keyword arguments: block_table, k_scale, v_scale
    where present).

    Dense caches are (B, s, K, H). With `page_size`, each row owns `max_pages` distinct pages of
    a shuffled pool (num_pages, page_size, K, H) with two spare pages no row references, except
    that rows 1.. share row 0's first `shared_pages` pages (which must lie within every row's
    length). `clean` holds random values everywhere; `dirty` is unreadable (see `poison`) in
    every slot past its row's length and in every unreferenced page. `scaled` defaults to
    whether the cache is quantised.
    """
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int32)
    assert lengths.shape == (b,)
    scaled = jnp.dtype(cache_dtype) not in FLOATS if scaled is None else scaled
    kw = {}
    if page_size is None:
        shape = (b, s, k, h)
        valid = np.arange(s)[None, :] < lengths[:, None]
    else:
        own = max_pages - shared_pages
        num_pages = b * own + shared_pages + 2
        pool = rng.permutation(num_pages)
        shared = np.broadcast_to(pool[:shared_pages], (b, shared_pages))
        table = np.concatenate([shared, pool[shared_pages:-2].reshape(b, own)], axis=1)
        assert np.all(lengths >= shared_pages * page_size), "shared pages must be valid"
        shape = (num_pages, page_size, k, h)
        valid = np.zeros(shape[:2], bool)
        for row, length in enumerate(lengths):
            j = np.arange(length)
            valid[table[row, j // page_size], j % page_size] = True
        kw["block_table"] = jnp.asarray(table, jnp.int32)
    q, *kv = normals(seed, (b, t, n, h), shape, shape)
    caches = [[], []]  # clean, dirty: [(k, k_scale), (v, v_scale)]
    for x in kv:
        stored, scale = store(x, cache_dtype, scaled=scaled)
        caches[0].append((stored, scale))
        caches[1].append(poison(stored, scale, valid))
    out = []
    for (k_cache, k_scale), (v_cache, v_scale) in caches:
        # Scales as the kernel takes them, each KV head's along its keys: (rows, K, slots).
        scales = {} if k_scale is None else dict(k_scale=jnp.asarray(np.swapaxes(k_scale, 1, 2)),
                                                 v_scale=jnp.asarray(np.swapaxes(v_scale, 1, 2)))
        out.append((jnp.asarray(k_cache), jnp.asarray(v_cache), {**kw, **scales}))
    return jnp.asarray(q, q_dtype), jnp.asarray(lengths), out[0], out[1]


def tolerance(q_dtype, cache_dtype):
    """The relative error allowed against the float32 reference: float32 q over float32 or
    quantised caches (dequantised alike by both) is exact up to summation order."""
    if jnp.dtype(q_dtype) == jnp.float32 and jnp.dtype(cache_dtype) not in (
        jnp.bfloat16, jnp.float16
    ):
        return 1e-5
    return 2e-2


def assert_matches(name, out, lse, ref_out, ref_lse, *, tol):
    """out (B, T, N, H) and lse (B, T, N) against the reference: finite, the same empty rows
    (lse -inf, output 0), relative error below `tol`."""
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    ref_out, ref_lse = np.asarray(ref_out, np.float32), np.asarray(ref_lse)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape, name
    assert lse.dtype == np.float32, name
    assert np.all(np.isfinite(out)), f"{name}: non-finite output"
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), empty), f"{name}: empty rows differ"
    assert not np.any(np.isnan(lse)) and not np.any(np.isposinf(lse)), f"{name}: lse not finite"
    assert not np.any(out[empty]), f"{name}: an empty row's output is not 0"
    assert rel_error(out, ref_out) < tol, f"{name}: out error {rel_error(out, ref_out)}"
    assert rel_error(lse[~empty], ref_lse[~empty]) < tol, f"{name}: lse error"
