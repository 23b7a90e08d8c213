"""Serving: the decode step on a cache of state slots (state_batch_indices, in place under
donation) and packed prefill (cu_seqlens, the sequences' final states), on both
implementations (Pallas in interpret mode on CPU), and their lowering for GPUs."""

import functools
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lowering_cases import TARGETS, TRITON_CALL
from numerics import rel_error
from ssd_cases import make_inputs

import pallas_kernels
from pallas_kernels import _compat
from pallas_kernels.mamba2 import reference

IMPLEMENTATIONS = ["pallas", "xla"]
SLOTS = 6
# Rows 0, 1, 3 step slots 4, 1, 0; row 2 is padding (-1) and row 4 out of range: both are
# padding rows (y 0, no slot touched). Slots 2, 3 and 5 are named by no row.
INDICES = np.array([4, 1, -1, 0, SLOTS], np.int32)
VALID = (INDICES >= 0) & (INDICES < SLOTS)


def _step_args(seed, b=5, dtype=jnp.float32):
    """(x, dt, A, B, C) and the arrays D, z, dt_bias of one decode step, b rows of 4 heads (P 8,
    N 16); the steps take dt_softplus=True."""
    a = make_inputs(seed, b=b, t=1, h=4, p=8, n=16, g=2)
    args = (a["x"][:, 0].astype(dtype), a["dt"][:, 0], a["A"], a["B"][:, 0], a["C"][:, 0])
    kw = dict(D=a["D"], z=a["z"][:, 0], dt_bias=a["dt_bias"])
    return args, kw


def _cache(dtype, seed=1):
    return jax.random.normal(jax.random.key(seed), (SLOTS, 4, 8, 16)).astype(dtype)


def _rows(tree, rows):
    """The per-row arrays of `tree` (leading dim b) at `rows`; the rest as they are."""
    return jax.tree.map(lambda v: v[rows] if jnp.ndim(v) and len(v) == len(INDICES) else v, tree)


@pytest.mark.parametrize("implementation, dtype", [
    ("pallas", jnp.float32), ("xla", jnp.float32), ("xla", jnp.bfloat16)])
def test_slots_step_like_the_dense_step_on_gathered_states(implementation, dtype):
    args, kw = _step_args(0)
    cache = _cache(dtype)
    rows = np.flatnonzero(VALID)

    @jax.jit
    def run(cache, args, kw):
        step = functools.partial(pallas_kernels.selective_state_update, dt_softplus=True,
                                 implementation=implementation)
        # The slots, then the dense step on the gathered slots of the real rows.
        return (step(cache, *args, **kw, state_batch_indices=jnp.asarray(INDICES)),
                step(cache[INDICES[rows]], *_rows(args, rows), **_rows(kw, rows)))

    (y, new_cache), (y_dense, stepped) = run(cache, args, kw)
    assert y.dtype == args[0].dtype and new_cache.dtype == dtype
    assert new_cache.shape == cache.shape
    assert stepped.dtype == dtype
    np.testing.assert_array_equal(np.asarray(y[rows]), np.asarray(y_dense))
    np.testing.assert_array_equal(np.asarray(new_cache[INDICES[rows]]), np.asarray(stepped))
    assert not np.any(np.asarray(y[~VALID]))  # padding rows
    untouched = np.setdiff1d(np.arange(SLOTS), INDICES)
    np.testing.assert_array_equal(np.asarray(new_cache[untouched]), np.asarray(cache[untouched]))

    # The float32 math of the reference, stored in the state's dtype.
    y_ref, ref_cache = jax.jit(functools.partial(
        reference.selective_state_update, dt_softplus=True))(
        cache, *args, **kw, state_batch_indices=jnp.asarray(INDICES))
    assert rel_error(y, y_ref) < 1e-6
    assert rel_error(new_cache.astype(jnp.float32), ref_cache.astype(jnp.float32)) < (
        1e-6 if dtype == jnp.float32 else 1e-2)


def test_slot_gradients_are_the_references():
    args, kw = _step_args(2)
    indices = jnp.asarray(INDICES)

    def loss(fn, cache, x, B):
        y, new_cache = fn(cache, x, args[1], args[2], B, args[4], **kw, dt_softplus=True,
                          state_batch_indices=indices)
        return jnp.sum(y * 1.5) + jnp.sum(jnp.sin(new_cache))

    ours = functools.partial(pallas_kernels.selective_state_update, implementation="pallas")
    grads, grads_ref = (jax.jit(jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2)))(
        _cache(jnp.float32), args[0], args[3]) for fn in (ours, reference.selective_state_update))
    for g, r in zip(grads, grads_ref, strict=True):
        assert rel_error(g, r) < 1e-6


def _state_sized_copies(hlo, state):
    """Lines of compiled HLO that copy an array of the state's shape."""
    shape = f"{jnp.dtype(state.dtype).name}[{','.join(map(str, state.shape))}]"
    return [line for line in hlo.splitlines()
            if re.search(r"\bcopy(-start)?\(", line) and shape in line.split("=")[1]]


@pytest.mark.parametrize("slots", [False, True], ids=["dense", "slots"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_donated_state_is_updated_in_place(slots, dtype):
    args, kw = _step_args(3)
    state = _cache(dtype) if slots else _cache(dtype)[:len(INDICES)]
    indices = jnp.asarray(INDICES) if slots else None

    def step(state):
        return pallas_kernels.selective_state_update(
            state, *args, **kw, dt_softplus=True, state_batch_indices=indices,
            implementation="pallas")

    compiled = jax.jit(step, donate_argnums=0).lower(state).compile()
    hlo = compiled.as_text()
    # The donated parameter 0 is output 1's buffer, and nothing state-sized is copied.
    assert re.search(r"input_output_alias=\{ \{1\}: \(0, \{\}, (may|must)-alias\) \}", hlo)
    assert not _state_sized_copies(hlo, state)
    expected = jax.jit(step)(state)
    donated = jnp.array(state)
    y, new_state = compiled(donated)
    assert donated.is_deleted()
    np.testing.assert_array_equal(np.asarray(new_state), np.asarray(expected[1]))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(expected[0]))


def test_state_batch_indices_bad_input():
    args, kw = _step_args(4)
    cache = _cache(jnp.float32)
    call = functools.partial(pallas_kernels.selective_state_update, cache, *args, **kw)
    with pytest.raises(ValueError, match="state_batch_indices"):
        call(state_batch_indices=jnp.asarray(INDICES[:3]))
    with pytest.raises(ValueError, match="state_batch_indices"):
        call(state_batch_indices=jnp.asarray(INDICES)[None])
    with pytest.raises(TypeError, match="state_batch_indices"):
        call(state_batch_indices=jnp.asarray(INDICES, jnp.float32))
    with pytest.raises(TypeError, match="state_batch_indices"):
        call(state_batch_indices=list(INDICES))
    with pytest.raises(ValueError, match="state"):  # the cache's heads must be x's
        pallas_kernels.selective_state_update(cache[:, :2], *args, **kw,
                                              state_batch_indices=jnp.asarray(INDICES))
    with pytest.raises(ValueError, match="state"):  # without indices: one state per row
        call()


# Packed prefill. Lengths 5, 37, 64 and 1 (107 tokens): with chunks of 16 the sequences start
# and end inside chunks, and 64 spans five; the second case adds empty sequences and chunks of
# 32.
PACKED = [("chunk16", (5, 37, 64, 1), 16), ("chunk32-empty", (0, 5, 37, 0, 64, 1), 32)]


def _packed(seed, lengths):
    args = make_inputs(seed, b=1, t=sum(lengths))
    bounds = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    return args, bounds


@functools.cache
def _alone(case):
    """Each sequence of a PACKED case sliced out and run alone (implementation "xla"), from
    initial_states if it holds token 0, else from zero: [(y, final state (H, P, N))], None for
    an empty sequence."""
    _, lengths, chunk_size = case
    args, _ = _packed(5, lengths)
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()

    @jax.jit
    def run(args):
        runs = []
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            own = {k: v[:, start:end] if k in ("x", "dt", "B", "C", "z") else v
                   for k, v in args.items()}
            if start > 0:
                own["initial_states"] = None
            runs.append(None if start == end else pallas_kernels.mamba_chunk_scan_combined(
                **own, chunk_size=chunk_size, dt_softplus=True, return_final_states=True,
                implementation="xla"))
        return runs

    return [None if r is None else (r[0], r[1][0]) for r in run(args)]


@pytest.mark.parametrize("implementation, case", [  # interpret mode is slow: one Pallas case
    ("pallas", PACKED[-1]), *[("xla", case) for case in PACKED]],
    ids=["pallas-" + PACKED[-1][0], *["xla-" + case[0] for case in PACKED]])
def test_varlen_states_equal_per_sequence_runs(implementation, case):
    _, lengths, chunk_size = case
    args, bounds = _packed(5, lengths)
    seq_idx = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None], jnp.int32)

    @jax.jit
    def run(args, bounds, seq_idx):
        call = functools.partial(pallas_kernels.mamba_chunk_scan_combined, **args,
                                 chunk_size=chunk_size, dt_softplus=True,
                                 implementation=implementation)
        return (call(cu_seqlens=bounds, return_final_states=True, return_varlen_states=True),
                call(seq_idx=seq_idx, return_final_states=True),
                call(cu_seqlens=bounds, return_varlen_states=True))

    (y, final, varlen), (y_seq, final_seq), only = run(args, bounds, seq_idx)
    assert varlen.shape == (len(lengths), 4, 8, 16) and varlen.dtype == jnp.float32
    # cu_seqlens alone marks the sequences: y is the seq_idx call's.
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_seq))
    np.testing.assert_array_equal(np.asarray(final), np.asarray(final_seq))
    assert np.array_equal(np.asarray(varlen[-1]), np.asarray(final[0]))
    # Only varlen_states asked for: (y, varlen_states), as mamba_ssm's.
    assert len(only) == 2
    np.testing.assert_array_equal(np.asarray(only[1]), np.asarray(varlen))
    for i, alone in enumerate(_alone(case)):
        if alone is None:  # an empty sequence
            assert not np.any(np.asarray(varlen[i])), i
            continue
        start, end = int(bounds[i]), int(bounds[i + 1])
        assert rel_error(y[:, start:end], alone[0]) < 2e-5, i
        assert rel_error(varlen[i], alone[1]) < 2e-5, i


def test_varlen_state_gradients_match_the_reference():
    args, bounds = _packed(6, PACKED[0][1])
    names = ("x", "dt", "A", "B", "C", "dt_bias", "initial_states")

    def loss(implementation, *values):
        y, varlen = pallas_kernels.mamba_chunk_scan_combined(
            **dict(args, **dict(zip(names, values, strict=True))), chunk_size=16,
            dt_softplus=True, cu_seqlens=bounds, return_varlen_states=True,
            implementation=implementation)
        return jnp.sum(y * 0.3) + jnp.sum(jnp.sin(varlen))

    values = [args[n] for n in names]
    grads, grads_ref = (jax.jit(jax.grad(functools.partial(loss, implementation),
                                         argnums=range(7)))(*values)
                        for implementation in ("pallas", "xla"))
    for name, g, r in zip(names, grads, grads_ref, strict=True):
        assert rel_error(g, r) < 5e-5, name


# mamba_ssm's `mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, ...)`, in its order.
MAMBA_SSM_ORDER = ("x", "dt", "A", "B", "C", "chunk_size", "D", "z", "dt_bias",
                   "initial_states", "seq_idx", "cu_seqlens", "dt_softplus", "dt_limit",
                   "return_final_states", "return_varlen_states")


def test_positional_call_means_what_mamba_ssm_means():
    parameters = inspect.signature(pallas_kernels.mamba_chunk_scan_combined).parameters
    assert tuple(parameters)[:len(MAMBA_SSM_ORDER)] == MAMBA_SSM_ORDER
    assert all(p.kind is p.KEYWORD_ONLY for p in tuple(parameters.values())[len(MAMBA_SSM_ORDER):])
    _, lengths, chunk_size = PACKED[0]
    args, bounds = _packed(5, lengths)  # the arrays of the tests above
    seq_idx = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None], jnp.int32)
    values = dict(args, seq_idx=seq_idx, cu_seqlens=bounds, chunk_size=chunk_size,
                  dt_softplus=True, dt_limit=(0.0, 2.0), return_final_states=True,
                  return_varlen_states=True)
    positional = [values[name] for name in MAMBA_SSM_ORDER]
    ssd = functools.partial(pallas_kernels.mamba_chunk_scan_combined, implementation="xla")
    # The same computation (traced, not compiled: the values are the reference's, tested above).
    by_position = jax.make_jaxpr(lambda: ssd(*positional))()
    assert str(by_position) == str(jax.make_jaxpr(lambda: ssd(**values))())
    assert len(by_position.out_avals) == 3  # y, final states, varlen states


def _bad_varlen_calls():
    a, bounds = _packed(0, [3, 5])
    two_rows = make_inputs(0, b=2, t=8)
    return [
        ("rank", dict(a, cu_seqlens=bounds[None]), ValueError),
        ("one entry", dict(a, cu_seqlens=bounds[:1]), ValueError),
        ("dtype", dict(a, cu_seqlens=bounds.astype(jnp.float32)), TypeError),
        ("batch", dict(two_rows, cu_seqlens=bounds), ValueError),
        ("end", dict(a, cu_seqlens=jnp.array([0, 3, 7], jnp.int32)), ValueError),
        ("falling", dict(a, cu_seqlens=jnp.array([0, 5, 3, 8], jnp.int32)), ValueError),
        ("seq_idx", dict(a, cu_seqlens=bounds, seq_idx=jnp.zeros((1, 8), jnp.int32)), ValueError),
        ("missing", dict(a), ValueError),
    ]


@pytest.mark.parametrize("kwargs,error", [c[1:] for c in _bad_varlen_calls()],
                         ids=[c[0] for c in _bad_varlen_calls()])
def test_bad_cu_seqlens_raise_before_tracing(kwargs, error, monkeypatch):
    from pallas_kernels.mamba2 import api

    def no_kernel(*args, **kw):
        raise AssertionError("a kernel was traced")

    monkeypatch.setattr(api, "_pallas_ssd", no_kernel)
    monkeypatch.setattr(api.reference, "mamba_chunk_scan_combined", no_kernel)
    with pytest.raises(error, match="cu_seqlens"):
        pallas_kernels.mamba_chunk_scan_combined(**kwargs, chunk_size=16,
                                                 return_varlen_states=True)


def _lower(fn, args, target, donate=()):
    device_kind, platform = TARGETS[target]
    with jax.sharding.use_abstract_mesh(_compat.abstract_gpu_mesh(device_kind, platform)):
        return jax.jit(fn, donate_argnums=donate).trace(*args).lower(
            lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("target", list(TARGETS))
def test_slot_update_lowers_in_place(target):
    # Mamba2-2.7B's mixer (80 heads of P 64, N 128, one group): 8 rows over a bf16 cache of 37
    # slots, donated: one Triton call, whose new state aliases the cache.
    b, h, p, n, slots = 8, 80, 64, 128, 37
    s, bf16, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    args = (s((slots, h, p, n), bf16), s((b, h, p), bf16), s((b, h), bf16), s((h,), f32),
            s((b, 1, n), bf16), s((b, 1, n), bf16), s((h,), f32), s((b, h, p), bf16),
            s((h,), f32), s((b,), jnp.int32))

    def step(state, x, dt, A, B, C, D, z, dt_bias, indices):
        return pallas_kernels.selective_state_update(
            state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True,
            state_batch_indices=indices)

    text = _lower(step, args, target, donate=0)
    assert text.count(TRITON_CALL) == 1
    assert re.search(r"%arg0: tensor<37x80x64x128xbf16> \{tf.aliasing_output = 1", text)
    assert "output_operand_aliases" in text


@pytest.mark.parametrize("target", list(TARGETS))
def test_varlen_prefill_lowers(target):
    # Three sequences packed into 300 tokens at the mixer shape (16 heads), bf16.
    t, h, p, n = 300, 16, 64, 128
    s, bf16, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    args = (s((1, t, h, p), bf16), s((1, t, h), bf16), s((h,), f32), s((1, t, 1, n), bf16),
            s((1, t, 1, n), bf16), s((4,), jnp.int32))

    def prefill(x, dt, A, B, C, bounds):
        return pallas_kernels.mamba_chunk_scan_combined(
            x, dt, A, B, C, 256, dt_softplus=True, cu_seqlens=bounds,
            return_varlen_states=True)

    # The dt preprocessing and the forward scan, then again for the states entering the chunks.
    assert _lower(prefill, args, target).count(TRITON_CALL) == 4
