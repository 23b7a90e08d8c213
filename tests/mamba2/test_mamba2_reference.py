"""The chunked SSD reference against the token-by-token recurrence, and the decode step."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mamba2 import reference, semantics

BATCH, HEADS, HEAD_DIM, STATE_DIM = 2, 4, 8, 16
LIMIT_DEFAULT = (0.0, float("inf"))
GRAD_ARGS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")

# XLA's CPU compile time dominates these tests; its backend optimisations buy nothing here.
jit = functools.partial(
    jax.jit,
    compiler_options={
        "xla_backend_optimization_level": 0,
        "xla_llvm_disable_expensive_passes": True,
    },
)


@pytest.fixture
def x64():
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


def rel_err(a, b):
    """||a - b|| / ||b|| (0 when both are 0)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    norm = np.linalg.norm(b)
    return np.linalg.norm(a - b) / norm if norm else np.linalg.norm(a)


@dataclasses.dataclass(frozen=True)
class Case:
    T: int
    chunk_size: int
    groups: int
    D: str | None = None  # None, "H" or "HP"
    z: bool = False
    dt_bias: bool = False
    dt_softplus: bool = False
    dt_limit: tuple[float, float] = LIMIT_DEFAULT
    initial_states: bool = False
    seq_idx: bool = False

    def __str__(self):
        flags = [f"T{self.T}", f"Q{self.chunk_size}", f"G{self.groups}"]
        flags += [f"D{self.D}"] if self.D else []
        names = ("z", "dt_bias", "dt_softplus", "initial_states", "seq_idx")
        flags += [name for name in names if getattr(self, name)]
        flags += ["dt_limit"] if self.dt_limit != LIMIT_DEFAULT else []
        return "-".join(flags)


LIMIT = (0.01, 0.2)
CASES = [
    Case(1, 16, 1),
    Case(1, 64, HEADS, D="HP", z=True, dt_bias=True, dt_softplus=True, initial_states=True,
         seq_idx=True),
    Case(37, 16, 1, D="H", z=True, dt_bias=True, dt_softplus=True, initial_states=True),
    Case(37, 16, 2, dt_limit=LIMIT, seq_idx=True),
    Case(37, 16, 2, D="H", dt_bias=True, initial_states=True, seq_idx=True),
    Case(37, 64, HEADS, D="HP", z=True, dt_bias=True, dt_softplus=True, dt_limit=LIMIT,
         initial_states=True, seq_idx=True),
    Case(64, 16, 2, D="H", initial_states=True, seq_idx=True),
    Case(64, 64, 1, D="HP", z=True, dt_bias=True, dt_softplus=True, initial_states=True),
    Case(64, 64, HEADS, z=True, dt_limit=LIMIT, seq_idx=True),
    Case(200, 16, 2, D="H", z=True, dt_bias=True, dt_softplus=True, dt_limit=LIMIT,
         initial_states=True, seq_idx=True),
    Case(200, 64, 1, D="HP", initial_states=True, seq_idx=True),
    Case(200, 64, HEADS, z=True, dt_bias=True, dt_softplus=True),
    Case(200, 16, HEADS, D="HP", z=True, dt_limit=LIMIT, initial_states=True, seq_idx=True),
    Case(200, 16, 1, D="H", z=True, dt_bias=True, dt_softplus=True, dt_limit=LIMIT,
         initial_states=True, seq_idx=True),
]


def make_seq_idx(T, chunk_size):
    """Row 0: boundaries inside chunks, at chunk edges and back to back; row 1: one sequence."""
    q = chunk_size
    starts = {1, 2, 5, q - 1, q, q + 3, q + 4, 2 * q + 7, 3 * q, T - 1}
    row = np.cumsum([t in starts for t in range(T)])
    return np.stack([row, np.full(T, 3)]).astype(np.int32)


def make_inputs(case, seed=0):
    """float64 numpy inputs; raw dt is spread around LIMIT when the clip is active."""
    rng = np.random.default_rng(seed)
    b, T, H, P, N, G = BATCH, case.T, HEADS, HEAD_DIM, STATE_DIM, case.groups
    if case.dt_softplus:
        dt = rng.normal(size=(b, T, H))
        if T > 3:
            dt[0, 3, 0] = 30.0  # the softplus(u) = u branch
    else:
        dt = rng.uniform(0.0, 0.3, (b, T, H))
    inputs = {
        "x": rng.normal(size=(b, T, H, P)),
        "dt": dt,
        "A": -np.exp(rng.uniform(np.log(0.3), np.log(3.0), H)),
        "B": rng.normal(size=(b, T, G, N)),
        "C": rng.normal(size=(b, T, G, N)),
    }
    if case.D is not None:
        inputs["D"] = rng.normal(size=(H,) if case.D == "H" else (H, P))
    if case.z:
        inputs["z"] = rng.normal(size=(b, T, H, P))
    if case.dt_bias:
        inputs["dt_bias"] = (
            rng.uniform(-4.0, -1.0, H) if case.dt_softplus else rng.uniform(0.0, 0.05, H)
        )
    if case.initial_states:
        inputs["initial_states"] = rng.normal(size=(b, H, P, N))
    return inputs


def run_with_grads(fn, case, inputs, cotangents):
    """y, final states and the gradients of sum(y * dy) + sum(final * dfinal) w.r.t. `inputs`."""
    seq_idx = jnp.asarray(make_seq_idx(case.T, case.chunk_size)) if case.seq_idx else None

    def loss(params):
        y, final = fn(
            **params,
            chunk_size=case.chunk_size,
            seq_idx=seq_idx,
            dt_softplus=case.dt_softplus,
            dt_limit=case.dt_limit,
            return_final_states=True,
        )
        return jnp.sum(y * cotangents[0]) + jnp.sum(final * cotangents[1]), (y, final)

    params = {k: jnp.asarray(v) for k, v in inputs.items()}
    (_, (y, final)), grads = jit(jax.value_and_grad(loss, has_aux=True))(params)
    return y, final, grads


@pytest.mark.parametrize("case", CASES, ids=str)
def test_chunked_matches_recurrence_float64(x64, case):
    inputs = make_inputs(case)
    rng = np.random.default_rng(1)
    x = inputs["x"]
    cotangents = (
        jnp.asarray(rng.normal(size=x.shape)),
        jnp.asarray(rng.normal(size=(BATCH, HEADS, HEAD_DIM, STATE_DIM))),
    )
    y, final, grads = run_with_grads(
        reference.mamba_chunk_scan_combined, case, inputs, cotangents
    )
    y_ref, final_ref, grads_ref = run_with_grads(
        reference.ssd_recurrence, case, inputs, cotangents
    )
    assert y.dtype == final.dtype == jnp.float64
    assert y.shape == x.shape and final.shape == cotangents[1].shape
    assert rel_err(y, y_ref) < 1e-10
    assert rel_err(final, final_ref) < 1e-10
    assert set(grads) == set(inputs) and set(grads) <= set(GRAD_ARGS)
    for name in grads:
        # A only acts through the decay, which has nothing to act on in a single token from zero.
        if name != "A" or case.T > 1 or case.initial_states:
            assert np.linalg.norm(grads_ref[name]) > 0, name
        assert rel_err(grads[name], grads_ref[name]) < 1e-10, name


def test_step_sizes_clamp_always_and_zero_the_gradient_outside(x64):
    dt = jnp.array([-1.0, 0.005, 0.01, 0.1, 0.2, 0.3])
    clamped = semantics.step_sizes(dt, dt_limit=LIMIT)
    np.testing.assert_array_equal(clamped, [0.01, 0.01, 0.01, 0.1, 0.2, 0.2])
    grad = jax.grad(lambda d: jnp.sum(semantics.step_sizes(d, dt_limit=LIMIT)))(dt)
    np.testing.assert_array_equal(grad, [0.0, 0.0, 1.0, 1.0, 1.0, 0.0])  # 1 on the limits
    # The default limit (0, inf) clamps too, as mamba_ssm's kernels: a negative dt' becomes 0.
    np.testing.assert_array_equal(semantics.step_sizes(dt), [0.0, 0.005, 0.01, 0.1, 0.2, 0.3])
    u = jnp.array([-30.0, 0.0, 19.0, 25.0])
    expected = np.where(np.asarray(u) > 20, u, np.log1p(np.exp(np.asarray(u))))
    np.testing.assert_allclose(semantics.step_sizes(u, dt_softplus=True), expected, rtol=1e-14)


def test_selective_state_update_steps_match_recurrence(x64):
    case = Case(37, 16, 2, D="HP", z=True, dt_bias=True, dt_softplus=True, initial_states=True)
    inputs = {k: jnp.asarray(v) for k, v in make_inputs(case, seed=2).items()}

    @jit
    def run(inputs):
        consts = {k: inputs[k] for k in ("A", "D", "dt_bias")}

        def step(state, token):
            x, dt, B, C, z = token
            y, state = reference.selective_state_update(
                state, x, dt, B=B, C=C, z=z, dt_softplus=True, **consts
            )
            return state, y

        tokens = tuple(jnp.moveaxis(inputs[k], 1, 0) for k in ("x", "dt", "B", "C", "z"))
        final, y = jax.lax.scan(step, inputs["initial_states"], tokens)
        expected = [
            fn(**inputs, chunk_size=case.chunk_size, dt_softplus=True, return_final_states=True)
            for fn in (reference.ssd_recurrence, reference.mamba_chunk_scan_combined)
        ]
        return (jnp.moveaxis(y, 0, 1), final), expected

    (y, final), expected = run(inputs)
    for y_ref, final_ref in expected:
        assert rel_err(y, y_ref) < 1e-10
        assert rel_err(final, final_ref) < 1e-10


def test_low_precision_dtypes_and_padding():
    """bfloat16 x, z, B, C: outputs in bfloat16, states in float32; T = 37 is padded to 48."""
    case = Case(37, 16, 2, D="H", z=True, initial_states=True)
    inputs = {
        k: jnp.asarray(v, jnp.bfloat16 if k in ("x", "z", "B", "C") else jnp.float32)
        for k, v in make_inputs(case, seed=3).items()
    }

    @jit
    def run(inputs):
        first = {k: inputs[k][:, 0] for k in ("x", "dt", "B", "C", "z")}
        return (
            reference.mamba_chunk_scan_combined(**inputs, chunk_size=16),
            reference.ssd_recurrence(**inputs, chunk_size=16, return_final_states=True),
            reference.selective_state_update(
                inputs["initial_states"], A=inputs["A"], D=inputs["D"], **first
            ),
        )

    y, (y_ref, final), (y_step, state) = run(inputs)
    assert y.dtype == y_ref.dtype == y_step.dtype == jnp.bfloat16
    assert y.shape == inputs["x"].shape
    assert final.dtype == state.dtype == jnp.float32
    assert rel_err(y, y_ref) < 2e-2


@pytest.mark.parametrize("softplus", [False, True])
def test_extreme_decays_stay_finite_float32(softplus):
    """dt' from ~1e-9 up to 20 with |A| up to 100: finite outputs and gradients in float32."""
    rng = np.random.default_rng(4)
    b, T, H, P, N, G = BATCH, 100, HEADS, HEAD_DIM, STATE_DIM, 2
    magnitude = rng.choice([1e-9, 1e-3, 1.0, 20.0], size=(b, T, H))
    # Raw dt giving those dt' through softplus (u > 20 takes the u branch, u = -20 gives ~2e-9).
    raw = np.where(magnitude == 20.0, 25.0, np.log(np.expm1(np.maximum(magnitude, 2e-9))))
    inputs = {
        "x": rng.normal(size=(b, T, H, P)),
        "dt": raw if softplus else magnitude,
        "A": -np.array([1e-3, 1.0, 30.0, 100.0]),
        "B": rng.normal(size=(b, T, G, N)),
        "C": rng.normal(size=(b, T, G, N)),
        "D": rng.normal(size=(H,)),
        "z": rng.normal(size=(b, T, H, P)),
        "dt_bias": np.zeros(H),
        "initial_states": rng.normal(size=(b, H, P, N)),
    }
    inputs = {k: jnp.asarray(v, jnp.float32) for k, v in inputs.items()}
    seq_idx = jnp.asarray(make_seq_idx(T, 16))

    def loss(params):
        y, final = reference.mamba_chunk_scan_combined(
            **params, chunk_size=16, seq_idx=seq_idx, dt_softplus=softplus,
            return_final_states=True,
        )
        return jnp.sum(y) + jnp.sum(final), (y, final)

    (_, (y, final)), grads = jit(jax.value_and_grad(loss, has_aux=True))(inputs)
    assert np.isfinite(y).all() and np.isfinite(final).all()
    for name, grad in grads.items():
        assert np.isfinite(grad).all(), name
