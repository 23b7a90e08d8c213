"""The SSD answers right or refuses: step sizes as mamba_ssm's, recurring sequence ids, checked
arguments, second-order derivatives, and non-finite values that stay where they belong.

Both paths (the Pallas kernels in interpret mode and the chunked jnp reference) are compared
with a token recurrence written here, in numpy float64, independently of the package.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_error
from ssd_cases import make_inputs

import pallas_kernels
from pallas_kernels.mamba2 import api

PATHS = {
    "pallas": functools.partial(pallas_kernels.mamba_chunk_scan_combined,
                                implementation="pallas", interpret=True),
    "xla": functools.partial(pallas_kernels.mamba_chunk_scan_combined, implementation="xla"),
}


def numpy_recurrence(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, initial_states=None,
                     seq_idx=None, dt_softplus=False, dt_limit=(0.0, math.inf)):
    """(y, final state) token by token in float64: mamba_ssm's semantics, written from its
    documentation (dt' = clamp(softplus?(dt + bias)), reset where seq_idx changes)."""
    x, dt, A, B, C = (np.asarray(v, np.float64) for v in (x, dt, A, B, C))
    b, t, h, p = x.shape
    n = B.shape[-1]
    group = np.arange(h) // (h // B.shape[2])
    u = dt + (0.0 if dt_bias is None else np.asarray(dt_bias, np.float64))
    if dt_softplus:
        u = np.where(u > 20.0, u, np.log1p(np.exp(np.minimum(u, 20.0))))
    step = np.clip(u, *dt_limit)
    state = (np.zeros((b, h, p, n)) if initial_states is None
             else np.array(initial_states, np.float64))
    y = np.zeros_like(x)
    for i in range(t):
        if seq_idx is not None and i > 0:
            state[np.asarray(seq_idx)[:, i] != np.asarray(seq_idx)[:, i - 1]] = 0.0
        decay = np.exp(step[:, i] * A)  # (b, h)
        update = (step[:, i, :, None] * x[:, i])[..., None] * B[:, i][:, group][:, :, None, :]
        state = decay[..., None, None] * state + update
        y[:, i] = np.einsum("bhpn,bhn->bhp", state, C[:, i][:, group])
    if D is not None:
        D = np.asarray(D, np.float64)
        y += (D[:, None] if D.ndim == 1 else D) * x
    if z is not None:
        z = np.asarray(z, np.float64)
        y *= z / (1.0 + np.exp(-z))
    return y, state


def _ssd(path, args, **kw):
    return PATHS[path](**args, chunk_size=16, return_final_states=True, **kw)



# --------------------------------------------------------------------------------------------
# Step sizes: dt' = clamp(softplus?(dt + dt_bias), dt_limit), the clamp always applied.

STEP_CASES = [
    # Raw negative dts with the default limit (0, inf): mamba_ssm clamps them to 0.
    ("negative-raw-default-limit", dict(), dict()),
    ("negative-raw-with-bias", dict(dt_bias=True), dict(dt_limit=(0.0, 0.4))),
    ("softplus-in-limits", dict(dt_bias=True), dict(dt_softplus=True, dt_limit=(0.3, 0.5))),
    ("softplus-zero-low", dict(dt_bias=True), dict(dt_softplus=True, dt_limit=(0.0, 0.25))),
]


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("case", STEP_CASES, ids=[c[0] for c in STEP_CASES])
def test_step_sizes_match_an_independent_recurrence(case, path):
    _, shape, kw = case
    args = make_inputs(31, t=40, z=False, dt_bias=shape.get("dt_bias", False))
    args["dt"] = args["dt"] * 2.0  # about half the raw steps negative
    assert float(jnp.mean(args["dt"] < 0)) > 0.3
    y, final = _ssd(path, args, **kw)
    y_ref, final_ref = numpy_recurrence(**args, **kw)
    assert rel_error(y, y_ref) < 2e-5
    assert rel_error(final, final_ref) < 2e-5


def test_step_size_gradients_agree_between_paths():
    # The clamp's gradient is zero outside the limits on both paths.
    args = make_inputs(32, t=40, dt_bias=True)
    args["dt"] = args["dt"] * 2.0
    names = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")

    def grads(path):
        def loss(*values):
            y, final = _ssd(path, dict(args, **dict(zip(names, values, strict=True))),
                            dt_limit=(0.0, 0.4))
            return jnp.sum(y * jnp.cos(y)) + jnp.sum(final)
        return jax.grad(loss, argnums=tuple(range(len(names))))(*(args[n] for n in names))

    for name, ours, ref in zip(names, grads("pallas"), grads("xla"), strict=True):
        assert rel_error(ours, ref) < 5e-5, name
    dt_grad = grads("xla")[1]
    clamped = np.asarray(args["dt"] + args["dt_bias"] < 0) | np.asarray(
        args["dt"] + args["dt_bias"] > 0.4)
    assert clamped.any() and np.all(np.asarray(dt_grad)[clamped] == 0)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_positive_A_under_jit_acts_as_zero(path):
    args = make_inputs(33, t=24)
    positive = args["A"].at[1].set(0.7)
    zero = args["A"].at[1].set(0.0)
    run = jax.jit(lambda a: _ssd(path, dict(args, A=a), dt_softplus=True))
    for ours, ref in zip(run(positive), run(zero), strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_zero_A_gets_the_recurrence_gradient(path):
    """A == 0 (no decay) sits where the reference clamps a positive log decay: the gradient
    there is the recurrence's whole one, not half of it (a minimum splits it at the tie)."""
    args = make_inputs(37, t=40, h=4)
    args["A"] = jnp.array([0.0, -0.5, 0.7, -2.0], jnp.float32)

    def d_a(fn):
        def loss(a):
            y, final = fn(**dict(args, A=a), chunk_size=CHUNK, dt_softplus=True,
                          return_final_states=True)
            return jnp.sum(jnp.sin(y)) + jnp.sum(final)
        return np.asarray(jax.jit(jax.grad(loss))(args["A"]))

    ours, want = d_a(PATHS[path]), d_a(ORACLE["recurrence"])
    assert want[0] != 0 and want[2] == 0
    np.testing.assert_allclose(ours, want, rtol=2e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------
# seq_idx: a new sequence wherever the id changes, recurring ids included.

def _recurring_ids(t):
    """Row 0: ids 0, 1, 0, 2, 0 in runs that start inside chunks; row 1: 5, 5, ..., 3, 5."""
    i = np.arange(t)
    row0 = np.select([i < 10, i < 23, i < 41, i < 50], [0, 1, 0, 2], 0)
    row1 = np.where((i >= 30) & (i < 33), 3, 5)
    return jnp.asarray(np.stack([row0, row1]), jnp.int32)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_recurring_sequence_ids_reset_where_the_id_changes(path):
    args = dict(make_inputs(34, t=61), seq_idx=_recurring_ids(61))
    y_ref, final_ref = numpy_recurrence(**args, dt_softplus=True)
    for chunk_size in (16, 32, 64):
        y, final = PATHS[path](**args, chunk_size=chunk_size, dt_softplus=True,
                               return_final_states=True)
        assert rel_error(y, y_ref) < 2e-5, chunk_size
        assert rel_error(final, final_ref) < 2e-5, chunk_size


def test_int64_sequence_ids_are_compared_at_their_width():
    with jax.enable_x64(True):
        args = make_inputs(35, t=20, h=2, g=1, dtype=jnp.float32)
        ids = np.where(np.arange(20) < 9, 0, 2**32)  # the same id once cast to int32
        args["seq_idx"] = jnp.asarray(np.stack([ids, ids]), jnp.int64)
        y_ref, _ = numpy_recurrence(**args, dt_softplus=True)
        for path in PATHS:
            y, _ = _ssd(path, args, dt_softplus=True)
            assert rel_error(y, y_ref) < 2e-5, path


def test_float64_final_states_come_back_float64_on_both_paths():
    with jax.enable_x64(True):
        args = make_inputs(36, t=20, h=2, g=1, dtype=jnp.float64)
        finals = {path: _ssd(path, args, dt_softplus=True)[1] for path in PATHS}
        assert {f.dtype for f in finals.values()} == {jnp.dtype(jnp.float64)}


# --------------------------------------------------------------------------------------------
# Every float argument checked for finiteness and sign, every flag for bool.

def _bad_arguments():
    a = make_inputs(0, t=8, h=4, p=8, n=16, g=2)
    inf = math.inf
    return [
        ("A positive", dict(a, A=a["A"].at[2].set(0.5)), ValueError, "A must be <= 0"),
        ("A NaN", dict(a, A=a["A"].at[0].set(jnp.nan)), ValueError, "A must be <= 0"),
        ("dt_limit negative low", dict(a, dt_limit=(-0.1, 1.0)), ValueError, "dt_limit"),
        ("dt_limit low > high", dict(a, dt_limit=(0.5, 0.1)), ValueError, "dt_limit"),
        ("dt_limit inf inf", dict(a, dt_limit=(inf, inf)), ValueError, "dt_limit"),
        ("dt_limit NaN", dict(a, dt_limit=(0.0, math.nan)), ValueError, "dt_limit"),
        ("dt_limit bool", dict(a, dt_limit=(False, 1.0)), ValueError, "dt_limit"),
        ("dt_limit one value", dict(a, dt_limit=0.5), ValueError, "dt_limit"),
        ("chunk_size bool", dict(a, chunk_size=True), ValueError, "chunk_size"),
        ("dt_softplus str", dict(a, dt_softplus="yes"), TypeError, "dt_softplus"),
        ("return_final_states int", dict(a, return_final_states=1), TypeError,
         "return_final_states"),
        ("interpret int", dict(a, interpret=1), TypeError, "interpret"),
    ]


@pytest.mark.parametrize("name,kwargs,error,needle", _bad_arguments(),
                         ids=[c[0] for c in _bad_arguments()])
def test_bad_values_raise_before_tracing(name, kwargs, error, needle, monkeypatch):
    monkeypatch.setattr(api, "_pallas_ssd", lambda *a, **k: pytest.fail("a kernel was traced"))
    kwargs = {"chunk_size": 16, "implementation": "pallas", **kwargs}
    with pytest.raises(error, match=needle):
        pallas_kernels.mamba_chunk_scan_combined(**kwargs)


def test_numpy_bools_and_infinite_high_limit_are_accepted():
    args = make_inputs(37, t=8)
    pallas_kernels.mamba_chunk_scan_combined(**args, chunk_size=16, dt_softplus=np.bool_(True),
                                             dt_limit=(0.0, math.inf))


def test_decode_step_checks_its_arguments_too():
    a = make_inputs(38, t=1, h=4, p=8, n=16, g=2)
    step = dict(state=a["initial_states"], x=a["x"][:, 0], dt=a["dt"][:, 0], A=a["A"],
                B=a["B"][:, 0], C=a["C"][:, 0])
    with pytest.raises(ValueError, match="A must be <= 0"):
        pallas_kernels.selective_state_update(**dict(step, A=-step["A"]))
    with pytest.raises(ValueError, match="dt_limit"):
        pallas_kernels.selective_state_update(**step, dt_limit=(-1.0, 1.0))
    # The step clamps like the scan: a negative raw dt takes no step.
    negative = dict(step, dt=-jnp.abs(step["dt"]))
    for implementation in ("pallas", "xla"):
        _, new_state = pallas_kernels.selective_state_update(
            **negative, implementation=implementation, interpret=True)
        np.testing.assert_allclose(np.asarray(new_state), np.asarray(step["state"]), rtol=1e-6)


# --------------------------------------------------------------------------------------------
# Second-order derivatives: the Pallas path's backward differentiates through the reference.

def test_grad_of_grad_and_hessian_match_the_reference():
    args = make_inputs(39, b=1, t=20, h=2, p=4, n=8, g=1)

    def loss(path, x, dt):
        y, final = _ssd(path, dict(args, x=x, dt=dt), dt_softplus=True)
        return jnp.sum(jnp.sin(y)) + jnp.sum(final**2)

    for order in ("grad-of-grad", "hessian"):
        results = {}
        for path in PATHS:
            f = functools.partial(loss, path)
            if order == "hessian":
                derivative = jax.hessian(f, argnums=1)
            else:
                inner = jax.grad(f, argnums=(0, 1))
                derivative = jax.grad(lambda x, dt, inner=inner: jnp.sum(jnp.stack(
                    [jnp.sum(g**2) for g in inner(x, dt)])), argnums=(0, 1))
            results[path] = jax.jit(derivative)(args["x"], args["dt"])  # eager: 4x slower
        for ours, ref in zip(jax.tree.leaves(results["pallas"]), jax.tree.leaves(results["xla"]),
                             strict=True):
            assert np.all(np.isfinite(np.asarray(ours))), order
            assert rel_error(ours, ref) < 1e-4, order


# --------------------------------------------------------------------------------------------
# Non-finite values: outputs and gradients are finite, and right, wherever those of the token
# recurrence (`reference.ssd_recurrence`, autodiffed) are, except at the other tokens of the
# chunk a non-finite value sits in: a matmul over the chunk's tokens multiplies it by the zero
# that masks it (README "Known limits").

CHUNK = 16  # the chunk of both paths at chunk_size=16
NAN_INPUTS = ("x", "B", "C", "dt")
PER_TOKEN = ("x", "B", "C", "dt")
ORACLE = dict(PATHS, recurrence=pallas_kernels.mamba2.reference.ssd_recurrence)


def _poisoned(args, name, token):
    return dict(args, **{name: args[name].at[:, token].set(jnp.nan)})


def _outputs_and_grads(path, args, loss_tokens):
    """(y, {name: gradient}) of sum(y[:, loss_tokens] * w) w.r.t. x, B, C and dt."""
    def loss(*values):
        y = ORACLE[path](**dict(args, **dict(zip(PER_TOKEN, values, strict=True))),
                         chunk_size=CHUNK, dt_softplus=True)
        w = jnp.cos(jnp.arange(y[:, loss_tokens].size, dtype=jnp.float32))
        return jnp.sum(y[:, loss_tokens].ravel() * w), y

    grads, y = jax.grad(loss, argnums=tuple(range(len(PER_TOKEN))), has_aux=True)(
        *(args[n] for n in PER_TOKEN))
    return y, dict(zip(PER_TOKEN, grads, strict=True))


def _check_against_recurrence(path, args, loss_tokens, nan_token):
    """Ours equal the recurrence's outputs and gradients wherever those are finite, outside
    the chunk of `nan_token` (some outputs there are)."""
    exempt = slice(nan_token // CHUNK * CHUNK, (nan_token // CHUNK + 1) * CHUNK)
    y, grads = _outputs_and_grads(path, args, loss_tokens)
    y_rec, grads_rec = _outputs_and_grads("recurrence", args, loss_tokens)
    pairs = [("y", y, y_rec)] + [(f"d{n}", grads[n], grads_rec[n]) for n in PER_TOKEN]
    for what, ours, ref in pairs:
        ours, ref = np.asarray(ours), np.asarray(ref)
        keep = np.isfinite(ref)
        keep[:, exempt] = False
        assert what != "y" or keep.any()
        assert np.all(np.isfinite(ours[keep])), what
        np.testing.assert_allclose(ours[keep], ref[keep], rtol=2e-4, atol=2e-5, err_msg=what)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("name", NAN_INPUTS)
def test_nan_in_a_later_token_reaches_no_earlier_chunk(name, path):
    args = make_inputs(40, t=64, initial_states=False, z=False)
    _check_against_recurrence(path, _poisoned(args, name, 37), slice(0, 32), 37)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("name", NAN_INPUTS)
def test_nan_in_another_sequence_stays_in_it(name, path):
    # Sequences [0, 20), [20, 40), [40, 64); the middle one's NaN at token 26 (chunk 1) must
    # not reach the other two, outside chunk 1, in the outputs or any per-token gradient.
    args = make_inputs(41, t=64, z=False)
    ids = np.digitize(np.arange(64), [20, 40])
    args["seq_idx"] = jnp.asarray(np.stack([ids, ids]), jnp.int32)
    _check_against_recurrence(path, _poisoned(args, name, 26), np.r_[0:16, 40:64], 26)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("name", ("B", "C", "dt"))
def test_nan_in_b_c_or_dt_spares_the_earlier_outputs_of_its_own_chunk(name, path):
    # Only x meets the masks inside a matmul over the chunk's tokens in the forward; B, C and
    # dt reach the outputs through selected scores and decays.
    args = make_inputs(42, t=32, initial_states=False)
    poisoned = _poisoned(args, name, 9)
    y = PATHS[path](**poisoned, chunk_size=CHUNK, dt_softplus=True)
    y_rec = ORACLE["recurrence"](**poisoned, chunk_size=CHUNK, dt_softplus=True)
    assert np.all(np.isfinite(np.asarray(y)[:, :9]))
    assert rel_error(np.asarray(y)[:, :9], np.asarray(y_rec)[:, :9]) < 2e-5
