"""Attention answers right or refuses: masked rows never read, every float and flag checked,
integer ids kept at their width, second-order derivatives on the Pallas path."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import make_inputs
from numerics import rel_error

import pallas_kernels
from pallas_kernels.attention import api

PATHS = {
    "pallas": functools.partial(pallas_kernels.dot_product_attention, implementation="pallas",
                                interpret=True),
    "xla": functools.partial(pallas_kernels.dot_product_attention, implementation="xla"),
}


def _outputs_and_grads(path, q, k, v, dout, **kw):
    def loss(q, k, v):
        out = PATHS[path](q, k, v, **kw)
        return jnp.sum(out * dout), out

    grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return (out, *grads)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_nan_past_the_lengths_is_never_read(causal, path):
    # Stale cache slots and padding may hold anything: keys and values past
    # key_value_seq_lengths and queries past query_seq_lengths, NaN and inf here.
    (q, k, v, dout, _), _ = make_inputs(50, t=45, s=77, n=8, k=2, h=24)
    q_len, kv_len = jnp.array([45, 19]), jnp.array([30, 77 - 13])
    kw = dict(query_seq_lengths=q_len, key_value_seq_lengths=kv_len, is_causal=causal)
    q_pos, kv_pos = jnp.arange(45)[None, :, None, None], jnp.arange(77)[None, :, None, None]
    q_masked = q_pos >= q_len[:, None, None, None]
    kv_masked = kv_pos >= kv_len[:, None, None, None]
    poisoned = (jnp.where(q_masked, jnp.nan, q), jnp.where(kv_masked, jnp.nan, k),
                jnp.where(kv_masked, jnp.inf, v))
    clean = _outputs_and_grads(path, q, k, v, dout, **kw)
    dirty = _outputs_and_grads(path, *poisoned, dout, **kw)
    for what, ours, ref in zip(("out", "dq", "dk", "dv"), dirty, clean, strict=True):
        assert np.all(np.isfinite(np.asarray(ours))), what
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref), err_msg=what)
    out, dq, dk, dv = dirty
    assert not np.any(np.asarray(jnp.where(q_masked, out, 0.0)))
    assert not np.any(np.asarray(jnp.where(q_masked, dq, 0.0)))
    assert not np.any(np.asarray(jnp.where(kv_masked, jnp.abs(dk) + jnp.abs(dv), 0.0)))


def _bad_values():
    q = jnp.zeros((2, 8, 4, 16))
    ok = dict(query=q, key=q, value=q)
    return [
        ("scale nan", dict(ok, scale=math.nan), ValueError, "scale"),
        ("scale inf", dict(ok, scale=math.inf), ValueError, "scale"),
        ("scale zero", dict(ok, scale=0.0), ValueError, "scale"),
        ("scale negative", dict(ok, scale=-0.5), ValueError, "scale"),
        ("scale bool", dict(ok, scale=True), TypeError, "scale"),
        ("cap inf", dict(ok, logits_soft_cap=math.inf), ValueError, "logits_soft_cap"),
        ("cap nan", dict(ok, logits_soft_cap=math.nan), ValueError, "logits_soft_cap"),
        ("cap bool", dict(ok, logits_soft_cap=True), TypeError, "logits_soft_cap"),
        ("window bool", dict(ok, local_window_size=True), TypeError, "local_window_size"),
        ("return_residual int", dict(ok, return_residual=1), TypeError, "return_residual"),
        ("interpret str", dict(ok, interpret="yes"), TypeError, "interpret"),
    ]


@pytest.mark.parametrize("name,kwargs,error,needle", _bad_values(),
                         ids=[c[0] for c in _bad_values()])
def test_bad_values_raise_before_tracing(name, kwargs, error, needle, monkeypatch):
    monkeypatch.setattr(api, "_pallas_attention", lambda *a, **k: pytest.fail("traced"))
    monkeypatch.setattr(api.reference, "banded_attention", lambda *a, **k: pytest.fail("traced"))
    with pytest.raises(error, match=needle):
        pallas_kernels.dot_product_attention(**kwargs)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_huge_windows_and_numpy_flags_work(path):
    (q, k, v, _, _), _ = make_inputs(51, t=20, n=2, h=16)
    plain = PATHS[path](q, k, v, is_causal=True)
    huge = PATHS[path](q, k, v, is_causal=np.bool_(True), local_window_size=2**31)
    wide = PATHS[path](q, k, v, is_causal=True, local_window_size=(2**40, np.int64(3)))
    np.testing.assert_array_equal(np.asarray(huge), np.asarray(plain))
    np.testing.assert_array_equal(np.asarray(wide), np.asarray(plain))


def test_int64_ids_and_lengths_keep_their_width():
    with jax.enable_x64(True):
        (q, k, v, _, _), _ = make_inputs(52, t=16, n=2, h=16)
        half = np.arange(16) >= 8
        narrow = jnp.asarray(np.stack([half, half]), jnp.int32)
        wide = jnp.asarray(np.stack([half * 2**32, half * 2**32]), jnp.int64)  # 0 when cast
        long_len = jnp.array([2**32 + 3, 5], jnp.int64)  # 3 when cast: clipped to 16 instead
        for path in PATHS:
            ours = PATHS[path](q, k, v, q_segment_ids=wide, kv_segment_ids=wide,
                               key_value_seq_lengths=long_len)
            ref = PATHS[path](q, k, v, q_segment_ids=narrow, kv_segment_ids=narrow,
                              key_value_seq_lengths=jnp.array([16, 5]))
            np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref), err_msg=path)


def test_grad_of_grad_with_a_packed_mask_matches_the_reference():
    """Second order through a user's (B, N, T, S) mask, which the kernels read 8 keys a byte:
    the tangents' reference unpacks it."""
    (q, k, v, _, _), _ = make_inputs(54, b=1, t=11, n=2, k=1, h=4)
    mask = jnp.asarray(np.random.default_rng(54).random((1, 2, 11, 11)) < 0.6) | jnp.eye(11,
                                                                                       dtype=bool)

    def grad_norm(path, q, k):
        grads = jax.grad(lambda q, k: jnp.sum(jnp.sin(PATHS[path](q, k, v, mask=mask))),
                         argnums=(0, 1))(q, k)
        return sum(jnp.sum(g**2) for g in grads)

    results = {path: jax.jit(jax.grad(functools.partial(grad_norm, path), argnums=(0, 1)))(q, k)
               for path in PATHS}
    for ours, ref in zip(results["pallas"], results["xla"], strict=True):
        assert np.all(np.isfinite(np.asarray(ours)))
        assert rel_error(ours, ref) < 1e-4


def test_grad_of_grad_and_hessian_match_the_reference():
    (q, k, v, _, _), _ = make_inputs(53, b=1, t=6, n=2, k=1, h=4)

    def loss(path, q, k):
        out, lse = PATHS[path](q, k, v, is_causal=True, logits_soft_cap=3.0,
                               return_residual=True)
        return jnp.sum(jnp.sin(out)) + jnp.sum(lse**2)

    def grad_norm(path, q, k):
        grads = jax.grad(functools.partial(loss, path), argnums=(0, 1))(q, k)
        return sum(jnp.sum(g**2) for g in grads)

    results = {path: jax.jit(lambda q, k, path=path: (  # eager: several times slower
        jax.grad(functools.partial(grad_norm, path), argnums=(0, 1))(q, k),
        jax.hessian(functools.partial(loss, path), argnums=1)(q, k)))(q, k) for path in PATHS}
    for ours, ref in zip(jax.tree.leaves(results["pallas"]), jax.tree.leaves(results["xla"]),
                         strict=True):
        assert np.all(np.isfinite(np.asarray(ours)))
        assert rel_error(ours, ref) < 1e-4
