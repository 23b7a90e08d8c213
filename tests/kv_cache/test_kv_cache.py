"""Decode attention over a KV cache (the split-K kernel in interpret mode on CPU, and the xla path)
against the float32 reference, and writing the cache with `update_kv_cache`."""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kv_cache_cases import QMAX, assert_matches, make_case, normals, poison, tolerance

import pallas_kernels
from pallas_kernels.kv_cache import reference, tuning

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
INT8, E4M3, FNUZ = jnp.int8, jnp.float8_e4m3fn, jnp.uint8  # uint8: float8_e4m3fnuz bits

CASES = [
    # (id, make_case kwargs, call kwargs), a covering selection: G = n // k. Lengths cover 0, 1,
    # fewer than T (queries before the cache's start), page boundaries, the whole capacity and
    # ragged rows; with num_splits 4, some splits see no key (short rows, windows).
    ("b1-t4-dense-f32-g1-h64-split1",
     dict(b=1, t=4, n=2, k=2, h=64, s=64, lengths=(37,)), dict(num_splits=1)),
    ("b3-t4-page16-bf16-g4-h128-auto",
     dict(b=3, t=4, n=8, k=2, h=128, page_size=16, max_pages=8, lengths=(0, 16, 77),
          cache_dtype=BF16, q_dtype=BF16), dict()),
    ("b8-t1-page32-int8-g8-h80-split4-cap",
     dict(b=8, t=1, n=8, k=1, h=80, page_size=32, max_pages=4,
          lengths=(1, 32, 64, 128, 5, 99, 0, 31), cache_dtype=INT8),
     dict(num_splits=4, logits_soft_cap=5.0)),
    ("b3-t4-dense-e4m3-g1-h256-split4-window",
     dict(b=3, t=4, n=2, k=2, h=256, s=96, lengths=(1, 96, 50), cache_dtype=E4M3),
     dict(num_splits=4, local_window_size=20)),
    ("b3-t1-page16-fnuz-g4-h64-auto-shared",
     dict(b=3, t=1, n=4, k=1, h=64, page_size=16, max_pages=16, lengths=(200, 48, 256),
          cache_dtype=FNUZ, shared_pages=3), dict()),
    ("b8-t4-page16-bf16q-bf16-g8-h64-split1-cap",
     dict(b=8, t=4, n=8, k=1, h=64, page_size=16, max_pages=4,
          lengths=(64, 0, 3, 17, 33, 1, 48, 60), cache_dtype=BF16, q_dtype=BF16),
     dict(num_splits=1, logits_soft_cap=2.0)),
    ("b1-t1-page32-f32-g8-h128-split4-window-full",
     dict(b=1, t=1, n=8, k=1, h=128, page_size=32, max_pages=8, lengths=(256,)),
     dict(num_splits=4, local_window_size=(64, 0))),
    ("b3-t4-page32-e4m3-unscaled-g1-h80-split1-window-cap-shared",
     dict(b=3, t=4, n=2, k=2, h=80, page_size=32, max_pages=4, lengths=(35, 32, 128),
          cache_dtype=E4M3, scaled=False, shared_pages=1),
     dict(num_splits=1, local_window_size=7, logits_soft_cap=3.0)),
    ("b8-t4-dense-fnuz-unscaled-g4-h128-auto",
     dict(b=8, t=4, n=8, k=2, h=128, s=32, lengths=(32, 1, 7, 16, 0, 31, 2, 20),
          cache_dtype=FNUZ, scaled=False), dict()),
    ("b3-t4-dense-bf16q-int8-g4-h80-split4-short",
     dict(b=3, t=4, n=4, k=1, h=80, s=48, lengths=(0, 1, 2), cache_dtype=INT8, q_dtype=BF16),
     dict(num_splits=4)),
    ("b1-t4-page16-f16-g4-h256-auto-window",
     dict(b=1, t=4, n=4, k=1, h=256, page_size=16, max_pages=4, lengths=(50,),
          cache_dtype=F16, q_dtype=F16), dict(local_window_size=(16, 16))),
    ("b3-t1-page16-f32q-bf16-g8-h80-split4-boundaries",
     dict(b=3, t=1, n=16, k=2, h=80, page_size=16, max_pages=16, lengths=(16, 144, 256),
          cache_dtype=BF16), dict(num_splits=4)),
    ("b3-t4-page16-bf16q-int8-g4-h80-auto-window",
     dict(b=3, t=4, n=8, k=2, h=80, page_size=16, max_pages=8, lengths=(5, 64, 100),
          cache_dtype=INT8, q_dtype=BF16), dict(local_window_size=9)),
]

PATHS = {
    "pallas": functools.partial(pallas_kernels.attention_with_kv_cache, implementation="pallas",
                                interpret=True),
    "xla": functools.partial(pallas_kernels.attention_with_kv_cache, implementation="xla"),
}


def _seed(name):
    return zlib.crc32(name.encode()) % 1000


def _without_splits(call):
    """The call's keyword arguments that the reference takes (all but num_splits)."""
    return {key: value for key, value in call.items() if key != "num_splits"}


def _attend(path, q, cache_seqlens, cache, **kw):
    """(out, lse) of a path, jitted whole (interpret mode and the reference run op by op
    otherwise, each op compiled on its own)."""
    k_cache, v_cache, arrays = cache
    run = jax.jit(functools.partial(PATHS[path], return_residual=True, **kw))
    return run(q, k_cache, v_cache, cache_seqlens, **arrays)


def _exact(q, cache_seqlens, cache, **kw):
    """The reference on float32 q: (out, lse)."""
    k_cache, v_cache, arrays = cache
    run = jax.jit(functools.partial(reference.attention_with_kv_cache, return_residual=True,
                                    **_without_splits(kw)))
    return run(q.astype(F32), k_cache, v_cache, cache_seqlens, **arrays)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference_on_poisoned_caches(case, path):
    """Run on caches holding NaN past every row's length and in unreferenced pages (NaN scales
    too), compared with the reference on clean caches."""
    name, spec, call = case
    q, seqlens, clean, dirty = make_case(_seed(name), **spec)
    out, lse = _attend(path, q, seqlens, dirty,
                       **(call if path == "pallas" else _without_splits(call)))
    assert out.dtype == q.dtype
    ref_out, ref_lse = _exact(q, seqlens, clean, **call)
    assert_matches(name, out, lse, ref_out, ref_lse,
                   tol=tolerance(spec.get("q_dtype", F32), spec.get("cache_dtype", F32)))


TABLE_READS = sorted({(tile.block_k, tile.gather_rows, tile.zero_int8_past_length)
                      for table in (tuning._TABLE, tuning._TABLE_JAXLIB_0_12)
                      for tile in table.values()})
TILE_CASES = (1, 2, 4, 7, 12)


@pytest.mark.parametrize(("block_k", "gather_rows", "zero_int8"), TABLE_READS)
@pytest.mark.parametrize("case", [CASES[i] for i in TILE_CASES],
                         ids=[CASES[i][0] for i in TILE_CASES])
def test_matches_reference_at_every_tile_of_the_tables(case, block_k, gather_rows, zero_int8,
                                                       monkeypatch):
    """The keys a step and the reads of every GPU's table row (this CPU runs the fallback row),
    jaxlib 0.12's rows included, on poisoned caches: a step wider than a short cache, pages
    per step, rows gathered or pages read, int8 values past the lengths selected or not."""
    name, spec, call = case
    monkeypatch.setattr(tuning, "table", lambda key_row_bytes: dict.fromkeys(
        ("hopper", "ampere", "cdna", "fallback"),
        tuning.DecodeBlocks(block_k, 4, 2, gather_rows, zero_int8)))
    q, seqlens, clean, dirty = make_case(_seed(name), **spec)
    out, lse = _attend("pallas", q, seqlens, dirty, **call)
    ref_out, ref_lse = _exact(q, seqlens, clean, **call)
    assert_matches(name, out, lse, ref_out, ref_lse,
                   tol=tolerance(spec.get("q_dtype", F32), spec.get("cache_dtype", F32)))


@pytest.mark.parametrize("case", [CASES[i] for i in (2, 7, 12)],
                         ids=[CASES[i][0] for i in (2, 7, 12)])
def test_kernel_poisoned_equals_clean_bitwise(case):
    """What lies past the lengths and in unreferenced pages changes no bit of the output."""
    name, spec, call = case
    q, seqlens, clean, dirty = make_case(_seed(name), **spec)
    results = [_attend("pallas", q, seqlens, cache, **call) for cache in (clean, dirty)]
    for what, x, y in zip(("out", "lse"), *results, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=what)


def test_xla_implementation_is_the_reference():
    name, spec, call = CASES[4]
    q, seqlens, _, (k_cache, v_cache, arrays) = make_case(_seed(name), **spec)
    out = pallas_kernels.attention_with_kv_cache(q, k_cache, v_cache, seqlens,
                                                 implementation="xla", **arrays, **call)
    ref = reference.attention_with_kv_cache(q, k_cache, v_cache, seqlens, **arrays, **call)
    assert np.array_equal(np.asarray(out), np.asarray(ref))
    # On a machine without a GPU, None picks the reference.
    default = pallas_kernels.attention_with_kv_cache(q, k_cache, v_cache, seqlens, **arrays,
                                                     **call)
    assert np.array_equal(np.asarray(default), np.asarray(out))


def test_reference_equals_dense_attention_on_the_gathered_cache():
    """Paged reads, the end-aligned causal band and the window agree with the package's dense
    attention over each row's keys, each row's queries placed at its last T positions."""
    name, spec, call = CASES[7]
    q, seqlens, clean, _ = make_case(_seed(name), **spec)
    k_cache, v_cache, arrays = clean
    out, lse = _exact(q, seqlens, clean, **call)

    @jax.jit
    def dense(q, seqlens):
        keys, values = (reference.read_cache(c, seqlens, block_table=arrays["block_table"])
                        for c in (k_cache, v_cache))
        b, t = q.shape[:2]
        position = seqlens[:, None] - t + jnp.arange(t)  # (B, T)
        placed = jnp.zeros((b, keys.shape[1], *q.shape[2:]), q.dtype)
        placed = placed.at[jnp.arange(b)[:, None], position].set(q)
        out, lse = pallas_kernels.dot_product_attention(
            placed, keys, values, is_causal=True, local_window_size=(call["local_window_size"], 0),
            logits_soft_cap=call["logits_soft_cap"], key_value_seq_lengths=seqlens,
            implementation="xla", return_residual=True,
        )
        return (jnp.take_along_axis(out, position[:, :, None, None], axis=1),
                jnp.take_along_axis(lse, position[:, :, None], axis=1))

    assert np.all(np.asarray(seqlens) >= q.shape[1])
    assert_matches(name, out, lse, *dense(q, seqlens), tol=1e-5)


UPDATES = [
    # (id, cache dtype, scaled, paged)
    *[(f"{jnp.dtype(d).name}-{'paged' if p else 'dense'}", d, d in (INT8, E4M3, FNUZ), p)
      for d in (BF16, F32, INT8, E4M3, FNUZ) for p in (False, True)],
    ("float8_e4m3fn-unscaled-dense", E4M3, False, False),
]


@pytest.mark.parametrize("update", UPDATES, ids=[u[0] for u in UPDATES])
def test_update_then_read_gives_the_written_values(update):
    name, cache_dtype, scaled, paged = update
    b, t, k, h = 3, 4, 2, 64
    layout = dict(page_size=16, max_pages=4) if paged else dict(s=64)
    before = (0, 15, 40)  # an empty row, a write across a page boundary, one mid-page
    _, seqlens, _, (k_cache, v_cache, arrays) = make_case(
        _seed(name), b=b, t=t, n=k, k=k, h=h, lengths=before, cache_dtype=cache_dtype,
        scaled=scaled, **layout,
    )
    new_dtype = BF16 if cache_dtype == BF16 else F32
    new = [jnp.asarray(x, new_dtype) for x in normals(_seed(name) + 1, *[(b, t, k, h)] * 2)]
    new[0] = new[0].at[1, 0].set(0)  # an all-zero key: scale 0, read back as exactly 0
    written = pallas_kernels.update_kv_cache(k_cache, v_cache, *new, seqlens, **arrays)
    assert len(written) == 4
    table = arrays.get("block_table")
    for what, x, old, stored, scale, old_scale in zip(
        "kv", new, (k_cache, v_cache), written[:2], written[2:],
        (arrays.get("k_scale"), arrays.get("v_scale")), strict=True,
    ):
        assert stored.shape == old.shape and stored.dtype == old.dtype, what
        assert (scale is None) == (old_scale is None), what
        read = reference.read_cache(stored, seqlens + t, block_table=table, scale=scale)
        got = jnp.stack([read[row, int(seqlens[row]):int(seqlens[row]) + t] for row in range(b)])
        x = np.asarray(x, np.float32)
        err = np.abs(np.asarray(got) - x)
        absmax = np.max(np.abs(x), axis=-1, keepdims=True)
        if cache_dtype in (BF16, F32):
            bound = np.zeros_like(x)
        elif cache_dtype == INT8:
            bound = absmax * (0.5 / 127 + 1e-6)
        else:  # 3 mantissa bits; subnormals at most 2**-9 of the scale apart (2**-10: fnuz)
            unit = absmax / QMAX[jnp.dtype(cache_dtype)] if scaled else 1.0
            bound = np.abs(x) * 2.0**-4 + unit * 2.0**-10 + absmax * 1e-6
        assert np.all(err <= bound), f"{what}: error {np.max(err - bound)} past the bound"
        if scaled:  # scales (rows or pages, K, slots) as (rows or pages, slots, K)
            scale, old_scale = (np.swapaxes(np.asarray(s), 1, 2) for s in (scale, old_scale))
            written_scale = _written_slots(scale, seqlens, t, table)
            np.testing.assert_allclose(
                written_scale, absmax[..., 0] / QMAX[jnp.dtype(cache_dtype)], rtol=1e-6,
                err_msg=f"{what} scale")
        # Every slot not written keeps its bits, NaN included.
        untouched = ~_written_mask(old.shape[:2], seqlens, t, table)
        for now, then in ((stored, old), (scale, old_scale)):
            if then is not None:
                now, then = np.asarray(now), np.asarray(then)
                bits = f"u{then.dtype.itemsize}"
                np.testing.assert_array_equal(now.view(bits)[untouched],
                                              then.view(bits)[untouched], err_msg=what)


def _slots(seqlens, t, table, page_size):
    """The storage (row or page, slot) of each written token, two (B, T) integer arrays."""
    position = np.asarray(seqlens)[:, None] + np.arange(t)
    if table is None:
        return np.broadcast_to(np.arange(len(position))[:, None], position.shape), position
    table = np.asarray(table)
    return (np.take_along_axis(table, position // page_size, axis=1), position % page_size)


def _written_mask(shape, seqlens, t, table):
    mask = np.zeros(shape, bool)
    mask[_slots(seqlens, t, table, shape[1])] = True
    return mask


def _written_slots(storage, seqlens, t, table):
    """storage (rows or pages, slots, ...) at the written tokens: (B, T, ...)."""
    return storage[_slots(seqlens, t, table, storage.shape[1])]


def test_update_then_attend_matches_the_reference():
    """A decode step: write T tokens into a paged int8 cache, then attend over it."""
    b, t, n, k, h = 3, 4, 8, 2, 64
    q, seqlens, _, (k_cache, v_cache, arrays) = make_case(
        21, b=b, t=t, n=n, k=k, h=h, page_size=16, max_pages=4, lengths=(0, 13, 44),
        cache_dtype=INT8,
    )
    new = jnp.asarray(normals(22, (2, b, t, k, h))[0])
    k_cache, v_cache, k_scale, v_scale = pallas_kernels.update_kv_cache(
        k_cache, v_cache, new[0], new[1], seqlens, **arrays)
    arrays = dict(block_table=arrays["block_table"], k_scale=k_scale, v_scale=v_scale)
    cache = (k_cache, v_cache, arrays)
    out, lse = _attend("pallas", q, seqlens + t, cache)
    ref_out, ref_lse = _exact(q, seqlens + t, cache)
    assert_matches("decode step", out, lse, ref_out, ref_lse, tol=1e-5)


def _bad_calls():
    q = jnp.zeros((2, 1, 4, 16))
    cache = jnp.zeros((2, 32, 2, 16))
    int8 = cache.astype(INT8)
    scale = jnp.ones((2, 2, 32))
    seqlens = jnp.array([3, 5], jnp.int32)
    table = jnp.zeros((2, 2), jnp.int32)
    odd = jnp.zeros((2, 40, 2, 16))  # 40 slots: a dense row, not a page
    ok = dict(q=q, k_cache=cache, v_cache=cache, cache_seqlens=seqlens)
    return [
        ("int8 without scales", dict(ok, k_cache=int8, v_cache=int8), "k_scale"),
        ("int8 without v_scale", dict(ok, k_cache=int8, v_cache=int8, k_scale=scale),
         "v_scale"),
        ("float32 with scales", dict(ok, k_scale=scale, v_scale=scale), "k_scale"),
        ("scale shape", dict(ok, k_cache=int8, v_cache=int8, k_scale=scale[..., :1],
                             v_scale=scale), "k_scale"),
        ("scale dtype", dict(ok, k_cache=int8, v_cache=int8, k_scale=scale.astype(BF16),
                             v_scale=scale), "k_scale"),
        ("block_table with a dense-shaped cache", dict(ok, k_cache=odd, v_cache=odd,
                                                       block_table=table), "k_cache|block_table"),
        ("dense cache rows", dict(ok, k_cache=cache[:1], v_cache=cache[:1]), "k_cache"),
        ("block_table batch", dict(ok, block_table=table[:1]), "block_table"),
        ("block_table rank", dict(ok, block_table=table[0]), "block_table"),
        ("block_table dtype", dict(ok, block_table=table.astype(F32)), "block_table"),
        ("cache_seqlens shape", dict(ok, cache_seqlens=seqlens[:, None]),
         "cache_seqlens"),
        ("cache_seqlens batch", dict(ok, cache_seqlens=seqlens[:1]), "cache_seqlens"),
        ("cache_seqlens dtype", dict(ok, cache_seqlens=seqlens.astype(F32)),
         "cache_seqlens"),
        ("block_table without pages", dict(ok, k_cache=cache[:, :16], v_cache=cache[:, :16],
                                           block_table=table[:, :0]), "block_table"),
    ]


@pytest.mark.parametrize("name,kwargs,needle", _bad_calls(), ids=[c[0] for c in _bad_calls()])
@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_bad_arguments_raise_naming_them(name, kwargs, needle, implementation):
    with pytest.raises((TypeError, ValueError), match=needle):
        pallas_kernels.attention_with_kv_cache(**kwargs, implementation=implementation)


def test_update_without_scales_for_int8_raises():
    cache = jnp.zeros((2, 32, 2, 16), INT8)
    new = jnp.zeros((2, 1, 2, 16))
    with pytest.raises(ValueError, match="k_scale"):
        pallas_kernels.update_kv_cache(cache, cache, new, new, jnp.array([3, 5], jnp.int32))


def test_poisoned_slots_are_the_unreadable_ones():
    """The harness itself: every slot past a row's length and every spare page is poisoned,
    nothing a row reads is."""
    name, spec, _ = CASES[4]
    _, seqlens, clean, dirty = make_case(_seed(name), **spec)
    table = np.asarray(clean[2]["block_table"])
    assert len(np.unique(table)) == table.size - 2 * spec["shared_pages"]
    readable = np.zeros(clean[0].shape[:2], bool)
    for row, length in enumerate(np.asarray(seqlens)):
        readable[tuple(_slots(np.zeros(1, int), length, table[row:row + 1], 16))] = True
    expected, _ = poison(np.asarray(clean[0]), None, readable)
    np.testing.assert_array_equal(np.asarray(dirty[0]), np.asarray(expected))
    scales = np.swapaxes(np.asarray(dirty[2]["k_scale"]), 1, 2)  # (pages, slots, K)
    assert np.all(np.isnan(scales[~readable]))
    assert not np.any(np.isnan(scales[readable]))


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_lengths_past_the_capacity_count_as_the_capacity(implementation):
    """Both paths read no key past a row's capacity, whatever cache_seqlens says."""
    q, cache = (jnp.asarray(x) for x in normals(_seed("past capacity"), (2, 1, 4, 16),
                                                  (2, 32, 2, 16)))
    call = functools.partial(pallas_kernels.attention_with_kv_cache, q, cache, cache,
                             implementation=implementation, interpret=True)
    np.testing.assert_array_equal(call(jnp.array([40, 33], jnp.int32)),
                                  call(jnp.array([32, 32], jnp.int32)))


def test_a_write_into_a_page_outside_the_pool_is_dropped():
    """A block table may name -1 (a page not allocated yet): the tokens that fall there are
    dropped, not written into the pool's last page."""
    cache = jnp.zeros((3, 16, 1, 8))
    new = jnp.ones((1, 2, 1, 8))
    table = jnp.array([[0, -1]], jnp.int32)
    k_cache, _, _, _ = pallas_kernels.update_kv_cache(cache, cache, new, new,
                                                      jnp.array([15], jnp.int32),
                                                      block_table=table)
    assert float(k_cache[0, 15].sum()) == 8.0  # the first token, in page 0
    assert float(jnp.abs(k_cache[1:]).sum()) == 0.0  # the second dropped, page 2 untouched


@pytest.mark.parametrize("batch, kv_heads, capacity, num_splits",
                         [(1, 1, 32768, None), (64, 4, 8192, None), (3, 2, 4096, 3),
                          (1, 8, 1000 * 16, 5), (2, 1, 64, None)])
def test_split_plans_cover_the_cache_in_a_power_of_two_of_splits(batch, kv_heads, capacity,
                                                                 num_splits):
    """The merge reads every split's partial as one power-of-two array: the plan's splits are
    a power of two that covers every block, none starts past the last block but the empty
    tail, and splits of a few blocks run with one stage."""
    plan = tuning.plan("NVIDIA H100 80GB HBM3", batch, kv_heads, capacity, page_size=16,
                       num_splits=num_splits, key_row_bytes=256)
    blocks = -(-capacity // plan.blocks.block_k)
    assert plan.splits & (plan.splits - 1) == 0
    assert plan.splits * plan.blocks_per_split >= blocks
    assert plan.splits < 2 * -(-blocks // plan.blocks_per_split)
    if plan.blocks_per_split <= tuning.UNPIPELINED_BLOCKS:
        assert plan.blocks.num_stages == 1
