"""Context parallelism on 8 (simulated) devices: the sequence sharded over a mesh axis, alone
on (8,) and with the batch on (2, 4), on `jax.make_mesh` meshes (Explicit axes) and classic
ones (`sharding=`), against the unsharded call: attention's "all_gather" and "ring" in
contiguous and zig-zag order, the SSD's state passing; the collectives each issues, read from
the compiled HLO; zig-zag's balance of causal work; lowering for 8 abstract GPUs; errors.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (`.ci/run` does).
"""

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ssd_cases
from attention_cases import loss_and_grads as attention_loss_and_grads
from attention_cases import make_inputs as attention_inputs
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_cases import mesh, seed
from numerics import rel_error

import pallas_kernels
from pallas_kernels import _compat, _sharding
from pallas_kernels.attention import masking
from pallas_kernels.mamba2 import reference
from pallas_kernels.mamba2.schedule import Schedule

pytestmark = pytest.mark.multidevice

MESHES = {"8": ((8,), ("context",)), "2x4": ((2, 4), ("data", "context"))}
# (id, mesh, PartitionSpec of the leading array, devices along the sequence).
SEQUENCE = ("sequence-8", "8", P(None, "context"), 8)
BATCH_SEQUENCE = ("batch2-sequence4", "2x4", P("data", "context"), 4)
TOLERANCE = 2e-5


def _run(loss_and_grads, sharding, explicit, args):
    """`loss_and_grads(*args, **extra)` under jit with args[0] placed by the sharding: through
    its type on an explicit mesh, through `sharding=` on a classic one."""
    _, mesh_name, spec, _ = sharding
    mesh_ = mesh(*MESHES[mesh_name], explicit)
    named = NamedSharding(mesh_, spec)
    args = (jax.device_put(args[0], named), *args[1:])
    extra = {} if explicit else dict(sharding=named)
    with jax.set_mesh(mesh_):
        return jax.tree.map(np.asarray,
                            jax.jit(functools.partial(loss_and_grads, **extra))(*args))


def _assert_close(got, want, names):
    for name, a, b in zip(names, got, want, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape, name
        if name == "lse":  # rows that see no key: -inf in both
            assert (np.isfinite(a) == np.isfinite(b)).all()
            a, b = np.where(np.isfinite(b), a, 0), np.where(np.isfinite(b), b, 0)
        assert rel_error(a, b) < TOLERANCE, name


# ---------------------------------------------------------------------------------------------
# Attention.

ATTENTION = {
    "gqa-causal-segments": ("causal", "segments"),  # segments cross the shard edges
    "window-softcap": ("window", "cap"),
    "lengths-causal": ("lengths", "causal"),
}


def _attention_cases():
    """(strategy, order, case, sharding, explicit, implementation): every case of each
    strategy in its harder order (all_gather: zig-zag on (8,); ring: zig-zag on (2, 4)) and
    one in the other order on the other mesh; one case on a classic mesh (all_gather) and one
    on the xla path (ring)."""
    cases = []
    for strategy, hard, easy in (("all_gather", SEQUENCE, BATCH_SEQUENCE),
                                 ("ring", BATCH_SEQUENCE, SEQUENCE)):
        cases += [(strategy, "zigzag", name, hard, True, "pallas") for name in ATTENTION]
        cases += [(strategy, "contiguous", "gqa-causal-segments", easy, True, "pallas")]
    cases += [("all_gather", "contiguous", "window-softcap", BATCH_SEQUENCE, False, "pallas"),
              ("ring", "zigzag", "lengths-causal", BATCH_SEQUENCE, True, "xla")]
    return [pytest.param(*c, id=f"{c[0]}-{c[1]}-{c[2]}-{c[3][0]}-"
                                f"{'make_mesh' if c[4] else 'classic'}-{c[5]}")
            for c in cases]


@pytest.mark.parametrize("strategy, order, name, sharding, explicit, implementation",
                         _attention_cases())
def test_attention_matches_unsharded(strategy, order, name, sharding, explicit,
                                     implementation):
    parts = sharding[3]
    t = 64 if parts == 8 else 72  # 72: zig-zag pieces of 9 tokens, padded to whole blocks
    (q, k, v, dout, dlse), masks = attention_inputs(
        seed(strategy, order, name, sharding[0]), b=2, t=t, n=4, k=2, h=16,
        mask=ATTENTION[name])
    attention = functools.partial(pallas_kernels.dot_product_attention,
                                  implementation=implementation)
    want = attention_loss_and_grads(attention, q, k, v, dout, dlse, **masks)

    placed = (lambda x: pallas_kernels.zigzag(x, parts)) if order == "zigzag" else (lambda x: x)
    masks = {key: placed(value) if key.endswith("segment_ids") else value
             for key, value in masks.items()}

    def sharded(q, k, v, dout, dlse, **extra):
        return attention_loss_and_grads(attention, q, k, v, dout, dlse, **masks, **extra,
                                         context_parallelism=strategy, sequence_order=order)

    got = _run(sharded, sharding, explicit, [placed(x) for x in (q, k, v, dout, dlse)])
    if order == "zigzag":
        got = [np.asarray(pallas_kernels.unzigzag(jnp.asarray(x), parts)) for x in got]
    _assert_close(got, want, ("out", "lse", "dq", "dk", "dv"))


def _collectives(text):
    """{op: [result shape text, ...]} of the collectives in compiled HLO text."""
    found = collections.defaultdict(list)
    for shape, op in re.findall(
            r"= (\S+) (all-gather|reduce-scatter|all-reduce|collective-permute|all-to-all)\(",
            text):
        found[op].append(shape)
    return found


def _attention_step(strategy, order, sharding, with_segments, backward=True):
    """Compiled HLO text of attention (causal) with its vjp on the (2, 4) mesh, batch over
    data and sequence over context: q (4, 64, 8, 16), k and v (4, 64, 4, 16)."""
    named = NamedSharding(mesh(*MESHES["2x4"], explicit=False), sharding)
    q = jax.ShapeDtypeStruct((4, 64, 8, 16), jnp.float32, sharding=named)
    kv = jax.ShapeDtypeStruct((4, 64, 4, 16), jnp.float32, sharding=named)
    seg = jax.ShapeDtypeStruct((4, 64), jnp.int32, sharding=named)

    def step(q, k, v, seg):
        segments = dict(q_segment_ids=seg, kv_segment_ids=seg) if with_segments else {}
        attention = functools.partial(
            pallas_kernels.dot_product_attention, is_causal=True, implementation="pallas",
            sharding=named, context_parallelism=strategy, sequence_order=order, **segments)
        if not backward:
            return attention(q, k, v)
        out, vjp = jax.vjp(attention, q, k, v)
        return vjp(out)

    return jax.jit(step).lower(q, kv, kv, seg).compile().as_text()


@pytest.mark.parametrize("order", ["contiguous", "zigzag"])
def test_all_gather_gathers_only_keys_values_and_their_segments(order):
    found = _collectives(_attention_step("all_gather", order, P("data", "context"), True))
    # K, V (2 rows, all 64 tokens) and the key segment ids; dK, dV reduce-scattered back.
    assert sorted(found["all-gather"]) == ["f32[2,64,4,16]{3,2,0,1}"] * 2 + ["s32[2,64]{0,1}"]
    assert len(found["reduce-scatter"]) == 2
    assert all(s.startswith("f32[2,16,4,16]") for s in found["reduce-scatter"])
    assert set(found) == {"all-gather", "reduce-scatter"}


def test_ring_passes_keys_and_values_n_minus_1_times_and_gradients_n_times():
    parts = 4
    forward = _collectives(_attention_step("ring", "zigzag", P("data", "context"), False,
                                           backward=False))
    assert set(forward) == {"collective-permute"}
    assert len(forward["collective-permute"]) == 2 * (parts - 1)  # K and V

    found = _collectives(_attention_step("ring", "zigzag", P("data", "context"), True))
    assert set(found) == {"collective-permute"}
    # Forward and backward pass K, V, segment ids n - 1 times each; dK, dV go round n times.
    assert len(found["collective-permute"]) == 2 * 3 * (parts - 1) + 2 * parts
    assert all(re.match(r"(f32\[2,16,4,16\]|s32\[2,16\])", s)
               for s in found["collective-permute"])  # shard-sized


def test_zigzag_balances_causal_work_within_one_block():
    """Key blocks visited per device for causal attention over 4096 tokens, 128-token blocks,
    counted from the kernels' block tables (`masking.block_table` with each piece's shift)."""
    t, block, parts = 4096, 128, 8

    def visited(order):
        counts = []
        for index in range(parts):
            total = 0
            for _, size, offset in _sharding.local_chunks(order, parts, index, t // parts):
                table = masking.block_table(
                    num_row_blocks=size // block, row_block=block, num_col_blocks=t // block,
                    col_block=block, band=(None, 0), row_len=np.array([size], np.int32),
                    col_len=np.array([t], np.int32), shift=np.int32(-offset), xp=np)
                total += int(np.sum(table[..., masking.HI] - table[..., masking.LO]))
            counts.append(total)
        return counts

    zigzag, contiguous = visited("zigzag"), visited("contiguous")
    assert sum(zigzag) == sum(contiguous)
    assert max(zigzag) - min(zigzag) <= 1
    assert max(contiguous) >= 10 * min(contiguous)


def test_zigzag_and_unzigzag_are_inverse_orders():
    x = jnp.arange(2 * 32).reshape(2, 32)
    z = pallas_kernels.zigzag(x, 4)
    assert z[0].tolist()[:8] == [0, 1, 2, 3, 28, 29, 30, 31]  # device 0: chunks 0 and 7
    assert (pallas_kernels.unzigzag(z, 4) == x).all()


# ---------------------------------------------------------------------------------------------
# The SSD.

SSD = {
    "d-z-bias-h0": dict(g=2),
    "seq-idx": dict(g=1, seq_idx=True),
    "plain-limits": dict(g=1, d=None, z=False, dt_bias=False, initial_states=False),
}


def _ssd_cases():
    """Each case once on make_mesh meshes (sequence, or batch x sequence), seq_idx on both and
    on a classic mesh."""
    cases = [("d-z-bias-h0", BATCH_SEQUENCE, True), ("seq-idx", SEQUENCE, True),
             ("seq-idx", BATCH_SEQUENCE, True), ("plain-limits", SEQUENCE, True),
             ("seq-idx", BATCH_SEQUENCE, False)]
    return [pytest.param(*c, id=f"{c[0]}-{c[1][0]}-{'make_mesh' if c[2] else 'classic'}")
            for c in cases]


def _sequence_ids(t, parts):
    """Row 0: new sequences at a shard edge and inside shards; row 1: one sequence until
    late, then one more (so states pass across most edges)."""
    shard = t // parts
    ids = np.zeros((2, t), np.int32)
    ids[0, shard:] = 1
    ids[0, shard + 3:] = 2
    ids[0, 3 * shard - 2:] = 3
    ids[1, t - shard // 2:] = 5
    return jnp.asarray(ids)


@pytest.mark.parametrize("name, sharding, explicit", _ssd_cases())
def test_ssd_matches_unsharded(name, sharding, explicit):
    parts = sharding[3]
    t = 8 * parts
    args = ssd_cases.make_inputs(seed(name, sharding[0]), b=2, t=t, h=4, p=8, n=16,
                                 **SSD[name])
    if args["seq_idx"] is not None:
        args["seq_idx"] = _sequence_ids(t, parts)
    limits = dict(dt_limit=(0.05, 2.0)) if name == "plain-limits" else {}
    ssd = functools.partial(pallas_kernels.mamba_chunk_scan_combined, chunk_size=16,
                            dt_softplus=True, implementation="pallas", **limits)
    (y, final), grads = ssd_cases.loss_and_grads(ssd, args)

    def sharded(x, **extra):
        return ssd_cases.loss_and_grads(functools.partial(ssd, **extra), dict(args, x=x))

    (y_got, final_got), grads_got = _run(sharded, sharding, explicit, [args["x"]])
    names = ["y", "final_states", *grads]
    _assert_close([y_got, final_got, *(grads_got[n] for n in grads)],
                  [y, final, *grads.values()], names)


@pytest.mark.parametrize("schedule, seq_idx", [(Schedule(10, 5, 3), False),
                                               (Schedule(5, 1, 0), True)],
                         ids=["halves-split", "five-parts-seq-idx"])
def test_ssd_cut_walks_match_recurrence(schedule, seq_idx, monkeypatch):
    """The kernels' state passing with every shard's walks cut (forced, as in the mamba2
    suite's test_cut_walks_match_recurrence): the final-state walk runs only the programs of
    each walk's last part, entering through unit sums (split walks too); the entering state's
    gradient walk only those of its first part, from the later units' sums (the backward's walks
    in 5 units). Against the token-by-token recurrence on the whole sequence."""
    parts, shard = BATCH_SEQUENCE[3], 150  # 10 chunks of 16 a shard (the last one padded)
    calls = ssd_cases.force_cut_walks(monkeypatch, schedule)
    args = ssd_cases.make_inputs(seed("cut-walks", str(schedule)), b=2, t=parts * shard, h=4,
                                 p=8, n=16, g=2)
    if seq_idx:
        args["seq_idx"] = _sequence_ids(parts * shard, parts)
    kw = dict(chunk_size=16, dt_softplus=True)
    (y, final), grads = ssd_cases.loss_and_grads(reference.ssd_recurrence, args, **kw)
    ssd = functools.partial(pallas_kernels.mamba_chunk_scan_combined, implementation="pallas",
                            **kw)

    def sharded(x):
        return ssd_cases.loss_and_grads(ssd, dict(args, x=x))

    (y_got, final_got), grads_got = _run(sharded, BATCH_SEQUENCE, True, [args["x"]])
    assert ("states", schedule) in calls and ("gradients", Schedule(5, 1, 0)) in calls
    for name, got, want in [("y", y_got, y), ("final", final_got, final),
                            *((n, grads_got[n], g) for n, g in grads.items())]:
        assert rel_error(got, want) < 5e-5, name


def test_ssd_second_order_derivatives_match_unsharded():
    """Grad of grad through the kernels' state passing: their backward's tangents come from the
    reference's state passing (seq_idx crossing shard edges, h0, z)."""
    parts = BATCH_SEQUENCE[3]
    t = 8 * parts
    args = ssd_cases.make_inputs(seed("second-order", "2x4"), b=2, t=t, h=4, p=8, n=16, g=2)
    args["seq_idx"] = _sequence_ids(t, parts)
    ssd = functools.partial(pallas_kernels.mamba_chunk_scan_combined, chunk_size=16,
                            dt_softplus=True, implementation="pallas")

    def grad_of_grad(x, **extra):
        def loss(x, dt):
            y, final = ssd(**dict(args, x=x, dt=dt), return_final_states=True, **extra)
            return jnp.sum(jnp.sin(y)) + jnp.sum(final**2)

        inner = jax.grad(loss, argnums=(0, 1))
        return jax.grad(lambda x, dt: sum(jnp.sum(g**2) for g in inner(x, dt)),
                        argnums=(0, 1))(x, args["dt"])

    want = jax.jit(grad_of_grad)(args["x"])
    got = _run(grad_of_grad, BATCH_SEQUENCE, True, [args["x"]])
    _assert_close(got, want, ["d2/dx", "d2/ddt"])


PER_TOKEN = ("x", "B", "C", "dt")


def _outputs_and_grads(fn, args, loss_tokens):
    """(y, grads of sum(y * w) over the `loss_tokens` (selected: the others may be NaN)
    w.r.t. x, B, C and dt) of `fn`."""
    def loss(*values):
        y = fn(**dict(args, **dict(zip(PER_TOKEN, values, strict=True))), chunk_size=16,
               dt_softplus=True)
        chosen = np.isin(np.arange(y.shape[1]), loss_tokens)[None, :, None, None]
        w = jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape))
        return jnp.sum(jnp.where(chosen, y, 0.0) * w), y

    grads, y = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(*(args[n] for n in PER_TOKEN))
    return (y, *grads)


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
@pytest.mark.parametrize("name", PER_TOKEN)
def test_ssd_nan_stays_in_its_packed_sequence_across_shards(name, implementation):
    """Sequences [0, 20), [20, 40), [40, 64) over 4 shards of 16, a NaN at token 26 of the
    middle one: the state entering a shard where a sequence starts, and its gradient, are
    dropped by selects, so the other sequences' outputs and gradients are the recurrence's
    (outside the NaN's chunk, as unsharded), not NaN."""
    args = ssd_cases.make_inputs(seed("nan-shards", name), b=2, t=64, z=False)
    ids = np.digitize(np.arange(64), [20, 40])
    args["seq_idx"] = jnp.asarray(np.stack([ids, ids]), jnp.int32)
    args[name] = args[name].at[:, 26].set(jnp.nan)
    loss_tokens = np.r_[0:16, 40:64]
    ssd = functools.partial(pallas_kernels.mamba_chunk_scan_combined,
                            implementation=implementation)

    def sharded(x, **extra):
        return _outputs_and_grads(functools.partial(ssd, **extra), dict(args, x=x), loss_tokens)

    got = _run(sharded, BATCH_SEQUENCE, True, [args["x"]])
    want = _outputs_and_grads(reference.ssd_recurrence, args, loss_tokens)
    for what, ours, ref in zip(("y", *(f"d{n}" for n in PER_TOKEN)), got, want, strict=True):
        keep = np.isfinite(np.asarray(ref))
        keep[:, 16:32] = False  # the NaN's chunk (README, "Known limits")
        assert what != "y" or keep[:, 40:].all()
        assert np.all(np.isfinite(ours[keep])), what
        np.testing.assert_allclose(ours[keep], np.asarray(ref)[keep], rtol=2e-4, atol=2e-5,
                                   err_msg=what)


def test_ssd_shards_compare_int64_ids_and_keep_float64():
    """Under x64: int64 ids that differ only above bit 31, changing at a shard edge, start a
    new sequence there as unsharded (the edges are compared at the ids' width); float64 inputs
    through the reference's state passing stay float64-exact against the recurrence."""
    with jax.enable_x64(True):
        args = ssd_cases.make_inputs(seed("x64-shards", "ids"), b=2, t=64, z=False)
        ids = np.where(np.arange(64) < 32, 0, 2**32)  # the same id once cast to int32
        args["seq_idx"] = jnp.asarray(np.stack([ids, ids]), jnp.int64)
        ssd = functools.partial(pallas_kernels.mamba_chunk_scan_combined, chunk_size=16,
                                dt_softplus=True, return_final_states=True)
        for implementation in ("pallas", "xla"):
            def sharded(x, implementation=implementation, **extra):
                return ssd(**dict(args, x=x), implementation=implementation, **extra)

            got = _run(sharded, BATCH_SEQUENCE, True, [args["x"]])
            want = ssd(**args, implementation=implementation)
            _assert_close(got, want, [f"{implementation} y", f"{implementation} final"])

        f64 = {n: (None if v is None or not jnp.issubdtype(v.dtype, jnp.floating)
                   else v.astype(jnp.float64)) for n, v in args.items()}
        f64["seq_idx"] = args["seq_idx"]
        xla = functools.partial(pallas_kernels.mamba_chunk_scan_combined, chunk_size=16,
                                dt_softplus=True, implementation="xla")

        def sharded64(x, **extra):
            return ssd_cases.loss_and_grads(functools.partial(xla, **extra), dict(f64, x=x))

        (y, final), grads = _run(sharded64, BATCH_SEQUENCE, True, [f64["x"]])
        (y_want, final_want), grads_want = ssd_cases.loss_and_grads(
            functools.partial(reference.ssd_recurrence, chunk_size=16, dt_softplus=True), f64)
        assert y.dtype == np.float64
        for what, ours, ref in [("y", y, y_want), ("final", final, final_want),
                                *((n, grads[n], g) for n, g in grads_want.items())]:
            assert rel_error(ours, ref) < 1e-12, what


def test_ssd_gathers_only_state_sized_arrays():
    named = NamedSharding(mesh(*MESHES["2x4"], explicit=False), P("data", "context"))
    replicated = NamedSharding(named.mesh, P())
    x = jax.ShapeDtypeStruct((4, 64, 8, 16), jnp.float32, sharding=named)
    dt = jax.ShapeDtypeStruct((4, 64, 8), jnp.float32, sharding=named)
    A = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=replicated)
    bc = jax.ShapeDtypeStruct((4, 64, 2, 32), jnp.float32, sharding=named)
    h0 = jax.ShapeDtypeStruct((4, 8, 16, 32), jnp.float32,
                              sharding=NamedSharding(named.mesh, P("data")))
    seq = jax.ShapeDtypeStruct((4, 64), jnp.int32, sharding=named)

    def step(x, dt, A, B, C, h0, seq):
        def loss(x, dt, A, B, C, h0):
            y, final = pallas_kernels.mamba_chunk_scan_combined(
                x, dt, A, B, C, 16, D=A, z=x, dt_bias=A, initial_states=h0, seq_idx=seq,
                dt_softplus=True, return_final_states=True, implementation="pallas",
                sharding=named)
            return jnp.sum(y) + jnp.sum(final)

        return jax.grad(loss, argnums=tuple(range(6)))(x, dt, A, B, C, h0)

    found = _collectives(jax.jit(step).lower(x, dt, A, bc, bc, h0, seq).compile().as_text())
    assert found["all-gather"] and not found["collective-permute"] and not found["all-to-all"]
    state = 2 * 8 * 16 * 32  # a device's (b, H, P, N)
    for op in ("all-gather", "reduce-scatter", "all-reduce"):
        for shape in found[op]:
            sizes = [int(d) for d in re.findall(r"\d+", shape.split("{")[0].split("[")[1])]
            assert np.prod(sizes) <= 4 * state, (op, shape)  # never (b, T, ...)


# ---------------------------------------------------------------------------------------------
# GPU lowering and errors.


@pytest.mark.parametrize("platform, device_kind", [("cuda", "NVIDIA H200"), ("rocm", "gfx942")])
def test_every_triton_call_gets_a_sequence_shard_on_8_gpus(platform, device_kind):
    """Lowered ahead of time for 8 abstract GPUs (2 x 4: batch over data, sequence over
    context): every Triton call of attention's train step (both strategies, zig-zag) and the
    SSD's sees a piece of the 1024-token sequence."""
    mesh_ = _compat.abstract_gpu_mesh(device_kind, platform, (2, 4), ("data", "context"),
                                      axis_types=(AxisType.Explicit,) * 2)
    named = NamedSharding(mesh_, P("data", "context"))
    q = jax.ShapeDtypeStruct((4, 1024, 8, 128), jnp.bfloat16, sharding=named)
    x = jax.ShapeDtypeStruct((4, 1024, 8, 64), jnp.bfloat16, sharding=named)
    dt = jax.ShapeDtypeStruct((4, 1024, 8), jnp.bfloat16, sharding=named)
    A = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh_, P()))
    bc = jax.ShapeDtypeStruct((4, 1024, 1, 128), jnp.bfloat16, sharding=named)

    def attention_step(strategy):
        def step(q, k, v):
            out, vjp = jax.vjp(functools.partial(
                pallas_kernels.dot_product_attention, is_causal=True,
                context_parallelism=strategy, sequence_order="zigzag"), q, k, v)
            return vjp(out)
        return step

    def ssd_step(x, dt, A, B, C):
        return jax.grad(lambda *a: jnp.sum(pallas_kernels.mamba_chunk_scan_combined(
            *a, chunk_size=256, dt_softplus=True).astype(jnp.float32)),
            argnums=(0, 1, 2, 3, 4))(x, dt, A, B, C)

    steps = {"all_gather": (attention_step("all_gather"), (q, q, q)),
             "ring": (attention_step("ring"), (q, q, q)), "ssd": (ssd_step, (x, dt, A, bc, bc))}
    with jax.sharding.use_abstract_mesh(mesh_):
        texts = {name: jax.jit(step).trace(*args).lower(lowering_platforms=(platform,)).as_text()
                 for name, (step, args) in steps.items()}
    for name, text in texts.items():
        calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
        assert calls
        for call in calls:
            assert not re.search(r"tensor<4x\d", call), call[-300:]  # 2 of 4 rows
            if name != "all_gather":  # which gathers whole keys and values, by design
                assert "x1024x" not in call, call[-300:]
        if name != "ssd":  # queries in zig-zag pieces of 128 tokens
            assert any("-> (tensor<2x128x8x128xbf16>" in call for call in calls)


def test_sequence_sharding_errors_name_the_argument_and_axis():
    named = NamedSharding(mesh(*MESHES["8"], explicit=False), P(None, "context"))
    q = jnp.zeros((2, 72, 4, 16))
    with pytest.raises(ValueError, match=r"query: the sequence \(72\) does not split into 16 "
                                         r"equal pieces over mesh axis 'context' \(zigzag"):
        pallas_kernels.dot_product_attention(q, q, q, sharding=named, sequence_order="zigzag")
    with pytest.raises(ValueError, match=r"key: the sequence \(36\) does not split into 8 "):
        pallas_kernels.dot_product_attention(q[:, :64], q[:, :36], q[:, :36], sharding=named)
    with pytest.raises(ValueError, match="context_parallelism must be one of"):
        pallas_kernels.dot_product_attention(q, q, q, context_parallelism="ulysses")
    with pytest.raises(ValueError, match="sequence_order must be one of"):
        pallas_kernels.dot_product_attention(q, q, q, sequence_order="striped")
    args = ssd_cases.make_inputs(0, b=2, t=36, h=4, p=8, n=16)
    with pytest.raises(ValueError, match=r"x: the sequence \(36\) does not split into 8 "):
        pallas_kernels.mamba_chunk_scan_combined(**args, chunk_size=16, sharding=named)
