"""SSD kernels (interpret mode on CPU) against the token-by-token recurrence."""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_error
from ssd_cases import force_cut_walks, loss_and_grads, make_inputs

import pallas_kernels
from pallas_kernels.mamba2 import common, preprocess, reference, semantics, tuning, walks
from pallas_kernels.mamba2 import schedule as scheduling
from pallas_kernels.mamba2.schedule import Plan, Schedule

pallas = functools.partial(pallas_kernels.mamba_chunk_scan_combined, implementation="pallas")

CASES = [
    # (id, make_inputs kwargs, call kwargs)
    ("t1", dict(t=1), dict(chunk_size=16, dt_softplus=True)),
    ("t37-g2", dict(t=37), dict(chunk_size=16, dt_softplus=True)),
    ("t64-g1-chunk64", dict(t=64, g=1, d="h"), dict(chunk_size=64, dt_softplus=True)),
    ("t200-gH", dict(t=200, g=4, d=None, z=False), dict(chunk_size=64, dt_softplus=True)),
    ("seq-idx", dict(t=77, seq_idx=True), dict(chunk_size=16, dt_softplus=True)),
    ("seq-idx-g1-no-h0", dict(t=64, g=1, seq_idx=True, initial_states=False),
     dict(chunk_size=16, dt_softplus=True)),
    ("dt-limit-no-bias", dict(t=40, dt_bias=False), dict(chunk_size=16, dt_limit=(0.1, 0.6))),
    ("dt-limit-softplus", dict(t=40), dict(chunk_size=32, dt_softplus=True,
                                          dt_limit=(0.2, 0.5))),
    ("p80-n40-odd", dict(t=50, p=20, n=40, h=2, g=1), dict(chunk_size=16, dt_softplus=True)),
    # N above 128 (padded to 256, the widest state the kernels take), with packed sequences.
    ("n160-state-blocks", dict(t=40, p=8, n=160, h=2, g=1, seq_idx=True),
     dict(chunk_size=16, dt_softplus=True)),
    # 12 heads per group: the chunk-gradient kernel splits each group into blocks of 6 heads
    # (tuning's 8 rounded down to a divisor); the state-term kernel loops over all 12 for dB, dC.
    ("h24-g2-head-blocks", dict(t=40, h=24, g=2), dict(chunk_size=16, dt_softplus=True)),
    # An odd head count: the dt preprocessing kernel pads the 3 heads to its 16-head block.
    ("h3-odd-heads", dict(t=20, h=3, g=1), dict(chunk_size=16, dt_softplus=True)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_recurrence_float32(case):
    _, shape, kw = case
    args = make_inputs(zlib.crc32(case[0].encode()) % 1000, **shape)
    (y, final), grads = loss_and_grads(pallas, args, **kw)
    (y_ref, final_ref), grads_ref = loss_and_grads(reference.ssd_recurrence, args, **kw)
    assert y.shape == y_ref.shape and y.dtype == args["x"].dtype
    assert final.dtype == jnp.float32
    assert rel_error(y, y_ref) < 2e-5
    assert rel_error(final, final_ref) < 2e-5
    for name, grad in grads.items():
        assert grad.shape == args[name].shape, name
        assert np.all(np.isfinite(np.asarray(grad))), name
        assert rel_error(grad, grads_ref[name]) < 5e-5, name


def _static(**fields):
    """A Static for interpret mode, without optional inputs unless `fields` say otherwise."""
    kw = dict(has_seq_idx=False, has_d=False, has_z=False, has_initial_states=False,
              seq_len=16, dt_softplus=True, dt_limit=(0.0, float("inf")), interpret=True)
    return common.Static(**(kw | fields))


# Cuts of the scan kernels' walks (schedule.Schedule) on 8 walks (2 rows x 4 heads) of 150 tokens
# = 10 chunks of 16: (id, forward schedule, backward's walks cut into 5 units too). Where the
# forward cuts its walks, the backward's state recompute runs the forward's programs from the
# states they started from; otherwise it walks the backward's cut, from segment sums.
SCHEDULES = [
    # The forward's walks uncut, the backward's in 5 parts.
    ("backward-only", Schedule(1, 1, 0), True),
    # Every walk in 5 parts of 2 chunks (few walks), the backward's as well.
    ("five-parts", Schedule(5, 1, 0), True),
    # Halves of 5 chunks; the backward's walks uncut.
    ("halves", Schedule(2, 1, 0), False),
    # Every walk split into 5 units (one part, all walks split).
    ("all-split", Schedule(5, 5, 8), False),
    # Walks 2-7 whole, walks 0-1 (the last round's) in 5 units; the backward's in 5 parts.
    ("last-round-split", Schedule(5, 5, 2), True),
    # Halves of 5 chunks; the first halves of walks 0-2 in 5 units of one chunk.
    ("halves-split", Schedule(10, 5, 3), True),
]


@pytest.mark.parametrize("case", SCHEDULES, ids=[c[0] for c in SCHEDULES])
def test_walk_parts_cover_every_unit_once(case):
    _, schedule, _ = case
    plan = Plan(num_chunks=10, walks=8, schedule=schedule, backward=schedule)
    seen = []
    for program in range(walks.num_programs(plan)):
        part = walks.walk_part(jnp.int32(program), plan)
        first, end = int(part.first_unit), int(part.end_unit)
        assert int(part.first_chunk) == first * plan.unit_chunks
        assert int(part.num_chunks) == (end - first) * plan.unit_chunks
        seen += [(int(part.walk), unit) for unit in range(first, end)]
    assert sorted(seen) == [(w, u) for w in range(8) for u in range(schedule.num_units)]


@pytest.mark.parametrize("seq_idx", [False, True], ids=["plain", "seq-idx"])
@pytest.mark.parametrize("case", SCHEDULES, ids=[c[0] for c in SCHEDULES])
def test_cut_walks_match_recurrence(case, seq_idx, monkeypatch):
    # The scan kernels (forward, state recompute, state gradients) with their walks cut into
    # programs walked in parallel (walks.py), forced here at a small size.
    _, schedule, backward_split = case
    calls = force_cut_walks(monkeypatch, schedule, backward_split)
    args = make_inputs(12, t=150)
    if seq_idx:  # sequences start on a unit's first token (32, 80) and inside chunks (37, 75)
        ids = jnp.arange(150)
        args["seq_idx"] = jnp.stack([(ids >= 32).astype(jnp.int32) + (ids >= 75),
                                     (ids >= 37).astype(jnp.int32) + (ids >= 80)])
    kw = dict(chunk_size=16, dt_softplus=True)
    (y, final), grads = loss_and_grads(pallas, args, **kw)
    (y_ref, final_ref), grads_ref = loss_and_grads(reference.ssd_recurrence, args, **kw)
    # The forward, then the backward's state recompute (from sums only where the forward did not
    # cut its walks) and state gradients.
    backward = Schedule(5, 1, 0)
    forward_cut = schedule != Schedule(1, 1, 0)
    assert calls == ([("states", schedule)] if forward_cut else []) + (
        [("states", backward)] if backward_split and not forward_cut else []) + (
        [("gradients", backward)] if backward_split else [])
    assert rel_error(y, y_ref) < 2e-5
    assert rel_error(final, final_ref) < 2e-5
    for name, grad in grads.items():
        assert rel_error(grad, grads_ref[name]) < 5e-5, name


@pytest.mark.parametrize("walks, num_chunks, schedule", [
    # b 4 x 80 heads at T 4096 (64 chunks), 264 programs at once: the last round's 56 walks
    # split in 4 units.
    (320, 64, Schedule(4, 4, 56)),
    # b 2 x 80 heads at T 8192 (128 chunks): halves, the 56 first halves beyond one round split
    # in 4 units of 16 chunks (steps 64 + 16, sums for 640 units).
    (160, 128, Schedule(8, 4, 56)),
    # 160 walks of 16 chunks fit one round: no cut.
    (160, 16, Schedule(1, 1, 0)),
    # 4 walks of 2048 chunks: 64 parts each, 256 programs in one round.
    (4, 2048, Schedule(64, 1, 0)),
])
def test_forward_schedule_on_h200(walks, num_chunks, schedule):
    blocks = tuning.blocks_for("NVIDIA H200", 64)
    assert scheduling.forward_schedule(walks, num_chunks, 264, blocks) == schedule


@pytest.mark.parametrize(
    "heads,softplus,limit,bias",
    [(12, True, (0.0, float("inf")), True), (5, False, (0.1, 0.6), False),
     (24, True, (0.2, 0.5), True)],
)
def test_preprocess_kernel_matches_xla(heads, softplus, limit, bias):
    """dt' and the in-chunk log2 cumsum s from the kernel against jnp: padding tokens zero."""
    t, t_pad, q = 77, 96, 32
    keys = jax.random.split(jax.random.key(8), 3)
    dt = jax.random.normal(keys[0], (2, t, heads), jnp.bfloat16)
    dt_bias = jax.random.normal(keys[1], (heads,)) if bias else None
    A = -jnp.exp(jax.random.normal(keys[2], (heads,)))
    static = _static(seq_len=t, dt_softplus=softplus, dt_limit=limit)
    padded = jnp.pad(dt, ((0, 0), (0, t_pad - t), (0, 0)), constant_values=3.0)
    step, s = preprocess.preprocess(padded, dt_bias, A, None, static=static, block_t=q)
    step_ref = semantics.step_sizes(dt, dt_bias, softplus, limit, jnp.float32)
    step_ref = jnp.swapaxes(step_ref, 1, 2)
    step_ref = jnp.pad(step_ref, ((0, 0), (0, 0), (0, t_pad - t)))
    np.testing.assert_array_equal(np.asarray(step), np.asarray(step_ref))
    s_ref = common.chunk_log2_decays(step_ref, A, q)
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_ref), rtol=1e-6, atol=1e-6)


def test_dt_limit_clamp_has_zero_gradient():
    args = make_inputs(3, t=32, dt_bias=False)
    (_, _), grads = loss_and_grads(pallas, args, chunk_size=16, dt_limit=(0.3, 0.4))
    clamped = np.asarray((args["dt"] < 0.3) | (args["dt"] > 0.4))
    assert clamped.any() and not clamped.all()
    assert np.all(np.asarray(grads["dt"])[clamped] == 0)


def test_bf16_relative_error_bound():
    args = make_inputs(4, t=100, h=4, p=32, n=32, g=2, dtype=jnp.bfloat16)
    kw = dict(chunk_size=32, dt_softplus=True)
    (y, final), grads = loss_and_grads(pallas, args, **kw)
    upcast = {k: (v.astype(jnp.float32) if v is not None and v.dtype == jnp.bfloat16 else v)
              for k, v in args.items()}
    (y_ref, final_ref), grads_ref = loss_and_grads(reference.ssd_recurrence, upcast, **kw)
    assert y.dtype == jnp.bfloat16
    assert rel_error(y, y_ref) < 2e-2
    assert rel_error(final, final_ref) < 2e-2
    for name, grad in grads.items():
        assert rel_error(grad, grads_ref[name]) < 3e-2, name


def test_extreme_decays_stay_finite():
    args = make_inputs(5, t=70, d="h")
    args["dt"] = jnp.where(jnp.arange(70)[None, :, None] % 3 == 0, 20.0, -20.0) * jnp.ones_like(
        args["dt"]
    )
    args["A"] = jnp.array([-100.0, -50.0, -1e-3, -10.0])
    (y, final), grads = loss_and_grads(pallas, args, chunk_size=16, dt_softplus=True)
    (y_ref, _), _ = loss_and_grads(reference.ssd_recurrence, args, chunk_size=16,
                                   dt_softplus=True)
    for value in (y, final, *grads.values()):
        assert np.all(np.isfinite(np.asarray(value)))
    assert rel_error(y, y_ref) < 1e-4


def test_bitwise_deterministic():
    args = make_inputs(6, t=64, h=4, g=1, dtype=jnp.bfloat16, seq_idx=True)
    run = jax.jit(lambda a: loss_and_grads(pallas, a, chunk_size=16, dt_softplus=True))
    first, second = run(args), run(args)
    for x, y in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def test_xla_implementation_is_the_chunked_reference():
    args = make_inputs(7, t=33)
    ours = pallas_kernels.mamba_chunk_scan_combined(**args, chunk_size=16, implementation="xla")
    ref = reference.mamba_chunk_scan_combined(**args, chunk_size=16)
    assert np.array_equal(np.asarray(ours), np.asarray(ref))
    default = pallas_kernels.mamba_chunk_scan_combined(**args, chunk_size=16)  # CPU: reference
    assert np.array_equal(np.asarray(default), np.asarray(ref))


def _bad_calls():
    a = make_inputs(0, t=8, h=4, p=8, n=16, g=2, seq_idx=True)
    return [
        ("x rank", dict(a, x=a["x"][0]), ValueError, "x"),
        ("x int", dict(a, x=a["x"].astype(jnp.int32)), TypeError, "x"),
        ("dt shape", dict(a, dt=a["dt"][:, :4]), ValueError, "dt"),
        ("A shape", dict(a, A=a["A"][:2]), ValueError, "A"),
        ("groups", dict(a, B=jnp.zeros((2, 8, 3, 16)), C=jnp.zeros((2, 8, 3, 16))), ValueError,
         "groups"),
        ("C shape", dict(a, C=a["C"][..., :8]), ValueError, "C"),
        ("D shape", dict(a, D=jnp.zeros((4, 3))), ValueError, "D"),
        ("z shape", dict(a, z=a["z"][:, :4]), ValueError, "z"),
        ("dt_bias shape", dict(a, dt_bias=jnp.zeros((2,))), ValueError, "dt_bias"),
        ("initial_states", dict(a, initial_states=jnp.zeros((2, 4, 8, 8))), ValueError,
         "initial_states"),
        ("seq_idx shape", dict(a, seq_idx=a["seq_idx"][:, :4]), ValueError, "seq_idx"),
        ("seq_idx dtype", dict(a, seq_idx=a["seq_idx"].astype(jnp.float32)), TypeError, "seq_idx"),
        ("dt_limit", dict(a, dt_limit=(1.0, 0.5)), ValueError, "dt_limit"),
        ("implementation", dict(a, implementation="triton"), ValueError, "implementation"),
    ]


@pytest.mark.parametrize("name,kwargs,error,needle", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_input_raises_before_tracing(name, kwargs, error, needle, monkeypatch):
    from pallas_kernels.mamba2 import api

    def no_kernel(*args, **kw):
        raise AssertionError("a kernel was traced")

    monkeypatch.setattr(api, "_pallas_ssd", no_kernel)
    monkeypatch.setattr(api.reference, "mamba_chunk_scan_combined", no_kernel)
    with pytest.raises(error, match=needle):
        pallas_kernels.mamba_chunk_scan_combined(**dict(kwargs, chunk_size=16))


@pytest.mark.parametrize("chunk_size", [0, 48, 1.5, -16])
def test_chunk_size_must_be_a_power_of_two(chunk_size):
    args = make_inputs(0, t=8)
    with pytest.raises(ValueError, match="chunk_size"):
        pallas_kernels.mamba_chunk_scan_combined(**args, chunk_size=chunk_size)


@pytest.mark.parametrize("d", ["h", "hp"])
def test_state_update_stepped_equals_scan(d):
    args = make_inputs(8, t=20, h=4, p=8, n=16, g=2, d=d)
    kw = dict(dt_softplus=True)
    y_scan, final_scan = pallas(**args, chunk_size=16, return_final_states=True, **kw)

    def step(state, t):
        y, state = pallas_kernels.selective_state_update(
            state, args["x"][:, t], args["dt"][:, t], args["A"], args["B"][:, t], args["C"][:, t],
            D=args["D"], z=args["z"][:, t], dt_bias=args["dt_bias"], implementation="pallas",
            **kw,
        )
        return state, y

    final, ys = jax.lax.scan(step, args["initial_states"], jnp.arange(20))
    assert rel_error(jnp.moveaxis(ys, 0, 1), y_scan) < 2e-5
    assert rel_error(final, final_scan) < 2e-5


def test_state_update_gradients_match_reference():
    args = make_inputs(9, t=1, h=4, p=8, n=16, g=2)
    step_args = [args["initial_states"], args["x"][:, 0], args["dt"][:, 0], args["A"],
                 args["B"][:, 0], args["C"][:, 0], args["D"], args["z"][:, 0], args["dt_bias"]]

    def loss(fn, *values):
        y, state = fn(*values, dt_softplus=True)
        return jnp.sum(y * 1.5) + jnp.sum(jnp.sin(state))

    ours = functools.partial(pallas_kernels.selective_state_update, implementation="pallas")
    grads = jax.grad(functools.partial(loss, ours), argnums=range(9))(*step_args)
    grads_ref = jax.grad(functools.partial(loss, reference.selective_state_update),
                         argnums=range(9))(*step_args)
    for g, r in zip(grads, grads_ref, strict=True):
        assert rel_error(g, r) < 1e-5


def test_state_update_bad_input():
    args = make_inputs(0, t=1, h=4, p=8, n=16, g=2)
    with pytest.raises(ValueError, match="state"):
        pallas_kernels.selective_state_update(
            args["initial_states"][..., :8], args["x"][:, 0], args["dt"][:, 0], args["A"],
            args["B"][:, 0], args["C"][:, 0],
        )
    with pytest.raises(ValueError, match="groups"):
        pallas_kernels.selective_state_update(
            args["initial_states"], args["x"][:, 0], args["dt"][:, 0], args["A"],
            jnp.zeros((2, 3, 16)), jnp.zeros((2, 3, 16)),
        )
