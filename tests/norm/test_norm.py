"""The gated RMSNorm (`rms_norm_gated`): the kernels in interpret mode on CPU against a float64
computation written here, forward and every gradient; the reference against the same; z read
in place from a wider array; the argument checks."""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_error

import pallas_kernels
from pallas_kernels.norm import tuning

BF16, F32 = jnp.bfloat16, jnp.float32

# (id, leading shape, D, group_size, gated, norm_before_gate, dtype)
CASES = [
    ("mixer-gate-first", (2, 64), 256, None, True, False, BF16),
    ("gate-after", (2, 64), 256, None, True, True, F32),
    ("plain", (3, 77), 128, None, False, True, BF16),
    ("groups", (2, 32), 256, 64, True, False, F32),
    ("d80-runs-the-reference", (1, 77), 80, None, True, False, F32),
    ("d80-groups-of-16", (2, 8), 80, 16, True, True, BF16),
    ("wide", (1, 16), 4096, None, True, False, BF16),
]


def _seed(name):
    return zlib.crc32(name.encode())


def _inputs(name, lead, d, dtype, gated):
    rng = np.random.default_rng(_seed(name))
    x = rng.standard_normal((*lead, d)) * 2.0
    z = rng.standard_normal((*lead, d)) * 1.5 if gated else None
    weight = 1.0 + 0.3 * rng.standard_normal(d)
    cast = lambda a: None if a is None else jnp.asarray(a, dtype)  # noqa: E731
    return cast(x), cast(weight), cast(z)


def _expected(x, weight, z, group_size, norm_before_gate):
    """float64 numpy forward."""
    x, weight = np.asarray(x, np.float64), np.asarray(weight, np.float64)
    gate = None if z is None else np.asarray(z, np.float64) / (1 + np.exp(-np.asarray(z,
                                                                                   np.float64)))
    v = x * gate if gate is not None and not norm_before_gate else x
    g = v.reshape(*v.shape[:-1], -1, group_size)
    out = (g / np.sqrt(np.mean(g * g, axis=-1, keepdims=True) + 1e-5)).reshape(v.shape)
    out = out * weight
    return out * gate if gate is not None and norm_before_gate else out


def _tolerance(dtype):
    return 2e-2 if dtype == BF16 else 2e-5


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_forward_matches_float64(case, implementation):
    name, lead, d, group_size, gated, nbg, dtype = case
    x, weight, z = _inputs(name, lead, d, dtype, gated)
    out = pallas_kernels.rms_norm_gated(x, weight, z, eps=1e-5, group_size=group_size,
                                        norm_before_gate=nbg, implementation=implementation,
                                        interpret=True)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert rel_error(out, _expected(x, weight, z, group_size or d, nbg)) < _tolerance(dtype)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_gradient_matches_float64(case):
    """dx, dweight and dz of the kernels against JAX's derivative of the reference run in
    float64 on the same (rounded) inputs, for a random output gradient."""
    name, lead, d, group_size, gated, nbg, dtype = case
    x, weight, z = _inputs(name, lead, d, dtype, gated)
    dout = jnp.asarray(np.random.default_rng(_seed(name) + 1).standard_normal(x.shape), dtype)
    args = (x, weight) if z is None else (x, weight, z)

    def run(implementation, *args):
        return pallas_kernels.rms_norm_gated(
            *args, eps=1e-5, group_size=group_size, norm_before_gate=nbg,
            implementation=implementation, interpret=True)

    _, vjp = jax.vjp(functools.partial(run, "pallas"), *args)
    with jax.enable_x64(True):
        wide = [np.asarray(a, np.float64) for a in (*args, dout)]
        _, vjp64 = jax.vjp(functools.partial(run, "xla"), *map(jnp.asarray, wide[:-1]))
        expected = [np.asarray(g) for g in vjp64(jnp.asarray(wide[-1]))]
    for got, want, label in zip(vjp(dout), expected, ["dx", "dweight", "dz"], strict=False):
        assert got.dtype == dtype, label
        assert rel_error(got, want) < _tolerance(dtype), label


@pytest.mark.parametrize("z_width, offset, group_size", [(640, 256, 128), (640, 0, None),
                                                         (600, 100, 128)],
                         ids=["in-place", "in-place-at-0", "sliced"])
def test_z_read_from_a_wider_array(z_width, offset, group_size):
    """z's channels at `z_column_offset` of a wider array (Mamba2's in_proj output): read in
    place at a whole group's offset, else sliced; outputs and gradients (z's zero outside its
    channels) equal the reference's on the sliced z."""
    rng = np.random.default_rng(_seed(f"wide-z-{offset}"))
    x, weight, zs, dout = (jnp.asarray(rng.standard_normal(shape), F32) for shape in
                           ((2, 16, 256), (256,), (2, 16, z_width), (2, 16, 256)))

    def run(implementation, x, weight, zs):
        return pallas_kernels.rms_norm_gated(
            x, weight, zs, eps=1e-5, group_size=group_size, norm_before_gate=False,
            z_column_offset=offset, implementation=implementation, interpret=True)

    out, vjp = jax.vjp(functools.partial(run, "pallas"), x, weight, zs)
    z = zs[..., offset:offset + 256]
    assert rel_error(out, _expected(x, weight, z, group_size or 256, False)) < 2e-5
    expected = jax.vjp(functools.partial(run, "xla"), x, weight, zs)[1](dout)
    for got, want, label in zip(vjp(dout), expected, ["dx", "dweight", "dz"], strict=True):
        assert got.shape == want.shape, label
        assert rel_error(got, want) < 2e-5, label
    dz = np.asarray(vjp(dout)[2])
    assert not np.any(dz[..., :offset]) and not np.any(dz[..., offset + 256:])


def test_kernel_gradients_are_bitwise_reproducible():
    name, lead, d, group_size, gated, nbg, dtype = CASES[0]
    x, weight, z = _inputs(name, lead, d, dtype, gated)

    def loss(x, weight, z):
        return jnp.sum(pallas_kernels.rms_norm_gated(
            x, weight, z, norm_before_gate=False, implementation="pallas",
            interpret=True).astype(F32) ** 2)

    first, second = (jax.grad(loss, argnums=(0, 1, 2))(x, weight, z) for _ in range(2))
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("rows, group, expect_rows", [(16384, 4096, 1), (16384, 2048, 2),
                                                      (77, 128, 1), (12, 64, 4), (8, 8192, 1)])
def test_tiles_divide_the_rows_and_stay_within_the_tile(rows, group, expect_rows):
    tiles = tuning.tiles("NVIDIA H100 80GB HBM3", rows, group)
    assert tiles.block_rows == expect_rows
    assert rows % tiles.block_rows == 0
    assert tiles.block_rows * group <= max(tuning.TILE_ENTRIES, group)
    programs = -(-rows // tiles.block_rows // tiles.backward_blocks)
    assert programs * tiles.backward_blocks * tiles.block_rows >= rows


@pytest.mark.parametrize("kwargs, error, needle", [
    (dict(x=jnp.zeros((4,))), ValueError, "x must be (..., D)"),
    (dict(weight=jnp.zeros((3,))), ValueError, "weight must be (D,)"),
    (dict(z=jnp.zeros((2, 3, 4))), ValueError, "z must have x's shape"),
    (dict(x=jnp.zeros((2, 8), jnp.int32)), TypeError, "x must be"),
    (dict(group_size=3), ValueError, "group_size (3) must divide"),
    (dict(group_size=2.0), TypeError, "group_size must be a positive int"),
    (dict(eps=0.0), ValueError, "eps must be"),
    (dict(norm_before_gate=1), TypeError, "norm_before_gate must be a bool"),
    (dict(z=jnp.zeros((2, 12)), z_column_offset=5), ValueError, "z must hold x's 8 channels"),
    (dict(z=jnp.zeros((2, 12)), z_column_offset=1.5), TypeError, "z_column_offset must be"),
])
def test_bad_arguments_raise_naming_them(kwargs, error, needle):
    call = dict(x=jnp.zeros((2, 8)), weight=jnp.ones((8,)), z=None)
    call.update(kwargs)
    with pytest.raises(error, match=None) as info:
        pallas_kernels.rms_norm_gated(call.pop("x"), call.pop("weight"), call.pop("z"), **call)
    assert needle in str(info.value)
