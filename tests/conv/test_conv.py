"""The causal conv (`causal_conv1d`): the kernels in interpret mode on CPU against a float64
numpy convolution written here, forward and every gradient; the channels of a wider x read in
place and the output in two parts; packed sequences (the reference) against per-sequence runs;
the argument checks."""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_error

import pallas_kernels

BF16, F32 = jnp.bfloat16, jnp.float32

# (id, B, T, C, W, bias, initial states, activation, dtype)
CASES = [
    ("mixer", 2, 128, 256, 4, True, False, "silu", BF16),
    ("odd-t-and-c", 1, 77, 200, 4, True, True, "silu", F32),
    ("short", 2, 3, 128, 4, False, True, "silu", F32),
    ("no-activation", 2, 70, 128, 2, True, True, None, BF16),
    ("width-8", 1, 100, 64, 8, True, True, "silu", F32),
    ("width-3", 2, 65, 128, 3, True, True, "silu", F32),
    ("width-1", 1, 20, 64, 1, True, False, None, F32),
]


def _seed(name):
    return zlib.crc32(name.encode())


def _inputs(case):
    name, b, t, c, w, bias, states, _, dtype = case
    rng = np.random.default_rng(_seed(name))
    x = rng.standard_normal((b, t, c))
    weight = rng.standard_normal((w, c)) * 0.5
    arrays = dict(x=x, weight=weight, bias=rng.standard_normal(c) * 0.5 if bias else None,
                  initial_states=rng.standard_normal((b, w - 1, c)) if states else None)
    return {k: None if v is None else jnp.asarray(v, dtype) for k, v in arrays.items()}


def _expected(x, weight, bias, initial_states, activation):
    """float64 numpy forward."""
    x, weight = np.asarray(x, np.float64), np.asarray(weight, np.float64)
    b, t, c = x.shape
    w = weight.shape[0]
    before = (np.zeros((b, w - 1, c)) if initial_states is None
              else np.asarray(initial_states, np.float64))
    padded = np.concatenate([before, x], axis=1)
    out = sum(weight[k] * padded[:, k:k + t] for k in range(w))
    if bias is not None:
        out = out + np.asarray(bias, np.float64)
    return out / (1 + np.exp(-out)) if activation == "silu" else out


def _tolerance(dtype):
    return 2e-2 if dtype == BF16 else 2e-5


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_forward_matches_float64(case, implementation):
    arrays = _inputs(case)
    out = pallas_kernels.causal_conv1d(**arrays, activation=case[7],
                                       implementation=implementation, interpret=True)
    assert out.dtype == arrays["x"].dtype and out.shape == arrays["x"].shape
    assert rel_error(out, _expected(**arrays, activation=case[7])) < _tolerance(case[8])


def _jit_vjp(fn, primals, cotangent):
    """(fn(*primals), its pullback of `cotangent`) from one jitted step (no op-by-op dispatch)."""

    def both(primals, cotangent):
        out, pullback = jax.vjp(fn, *primals)
        return out, pullback(cotangent)

    return jax.jit(both)(primals, cotangent)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_gradient_matches_float64(case):
    """dx, dweight, dbias and the initial states' gradient of the kernels against JAX's
    derivative of the reference in float64 on the same (rounded) inputs."""
    arrays = {k: v for k, v in _inputs(case).items() if v is not None}
    names = list(arrays)
    dout = jnp.asarray(np.random.default_rng(_seed(case[0]) + 1).standard_normal(
        arrays["x"].shape), case[8])

    def run(implementation, *values):
        return pallas_kernels.causal_conv1d(**dict(zip(names, values, strict=True)),
                                            activation=case[7], implementation=implementation,
                                            interpret=True)

    _, got = _jit_vjp(functools.partial(run, "pallas"), tuple(arrays.values()), dout)
    with jax.enable_x64(True):
        wide = tuple(jnp.asarray(np.asarray(v, np.float64)) for v in arrays.values())
        _, expected = _jit_vjp(functools.partial(run, "xla"), wide,
                               jnp.asarray(np.asarray(dout, np.float64)))
        expected = [np.asarray(g) for g in expected]
    for name, g, want in zip(names, got, expected, strict=True):
        assert g.dtype == arrays[name].dtype, name
        assert rel_error(g, want) < _tolerance(case[8]), name


def test_kernel_gradients_are_bitwise_reproducible():
    arrays = {k: v for k, v in _inputs(CASES[0]).items() if v is not None}

    def loss(*values):
        out = pallas_kernels.causal_conv1d(**dict(zip(arrays, values, strict=True)),
                                           implementation="pallas", interpret=True)
        return jnp.sum(out.astype(F32) ** 2)

    first, second = (jax.grad(loss, argnums=(0, 1, 2))(*arrays.values()) for _ in range(2))
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# (id, T, x's channels, column_offset, C, split, dtype): offsets and splits that are multiples
# of the kernels' channel block (128) read and write in place, the others are sliced.
COLUMN_CASES = [
    ("in-place-and-split", 70, 512, 128, 256, 128, F32),
    ("in-place-bf16", 64, 640, 256, 384, 256, BF16),
    ("in-place-one-output", 33, 384, 128, 256, None, F32),
    ("split-only", 40, 256, None, 256, 128, F32),
    ("sliced", 33, 300, 20, 200, 72, F32),
]


@pytest.mark.parametrize("case", COLUMN_CASES, ids=[c[0] for c in COLUMN_CASES])
def test_columns_of_a_wider_x_and_output_parts(case):
    """The conv over x's columns [column_offset, column_offset + C) with the output split at
    `split` equals the conv of those columns, split; every gradient (x's zero outside them)
    equals the reference's, through both parts' cotangents."""
    name, t, width_x, offset, c, split, dtype = case
    rng = np.random.default_rng(_seed(name))
    x, weight, bias, states = (jnp.asarray(rng.standard_normal(shape) * scale, dtype)
                               for shape, scale in (((2, t, width_x), 1.0), ((4, c), 0.5),
                                                    ((c,), 0.5), ((2, 3, c), 1.0)))
    parts = 1 if split is None else 2
    douts = [jnp.asarray(rng.standard_normal((2, t, width)), dtype)
             for width in ((c,) if split is None else (split, c - split))]

    def run(implementation, x, weight, bias, states):
        out = pallas_kernels.causal_conv1d(
            x, weight, bias, initial_states=states, column_offset=offset, split=split,
            implementation=implementation, interpret=True)
        return (out,) if split is None else out

    got, grads = _jit_vjp(functools.partial(run, "pallas"), (x, weight, bias, states),
                          tuple(douts))
    start = offset or 0
    whole = _expected(x[..., start:start + c], weight, bias, states, "silu")
    expected = (whole,) if split is None else (whole[..., :split], whole[..., split:])
    assert len(got) == parts
    for out, want in zip(got, expected, strict=True):
        assert out.dtype == dtype and out.shape == want.shape
        assert rel_error(out, want) < _tolerance(dtype)
    with jax.enable_x64(True):
        wide = tuple(jnp.asarray(np.asarray(v, np.float64)) for v in (x, weight, bias, states))
        _, want_grads = _jit_vjp(functools.partial(run, "xla"), wide,
                                 tuple(jnp.asarray(np.asarray(d, np.float64)) for d in douts))
    for name_, g, want in zip(("x", "weight", "bias", "initial_states"), grads, want_grads,
                              strict=True):
        assert g.shape == want.shape, name_
        assert rel_error(g, np.asarray(want)) < _tolerance(dtype), name_
    dx = np.asarray(grads[0], np.float32)
    assert not np.any(dx[..., :start]) and not np.any(dx[..., start + c:])


def test_aligned_columns_are_read_in_place():
    """At an offset and split that are multiples of 128 the kernels take x whole (no copy of
    its columns) and write the two parts themselves (no copy of the output)."""
    x = jnp.zeros((1, 16, 512), F32)

    def conv(x):
        return pallas_kernels.causal_conv1d(x, jnp.ones((4, 256), F32), column_offset=128,
                                            split=128, implementation="pallas", interpret=True)

    calls = [eqn for eqn in jax.make_jaxpr(conv)(x).jaxpr.eqns
             if eqn.primitive.name == "custom_vjp_call"]
    (call,) = calls
    assert call.invars[0].aval.shape == (1, 16, 512)
    assert [v.aval.shape for v in call.outvars] == [(1, 16, 128), (1, 16, 128)]


def test_packed_sequences_equal_separate_runs():
    """With seq_idx, each sequence of a packed row convolves as if alone (zeros before it)."""
    rng = np.random.default_rng(_seed("packed"))
    x = jnp.asarray(rng.standard_normal((1, 20, 16)), F32)
    weight = jnp.asarray(rng.standard_normal((4, 16)), F32)
    seq_idx = jnp.asarray([[0] * 7 + [1] * 9 + [2] * 4], jnp.int32)
    packed = pallas_kernels.causal_conv1d(x, weight, seq_idx=seq_idx)
    for start, stop in ((0, 7), (7, 16), (16, 20)):
        alone = pallas_kernels.causal_conv1d(x[:, start:stop], weight)
        np.testing.assert_allclose(packed[:, start:stop], alone, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kwargs, error, needle", [
    (dict(x=jnp.zeros((2, 8))), ValueError, "x must be (B, T, C)"),
    (dict(weight=jnp.zeros((4, 3))), ValueError, "weight must be (W, C)"),
    (dict(bias=jnp.zeros((3,))), ValueError, "bias must be (C,)"),
    (dict(initial_states=jnp.zeros((2, 2, 8))), ValueError, "initial_states must be"),
    (dict(seq_idx=jnp.zeros((2, 5))), TypeError, "seq_idx must be an integer array"),
    (dict(seq_idx=jnp.zeros((2, 4), jnp.int32)), ValueError, "seq_idx must be (2, 5)"),
    (dict(initial_seq_idx=jnp.zeros((2, 3), jnp.int32)), ValueError, "needs seq_idx"),
    (dict(activation="relu"), ValueError, "activation must be one of"),
    (dict(column_offset=2), ValueError, "column_offset must leave weight's C = 8"),
    (dict(column_offset=1.0), TypeError, "column_offset must be an int or None"),
    (dict(split=8), ValueError, "split must be in (0, C) = (0, 8)"),
    (dict(split="4"), TypeError, "split must be an int or None"),
])
def test_bad_arguments_raise_naming_them(kwargs, error, needle):
    call = dict(x=jnp.zeros((2, 5, 8)), weight=jnp.ones((4, 8)))
    call.update(kwargs)
    with pytest.raises(error) as info:
        pallas_kernels.causal_conv1d(call.pop("x"), call.pop("weight"), **call)
    assert needle in str(info.value)
