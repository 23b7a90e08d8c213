"""The causal conv (`causal_conv1d`): the kernels in interpret mode on CPU against a float64
numpy convolution written here, forward and every gradient; packed sequences (the reference)
against per-sequence runs; the argument checks."""

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

    got = jax.vjp(functools.partial(run, "pallas"), *arrays.values())[1](dout)
    with jax.enable_x64(True):
        wide = [jnp.asarray(np.asarray(v, np.float64)) for v in arrays.values()]
        expected = jax.vjp(functools.partial(run, "xla"), *wide)[1](
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
])
def test_bad_arguments_raise_naming_them(kwargs, error, needle):
    call = dict(x=jnp.zeros((2, 5, 8)), weight=jnp.ones((4, 8)))
    call.update(kwargs)
    with pytest.raises(error) as info:
        pallas_kernels.causal_conv1d(call.pop("x"), call.pop("weight"), **call)
    assert needle in str(info.value)
