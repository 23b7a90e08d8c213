"""`dot_product_attention` as a drop-in for `jax.nn.dot_product_attention`: the same calls, by
position and by name, with masks, biases, lengths, GQA and windows; the kernels (interpret mode)
against jax.nn's own XLA attention in float32, outputs and every gradient, the bias's too."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels.attention import api, masking, tuning

B, T, S, N, H = 2, 40, 48, 4, 16

SMALL = tuning.AttentionBlocks(  # the dK/dV kernel splits GQA groups across two programs
    tuning.KernelBlocks(16, 16, 4, 1),
    tuning.KernelBlocks(16, 16, 4, 1, head_splits=2),
    tuning.KernelBlocks(16, 16, 4, 1),
)


def _inputs(seed, k_heads=N, t=T, s=S):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], (B, t, N, H)),
            jax.random.normal(keys[1], (B, s, k_heads, H)),
            jax.random.normal(keys[2], (B, s, k_heads, H)))


def _mask(seed, shape, t=T, s=S):
    """A random boolean mask of `shape` (broadcastable to (B, N, T, S)) whose diagonal is
    visible, so every query sees a key (jax.nn and this package differ on rows that see none)."""
    keep = np.random.default_rng(seed).random(shape) < 0.7
    if shape[-2] == t and shape[-1] == s:
        keep |= np.eye(t, s, dtype=bool)
    elif shape[-1] == s:
        keep[..., 0] = True
    return jnp.asarray(keep)


def _bias(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


# (id, positional bias and mask (None: absent), jax.nn keywords, our extra keywords)
CASES = [
    ("bias and mask BNTS", (_bias(5, (B, N, T, S)), _mask(1, (B, N, T, S))), {}),
    ("mask 11TS causal window", (None, _mask(3, (1, 1, T, S))),
     dict(is_causal=True, local_window_size=(9, 0))),
    ("key mask B11S lengths gqa", (None, _mask(4, (B, 1, 1, S))),
     dict(query_seq_lengths=jnp.array([T, 25]), key_value_seq_lengths=jnp.array([S, 30]))),
    ("bias 1N1S mask B1TS mqa causal", (_bias(6, (1, N, 1, S)), _mask(7, (B, 1, T, S))),
     dict(is_causal=True)),
    ("bias NTS unbatched", (_bias(8, (N, T, S)), None), dict(scale=0.3)),
]
GQA = {"key mask B11S lengths gqa": 2, "bias 1N1S mask B1TS mqa causal": 1}


def _grads(attention, q, k, v, bias, mask, kw):
    """out and the gradients of a fixed random projection of it, for q, k, v (and the bias)."""
    weights = jax.random.normal(jax.random.key(9), q.shape)

    def loss(q, k, v, bias):
        out = attention(q, k, v, bias, mask, **kw)
        return jnp.sum(out * weights[..., :out.shape[-1]]), out

    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(q, k, v, bias)
    return out, grads


def _jax_nn(q, k, v, bias, mask, **kw):
    return jax.nn.dot_product_attention(q, k, v, bias, mask, implementation="xla", **kw)


def _ours(q, k, v, bias, mask, **kw):
    return pallas_kernels.dot_product_attention(q, k, v, bias, mask, implementation="pallas",
                                                block_sizes=SMALL, **kw)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernels_match_jax_nn(case):
    name, (bias, mask), kw = case
    q, k, v = _inputs(len(name), GQA.get(name, N))
    if "unbatched" in name:
        q, k, v = q[0], k[0], v[0]
    ours = _grads(_ours, q, k, v, bias, mask, kw)
    theirs = _grads(_jax_nn, q, k, v, bias, mask, kw)
    rows = slice(None)
    if "query_seq_lengths" in kw:  # jax.nn leaves rows past the length unmasked; ours are 0
        valid = jnp.arange(T)[None, :] < kw["query_seq_lengths"][:, None]
        rows = np.asarray(valid)
    for label, x, ref in zip(("out", "dq", "dk", "dv", "dbias"), (ours[0], *ours[1]),
                             (theirs[0], *theirs[1]), strict=False):
        x, ref = np.asarray(x), np.asarray(ref)
        if label in ("out", "dq"):
            x, ref = x[rows], ref[rows]
        np.testing.assert_allclose(x, ref, rtol=2e-5, atol=2e-5, err_msg=f"{name}: {label}")


def test_a_bias_shared_by_the_batch_rows_gets_their_summed_gradient():
    """A (1, N, T, S) bias over 3 rows, with each row's own mask, key length and segments and a
    soft cap: the kernel sums its gradient over the rows (no (B, N, T, S) buffer), against the
    reference's. Keys and values past the lengths hold NaN and inf."""
    q, k, v = (jnp.concatenate([x, x[:1] * 0.5], axis=0) for x in _inputs(15, k_heads=2))
    kv_len = jnp.array([S, 30, 21])
    past = (jnp.arange(S)[None, :] >= kv_len[:, None])[..., None, None]
    k, v = jnp.where(past, jnp.nan, k), jnp.where(past, jnp.inf, v)
    bias, mask = _bias(16, (1, N, T, S)), _mask(17, (3, 1, T, S))
    segments = jnp.asarray(np.repeat([[0] * 30 + [1] * 18], 3, axis=0), jnp.int32)
    kw = dict(is_causal=True, logits_soft_cap=4.0, key_value_seq_lengths=kv_len,
              q_segment_ids=segments[:, :T], kv_segment_ids=segments)

    def call(implementation, **extra):
        def attention(q, k, v, bias, mask, **kw):
            return pallas_kernels.dot_product_attention(
                q, k, v, bias, mask, implementation=implementation, **extra, **kw)
        return _grads(attention, q, k, v, bias, mask, kw)

    ours, reference = call("pallas", block_sizes=SMALL), call("xla")
    for label, x, ref in zip(("out", "dq", "dk", "dv", "dbias"), (ours[0], *ours[1]),
                             (reference[0], *reference[1]), strict=True):
        x, ref = np.asarray(x), np.asarray(ref)
        if label in ("dk", "dv"):
            x, ref = x[~past[..., 0, 0]], ref[~past[..., 0, 0]]
        assert np.all(np.isfinite(x)), label
        np.testing.assert_allclose(x, ref, rtol=2e-5, atol=2e-5, err_msg=label)


def test_positional_and_keyword_calls_agree():
    """jax.nn's call forms: bias and mask by position or by name, keywords in any order."""
    q, k, v = _inputs(0)
    bias, mask = _bias(1, (1, N, T, S)), _mask(2, (B, 1, T, S))
    forms = [
        pallas_kernels.dot_product_attention(q, k, v, bias, mask, scale=0.2, is_causal=True),
        pallas_kernels.dot_product_attention(query=q, key=k, value=v, mask=mask, bias=bias,
                                             is_causal=np.bool_(True), scale=jnp.float32(0.2)),
        pallas_kernels.dot_product_attention(q, k, v, bias, mask, scale=np.array([0.2]),
                                             is_causal=True),
        jax.nn.dot_product_attention(q, k, v, bias, mask, scale=0.2, is_causal=True),
    ]
    for form in forms[1:]:
        np.testing.assert_allclose(np.asarray(form), np.asarray(forms[0]), rtol=1e-5,
                                   atol=1e-5)


def test_reference_takes_the_mask_and_bias():
    from pallas_kernels.attention import reference

    q, k, v = _inputs(10)
    bias, mask = _bias(11, (B, N, T, S)), _mask(12, (B, 1, T, S))
    np.testing.assert_allclose(np.asarray(reference.dot_product_attention(q, k, v, bias, mask)),
                               np.asarray(_jax_nn(q, k, v, bias, mask)), rtol=2e-5, atol=2e-5)


def test_unbatched_call_takes_a_mask_with_a_batch_of_one():
    q, k, v = (x[0] for x in _inputs(13))
    mask = _mask(14, (1, N, T, S))
    np.testing.assert_allclose(np.asarray(_ours(q, k, v, None, mask)),
                               np.asarray(_jax_nn(q, k, v, None, mask)), rtol=2e-5, atol=2e-5)


def test_several_batch_dims_and_unbatched_lengths():
    q, k, v = _inputs(3)
    lead = (2, 1)
    q5, k5, v5 = (x[:, None].reshape(*lead, *x.shape[1:]) for x in (q, k, v))
    kv_len = jnp.array([[S], [20]])
    out = pallas_kernels.dot_product_attention(q5, k5, v5, key_value_seq_lengths=kv_len)
    flat = pallas_kernels.dot_product_attention(q, k, v, key_value_seq_lengths=kv_len[:, 0])
    assert out.shape == (*lead, T, N, H)
    np.testing.assert_allclose(np.asarray(out).reshape(flat.shape), np.asarray(flat), atol=1e-6)
    single = pallas_kernels.dot_product_attention(q[1], k[1], v[1],
                                                  key_value_seq_lengths=jnp.int32(20))
    np.testing.assert_allclose(np.asarray(single), np.asarray(flat[1]), atol=1e-6)


def test_mask_equal_to_causal_visits_the_causal_blocks():
    """The block tables built from a causal mask skip and leave unmasked the same blocks as
    is_causal=True."""
    q, k, _ = _inputs(0, t=128, s=128)
    causal = masking.pack_mask(jnp.tril(jnp.ones((128, 128), bool))[None, None], 128, 128)
    for kernel in ("forward", "dq", "dkv"):
        tables = []
        for is_causal, mask in ((True, None), (False, causal)):
            config = api._configure(q, k, False, None, None, None, SMALL, scale=1.0,
                                    band=masking.band(is_causal, None), logits_soft_cap=None,
                                    interpret=True, has_mask=mask is not None)
            tables.append(np.asarray(api._tables(config, 128, 128, None, None, None, None, None,
                                                 mask, kernel))[..., :4])
        np.testing.assert_array_equal(tables[1], np.broadcast_to(tables[0], tables[1].shape),
                                      err_msg=kernel)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "int8"])
@pytest.mark.parametrize("shape", [(B, N, T, S), (B, 1, 1, S), (1, N, T, 1), (1, 1, 1, 1)])
def test_a_packed_mask_holds_the_mask_and_its_blocks(shape, packed):
    """`masking.pack_mask` keeps every key's bit (8 a byte where the mask has keys, or one int8
    entry a pair), pads with False, and its blocks' any / all are those of the boolean mask, in
    both orientations."""
    t_pad, s_pad, rows, cols = 48, 64, 16, 32
    shape = (*shape[:3], 37 if shape[3] > 1 else 1)  # keys that end inside a byte
    mask = _mask(15, shape, s=37)
    stored = masking.pack_mask(mask, t_pad, s_pad, packed=packed)
    assert masking.is_packed(stored) == (packed and shape[3] > 1)
    padded = np.zeros((*shape[:2], t_pad if shape[2] > 1 else 1, s_pad if shape[3] > 1 else 1),
                      bool)
    padded[..., :shape[2], :shape[3]] = np.asarray(mask)
    np.testing.assert_array_equal(np.asarray(masking.unpack_mask(stored)), padded)
    full = np.broadcast_to(padded, (*shape[:2], t_pad, s_pad)).reshape(
        shape[0], shape[1], t_pad // rows, rows, s_pad // cols, cols)
    for transpose in (False, True):
        blocks = dict(num_row_blocks=t_pad // rows, row_block=rows, num_col_blocks=s_pad // cols,
                      col_block=cols)
        want = (full.any(axis=(1, 3, 5)), full.all(axis=(1, 3, 5)))
        if transpose:
            blocks = dict(num_row_blocks=s_pad // cols, row_block=cols,
                          num_col_blocks=t_pad // rows, col_block=rows)
            want = tuple(np.swapaxes(w, 1, 2) for w in want)
        got = masking.pair_blocks(stored, transpose=transpose, **blocks)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"transpose={transpose}")


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "int8 as on cdna"])
def test_kernels_read_either_form_of_a_mask_with_ragged_keys(monkeypatch, packed):
    """A (B, N, T, S) mask and bias at S = 37 (keys ending inside a byte), the kernels reading
    the mask packed or one int8 entry a pair (`tuning.packs_masks`, False on gfx942)."""
    forms = []
    pack = masking.pack_mask

    def spy(*args, **kw):
        forms.append(kw["packed"])
        return pack(*args, **kw)

    monkeypatch.setattr(tuning, "packs_masks", lambda device_kind: packed)
    monkeypatch.setattr(masking, "pack_mask", spy)
    q, k, v = _inputs(16, s=37)
    bias, mask = _bias(17, (B, N, T, 37)), _mask(18, (B, N, T, 37), s=37)
    for x, ref in zip(_grads(_ours, q, k, v, bias, mask, {}),
                      _grads(_jax_nn, q, k, v, bias, mask, {}), strict=True):
        for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)
    assert forms and set(forms) == {packed}


def test_traced_mask_and_bias_under_jit():
    q, k, v = _inputs(4)
    bias, mask = _bias(5, (B, N, T, S)), _mask(6, (B, N, T, S))
    step = jax.jit(lambda q, bias, mask: _ours(q, k, v, bias, mask))
    np.testing.assert_allclose(np.asarray(step(q, bias, mask)),
                               np.asarray(_jax_nn(q, k, v, bias, mask)), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name,kwargs,error,needle", [
    ("mask dtype", dict(mask=jnp.ones((T, S))), TypeError, "mask"),
    ("mask shape", dict(mask=jnp.ones((3, T, S), bool)), ValueError, "mask"),
    ("bias dtype", dict(bias=jnp.ones((T, S), jnp.int32)), TypeError, "bias"),
    ("bias rank", dict(bias=jnp.ones((1, 1, 1, T, S))), ValueError, "bias"),
    ("traced scale", dict(scale="traced"), TypeError, "scale"),
    ("cudnn with segments", dict(implementation="cudnn", q_segment_ids=jnp.zeros((B, T), int),
                                 kv_segment_ids=jnp.zeros((B, S), int)), ValueError,
     "q_segment_ids, kv_segment_ids"),
    ("cudnn with ring", dict(implementation="cudnn", context_parallelism="ring"), ValueError,
     "context_parallelism"),
    ("implementation", dict(implementation="fast"), ValueError, "implementation"),
])
def test_bad_arguments_name_themselves(name, kwargs, error, needle):
    q, k, v = _inputs(0)
    if kwargs.get("scale") == "traced":
        with pytest.raises(error, match=needle):
            jax.jit(lambda s: pallas_kernels.dot_product_attention(q, k, v, scale=s))(0.5)
        return
    with pytest.raises(error, match=needle):
        pallas_kernels.dot_product_attention(q, k, v, **kwargs)
