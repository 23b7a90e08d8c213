"""Flax attention layers on the kernels: parity with flax's own attention and decode == forward."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

from flax_layers import FlashMultiHeadAttention, flash_attention_fn
from flax_layers import attention as flax_attention


def _close(x, y, tol=2e-5):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def _layer(implementation, **kw):
    return FlashMultiHeadAttention(4, 32, num_kv_heads=2, implementation=implementation,
                                   rngs=nnx.Rngs(0), **kw)


@pytest.mark.parametrize("options", [
    dict(is_causal=True, rope_theta=10000.0),
    dict(local_window_size=(5, 0), logits_soft_cap=5.0, use_bias=True),
])
def test_pallas_and_xla_layers_agree_with_gradients(options):
    x = jax.random.normal(jax.random.key(1), (2, 21, 32))
    segments = jnp.array([[0] * 10 + [1] * 11, [0] * 21])

    def loss(layer):
        y = layer(x, q_segment_ids=segments, kv_segment_ids=segments)
        return jnp.sum(jnp.sin(y)), y

    outs, grads = [], []
    for implementation in ("pallas", "xla"):
        (_, y), g = nnx.value_and_grad(loss, has_aux=True)(_layer(implementation, **options))
        outs.append(y)
        grads.append(jax.tree.leaves(nnx.state(g, nnx.Param)))
    _close(*outs)
    for a, b in zip(*grads, strict=True):
        _close(a, b, 1e-4)


@pytest.mark.parametrize("options", [
    dict(is_causal=True, rope_theta=10000.0),
    dict(is_causal=True, local_window_size=(3, 0), logits_soft_cap=4.0),
])
def test_decode_token_by_token_equals_forward(options):
    x = jax.random.normal(jax.random.key(2), (2, 12, 32))
    layer = _layer("xla", **options)
    full = layer(x)
    layer.init_cache((2, 16, 32))
    prefill = layer(x[:, :5], decode=True)  # prefill 5 tokens, then one at a time
    steps = [layer(x[:, t:t + 1], decode=True) for t in range(5, 12)]
    _close(jnp.concatenate([prefill, *steps], axis=1), full)


def test_flash_attention_fn_in_stock_nnx_attention():
    x = jax.random.normal(jax.random.key(3), (2, 9, 16))
    make = lambda fn: nnx.MultiHeadAttention(  # noqa: E731
        4, 16, attention_fn=fn, decode=False, rngs=nnx.Rngs(0))
    stock, ours = make(nnx.dot_product_attention), make(flash_attention_fn)
    _close(ours(x), stock(x))
    _close(ours(x, is_causal=True), stock(x, is_causal=True))
    causal = nnx.make_causal_mask(jnp.ones((2, 9)))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        _close(ours(x, mask=causal), stock(x, mask=causal))


def test_flash_attention_fn_in_linen_attention(monkeypatch):
    monkeypatch.setattr(flax_attention, "_WARNED", set())
    x = jax.random.normal(jax.random.key(4), (2, 9, 16))
    stock = linen.MultiHeadDotProductAttention(num_heads=4, qkv_features=16)
    ours = linen.MultiHeadDotProductAttention(num_heads=4, qkv_features=16,
                                              attention_fn=flash_attention_fn)
    params = stock.init(jax.random.key(0), x)
    _close(ours.apply(params, x), stock.apply(params, x))
    causal = linen.make_causal_mask(jnp.ones((2, 9)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            _close(ours.apply(params, x, mask=causal), stock.apply(params, x, mask=causal))
    assert sum("dense mask" in str(w.message) for w in caught) == 1  # once, with the reason


def test_bad_configuration():
    with pytest.raises(ValueError, match="num_kv_heads"):
        FlashMultiHeadAttention(4, 32, num_kv_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_heads"):
        FlashMultiHeadAttention(3, 32, rngs=nnx.Rngs(0))
    layer = FlashMultiHeadAttention(4, 32, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="init_cache"):
        layer(jnp.ones((1, 1, 32)), decode=True)
