"""FlashAttention kernels (interpret mode on CPU) against the float32 reference."""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import NAMES, assert_close, exact, loss_and_grads, make_inputs, pallas

import pallas_kernels
from pallas_kernels import _device
from pallas_kernels.attention import masking, reference, tuning

# Small tiles; the dK/dV kernel splits GQA groups across two programs (head_splits).
SMALL = tuning.AttentionBlocks(
    tuning.KernelBlocks(32, 16, 4, 1),
    tuning.KernelBlocks(16, 32, 4, 1, head_splits=2),
    tuning.KernelBlocks(32, 16, 4, 1),
)

CASES = [
    # (id, make_inputs kwargs, mask features)
    ("full", dict(t=64, h=32), ()),
    ("causal", dict(t=77, h=40), ("causal",)),
    ("gqa4-causal", dict(t=130, n=8, k=2, h=64), ("causal",)),
    ("mqa", dict(t=17, s=45, n=4, k=1, h=16), ()),
    ("cross-t<s-causal", dict(t=17, s=77, h=80), ("causal",)),
    ("cross-t>s-causal", dict(t=77, s=17, h=32), ("causal",)),
    ("t1", dict(t=1, s=33, h=128), ()),
    ("t1-s1-causal", dict(t=1, s=1, h=16), ("causal",)),
    ("window", dict(t=130, h=32), ("window",)),
    ("window-causal-gqa", dict(t=77, n=4, k=2, h=40), ("window", "causal")),
    ("segments", dict(t=77, h=32), ("segments",)),
    ("segments-causal-mqa", dict(t=64, s=50, n=4, k=1, h=16), ("segments", "causal")),
    ("soft-cap", dict(t=45, h=64), ("cap", "causal")),
    ("lengths", dict(t=40, s=70, h=32), ("lengths",)),
    ("everything", dict(t=77, s=90, n=4, k=2, h=80),
     ("causal", "window", "segments", "lengths", "cap")),
]


@pytest.mark.parametrize("blocks", [None, SMALL], ids=["table-blocks", "16-32-blocks"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference_float32(case, blocks):
    _, shape, mask = case
    args, kw = make_inputs(zlib.crc32(case[0].encode()) % 1000, mask=mask, **shape)
    ours = loss_and_grads(pallas(block_sizes=blocks), *args, **kw)
    ref = loss_and_grads(exact, *args, **kw)
    for name, x, r in zip(NAMES, ours, ref, strict=True):
        assert x.shape == r.shape and x.dtype == r.dtype, name
        assert_close(name, x, r, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("mask", [(), ("causal", "segments")], ids=["full", "causal-segments"])
def test_low_precision_error_at_most_twice_reference(dtype, mask):
    """Error vs the float32 truth <= 2x that of a reference with the same input rounding."""
    args, kw = make_inputs(3, t=70, n=4, k=2, h=64, dtype=dtype, mask=mask)
    truth = loss_and_grads(exact, *args, **kw)
    ours = loss_and_grads(pallas(), *args, **kw)
    low = loss_and_grads(
        functools.partial(reference.dot_product_attention, upcast=False), *args, **kw
    )
    for name, x, lo, tr in zip(NAMES, ours, low, truth, strict=True):
        if name == "out":
            assert x.dtype == dtype
        tr = np.asarray(tr)
        finite = np.isfinite(tr)
        err = np.max(np.abs(np.asarray(x, np.float32)[finite] - tr[finite]))
        base = np.max(np.abs(np.asarray(lo, np.float32)[finite] - tr[finite]))
        assert err <= 2 * base + 1e-2, f"{name}: {err} vs reference {base}"


def test_rows_that_see_no_key_give_zero_not_nan():
    args, kw = make_inputs(5, t=40, s=40, h=32, mask=("segments", "lengths"))
    out, lse, dq, dk, dv = loss_and_grads(pallas(), *args, **kw)
    visible = masking.dense_mask(
        40, 40, band=(None, None), q_segment_ids=kw["q_segment_ids"],
        kv_segment_ids=kw["kv_segment_ids"], query_seq_lengths=kw["query_seq_lengths"],
        key_value_seq_lengths=kw["key_value_seq_lengths"],
    )
    empty = ~np.asarray(visible.any(-1))  # (B, T)
    assert empty.any() and not empty.all()
    for x in (out, dq, dk, dv):
        assert np.all(np.isfinite(np.asarray(x)))
    assert np.all(np.asarray(out)[empty] == 0)
    assert np.all(np.asarray(dq)[empty] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[empty]))
    assert np.all(np.asarray(dk)[1] == 0) and np.all(np.asarray(dv)[1] == 0)  # kv_len 0


def test_bitwise_deterministic():
    args, kw = make_inputs(7, t=77, n=8, k=2, h=32, dtype=jnp.bfloat16, mask=("causal",))
    run = jax.jit(lambda *a: loss_and_grads(pallas(), *a, **kw))
    first = run(*args)
    second = run(*args)
    for name, x, y in zip(NAMES, first, second, strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y)), name


def test_rank3_inputs():
    (q, k, v, *_), _ = make_inputs(8, b=1, t=33, h=32)
    out = pallas_kernels.dot_product_attention(
        q[0], k[0], v[0], is_causal=True, implementation="pallas"
    )
    ref = exact(q, k, v, is_causal=True)[0]
    assert out.shape == q.shape[1:]
    assert_close("out", out, ref, rtol=2e-5, atol=2e-5)


def test_jit_vmap_remat_and_scan():
    (q, k, v, dout, _), _ = make_inputs(9, b=2, t=40, n=2, h=16)
    attention = functools.partial(
        pallas_kernels.dot_product_attention, is_causal=True, implementation="pallas"
    )
    reference_out = exact(q, k, v, is_causal=True)

    # vmap over an extra leading axis, through jit and remat, with a gradient.
    stacked = [jnp.stack([x, 2 * x]) for x in (q, k, v)]

    @jax.jit
    def vmapped_loss(q, k, v):
        out = jax.vmap(jax.checkpoint(attention))(q, k, v)
        return jnp.sum(out * dout), out

    (_, out), grads = jax.value_and_grad(vmapped_loss, argnums=(0, 1, 2), has_aux=True)(*stacked)
    assert_close("vmap out", out[0], reference_out, rtol=2e-5, atol=2e-5)
    assert_close("vmap out 2x", out[1], exact(2 * q, 2 * k, 2 * v, is_causal=True), rtol=2e-5,
                 atol=2e-5)
    ref_grads = jax.grad(
        lambda q, k, v: jnp.sum(exact(q, k, v, is_causal=True) * dout), argnums=(0, 1, 2)
    )(q, k, v)
    for g, r in zip(grads, ref_grads, strict=True):
        assert_close("vmap grad", g[0], r, rtol=2e-5, atol=2e-5)

    # Inside lax.scan: two layers of attention, differentiated.
    def layers(q):
        def layer(x, _):
            return attention(x, k, v) + x, None

        return jnp.sum(jax.lax.scan(layer, q, None, length=2)[0] * dout)

    def layers_ref(q):
        x = q
        for _ in range(2):
            x = exact(x, k, v, is_causal=True) + x
        return jnp.sum(x * dout)

    assert_close("scan grad", jax.grad(layers)(q), jax.grad(layers_ref)(q), rtol=1e-4, atol=1e-4)


def test_xla_implementation_is_the_reference():
    args, kw = make_inputs(10, t=33, h=32, mask=("causal", "segments"))
    q, k, v = args[:3]
    out = pallas_kernels.dot_product_attention(q, k, v, implementation="xla", **kw)
    assert np.array_equal(np.asarray(out), np.asarray(exact(q, k, v, **kw)))
    # On a machine without a GPU, None picks the reference.
    default = pallas_kernels.dot_product_attention(q, k, v, **kw)
    assert np.array_equal(np.asarray(default), np.asarray(out))


def test_reference_matches_jax_nn():
    args, _ = make_inputs(11, t=50, s=50, n=4, k=2, h=32)
    q, k, v = args[:3]
    lengths = jnp.array([50, 20], jnp.int32)
    for kw in (dict(is_causal=True), dict(local_window_size=(5, 3)),
               dict(key_value_seq_lengths=lengths)):
        ours = reference.dot_product_attention(q, k, v, **kw)
        theirs = jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)
        assert_close(str(kw), ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("trial", range(40))
def test_block_table_covers_visible_blocks(trial):
    """[LO, HI) holds every visible pair; [FULL_LO, FULL_HI) holds only fully visible blocks."""
    rng = np.random.default_rng(trial)
    rows, cols = rng.integers(1, 70, size=2)
    row_block, col_block = 2 ** rng.integers(2, 5, size=2)
    nrb, ncb = -(-rows // row_block), -(-cols // col_block)
    lo = None if rng.random() < 0.4 else -int(rng.integers(0, 30))
    hi = None if rng.random() < 0.4 else int(rng.integers(-20, 30))
    segments = rng.random() < 0.4
    b = 2
    row_len = jnp.asarray(rng.integers(0, rows + 1, size=b), jnp.int32)
    col_len = jnp.asarray(rng.integers(0, cols + 1, size=b), jnp.int32)
    row_seg = jnp.asarray(np.sort(rng.integers(0, 3, size=(b, nrb * row_block))), jnp.int32)
    col_seg = jnp.asarray(np.sort(rng.integers(0, 3, size=(b, ncb * col_block))), jnp.int32)
    table = np.asarray(masking.block_table(
        num_row_blocks=nrb, row_block=row_block, num_col_blocks=ncb, col_block=col_block,
        band=(lo, hi), row_len=row_len, col_len=col_len,
        row_segments=row_seg if segments else None, col_segments=col_seg if segments else None,
    ))
    host_table = masking.block_table(
        num_row_blocks=nrb, row_block=row_block, num_col_blocks=ncb, col_block=col_block,
        band=(lo, hi), row_len=np.asarray(row_len), col_len=np.asarray(col_len),
        row_segments=np.asarray(row_seg) if segments else None,
        col_segments=np.asarray(col_seg) if segments else None, xp=np,
    )
    assert isinstance(host_table, np.ndarray) and np.array_equal(host_table, table)
    mask = np.asarray(masking.dense_mask(
        nrb * row_block, ncb * col_block, band=(lo, hi),
        q_segment_ids=row_seg if segments else None, kv_segment_ids=col_seg if segments else None,
        query_seq_lengths=row_len, key_value_seq_lengths=col_len,
    ))
    mask = np.broadcast_to(mask, (b, *mask.shape[1:]))
    blocks = mask.reshape(b, nrb, row_block, ncb, col_block)
    any_visible = blocks.any(axis=(2, 4))
    all_visible = blocks.all(axis=(2, 4))
    for bi in range(b):
        for r in range(nrb):
            lo_b, hi_b, full_lo, full_hi = table[bi, r, :4]
            assert lo_b <= full_lo <= full_hi <= hi_b
            visible_cols = np.flatnonzero(any_visible[bi, r])
            if visible_cols.size:
                assert lo_b <= visible_cols[0] and visible_cols[-1] < hi_b
            assert all_visible[bi, r, full_lo:full_hi].all()


def test_block_sizes_override_and_validation():
    args, kw = make_inputs(12, t=50, h=32, mask=("causal",))
    q, k, v = args[:3]
    out = pallas_kernels.dot_product_attention(
        q, k, v, implementation="pallas", block_sizes=SMALL, **kw
    )
    assert_close("out", out, exact(q, k, v, **kw), rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="block_q"):
        tuning.KernelBlocks(48, 16, 4, 1)
    with pytest.raises(ValueError, match="at least 16"):
        tuning.KernelBlocks(8, 16, 4, 1)


def test_causal_gqa_groups_of_four_or_more_split_the_dkv_programs_on_hopper():
    def splits(kind, groups, causal):
        return tuning.blocks_for(kind, 128, groups=groups, causal=causal).dkv.head_splits

    assert splits("NVIDIA H200", 8, True) == splits("NVIDIA H100 80GB HBM3", 4, True) == 4
    assert splits("NVIDIA H200", 2, True) == splits("NVIDIA H200", 8, False) == 1
    assert splits("gfx942", 8, True) == 1


@pytest.mark.parametrize("device_kind", ["gfx942", "gfx90a", "AMD Instinct MI300X"])
@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
def test_amd_rows_use_one_stage(device_kind, head_dim):
    # What the rows use of the 64 KiB LDS and the registers is measured by compiling them to
    # gfx942 machine code (test_machine_code.py), no longer estimated here.
    sizes = tuning.blocks_for(device_kind, head_dim)
    assert _device.family(device_kind) == "cdna"
    for kernel in ("forward", "dkv", "dq"):
        assert getattr(sizes, kernel).num_stages == 1


def _bad_calls():
    q = jnp.zeros((2, 8, 4, 16))
    k = jnp.zeros((2, 8, 2, 16))
    seg = jnp.zeros((2, 8), jnp.int32)
    ok = dict(query=q, key=k, value=k)
    return [
        ("rank", dict(ok, query=q[0, 0]), ValueError, "query"),
        ("ranks differ", dict(ok, key=k[0]), ValueError, "rank"),
        ("int dtype", dict(ok, query=q.astype(jnp.int32)), TypeError, "query"),
        ("dtype mismatch", dict(ok, key=k.astype(jnp.bfloat16), value=k.astype(jnp.bfloat16)),
         TypeError, "key"),
        ("kv shapes", dict(ok, value=k[:, :4]), ValueError, "value"),
        ("batch", dict(ok, key=k[:1], value=k[:1]), ValueError, "batch"),
        ("head dim", dict(ok, key=k[..., :8], value=k[..., :8]), ValueError, "head dim"),
        ("heads", dict(ok, key=jnp.zeros((2, 8, 3, 16)), value=jnp.zeros((2, 8, 3, 16))),
         ValueError, "heads"),
        ("one segment array", dict(ok, q_segment_ids=seg), ValueError, "kv_segment_ids"),
        ("segment shape", dict(ok, q_segment_ids=seg[:, :4], kv_segment_ids=seg), ValueError,
         "q_segment_ids"),
        ("segment dtype", dict(ok, q_segment_ids=seg, kv_segment_ids=seg.astype(jnp.float32)),
         TypeError, "kv_segment_ids"),
        ("lengths shape", dict(ok, query_seq_lengths=seg), ValueError, "query_seq_lengths"),
        ("lengths dtype", dict(ok, key_value_seq_lengths=jnp.ones((2,))), TypeError,
         "key_value_seq_lengths"),
        ("negative window", dict(ok, local_window_size=(-1, 2)), ValueError, "local_window_size"),
        ("window type", dict(ok, local_window_size=(1, 2, 3)), TypeError, "local_window_size"),
        ("cap zero", dict(ok, logits_soft_cap=0.0), ValueError, "logits_soft_cap"),
        ("cap negative", dict(ok, logits_soft_cap=-1), ValueError, "logits_soft_cap"),
        ("implementation", dict(ok, implementation="fast"), ValueError, "implementation"),
        ("causal type", dict(ok, is_causal=1), TypeError, "is_causal"),
        ("block sizes", dict(ok, block_sizes=(64, 64)), TypeError, "block_sizes"),
        ("scale type", dict(ok, scale="big"), TypeError, "scale"),
        ("head dim too big", dict(query=jnp.zeros((1, 4, 1, 300)), key=jnp.zeros((1, 4, 1, 300)),
                                  value=jnp.zeros((1, 4, 1, 300)), implementation="pallas"),
         ValueError, "head dim"),
    ]


@pytest.mark.parametrize("name,kwargs,error,needle", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_input_raises_before_tracing(name, kwargs, error, needle, monkeypatch):
    from pallas_kernels.attention import api

    def no_kernel(*args, **kw):
        raise AssertionError("a kernel was traced")

    monkeypatch.setattr(api, "_pallas_attention", no_kernel)
    monkeypatch.setattr(api.reference, "banded_attention", no_kernel)
    with pytest.raises(error, match=needle):
        pallas_kernels.dot_product_attention(**kwargs)
