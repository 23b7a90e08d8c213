"""Flax attention layers on the kernels: parity with flax's own attention and decode == forward."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

import pallas_kernels
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
        _close(ours.apply(params, x, mask=causal), stock.apply(params, x, mask=causal))
    assert not _fallback_warnings(caught)  # the mask runs in the kernels


def test_decode_past_the_cache_is_a_value_error_eagerly():
    layer = _layer("xla", is_causal=True)
    layer.init_cache((2, 16, 32))
    x = jax.random.normal(jax.random.key(5), (2, 17, 32))
    with pytest.raises(ValueError, match="KV cache holds 16 positions; 17 new tokens do not fit"):
        layer(x, decode=True)  # a prompt longer than the cache
    layer(x[:, :13], decode=True)
    keys = layer.cache.keys[...]
    with pytest.raises(ValueError, match="16 positions; 13 are filled and 4 new tokens do not"):
        layer(x[:, 13:17], decode=True)
    with pytest.raises(ValueError, match="batch 3 does not match the KV cache's batch 2"):
        layer(jnp.ones((3, 1, 32)), decode=True)
    assert layer.cache.lengths[...].tolist() == [13, 13]
    assert np.array_equal(layer.cache.keys[...], keys)


def test_decode_past_the_cache_under_jit_gives_nan_and_keeps_the_cache():
    layer = _layer("xla", is_causal=True)
    layer.init_cache((2, 16, 32), page_size=16)
    step = nnx.jit(lambda layer, x: layer(x, decode=True))
    x = jax.random.normal(jax.random.key(6), (2, 5, 32))
    for _ in range(3):  # 15 of the 16 positions filled
        assert np.isfinite(step(layer, x)).all()
    keys, values = layer.cache.keys[...], layer.cache.values[...]
    assert np.isnan(step(layer, x)).all()  # 15 + 5 > 16
    assert np.array_equal(layer.cache.keys[...], keys)
    assert np.array_equal(layer.cache.values[...], values)
    assert layer.cache.lengths[...].tolist() == [20, 20]
    assert np.isnan(step(layer, x[:, :1])).all()  # every later step is NaN too


@pytest.mark.parametrize("option", [dict(logits_soft_cap=0.0), dict(logits_soft_cap=-1.0),
                                    dict(logits_soft_cap=float("nan")),
                                    dict(local_window_size=-1), dict(local_window_size=(3, -2)),
                                    dict(local_window_size=2.5)])
def test_decode_and_forward_reject_the_same_options(option):
    q = jnp.ones((1, 4, 4, 8))
    with pytest.raises((ValueError, TypeError)) as forward_error:
        pallas_kernels.dot_product_attention(q, q, q, **option)
    with pytest.raises(type(forward_error.value)) as layer_error:
        _layer("xla", **option)  # checked at construction, before either path runs
    assert str(layer_error.value) == str(forward_error.value)


def test_window_is_stored_normalised():
    assert _layer("xla", local_window_size=3).local_window_size == (3, 3)


def test_decode_takes_self_attention_only():
    layer = _layer("xla")
    layer.init_cache((1, 4, 32))
    x = jnp.ones((1, 1, 32))
    with pytest.raises(ValueError, match="inputs_kv"):
        layer(x, x, decode=True)
    with pytest.raises(ValueError, match="q_segment_ids"):
        layer(x, q_segment_ids=jnp.zeros((1, 1), jnp.int32),
              kv_segment_ids=jnp.zeros((1, 1), jnp.int32), decode=True)


@pytest.mark.parametrize("kwargs, error, needle", [
    (dict(num_heads=0), ValueError, "num_heads must be a positive int, got 0"),
    (dict(num_kv_heads=0), ValueError, "num_kv_heads must be a positive int, got 0"),
    (dict(in_features=0), ValueError, "in_features must be a positive int, got 0"),
    (dict(qkv_features=0), ValueError, "qkv_features must be a positive int, got 0"),
    (dict(out_features=0), ValueError, "out_features must be a positive int, got 0"),
    (dict(num_heads=4.0), TypeError, "num_heads must be an int, got 4.0"),
    (dict(num_heads=True), TypeError, "num_heads must be an int, got True"),
    (dict(num_kv_heads=3), ValueError, r"num_heads \(4\) must be divisible by num_kv_heads \(3\)"),
    (dict(num_heads=3), ValueError, r"qkv_features \(32\) must be divisible by num_heads \(3\)"),
    (dict(qkv_features=20, rope_theta=1e4), ValueError, "even head dim, got 5"),
    (dict(rope_theta=0.0), ValueError, "rope_theta must be a finite number > 0"),
    (dict(rope_theta=float("inf")), ValueError, "rope_theta must be a finite number > 0"),
    (dict(is_causal=1), TypeError, "is_causal must be a bool, got 1"),
    (dict(use_bias="no"), TypeError, "use_bias must be a bool"),
    (dict(dtype=jnp.int32), TypeError, "dtype must be a floating dtype"),
    (dict(implementation="cuda"), ValueError, "implementation must be one of"),
    (dict(in_kv_features=0), ValueError, "in_kv_features must be a positive int, got 0"),
    (dict(scale=0.0), ValueError, "scale must be a finite number > 0"),
    (dict(scale="1"), TypeError, "scale must be a number"),
    (dict(precision="fast"), ValueError, "precision must be None, a jax.lax.Precision"),
    (dict(kernel_init=0.02), TypeError, "kernel_init must be callable"),
    (dict(out_bias_init=1), TypeError, "out_bias_init must be callable"),
    (dict(bias_metadata=["x"]), TypeError, "bias_metadata must be a mapping"),
    (dict(decode=None), TypeError, "decode must be a bool"),
])
def test_bad_configuration(kwargs, error, needle):
    kwargs = dict(num_heads=4, in_features=32) | kwargs
    with pytest.raises(error, match=needle):
        FlashMultiHeadAttention(**kwargs, rngs=nnx.Rngs(0))


def test_decode_needs_a_cache_and_self_attention():
    layer = FlashMultiHeadAttention(4, 32, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="init_cache"):
        layer(jnp.ones((1, 1, 32)), decode=True)
    cross = FlashMultiHeadAttention(4, 32, in_kv_features=16, is_causal=True, rngs=nnx.Rngs(0))
    cross.init_cache((1, 4, 32))
    with pytest.raises(ValueError, match=r"in_kv_features \(16\) == in_features \(32\)"):
        cross(jnp.ones((1, 1, 32)), decode=True)


def _normal(seed, shape):
    """Standard normal float32 inputs from numpy (no XLA compile per shape)."""
    return np.random.default_rng(seed).standard_normal(shape, np.float32)


def _fallback_warnings(caught):
    return [str(w.message) for w in caught if "flash_attention_fn" in str(w.message)]


def test_flash_attention_fn_runs_nnx_decode_on_the_kernels(monkeypatch):
    """nnx's decode mask (the filled part of the cache) runs in the kernels, eager or under jit,
    with no fallback."""
    monkeypatch.setattr(flax_attention, "_WARNED", set())
    x = _normal(7, (2, 5, 16))
    make = lambda fn: nnx.MultiHeadAttention(  # noqa: E731
        4, 16, num_kv_heads=2, attention_fn=fn, decode=True, rngs=nnx.Rngs(0))
    stock, ours = make(nnx.dot_product_attention), make(flash_attention_fn)
    for layer in (stock, ours):
        layer.init_cache((2, 8, 16))
    step = nnx.jit(lambda layer, token: layer(token))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _close(ours(x[:, :1]), stock(x[:, :1]))
        for t in range(1, 5):
            _close(step(ours, x[:, t:t + 1]), step(stock, x[:, t:t + 1]))
    assert not _fallback_warnings(caught)


def test_flash_attention_fn_runs_masks_and_biases_in_the_kernels(monkeypatch):
    """Any mask and bias under jit, with no fallback; only dropout falls back."""
    monkeypatch.setattr(flax_attention, "_WARNED", set())
    q, k, v = _normal(8, (3, 2, 6, 4, 8))
    attend = jax.jit(flash_attention_fn)
    mask = np.arange(6) < np.array([3, 6])[:, None, None, None]  # (2, 1, 1, 6)
    mask[0, ..., 1] = False  # a hole
    bias = _normal(9, (1, 4, 6, 6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _close(attend(q, k, v, bias, mask),
               nnx.dot_product_attention(q, k, v, bias=bias, mask=mask))
        assert not _fallback_warnings(caught)
        flash_attention_fn(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(0))
    assert any("dropout" in m for m in _fallback_warnings(caught))


def test_flash_attention_fn_takes_rope_and_input_positions():
    q, k, v = _normal(9, (3, 2, 6, 4, 8))
    positions = np.array([[3, 4, 5, 6, 7, 8], [0, 1, 2, 0, 1, 2]])
    rope = nnx.RoPE(theta=500.0)
    with_rope = functools.partial(flash_attention_fn, rope=rope)

    @jax.jit
    def pairs(q, k, v, positions):  # (ours, expected): at the default positions, at positions
        rotated = (flax_attention.rotary_embedding(x, positions, 500.0) for x in (q, k))
        return ((with_rope(q, k, v, is_causal=True),
                 nnx.dot_product_attention_with_rope(q, k, v, rope=rope, is_causal=True)),
                (with_rope(q, k, v, input_positions=positions), flash_attention_fn(*rotated, v)))

    for ours, expected in pairs(q, k, v, positions):
        _close(ours, expected)
    layer = nnx.MultiHeadAttention(4, 16, attention_fn=with_rope, decode=False, rngs=nnx.Rngs(0))
    x = jax.ShapeDtypeStruct((2, 6, 16), jnp.float32)
    assert jax.eval_shape(lambda x: layer(x, input_positions=positions), x).shape == x.shape
    with pytest.raises(ValueError, match="input_positions"):
        flash_attention_fn(q, k, v, input_positions=positions)


def test_layer_takes_nnx_constructor_arguments():
    """Cross-attention with nnx's projections, inits and biases; `scale` s equals nnx's
    1/sqrt(H) with the query projection multiplied by s sqrt(H)."""
    xq, xkv = _normal(11, (2, 7, 12)), _normal(12, (2, 5, 20))
    kw = dict(bias_init=nnx.initializers.normal(0.1), out_kernel_init=nnx.initializers.ones,
              rngs=nnx.Rngs(0))
    stock = nnx.MultiHeadAttention(4, 12, 32, 24, 2, 20, decode=False, **kw)
    ours = FlashMultiHeadAttention(4, 12, 32, 24, 2, 20, scale=0.5, precision="highest",
                                   kernel_metadata={"note": "q"}, implementation="xla", **kw)
    assert ours.query.precision == "highest"
    assert ours.query.kernel.get_metadata()["note"] == "q"
    assert ours.out.kernel.get_metadata()["out_sharding"] == ("heads", "head_dim", "embed")
    _close(ours.out.kernel[...], 1.0)
    params = nnx.state(ours, nnx.Param)  # the same tree: take nnx's values
    nnx.replace_by_pure_dict(params, nnx.to_pure_dict(nnx.state(stock, nnx.Param)))
    nnx.update(ours, params)
    for name in ("kernel", "bias"):
        getattr(stock.query, name)[...] *= 0.5 * 8**0.5
    _close(*nnx.jit(lambda a, b: (a(xq, xkv), b(xq, xkv)))(ours, stock), 1e-5)


def test_decode_is_settable_with_nnx_view():
    x = _normal(13, (2, 3, 32))
    layer = _layer("xla", is_causal=True)
    assert nnx.view(layer, decode=True).decode and not layer.decode
    decoder = nnx.view(layer, decode=True, batch_size=2, max_length=16)
    _close(decoder(x), layer(x))
    assert decoder.cache.lengths[...].tolist() == [3, 3]
    with pytest.raises(ValueError, match="batch_size and max_length"):
        nnx.view(layer, batch_size=2)
