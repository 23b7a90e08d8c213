"""The fused Mamba2 mixer (`mixer.split_conv_scan_norm`: conv, SSD and gated norm from in_proj's
packed output, with the packed gradient assembled in place): the kernels in interpret mode on
CPU against the three public ops run as the reference in float64, forward and every gradient;
bit for bit against the three ops' kernels run one after another; which calls the Mamba2 layer
sends through it."""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from numerics import rel_error

import flax_layers
import pallas_kernels
from pallas_kernels.mamba2 import mixer

BF16, F32 = jnp.bfloat16, jnp.float32

# (id, B, T, d_ssm, G, N, H, conv bias, D per channel, norm_before_gate, norm groups, dtype)
CASES = [
    ("mixer-bf16", 2, 77, 128, 1, 16, 4, True, False, False, 1, BF16),
    ("groups-f32", 1, 70, 256, 2, 32, 8, False, True, True, 2, F32),
]


def _arrays(case):
    name, b, t, d, g, n, h, bias, d_per_channel, _, _, dtype = case
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    shape = _shape(case)
    arrays = dict(
        zxbcdt=rng.standard_normal((b, t, shape.width)),
        conv_weight=rng.standard_normal((4, shape.conv_dim)) * 0.5,
        conv_bias=rng.standard_normal(shape.conv_dim) * 0.5 if bias else None,
        dt_bias=rng.uniform(-3.0, -1.0, h),
        A=-rng.uniform(0.5, 4.0, h),
        D=rng.standard_normal((h, d // h) if d_per_channel else h),
        norm_weight=1.0 + 0.3 * rng.standard_normal(d),
    )
    # Parameters float32 as the layer keeps them; activations in the case's dtype.
    return {k: None if v is None else jnp.asarray(v, dtype if k == "zxbcdt" else F32)
            for k, v in arrays.items()}


def _shape(case):
    _, _, _, d, g, n, h, _, _, _, norm_groups, _ = case
    return mixer.MixerShape(d_ssm=d, ngroups=g, d_state=n, nheads=h,
                            norm_group_size=d // norm_groups)


def _options(case):
    return dict(chunk_size=32, dt_limit=(0.0, float("inf")), norm_eps=1e-5,
                norm_before_gate=case[9])


def _composed(case, implementation, zxbcdt, conv_weight, conv_bias, dt_bias, A, D,
              norm_weight):
    """The three public ops one after another on the packed array's slices."""
    shape, options = _shape(case), _options(case)
    b, t = zxbcdt.shape[:2]
    d, gn = shape.d_ssm, shape.ngroups * shape.d_state
    run = dict(implementation=implementation, interpret=True)
    xbc = pallas_kernels.causal_conv1d(
        zxbcdt[..., d:d + shape.conv_dim], conv_weight.astype(zxbcdt.dtype),
        None if conv_bias is None else conv_bias.astype(zxbcdt.dtype), **run)
    groups = (b, t, shape.ngroups, shape.d_state)
    y = pallas_kernels.mamba_chunk_scan_combined(
        xbc[..., :d].reshape(b, t, shape.nheads, -1), zxbcdt[..., d + shape.conv_dim:], A,
        xbc[..., d:d + gn].reshape(groups), xbc[..., d + gn:].reshape(groups),
        options["chunk_size"], D=D, dt_bias=dt_bias, dt_softplus=True,
        dt_limit=options["dt_limit"], **run)
    return pallas_kernels.rms_norm_gated(
        y.reshape(b, t, d), norm_weight, zxbcdt[..., :d], eps=options["norm_eps"],
        group_size=shape.norm_group_size, norm_before_gate=options["norm_before_gate"], **run)


def _fused(case, zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight):
    return mixer.split_conv_scan_norm(
        zxbcdt, conv_weight.astype(zxbcdt.dtype),
        None if conv_bias is None else conv_bias.astype(zxbcdt.dtype), dt_bias, A, D,
        norm_weight, shape=_shape(case), interpret=True, **_options(case))


def _gradients(fn, arrays, dout):
    names = [k for k, v in arrays.items() if v is not None]

    def call(*values):
        return fn(**{**arrays, **dict(zip(names, values, strict=True))})

    def run(values, dout):  # jitted: one compile instead of op-by-op dispatch
        out, pullback = jax.vjp(call, *values)
        return out, pullback(dout)

    out, grads = jax.jit(run)([arrays[k] for k in names], dout)
    return out, dict(zip(names, grads, strict=True))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_and_every_gradient_match_the_ops_in_float64(case):
    arrays = _arrays(case)
    dtype = case[-1]
    assert mixer.applies(arrays["zxbcdt"], _shape(case))
    dout = jnp.asarray(np.random.default_rng(7).standard_normal(
        (*arrays["zxbcdt"].shape[:2], case[3])), dtype)
    out, grads = _gradients(functools.partial(_fused, case), arrays, dout)
    with jax.enable_x64(True):
        wide = {k: None if v is None else jnp.asarray(np.asarray(v, np.float64))
                for k, v in arrays.items()}
        want, want_grads = _gradients(functools.partial(_composed, case, "xla"), wide,
                                      jnp.asarray(np.asarray(dout, np.float64)))
    tolerance = 3e-2 if dtype == BF16 else 1e-4
    assert out.dtype == dtype and rel_error(out, want) < tolerance
    for name, g in grads.items():
        assert g.dtype == arrays[name].dtype, name
        assert rel_error(g, want_grads[name]) < tolerance, name


def test_bitwise_equal_to_the_ops_kernels():
    """The fused op only moves where the packed gradient is written: its values and gradients
    are the three ops' kernels' bit for bit."""
    case = CASES[0]
    arrays = _arrays(case)
    dout = jnp.asarray(np.random.default_rng(8).standard_normal(
        (*arrays["zxbcdt"].shape[:2], case[3])), case[-1])
    out, grads = _gradients(functools.partial(_fused, case), arrays, dout)
    want, want_grads = _gradients(functools.partial(_composed, case, "pallas"), arrays, dout)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    for name, g in grads.items():
        np.testing.assert_array_equal(np.asarray(g, np.float32),
                                      np.asarray(want_grads[name], np.float32), err_msg=name)


@pytest.mark.parametrize("kwargs, fuses", [
    (dict(implementation="pallas"), True),
    (dict(implementation="xla"), False),
    (dict(implementation="pallas", rmsnorm=False), False),
    (dict(implementation="pallas", d_ssm=64), False),  # a gated MLP beside the SSM
    (dict(implementation="pallas", headdim=16, expand=1), False),  # d_ssm 64: not on a block
])
def test_which_layers_fuse(kwargs, fuses, monkeypatch):
    monkeypatch.setattr(mixer, "split_conv_scan_norm", lambda *args, **kwargs: "fused")
    layer = flax_layers.Mamba2(64, d_state=16, **{"headdim": 32, **kwargs}, rngs=nnx.Rngs(0))
    zxbcdt = jnp.zeros((1, 8, layer.in_proj.kernel.shape[1]), BF16)
    assert (layer._fused_mixer(zxbcdt, None) == "fused") == fuses
    if fuses:  # sequence ids
        assert layer._fused_mixer(zxbcdt, jnp.zeros((1, 8), jnp.int32)) is None


# The decode step (`mixer.split_conv_step`): one token from the conv and SSM states, in_proj's
# output read in place (after `OFFSET` columns of a gated MLP).
OFFSET = 32


def _step_arrays(case):
    arrays = _arrays(case)
    b, shape, dtype = case[1], _shape(case), case[-1]
    rng = np.random.default_rng(zlib.crc32(case[0].encode()) + 1)
    mlp = jnp.asarray(rng.standard_normal((b, OFFSET)), dtype)
    p = shape.d_ssm // shape.nheads
    return dict(
        zxbcdt=jnp.concatenate([mlp, arrays["zxbcdt"][:, 0]], axis=1),
        conv_state=jnp.asarray(rng.standard_normal((b, 3, shape.conv_dim)), dtype),
        ssm_state=jnp.asarray(rng.standard_normal((b, shape.nheads, p, shape.d_state)), F32),
        A_log=jnp.log(-arrays["A"]),
        **{k: arrays[k] for k in ("conv_weight", "conv_bias", "dt_bias", "D")})


def _step_composed(case, implementation, zxbcdt, conv_state, ssm_state, conv_weight, conv_bias,
                   dt_bias, A_log, D):
    """`causal_conv1d_update` and `selective_state_update` on the packed row's slices."""
    shape = _shape(case)
    b, d, gn, start = zxbcdt.shape[0], shape.d_ssm, shape.ngroups * shape.d_state, OFFSET
    run = dict(implementation=implementation, interpret=True)
    xbc, conv_state = pallas_kernels.causal_conv1d_update(
        zxbcdt[:, start + d:start + d + shape.conv_dim], conv_state, conv_weight, conv_bias,
        **run)
    groups = (b, shape.ngroups, shape.d_state)
    y, ssm_state = pallas_kernels.selective_state_update(
        ssm_state, xbc[:, :d].reshape(b, shape.nheads, -1),
        zxbcdt[:, start + d + shape.conv_dim:], -jnp.exp(A_log), xbc[:, d:d + gn].reshape(groups),
        xbc[:, d + gn:].reshape(groups), D=D, dt_bias=dt_bias, dt_softplus=True,
        dt_limit=_options(case)["dt_limit"], **run)
    return y, conv_state, ssm_state


def _step_fused(case, zxbcdt, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log,
                D):
    return mixer.split_conv_step(zxbcdt, conv_state, ssm_state, conv_weight, conv_bias, dt_bias,
                                 A_log, D, shape=_shape(case), column_offset=OFFSET,
                                 dt_limit=_options(case)["dt_limit"], interpret=True)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_decode_step_and_its_gradients_match_the_ops(case):
    """Values those of the two public ops' kernels on the slices (to the last bits: the step
    size is computed in the kernel, not by XLA); values and every gradient within rounding of
    the ops' references."""
    arrays = _step_arrays(case)
    assert mixer.step_applies(_shape(case), 4)
    got = _step_fused(case, **arrays)
    kernels = _step_composed(case, "pallas", **arrays)
    for g, k in zip(got, kernels, strict=True):
        assert g.dtype == k.dtype and rel_error(g, k) < 1e-6
    douts = [jnp.asarray(np.random.default_rng(9).standard_normal(o.shape), o.dtype)
             for o in got]
    out, grads = _gradients(functools.partial(_step_fused, case), arrays, tuple(douts))
    want, want_grads = _gradients(functools.partial(_step_composed, case, "xla"), arrays,
                                  tuple(douts))
    tolerance = 2e-2 if case[-1] == BF16 else 1e-5
    for o, w in zip(out, want, strict=True):
        assert o.dtype == w.dtype and rel_error(o, w) < tolerance
    for name, g in grads.items():
        assert g.dtype == arrays[name].dtype, name
        assert rel_error(g, want_grads[name]) < tolerance, name


def test_decode_step_reads_only_its_columns():
    """NaN in z's and the gated MLP's columns of in_proj's output leaves the step finite."""
    case = CASES[0]
    arrays = _step_arrays(case)
    width = arrays["zxbcdt"].shape[1]
    other = jnp.arange(width) < OFFSET + _shape(case).d_ssm
    arrays["zxbcdt"] = jnp.where(other, jnp.nan, arrays["zxbcdt"])
    for out in _step_fused(case, **arrays):
        assert np.all(np.isfinite(np.asarray(out, np.float32)))


@pytest.mark.parametrize("kwargs, fuses", [
    (dict(implementation="pallas"), True),
    (dict(implementation="pallas", d_ssm=64), True),  # a gated MLP's columns first
    (dict(implementation="xla"), False),
    (dict(implementation="pallas", rmsnorm=False), False),  # z gates the step itself
    (dict(implementation="pallas", d_state=24), False),  # N not a power of two
    (dict(implementation="pallas", d_conv=1), False),  # no conv state
])
def test_which_layers_step_fused(kwargs, fuses, monkeypatch):
    monkeypatch.setattr(mixer, "split_conv_step", lambda *args, **kwargs: "fused")
    layer = flax_layers.Mamba2(64, **{"headdim": 32, "d_state": 16, **kwargs},
                               rngs=nnx.Rngs(0))
    layer.init_cache(2)
    zxbcdt = jnp.zeros((2, 1, layer.in_proj.kernel.shape[1]), BF16)
    assert (layer._fused_step(zxbcdt, layer.conv_state[...], layer.ssm_state[...])
            == "fused") == fuses


@pytest.mark.parametrize("options", [
    dict(d_model=64),
    dict(d_model=64, d_ssm=64),  # a gated MLP's columns before z
    # xBC from column 256, read in place by the conv; groups, a finite dt_limit, D per channel
    dict(d_model=128, ngroups=2, dt_limit=(0.01, 0.05), D_has_hdim=True),
], ids=["plain", "gated-mlp", "in-place-groups-limit"])
def test_layer_steps_continue_the_forward(options):
    """The layer decoding token by token through the fused step gives the forward's outputs."""
    d_model = options["d_model"]
    u = jax.random.normal(jax.random.key(4), (2, 11, d_model))
    layers = [flax_layers.Mamba2(**options, d_state=16, headdim=32, chunk_size=16,
                                 implementation=implementation, rngs=nnx.Rngs(6))
              for implementation in ("pallas", "xla")]
    full = layers[1](u)
    layer = layers[0]
    layer.init_cache(2)
    step = nnx.jit(lambda layer, token: layer(token, decode=True))
    steps = jnp.concatenate([step(layer, u[:, t:t + 1]) for t in range(11)], axis=1)
    assert rel_error(steps, full) < 1e-5
