"""The Flax Mamba2 mixer: kernels vs reference, decode == forward, parameter count, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flax_layers import Mamba2

SMALL = dict(d_state=16, headdim=8, chunk_size=16)


def _close(x, y, tol=2e-5):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def _caches(layer):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(layer, nnx.Cache))]


def test_pallas_and_xla_agree_with_parameter_gradients():
    u = jax.random.normal(jax.random.key(0), (2, 37, 16))
    seq_idx = jnp.array([[0] * 20 + [1] * 17, [0] * 37], jnp.int32)

    def loss(layer):
        y = layer(u, seq_idx=seq_idx)
        return jnp.sum(jnp.sin(y)), y

    outs, grads = [], []
    for implementation in ("pallas", "xla"):
        layer = Mamba2(16, ngroups=2, D_has_hdim=True, implementation=implementation,
                       rngs=nnx.Rngs(0), **SMALL)
        (_, y), g = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(layer)  # eager: slow
        outs.append(y)
        grads.append(jax.tree.leaves(nnx.state(g, nnx.Param)))
    _close(*outs)
    for a, b in zip(*grads, strict=True):
        _close(a, b, 1e-4)


@pytest.mark.parametrize("options", [dict(ngroups=1), dict(ngroups=2, rmsnorm=False),
                                     dict(ngroups=2, norm_before_gate=True, d_conv=1)])
def test_decode_continues_the_forward_exactly(options):
    u = jax.random.normal(jax.random.key(1), (2, 19, 16))
    layer = Mamba2(16, implementation="xla", rngs=nnx.Rngs(1), **SMALL, **options)
    full = layer(u)
    layer.init_cache(2)
    prefill = layer(u[:, :7], decode=True)  # several tokens: the chunked scan from the caches
    caches = _caches(layer)
    layer(-u)  # a forward in between touches no cache
    assert all(np.array_equal(a, b) for a, b in zip(caches, _caches(layer), strict=True))
    steps = [layer(u[:, t:t + 1], decode=True) for t in range(7, 12)]  # one at a time
    rest = layer(u[:, 12:], decode=True)  # several again (7: the prefill's compiled shape)
    _close(jnp.concatenate([prefill, *steps, rest], axis=1), full, 1e-4)
    layer.init_cache(2)
    _close(jnp.concatenate([layer(u[:, t:t + 1], decode=True) for t in range(19)], axis=1),
           full, 1e-4)  # token by token from an empty cache


def test_parameter_count_matches_mamba_ssm_formula():
    d_model, d_state, d_conv, expand, headdim, ngroups = 64, 32, 4, 2, 16, 2
    layer = Mamba2(d_model, d_state=d_state, d_conv=d_conv, expand=expand, headdim=headdim,
                   ngroups=ngroups, rngs=nnx.Rngs(0))
    d_inner = expand * d_model
    nheads = d_inner // headdim
    conv_dim = d_inner + 2 * ngroups * d_state
    expected = (
        d_model * (2 * d_inner + 2 * ngroups * d_state + nheads)  # in_proj (no bias)
        + conv_dim * d_conv + conv_dim  # depthwise conv weight and bias
        + 3 * nheads  # dt_bias, A_log, D
        + d_inner  # norm weight
        + d_inner * d_model  # out_proj
    )
    count = sum(x.size for x in jax.tree.leaves(nnx.state(layer, nnx.Param)))
    assert count == expected


def test_initialisation_follows_mamba_ssm():
    layer = Mamba2(64, rngs=nnx.Rngs(0), **SMALL)
    a = -jnp.exp(layer.A_log[...])
    assert jnp.all((a <= -1) & (a >= -16))
    dt = jax.nn.softplus(layer.dt_bias[...])
    assert jnp.all((dt >= 1e-3 * 0.999) & (dt <= 0.1 * 1.001))
    assert jnp.all(layer.D[...] == 1)


def test_decode_checks_the_cache():
    layer = Mamba2(16, implementation="xla", rngs=nnx.Rngs(0), **SMALL)
    u = jnp.ones((1, 1, 16))
    with pytest.raises(ValueError, match="init_cache"):
        layer(u, decode=True)
    layer.init_cache(2)
    with pytest.raises(ValueError, match="batch 1 does not match the Mamba2 cache's batch 2"):
        layer(u, decode=True)  # used to broadcast silently
    with pytest.raises(ValueError, match="batch 3 does not match the Mamba2 cache's batch 2"):
        layer(jnp.ones((3, 1, 16)), decode=True)
    with pytest.raises(ValueError, match="seq_idx"):
        layer(jnp.ones((2, 1, 16)), seq_idx=jnp.zeros((2, 1), jnp.int32), decode=True)


@pytest.mark.parametrize("kwargs, error, needle", [
    *[(dict(d_model=16, headdim=8) | {name: 0}, ValueError,
       f"{name} must be a positive int, got 0")
      for name in ("d_model", "d_state", "d_conv", "expand", "headdim", "ngroups", "chunk_size")],
    (dict(d_model=10, headdim=8), ValueError, r"expand \* d_model \(20\) must be divisible by "
                                              r"headdim \(8\)"),
    (dict(d_model=16, headdim=8, ngroups=3), ValueError,
     r"heads \(4\) must be divisible by ngroups \(3\)"),
    (dict(d_model=16, headdim=8, chunk_size=24), ValueError,
     "chunk_size must be a positive power of two, got 24"),
    (dict(d_model=16.0), TypeError, "d_model must be an int"),
    (dict(d_model=16, headdim=8, dt_min=0.2, dt_max=0.1), ValueError, "dt_min"),
    (dict(d_model=16, headdim=8, dt_max=float("inf")), ValueError, "dt_min"),
    (dict(d_model=16, headdim=8, A_init_range=(0, 16)), ValueError, "A_init_range"),
    (dict(d_model=16, headdim=8, dt_init_floor=-1.0), ValueError, "dt_init_floor"),
    *[(dict(d_model=16, headdim=8, dt_limit=limit), ValueError, "dt_limit")
      for limit in [(-0.1, 1.0), (0.5, 0.1), (float("nan"), 1.0), (float("inf"),) * 2, (1.0,)]],
    (dict(d_model=16, headdim=8, rmsnorm=1), TypeError, "rmsnorm must be a bool"),
    (dict(d_model=16, headdim=8, bias=None), TypeError, "bias must be a bool"),
    (dict(d_model=16, headdim=8, param_dtype=jnp.int8), TypeError, "param_dtype"),
    (dict(d_model=16, headdim=8, implementation="triton"), ValueError, "implementation"),
])
def test_bad_configuration(kwargs, error, needle):
    with pytest.raises(error, match=needle):
        Mamba2(**kwargs, rngs=nnx.Rngs(0))
