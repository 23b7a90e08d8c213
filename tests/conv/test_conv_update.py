"""The causal conv's decode step (`causal_conv1d_update`): the kernel in interpret mode on CPU
against a float64 numpy step written here; stepping a sequence equals `causal_conv1d` over it;
the channels of a wider x read in place, with NaN planted in the columns it must not read; the
state updated in place; every gradient against the reference; the argument checks."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_error

import pallas_kernels

BF16, F32 = jnp.bfloat16, jnp.float32

# (id, B, C, W, bias, activation, x dtype, state dtype, column offset, x width)
CASES = [
    ("mixer-bf16", 3, 512, 4, True, "silu", BF16, BF16, None, 512),
    ("odd-c-f32-state", 2, 200, 4, True, "silu", BF16, F32, None, 200),
    ("f32", 1, 256, 4, False, None, F32, F32, None, 256),
    ("width-2", 2, 64, 2, True, "silu", F32, F32, None, 64),
    ("width-8", 2, 300, 8, True, "silu", F32, F32, None, 300),
    ("in-place", 2, 300, 4, True, "silu", BF16, BF16, 256, 700),
    ("sliced", 2, 256, 4, True, "silu", F32, F32, 44, 333),
]


def _arrays(case):
    name, b, c, w, bias, _, x_dtype, state_dtype, _, width = case
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return dict(x=jnp.asarray(rng.standard_normal((b, width)), x_dtype),
                conv_state=jnp.asarray(rng.standard_normal((b, w - 1, c)), state_dtype),
                weight=jnp.asarray(rng.standard_normal((w, c)) * 0.5, F32),
                bias=jnp.asarray(rng.standard_normal(c) * 0.5, F32) if bias else None)


def _token(case, x):
    offset = case[8] or 0
    return x[:, offset:offset + case[2]]


def _expected(case, x, conv_state, weight, bias):
    """float64 numpy: (out, new state). The state is rounded to x's dtype for the sum."""
    activation = case[5]
    token = np.asarray(_token(case, x), np.float64)
    rounded = np.asarray(conv_state.astype(x.dtype), np.float64)
    inputs = np.concatenate([rounded, token[:, None]], axis=1)
    out = np.einsum("bkc,kc->bc", inputs, np.asarray(weight, np.float64))
    if bias is not None:
        out = out + np.asarray(bias, np.float64)
    if activation == "silu":
        out = out / (1 + np.exp(-out))
    state = np.concatenate([np.asarray(conv_state, np.float64)[:, 1:],
                            np.asarray(_token(case, x).astype(conv_state.dtype),
                                       np.float64)[:, None]], axis=1)
    return out, state


def _update(case, implementation, **arrays):
    return pallas_kernels.causal_conv1d_update(
        arrays["x"], arrays["conv_state"], arrays["weight"], arrays["bias"],
        activation=case[5], column_offset=case[8], implementation=implementation)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_update_matches_float64(case, implementation):
    arrays = _arrays(case)
    out, state = _update(case, implementation, **arrays)
    want_out, want_state = _expected(case, **arrays)
    assert out.dtype == arrays["x"].dtype and out.shape == want_out.shape
    assert rel_error(out, want_out) < (2e-2 if out.dtype == BF16 else 2e-6)
    # The shifted rows are the state's own, the token in the state's dtype: exact.
    assert state.dtype == arrays["conv_state"].dtype
    np.testing.assert_array_equal(np.asarray(state, np.float64), want_state)


@pytest.mark.parametrize("case", [CASES[1], CASES[4]], ids=[CASES[1][0], CASES[4][0]])
def test_stepping_equals_the_conv_over_the_sequence(case):
    """Token by token from a state equals `causal_conv1d` over the tokens with that state as
    its initial states, and the final state holds the last W - 1 tokens."""
    _, b, c, w = case[:4]
    arrays = _arrays(case)
    xs = jnp.asarray(np.random.default_rng(3).standard_normal((b, 9, c)), arrays["x"].dtype)
    whole = pallas_kernels.causal_conv1d(xs, arrays["weight"], arrays["bias"],
                                         initial_states=arrays["conv_state"],
                                         activation=case[5], implementation="pallas")
    state, outs = arrays["conv_state"], []
    for t in range(xs.shape[1]):
        out, state = pallas_kernels.causal_conv1d_update(
            xs[:, t], state, arrays["weight"], arrays["bias"], activation=case[5],
            implementation="pallas")
        outs.append(out)
    np.testing.assert_allclose(np.asarray(jnp.stack(outs, axis=1), np.float32),
                               np.asarray(whole, np.float32), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(state, np.float32),
                                  np.asarray(xs[:, -(w - 1):].astype(state.dtype), np.float32))


@pytest.mark.parametrize("case", [CASES[1], CASES[5], CASES[6]],
                         ids=[CASES[1][0], CASES[5][0], CASES[6][0]])
def test_every_gradient_matches_the_reference(case):
    arrays = {k: v if v is None else v.astype(F32) for k, v in _arrays(case).items()}
    rng = np.random.default_rng(5)
    douts = [jnp.asarray(rng.standard_normal(s), F32)
             for s in ((case[1], case[2]), arrays["conv_state"].shape)]

    def grads(implementation):
        names = [k for k, v in arrays.items() if v is not None]

        def fn(*values):
            return _update(case, implementation, **{**arrays, **dict(zip(names, values,
                                                                          strict=True))})

        _, vjp = jax.vjp(fn, *(arrays[k] for k in names))
        return dict(zip(names, vjp(tuple(douts)), strict=True))

    got, want = grads("pallas"), grads("xla")
    for name, g in got.items():
        assert g.shape == arrays[name].shape, name
        assert rel_error(g, want[name]) < 1e-6, name


def test_columns_outside_the_conv_are_not_read():
    """NaN in x's columns before and after the conv's (read in place, the last channel block
    reaching past C) leaves the output and the state finite."""
    case = CASES[5]
    arrays = _arrays(case)
    offset, c = case[8], case[2]
    outside = (jnp.arange(case[9]) < offset) | (jnp.arange(case[9]) >= offset + c)
    arrays["x"] = jnp.where(outside, jnp.nan, arrays["x"])
    out, state = _update(case, "pallas", **arrays)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert np.all(np.isfinite(np.asarray(state, np.float32)))


def test_aligned_columns_are_read_in_place_and_the_state_updated_in_place():
    """At an offset that is a multiple of 256 the kernel takes x whole (no copy of its
    columns), and its new state aliases the state's buffer."""
    case = CASES[5]
    arrays = _arrays(case)
    jaxpr = jax.make_jaxpr(lambda x, s: _update(case, "pallas", x=x, conv_state=s,
                                                weight=arrays["weight"], bias=arrays["bias"]))
    eqns = [e for e in jaxpr(arrays["x"], arrays["conv_state"]).jaxpr.eqns
            if e.primitive.name == "custom_vjp_call"]
    (call,) = eqns
    assert call.invars[0].aval.shape == arrays["x"].shape
    (kernel,) = [e for e in call.params["call_jaxpr"].jaxpr.eqns
                 if e.primitive.name == "pallas_call"]
    assert kernel.params["input_output_aliases"] == ((1, 1),)  # state -> new state


@pytest.mark.parametrize("kwargs, error, needle", [
    (dict(x=jnp.zeros((2, 1, 8))), ValueError, "x must be (B, C)"),
    (dict(conv_state=None), TypeError, "conv_state must be an array"),
    (dict(conv_state=jnp.zeros((2, 2, 8))), ValueError, "conv_state must be (B, W - 1, C)"),
    (dict(conv_state=jnp.zeros((2, 3, 8), jnp.int32)), TypeError, "conv_state must be"),
    (dict(weight=jnp.ones((1, 8)), conv_state=jnp.zeros((2, 0, 8))), ValueError, "W >= 2"),
    (dict(weight=jnp.ones((4, 3))), ValueError, "weight must be (W, C)"),
    (dict(bias=jnp.zeros((3,))), ValueError, "bias must be (C,)"),
    (dict(activation="relu"), ValueError, "activation must be one of"),
    (dict(column_offset=2), ValueError, "column_offset must leave weight's C = 8"),
])
def test_bad_arguments_raise_naming_them(kwargs, error, needle):
    call = dict(x=jnp.zeros((2, 8)), conv_state=jnp.zeros((2, 3, 8)), weight=jnp.ones((4, 8)))
    call.update(kwargs)
    with pytest.raises(error) as info:
        pallas_kernels.causal_conv1d_update(call.pop("x"), call.pop("conv_state"),
                                            call.pop("weight"), **call)
    assert needle in str(info.value)
