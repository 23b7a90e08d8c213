"""The Flax Mamba2 mixer: kernels vs reference, decode == forward, parameter count, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flax_layers import Mamba2
from pallas_kernels.mamba2 import reference

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


@pytest.mark.parametrize("d_model, d_ssm", [(64, None), (128, 128)], ids=["ssm", "with-mlp"])
def test_conv_and_norm_read_in_proj_output_in_place(d_model, d_ssm):
    """Where xBC's first column and d_ssm are multiples of 128, the conv kernels take
    in_proj's output whole and write x and [B, C] apart, and the norm kernels read z from it
    (no copies); without a gated MLP the three run as one op (`mixer.split_conv_scan_norm`)
    from in_proj's output to the norm's. The layer's outputs and gradients equal the
    reference's."""
    u = jax.random.normal(jax.random.key(4), (2, 40, d_model))
    layers = [Mamba2(d_model, d_ssm=d_ssm, implementation=implementation, rngs=nnx.Rngs(5),
                     **SMALL) for implementation in ("pallas", "xla")]
    layer = layers[0]
    eqns = jax.make_jaxpr(lambda u: layer(u))(u).jaxpr.eqns
    calls = [eqn for eqn in eqns if eqn.primitive.name == "custom_vjp_call"
             and eqn.invars[0].aval.shape == (2, 40, layer.in_proj.out_features)]
    if layer.d_mlp:
        assert [[v.aval.shape for v in eqn.outvars] for eqn in calls] == [
            [(2, 40, layer.d_ssm), (2, 40, 2 * layer.d_state)]]
        # The norm flattens its rows: z, its third operand, is in_proj's output reshaped.
        norms = [eqn for eqn in eqns
                 if eqn.primitive.name == "custom_vjp_call" and len(eqn.invars) >= 3
                 and eqn.invars[2].aval.shape == (80, layer.in_proj.out_features)]
        assert len(norms) == 1
    else:
        assert [[v.aval.shape for v in eqn.outvars] for eqn in calls] == [
            [(2, 40, layer.d_ssm)]]

    def loss(layer):
        y = layer(u)
        return jnp.sum(jnp.sin(y)), y

    (_, y), g = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(layers[0])  # eager: slow
    (_, y_ref), g_ref = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(layers[1])
    _close(y, y_ref)
    for a, b in zip(jax.tree.leaves(nnx.state(g, nnx.Param)),
                    jax.tree.leaves(nnx.state(g_ref, nnx.Param)), strict=True):
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


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_bfloat16_ssm_state_continues_the_forward(implementation):
    """A bf16 SSM state (mamba_ssm's for a bf16 model): stays bf16 through the prefill and the
    steps, and the outputs follow the float32 forward within bf16 rounding of the state."""
    u = jax.random.normal(jax.random.key(2), (2, 19, 16))
    layer = Mamba2(16, implementation=implementation, rngs=nnx.Rngs(2), **SMALL)
    full = layer(u)
    layer.init_cache(2, ssm_dtype=jnp.bfloat16)
    out = [layer(u[:, :7], decode=True)]
    assert layer.ssm_state[...].dtype == jnp.bfloat16
    out += [layer(u[:, t:t + 1], decode=True) for t in range(7, 19)]
    assert layer.ssm_state[...].dtype == jnp.bfloat16
    out = jnp.concatenate(out, axis=1)
    scale = float(jnp.max(jnp.abs(full)))
    assert float(jnp.max(jnp.abs(out - full))) < 2e-2 * scale
    assert float(jnp.max(jnp.abs(out - full))) > 0  # the state was rounded


@pytest.mark.parametrize("ssm_dtype", [jnp.int8, jnp.float8_e4m3fn, "int32", None])
def test_ssm_state_dtype_is_checked(ssm_dtype):
    layer = Mamba2(16, rngs=nnx.Rngs(0), **SMALL)
    with pytest.raises(TypeError, match="ssm_dtype"):
        layer.init_cache(2, ssm_dtype=ssm_dtype)


@pytest.mark.parametrize("d_ssm", [None, 64])
def test_parameter_count_matches_mamba_ssm_formula(d_ssm):
    d_model, d_state, d_conv, expand, headdim, ngroups = 64, 32, 4, 2, 16, 2
    layer = Mamba2(d_model, d_state=d_state, d_conv=d_conv, expand=expand, headdim=headdim,
                   d_ssm=d_ssm, ngroups=ngroups, rngs=nnx.Rngs(0))
    d_inner = expand * d_model
    d_ssm = d_inner if d_ssm is None else d_ssm
    nheads = d_ssm // headdim
    conv_dim = d_ssm + 2 * ngroups * d_state
    expected = (
        d_model * (2 * d_inner + 2 * ngroups * d_state + nheads)  # in_proj (no bias)
        + conv_dim * d_conv + conv_dim  # depthwise conv weight and bias
        + 3 * nheads  # dt_bias, A_log, D
        + d_ssm  # norm weight
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
    assert jnp.max(jnp.abs(layer.conv_weight[...])) > 0.3  # PyTorch's default: +-1/sqrt(4)
    narrow = Mamba2(64, conv_init=0.01, layer_idx=3, rngs=nnx.Rngs(0), **SMALL)
    assert jnp.max(jnp.abs(narrow.conv_weight[...])) <= 0.01
    assert narrow.layer_idx == 3


def _mamba_ssm_forward(layer, u):
    """mamba_ssm's `Mamba2.forward` (its path without the fused kernels, rmsnorm and
    norm_before_gate=False), transcribed in jnp on the layer's parameters; the SSD token by
    token."""
    b, t, _ = u.shape
    g, n, p = layer.ngroups, layer.d_state, layer.headdim
    zxbcdt = layer.in_proj(u)
    d_mlp = (zxbcdt.shape[-1] - 2 * layer.d_ssm - 2 * g * n - layer.nheads) // 2
    sizes = [d_mlp, d_mlp, layer.d_ssm, layer.d_ssm + 2 * g * n]
    z0, x0, z, xbc, dt = jnp.split(zxbcdt, np.cumsum(sizes), axis=-1)
    width = layer.d_conv  # Conv1d(groups=channels, padding=width - 1)[:, :t]
    padded = jnp.pad(xbc, ((0, 0), (width - 1, 0), (0, 0)))
    xbc = jax.nn.silu(sum(padded[:, k:k + t] * layer.conv_weight[k] for k in range(width))
                      + layer.conv_bias[...])
    x, B, C = jnp.split(xbc, [layer.d_ssm, layer.d_ssm + g * n], axis=-1)
    y = reference.ssd_recurrence(
        x.reshape(b, t, -1, p), dt, -jnp.exp(layer.A_log[...]), B.reshape(b, t, g, n),
        C.reshape(b, t, g, n), layer.chunk_size, D=layer.D[...], dt_bias=layer.dt_bias[...],
        dt_softplus=True).reshape(b, t, layer.d_ssm)
    y = (y * jax.nn.silu(z)).reshape(b, t, g, -1)  # RMSNormGated(group_size=d_ssm // ngroups)
    y = (y * jax.lax.rsqrt(jnp.mean(y**2, -1, keepdims=True) + 1e-5)).reshape(b, t, -1)
    y = jnp.concatenate([jax.nn.silu(z0) * x0, y * layer.norm_weight[...]], axis=-1)
    return layer.out_proj(y)


def test_forward_matches_mamba_ssm_transcription():
    u = jax.random.normal(jax.random.key(2), (2, 21, 16))
    layer = Mamba2(16, d_ssm=16, ngroups=2, implementation="xla", rngs=nnx.Rngs(2), **SMALL)
    ours, theirs = nnx.jit(lambda layer: (layer(u), _mamba_ssm_forward(layer, u)))(layer)
    _close(ours, theirs, 1e-4)


def test_decode_is_settable_with_nnx_view():
    u = jax.random.normal(jax.random.key(3), (2, 3, 16))
    layer = Mamba2(16, d_ssm=16, implementation="xla", rngs=nnx.Rngs(3), **SMALL)
    assert nnx.view(layer, decode=True).decode and not layer.decode

    @nnx.jit
    def decode_and_forward(layer):  # from empty caches, a prefill then a step (gated MLP too)
        decoder = nnx.view(layer, decode=True, batch_size=2)
        return jnp.concatenate([decoder(u[:, :2]), decoder(u[:, 2:])], axis=1), layer(u)

    _close(*decode_and_forward(layer), 1e-4)  # the forward's outputs


def test_numpy_sizes_are_accepted_at_construction_and_call():
    layer = Mamba2(np.int64(16), headdim=np.int32(8), d_state=16, chunk_size=np.int64(16),
                   implementation="xla", rngs=nnx.Rngs(0))
    u = jax.ShapeDtypeStruct((1, 4, 16), jnp.float32)
    assert jax.eval_shape(layer, u).shape == u.shape  # the kernel's checks run when traced


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
    (dict(d_model=16, headdim=8, d_ssm=40), ValueError,
     r"d_ssm \(40\) must be at most d_inner = expand \* d_model \(32\)"),
    (dict(d_model=16, headdim=8, d_ssm=12), ValueError,
     r"d_ssm \(12\) must be divisible by headdim \(8\)"),
    (dict(d_model=16, headdim=8, d_ssm=0), ValueError, "d_ssm must be a positive int"),
    (dict(d_model=16, headdim=8, conv_init=0.0), ValueError, "conv_init"),
    (dict(d_model=16, headdim=8, layer_idx=-1), ValueError, "layer_idx must be >= 0"),
    (dict(d_model=16, headdim=8, layer_idx="0"), TypeError, "layer_idx must be an int"),
    (dict(d_model=16, headdim=8, decode=1), TypeError, "decode must be a bool"),
])
def test_bad_configuration(kwargs, error, needle):
    with pytest.raises(error, match=needle):
        Mamba2(**kwargs, rngs=nnx.Rngs(0))
