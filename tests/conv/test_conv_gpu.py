"""The conv and norm kernels compiled for a real GPU, at the mixer's sizes and at ragged ones
(T and C that are not multiples of the tiles: edge tiles masked on store, gathers clamped),
forward and every gradient against the float32 references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_error

import pallas_kernels

pytestmark = pytest.mark.gpu


def _normals(seed, *shapes, dtype=jnp.bfloat16):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(k, s, dtype) for k, s in zip(keys, shapes, strict=True)]


def _worst_row_error(got, want):
    """The largest relative error of one (batch, token) row: a wrong first or last tile would
    vanish in the whole array's norm."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.linalg.norm(got - want, axis=-1)
                        / np.maximum(np.linalg.norm(want, axis=-1), 1e-30)))


def _vjp_both(fn, args, dout):
    """(outputs and gradients) of fn with the kernels and with the reference (float32 args)."""
    results = []
    for implementation, cast in (("pallas", None), ("xla", jnp.float32)):
        values = args if cast is None else [a.astype(cast) for a in args]
        out, vjp = jax.vjp(lambda *a, i=implementation: fn(*a, implementation=i), *values)
        results.append([out, *vjp(dout if cast is None else dout.astype(cast))])
    return results


@pytest.mark.parametrize("b, t, c", [(4, 4096, 4224), (2, 77, 200), (1, 1, 128)])
def test_conv_matches_the_reference_on_the_gpu(b, t, c):
    x, dout, weight, bias, states = _normals(0, (b, t, c), (b, t, c), (4, c), (c,), (b, 3, c))

    def conv(x, weight, bias, states, implementation):
        return pallas_kernels.causal_conv1d(x, weight, bias, initial_states=states,
                                            implementation=implementation)

    kernel, ref = _vjp_both(conv, [x, weight, bias, states], dout)
    for got, want in zip(kernel, ref, strict=True):
        assert np.all(np.isfinite(np.asarray(got, np.float32)))
        assert rel_error(got, want) < 2e-2
    for got, want in zip(kernel[:2], ref[:2], strict=True):  # out and dx, row by row
        assert _worst_row_error(got, want) < 3e-2


@pytest.mark.parametrize("b, t", [(4, 4096), (2, 77)])
def test_conv_in_place_and_split_match_the_reference_on_the_gpu(b, t):
    """The mixer's call: xBC's 4224 channels read in place from in_proj's 8384 (from column
    4096), the output written as x (4096) and [B, C] (128)."""
    zxbcdt, dx, dbc, weight, bias, states = _normals(
        2, (b, t, 8384), (b, t, 4096), (b, t, 128), (4, 4224), (4224,), (b, 3, 4224))

    def conv(zxbcdt, weight, bias, states, implementation):
        return pallas_kernels.causal_conv1d(zxbcdt, weight, bias, initial_states=states,
                                            column_offset=4096, split=4096,
                                            implementation=implementation)

    results = []
    for implementation, cast in (("pallas", None), ("xla", jnp.float32)):
        values = [a if cast is None else a.astype(cast) for a in (zxbcdt, weight, bias, states)]
        out, vjp = jax.vjp(lambda *a, i=implementation: conv(*a, implementation=i), *values)
        douts = (dx, dbc) if cast is None else (dx.astype(cast), dbc.astype(cast))
        results.append([*out, *vjp(douts)])
    for got, want in zip(*results, strict=True):
        assert np.all(np.isfinite(np.asarray(got, np.float32)))
        assert rel_error(got, want) < 2e-2
    for got, want in zip(results[0][:3], results[1][:3], strict=True):  # x, [B, C], d(zxbcdt)
        assert _worst_row_error(got, want) < 3e-2


@pytest.mark.parametrize("shape, group_size, norm_before_gate",
                         [((4, 4096, 4096), None, False), ((2, 77, 1024), 256, True)])
def test_norm_matches_the_reference_on_the_gpu(shape, group_size, norm_before_gate):
    x, z, dout, weight = _normals(1, shape, shape, shape, shape[-1:])

    def norm(x, weight, z, implementation):
        return pallas_kernels.rms_norm_gated(x, weight, z, group_size=group_size,
                                             norm_before_gate=norm_before_gate,
                                             implementation=implementation)

    kernel, ref = _vjp_both(norm, [x, weight, z], dout)
    for got, want in zip(kernel, ref, strict=True):
        assert rel_error(got, want) < 2e-2
    for i in (0, 1, 3):  # out, dx, dz row by row
        assert _worst_row_error(kernel[i], ref[i]) < 3e-2


def test_norm_reads_z_in_place_on_the_gpu():
    """The mixer's call: z, in_proj's first 4096 of 8384 columns, read in place."""
    x, packed, dout, weight = _normals(3, (4, 4096, 4096), (4, 4096, 8384), (4, 4096, 4096),
                                       (4096,))

    def norm(x, weight, packed, implementation):
        return pallas_kernels.rms_norm_gated(x, weight, packed, norm_before_gate=False,
                                             z_column_offset=0, implementation=implementation)

    kernel, ref = _vjp_both(norm, [x, weight, packed], dout)
    for got, want in zip(kernel, ref, strict=True):
        assert rel_error(got, want) < 2e-2
    assert not np.any(np.asarray(kernel[3], np.float32)[..., 4096:])


@pytest.mark.parametrize("b, c, x_width, offset", [(64, 4224, 8384, 4096), (3, 200, 200, None),
                                                  (2, 300, 700, 256)])
def test_conv_update_matches_the_reference_on_the_gpu(b, c, x_width, offset):
    """One token's step (`causal_conv1d_update`): the mixer's decode call (xBC read in place
    from in_proj's output), a ragged C (the edge block masked), a ragged C read in place (its
    last block reaching into the next columns)."""
    x, states, weight, bias = _normals(4, (b, x_width), (b, 3, c), (4, c), (c,))
    got = pallas_kernels.causal_conv1d_update(x, states, weight, bias, column_offset=offset,
                                              implementation="pallas")
    want = pallas_kernels.causal_conv1d_update(x.astype(jnp.float32), states, weight, bias,
                                               column_offset=offset, implementation="xla")
    assert rel_error(got[0], want[0]) < 2e-2 and _worst_row_error(got[0], want[0]) < 3e-2
    np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(want[1], np.float32))
