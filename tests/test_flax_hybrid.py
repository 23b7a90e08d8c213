"""HybridLM: decode == forward, kernels vs reference, training, Linen wrappers, configuration."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from flax_layers import HybridLM, HybridLMConfig
from flax_layers import linen as linen_layers

SMALL = dict(d_model=32, num_layers=2, shared_every=2, num_heads=2, num_kv_heads=1,
             head_dim=16, mlp_hidden=64, d_state=16, headdim=16, chunk_size=16)


def _close(x, y, tol=2e-5):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def test_prefill_then_decode_equals_forward():
    model = HybridLM(HybridLMConfig.preset("tiny", implementation="xla"), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (2, 14), 0, 256)
    full = model(tokens)
    model.init_cache(2, 16)
    prefill = model(tokens[:, :6], decode=True)
    steps = [model(tokens[:, t:t + 1], decode=True) for t in range(6, 14)]
    _close(jnp.concatenate([prefill, *steps], axis=1), full, 1e-4)


def test_pallas_and_xla_agree_with_gradients():
    tokens = jax.random.randint(jax.random.key(1), (2, 20), 0, 256)
    segments = jnp.array([[0] * 8 + [1] * 12, [0] * 20], jnp.int32)

    def loss(model):
        logits = model(tokens, segment_ids=segments)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean(), logits

    outs, grads = [], []
    for implementation in ("pallas", "xla"):
        model = HybridLM(HybridLMConfig(**SMALL, implementation=implementation),
                         rngs=nnx.Rngs(0))
        (_, logits), g = nnx.value_and_grad(loss, has_aux=True)(model)
        outs.append(logits)
        grads.append(jax.tree.leaves(nnx.state(g, nnx.Param)))
    _close(*outs, 1e-4)
    for a, b in zip(*grads, strict=True):
        _close(a, b, 1e-4)


def test_jit_train_step_lowers_the_loss():
    model = HybridLM(HybridLMConfig.preset("tiny", implementation="xla"), rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    tokens = jax.random.randint(jax.random.key(2), (4, 33), 0, 32)

    @nnx.jit
    def train_step(model, optimizer, tokens):
        def loss_fn(model):
            logits = model(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(train_step(model, optimizer, tokens)) for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]


def test_generate_is_deterministic_at_temperature_zero():
    model = HybridLM(HybridLMConfig(**SMALL, implementation="xla"), rngs=nnx.Rngs(0))
    prompt = jnp.array([[1, 2, 3], [4, 5, 6]], jnp.int32)
    first = model.generate(prompt, 4, temperature=0.0, rng=jax.random.key(0))
    second = model.generate(prompt, 4, temperature=0.0, rng=jax.random.key(9))
    assert first.shape == (2, 4) and first.dtype == jnp.int32
    assert np.array_equal(first, second)


def test_linen_wrappers_init_and_apply():
    x = jnp.ones((2, 8, 16))
    attention = linen_layers.FlashMultiHeadAttention(2, 16, num_kv_heads=1, is_causal=True,
                                                     implementation="xla")
    variables = attention.init(jax.random.key(0), x)
    assert attention.apply(variables, x).shape == (2, 8, 16)
    mixer = linen_layers.Mamba2(16, d_state=16, headdim=8, chunk_size=16, implementation="xla")
    variables = mixer.init(jax.random.key(0), x)
    assert mixer.apply(variables, x).shape == (2, 8, 16)
    lm = linen_layers.HybridLM(HybridLMConfig(**SMALL, implementation="xla"))
    tokens = jnp.ones((2, 8), jnp.int32)
    variables = lm.init(jax.random.key(0), tokens)
    assert lm.apply(variables, tokens).shape == (2, 8, 256)


def test_bad_configuration():
    with pytest.raises(ValueError, match="shared_every"):
        HybridLM(HybridLMConfig(**{**SMALL, "num_layers": 3}), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="preset"):
        HybridLMConfig.preset("huge")
    model = HybridLM(HybridLMConfig(**SMALL), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="init_cache"):
        model(jnp.ones((1, 1), jnp.int32), decode=True)


def test_every_parameter_has_logical_axis_names():
    model = HybridLM(HybridLMConfig(**SMALL, implementation="xla"), rngs=nnx.Rngs(0))
    attention_with_bias = linen_layers.attention.FlashMultiHeadAttention(
        2, 16, use_bias=True, rngs=nnx.Rngs(0))
    for module in (model, attention_with_bias):
        params = nnx.state(module, nnx.Param)
        specs = nnx.get_partition_spec(params)
        for param, spec in zip(jax.tree.leaves(params), jax.tree.leaves(specs), strict=True):
            assert len(spec) == param.ndim and all(name for name in spec), spec
