"""SSD backward kernels (Pallas, Triton lowering), deterministic: no atomics.

* `gradients`: every input's gradient from the residuals of the forward: the z gate, D, A and
  the dt preprocessing in XLA around the kernels below.
* `states_and_gradients`: two independent walks in one launch, the forward kernel recomputing
  the state entering each chunk (`forward(emit="states")`) and `state_gradients`: one program
  per (batch row, head, head-dim block, part: see `walks`) walks the chunks in reverse,
  G <- dH_local + exp(s_last) G, writing G (the gradient of the state leaving each chunk) and
  the initial-state gradient.
* `chunk_gradients`: one program per (chunk, block of one group's heads, batch row) loops over
  its heads. It computes C B^T once, writes dx and per-token float32 vectors per head (the dt'
  term of dx and the intra-chunk parts of the gradient of the log decay a = dt' A, as
  dY . y_intra - xbar . dxbar sums, so no (Q, Q) prefix sum is needed).
* `_state_terms`: one program per (chunk, group, batch row) loops over the group's heads for dB
  and dC: it sums the (Q, Q) score gradient over them (C and B are shared by the group, so two
  matmuls per program give the intra-chunk terms) and accumulates the state terms, the
  decay-scaled x bar times G (dB) and dY times H (dC), in two (Q, N) tiles. With G, H and C
  loaded, it also gives the log-decay gradient's terms through the states: per chunk the
  state-passing term exp(s_last) <G, H>, and per token the output's part from the state
  entering the chunk, dY_l . exp(s_l) (C H^T)_l.

Decays are written here as exp of natural-log cumsums s, as in forward.py; the kernels hold s
in base 2 (`common.chunk_log2_decays`) and take exp2, the same numbers. The log-decay gradient is
built from products (dY . y, xbar . dxbar, <G, H>), so it comes out in natural-log units.

The recurrences carry states and their gradients in float32; the copies that pass between the
kernels (matmul operands there) are stored in the inputs' dtype, as mamba_ssm stores its states.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _device, _operands
from pallas_kernels._operands import Operands
from pallas_kernels.mamba2 import common, forward, semantics, walks


def gradients(residuals, dy, dfinal, *, static, blocks, plan):
    """The gradients of (x, dt, dt_bias, A, B, C, D, z, h0) of the padded SSD (None for an
    absent input) from its forward's residuals (x, dt, dt_bias, dt', s, A, B, C, D, z, h0, seq,
    y_pre, entries: see `api`) and the cotangents dy (b, Tp, H, Pp) of y and dfinal
    (b, H, Pp, Np) of the final state."""
    x, dt, dt_bias, dt_step, s, A, B, C, D, z, h0, seq, y_pre, entries = residuals
    dy, dz = gate_gradients(dy, z, y_pre, x.dtype)
    states, gstates, dh0 = states_and_gradients(
        x, dy, dt_step, s, B, C, seq, h0, dfinal.astype(jnp.float32), entries, static=static,
        blocks=blocks, plan=plan)
    dx, ddt_x, dlog_decay, dB, dC, dD = chunk_gradients(
        x, dy, dt_step, s, B, C, seq, D, states, gstates, static=static, blocks=blocks, plan=plan)
    ddt_step = dlog_decay * A[None, :, None] + ddt_x
    dA = jnp.sum(dlog_decay * dt_step, axis=(0, 2))
    ddt, ddt_bias = _step_size_vjp(static, dt, dt_bias, ddt_step)
    return dx, ddt, ddt_bias, dA, dB, dC, dD, dz, None if h0 is None else dh0


def gate_gradients(dy, z, y_pre, dtype):
    """(the gradient of the output before the z gate, in `dtype`; z's, or None) from that of
    y = y_pre * silu(z)."""
    if z is None:
        return dy.astype(dtype), None
    zf = z.astype(jnp.float32)
    sig = jax.nn.sigmoid(zf)
    dz = dy.astype(jnp.float32) * y_pre.astype(jnp.float32) * sig * (1 + zf * (1 - sig))
    return (dy.astype(jnp.float32) * zf * sig).astype(dtype), dz.astype(z.dtype)


def _step_size_vjp(static, dt, dt_bias, ddt_step):
    """Gradients of the raw dt (b, Tp, H) and dt_bias (or None) from that of dt' (b, H, Tp),
    through `semantics.step_sizes` (what `preprocess.preprocess` computes in the kernel)."""
    real = jnp.arange(dt.shape[1]) < static.seq_len  # padding tokens have no step
    ddt_step = jnp.where(real[None, :, None], jnp.swapaxes(ddt_step, 1, 2), 0.0)

    def step_sizes(dt, dt_bias):
        return semantics.step_sizes(dt, dt_bias, static.dt_softplus, static.dt_limit,
                                    jnp.float32)

    step, vjp = jax.vjp(step_sizes, dt, dt_bias)
    return vjp(ddt_step.astype(step.dtype))


def _state_gradients_kernel(program, refs, *, static, block_t, plan):
    num_units = plan.schedule.num_units
    part = walks.walk_part(program, plan)

    def chunk(i, grad):
        c = part.first_chunk + part.num_chunks - 1 - i
        if refs.gstates is not None:
            refs.gstates[c] = grad.astype(refs.gstates.dtype)
        tok = _device.block_slice(c, block_t)
        dy = refs.dy[tok, :]
        cmat = refs.c[tok, :]
        masks = common.chunk_masks(c, refs.s, refs.seq, block_t)
        dy_weighted = masks.carried_in(dy.astype(jnp.float32)).astype(cmat.dtype)
        local = jnp.dot(dy_weighted.T, masks.of_continuing(cmat),
                        preferred_element_type=jnp.float32)  # (P, N)
        return local + masks.pass_on(grad)

    def walk():
        grad = (
            refs.dfinal[...].astype(jnp.float32)
            if refs.dfinal is not None
            else jnp.zeros(refs.dh0.shape, jnp.float32)
        )
        if num_units > 1:
            # The gradient of the state leaving this part: the later units' own gradients
            # passed back (index j holds unit j + 1).
            def leave(i, grad):
                j = num_units - 2 - i
                return refs.unit_sums[j] + walks.pass_on(refs.unit_decays[j, 0], grad, static)

            grad = jax.lax.fori_loop(0, num_units - part.end_unit, leave, grad)
        return jax.lax.fori_loop(0, part.num_chunks, chunk, grad)

    first = part.first_unit == 0
    if refs.gstates is None:  # dh0 alone: only the programs walking a walk's first part

        @pl.when(first)
        def _():
            refs.dh0[...] = walk()

        return
    grad = walk()

    @pl.when(first)
    def _():
        refs.dh0[...] = grad


def states_and_gradients(x, dy, dt, s, b, c, seq, h0, dfinal, entries, *, static, blocks,
                         plan):
    """The backward's two walks in one launch: the states entering each chunk, recomputed
    (`forward.forward(emit="states")`), and the state gradients (`state_gradients_call`).

    They are independent, so the programs of one fill what the other leaves idle: at b 2 T 8192
    the gradient walks are 160 programs of 128 chunks, fewer than the GPU runs at once. The
    gradient walks launch first, as the longer ones. `entries` are the states the forward's
    programs started from, or None (the forward did not cut its walks), and `plan` the
    forward's; the gradient walks, and the recompute without entries, take the backward's cut
    (`plan.for_backward()`). Returns (states, gstates, dh0): states and gstates
    (B, nc, H, Pp, Np) in x's dtype, dh0 (B, H, Pp, Np) float32.
    """
    backward_plan = plan.for_backward()
    recompute = forward.scan_call(x, dt, s, b, c, seq, None, None, h0, emit="states",
                                  static=static, blocks=blocks,
                                  plan=backward_plan if entries is None else plan,
                                  entries=entries)
    gradients = state_gradients_call(dy, dt, s, c, seq, dfinal, static=static, blocks=blocks,
                                     plan=backward_plan)
    grads, states = walks.launch(
        [gradients, recompute], num_warps=blocks.num_warps, num_stages=blocks.num_stages,
        interpret=static.interpret)
    return states["states"], grads["gstates"], grads["dh0"]


def initial_state_gradient(dy, dt, s, c, seq, *, static, blocks, plan):
    """dh0 (B, H, Pp, Np) float32, the gradient of the state entering the sequence from the
    pre-gate output's gradient dy alone (the final state's taken as zero): the state gradients'
    walk without gstates, only its first parts walked (`state_gradients_call`, the backward's
    cut). A sequence shard's first backward pass (`context`)."""
    call = state_gradients_call(dy, dt, s, c, seq, None, static=static, blocks=blocks,
                                plan=plan.for_backward(), write_states=False)
    (out,) = walks.launch([call], num_warps=blocks.num_warps, num_stages=blocks.num_stages,
                          interpret=static.interpret)
    return out["dh0"]


def state_gradients_call(dy, dt, s, c, seq, dfinal, *, static, blocks, plan, write_states=True):
    """The `walks.ScanCall` of the state gradients: gstates (B, nc, H, Pp, Np) in dy's dtype,
    the gradient of the state leaving each chunk (not written without `write_states`), and
    dh0 (B, H, Pp, Np) float32.

    dy (B, Tp, H, Pp) is the gradient of the pre-gate output; dt, s (B, H, Tp); c (B, Tp, G, Np);
    seq (B, Tp) or None; dfinal (B, H, Pp, Np) float32 or None.
    """
    batch, t_pad, heads, p_pad = dy.shape
    n_pad = c.shape[-1]
    bp, nc, num_p_blocks = blocks.block_p, plan.num_chunks, p_pad // blocks.block_p
    hpg = heads // c.shape[2]
    index = walks.program_index(plan, heads, num_p_blocks, hpg)
    state_spec = pl.BlockSpec((None, None, bp, n_pad), index.state)
    inputs = (Operands()
              .add("dy", pl.BlockSpec((None, t_pad, None, bp), index.tokens), dy)
              .add("s", pl.BlockSpec((None, None, t_pad), index.per_head), s)
              .add("c", pl.BlockSpec((None, t_pad, None, n_pad), index.group), c)
              .add("seq", pl.BlockSpec((None, t_pad), index.row), seq)
              .add("dfinal", state_spec, dfinal))
    if plan.schedule.num_units > 1:
        sums = walks.unit_sums(dy, dt, s, c, seq, static=static, blocks=blocks, plan=plan,
                               kind="gradients")
        walks.add_unit_sums(inputs, *sums, plan, n_pad, bp, "gradients")
    outputs = (Operands()
               .add("gstates", pl.BlockSpec((None, nc, None, bp, n_pad), index.chunk_states),
                    jax.ShapeDtypeStruct((batch, nc, heads, p_pad, n_pad), dy.dtype)
                    if write_states else None)
               .add("dh0", state_spec,
                    jax.ShapeDtypeStruct((batch, heads, p_pad, n_pad), jnp.float32)))
    return walks.ScanCall(
        functools.partial(_state_gradients_kernel, static=static, block_t=blocks.block_t,
                          plan=plan),
        walks.num_programs(plan), inputs, outputs, "ssd_state_gradients")


def _chunk_gradients_kernel(refs, *, block_t, heads_per_program):
    c = pl.program_id(0)
    b = refs.b[...]
    dtype = b.dtype
    # C B^T (Q, Q), held in the inputs' dtype (the weights below are rounded to it anyway): it
    # stays live across the head loop, in a kernel short of registers.
    scores = jnp.dot(refs.c[...], b.T, preferred_element_type=jnp.float32).astype(dtype)

    def head(j, carry):
        x = refs.x[:, j, :]
        dy = refs.dy[:, j, :]
        dt = refs.dt[j, _device.block_slice(c, block_t)]
        masks = common.chunk_masks(c, refs.s, refs.seq, block_t, head=j)
        grad = refs.gstates[j].astype(dtype)  # (P, N): gradient of the state leaving it
        x32, dy32 = x.astype(jnp.float32), dy.astype(jnp.float32)
        x_bar = (x32 * dt[:, None]).astype(dtype)
        weights = masks.weigh(scores.astype(jnp.float32)).astype(dtype)  # C B^T o L

        grad_b = jnp.dot(b, grad.T, preferred_element_type=jnp.float32)  # B G^T, (Q, P)
        dx_bar_intra = jnp.dot(weights.T, dy, preferred_element_type=jnp.float32)
        dx_bar = masks.to_state(grad_b) + dx_bar_intra
        dx = dx_bar * dt[:, None]
        if refs.d is not None:
            dx += refs.d[j, :][None, :] * dy32
            refs.dskip[j, :] = jnp.sum(dy32 * x32, axis=0)
        refs.dx[:, j, :] = dx.astype(refs.dx.dtype)
        refs.ddt[j, :] = jnp.sum(dx_bar * x32, axis=1)
        # The log-decay gradient's intra-chunk per-token parts (see `chunk_gradients`), with
        # the intra-chunk output before D, (Q, P):
        x_bar32 = x_bar.astype(jnp.float32)
        y_intra = jnp.dot(weights, x_bar, preferred_element_type=jnp.float32)
        refs.dcumsum[j, :] = jnp.sum(dy32 * y_intra - x_bar32 * dx_bar_intra, axis=1)
        refs.into_state[j, :] = masks.to_state(jnp.sum(x_bar32 * grad_b, axis=1))
        return carry

    jax.lax.fori_loop(0, heads_per_program, head, None)


def chunk_gradients(x, dy, dt, s, b, c, seq, d, states, gstates, *, static, blocks, plan):
    """dx, the per-head float32 vectors (ddt_x, dlog_decay), dB, dC and dD.

    x, dy (B, Tp, H, Pp); dt, s (B, H, Tp) float32; b, c (B, Tp, G, Np); seq (B, Tp) or None;
    d (H, Pp) float32 or None; states, gstates (B, nc, H, Pp, Np). Returns dx (B, Tp, H, Pp)
    in x's dtype; ddt_x (the dt' term of dx) and dlog_decay (the gradient of a = dt' A)
    (B, H, Tp) float32; db and dc (B, Tp, G, Np) in b's dtype; dd (H, Pp) float32, the sum of
    dY x over the tokens (None without d).

    One program per (chunk, block of `blocks.heads_per_program` heads of one group, batch row)
    gives dx, the log-decay gradient's intra-chunk parts and its chunk's part of dd (XLA sums
    the parts over chunks and rows, a fixed order); dB and dC come from `_state_terms`
    (one program per chunk and group, looping over its heads; it also gives the log-decay
    gradient's terms through the states), the log-decay gradient's reverse cumsum from XLA: a
    fixed order (deterministic, no atomics).
    """
    batch, t_pad, heads, p_pad = x.shape
    groups, n_pad = b.shape[2], b.shape[3]
    hpg, q, nc = heads // groups, blocks.block_t, plan.num_chunks
    hb = blocks.heads_per_program
    blocks_per_group = hpg // hb
    tokens = pl.BlockSpec((None, q, hb, p_pad), lambda ci, k, i: (i, ci, k, 0))
    per_head_full = pl.BlockSpec((None, hb, t_pad), lambda ci, k, i: (i, k, 0))
    per_head_chunk = pl.BlockSpec((None, hb, q), lambda ci, k, i: (i, k, ci))
    group = pl.BlockSpec(
        (None, q, None, n_pad), lambda ci, k, i: (i, ci, k // blocks_per_group, 0)
    )
    chunk_states = pl.BlockSpec((None, None, hb, p_pad, n_pad), lambda ci, k, i: (i, ci, k, 0, 0))
    inputs = (Operands()
              .add("x", tokens, x).add("dy", tokens, dy)
              .add("dt", per_head_full, dt).add("s", per_head_full, s)
              .add("b", group, b).add("c", group, c).add("gstates", chunk_states, gstates)
              .add("seq", pl.BlockSpec((None, t_pad), lambda ci, k, i: (i, 0)), seq)
              .add("d", pl.BlockSpec((hb, p_pad), lambda ci, k, i: (k, 0)), d))
    per_token = jax.ShapeDtypeStruct((batch, heads, t_pad), jnp.float32)
    outputs = (Operands().add("dx", tokens, jax.ShapeDtypeStruct(x.shape, x.dtype))
               .add("ddt", per_head_chunk, per_token)
               .add("dcumsum", per_head_chunk, per_token)
               .add("into_state", per_head_chunk, per_token)
               .add("dskip", pl.BlockSpec((None, None, hb, p_pad), lambda ci, k, i: (i, ci, k, 0)),
                    None if d is None else jax.ShapeDtypeStruct((batch, nc, heads, p_pad),
                                                                jnp.float32)))
    out = _operands.call(
        functools.partial(_chunk_gradients_kernel, block_t=q, heads_per_program=hb),
        inputs, outputs,
        grid=(nc, heads // hb, batch),
        num_warps=blocks.grad_num_warps, num_stages=blocks.grad_num_stages,
        interpret=static.interpret,
        name="ssd_chunk_gradients",
    )
    dx, ddt_x, dcumsum, into_state = (out[k] for k in ("dx", "ddt", "dcumsum", "into_state"))

    db, dc, passing, carried = _state_terms(x, dy, dt, s, b, c, seq, states, gstates,
                                            static=static, blocks=blocks, plan=plan)

    # Gradient of the log decay a_t. Within a chunk the decays depend on a only through the
    # cumsum s, so d/da_t = sum_{u >= t} d/ds_u. Each decay is exp(s_end - s_start) of a span
    # (masks are constant), giving d/ds_end its own term and d/ds_start minus it. For the
    # outputs (spans ending at t, y before D) that is dY_t . y_t, and for the intra-chunk spans
    # starting at t, -xbar_t . ((C B^T o L)^T dY)_t; both sums over intra-chunk spans hold the
    # same products, so the diagonal cancels exactly (the kernel's `dcumsum`); the output's
    # spans from the chunk start (the carried state) add `carried`. The spans into the leaving
    # state start at j and all end at the last token: their reverse cumsum is
    # sum_{j<t} into_state_j, plus the state passed on, exp(s_last) <G, H> (`passing`), for
    # every t.
    # Both in-chunk sums are one float32 matmul with a (2Q, Q) 0/1 matrix (one pass, where
    # XLA's cumsums took reduce-windows fused with the dt transposes). With seq_idx the
    # spans' sums run over each token's own sequence, as s does (`preprocess`).
    rows, cols = jnp.arange(q)[:, None], jnp.arange(q)[None, :]
    spans = (dcumsum + carried).reshape(batch, heads, nc, q)
    into_state = into_state.reshape(batch, heads, nc, q)
    if seq is None:
        sums = jnp.concatenate([rows >= cols, rows < cols]).astype(jnp.float32)
        in_chunk = jnp.matmul(jnp.concatenate([spans, into_state], axis=-1), sums,
                              precision=jax.lax.Precision.HIGHEST)
    else:
        in_chunk = _reverse_sums_by_sequence(spans, seq.reshape(batch, nc, q)) + jnp.matmul(
            into_state, (rows < cols).astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    dlog_decay = (in_chunk + passing[..., None]).reshape(batch, heads, t_pad)
    dd = None if d is None else jnp.sum(out["dskip"], axis=(0, 1))
    return dx, ddt_x, dlog_decay, db, dc, dd


def _reverse_sums_by_sequence(values, seq):
    """sum_{u >= t, u in t's sequence} values_u within each chunk: values (B, H, nc, Q), seq
    (B, nc, Q) sequence runs.

    Mathematically the same as summing over every u >= t (a later sequence's terms sum to
    zero: its decays depend only on differences of s within it), but a non-finite value of a
    later sequence stays there. The sums are matmuls over finite values with the 0/1 matrix,
    and rows whose sum holds a non-finite value are set to NaN by counting them the same way.
    """
    q = values.shape[-1]
    later = jnp.arange(q)[:, None] >= jnp.arange(q)[None, :]  # (u, t): u >= t
    summed = (later & (seq[..., :, None] == seq[..., None, :])).astype(jnp.float32)
    finite = jnp.isfinite(values)
    sums = jnp.einsum("bhcu,bcut->bhct", jnp.where(finite, values, 0.0), summed,
                      precision=jax.lax.Precision.HIGHEST)
    non_finite = jnp.einsum("bhcu,bcut->bhct", jnp.where(finite, 0.0, 1.0), summed,
                            precision=jax.lax.Precision.HIGHEST)
    return jnp.where(non_finite > 0, jnp.nan, sums)


def _state_terms_kernel(refs, *, block_t):
    c = pl.program_id(0)
    cmat = refs.c[...]
    dtype = cmat.dtype
    has_seq = refs.seq is not None

    def head(j, accs):
        db, dc, dscores = accs
        masks = common.chunk_masks(c, refs.s, refs.seq, block_t, head=j)
        state, grad = refs.states[j], refs.gstates[j]  # (P, N): entering, gradient of leaving
        dt = refs.dt[j, _device.block_slice(c, block_t)]
        x32 = refs.x[:, j, :].astype(jnp.float32)
        dy = refs.dy[:, j, :]
        # Intra-chunk: the gradient of the scores C B^T, summed over the group's heads (C and
        # B are shared by them), dS = sum_h L_h o (dY_h xbar_h^T).
        x_bar = (x32 * dt[:, None]).astype(dtype)
        dscores += masks.weigh(jnp.dot(dy, x_bar.T, preferred_element_type=jnp.float32))
        # dB: x bar decayed to the chunk's end, times G; dC: dY decayed from its start, times H
        # (products with the states are taken before the masks, which then select: a state may
        # hold another sequence's non-finite values).
        x_scaled = masks.to_state(x32, dt) if not has_seq else x32 * dt[:, None]
        db_state = jnp.dot(x_scaled.astype(grad.dtype), grad, preferred_element_type=jnp.float32)
        db += db_state if not has_seq else masks.to_state(db_state)
        dy32 = dy.astype(jnp.float32)
        dy_scaled = masks.carried_in(dy32) if not has_seq else dy32
        dc_state = jnp.dot(dy_scaled.astype(state.dtype), state, preferred_element_type=jnp.float32)
        dc += dc_state if not has_seq else masks.carried_in(dc_state)
        # The log-decay gradient's per-token part through the state entering the chunk,
        # dY_l . exp(s_l) (C H^T)_l.
        carried = jnp.dot(cmat, state.T, preferred_element_type=jnp.float32)  # (Q, P)
        refs.carried[j, :] = masks.carried_in(jnp.sum(dy32 * carried, axis=1))
        # The state-passing term of the log-decay gradient, exp(s_last) <G, H>, summed over N
        # here and over P by the caller.
        overlap = jnp.sum(grad.astype(jnp.float32) * state.astype(jnp.float32), axis=1)
        refs.passing[j, :] = masks.pass_on(overlap)
        return db, dc, dscores

    q, n = cmat.shape
    zeros = jnp.zeros((q, n), jnp.float32)
    db, dc, dscores = jax.lax.fori_loop(
        0, refs.x.shape[1], head, (zeros, zeros, jnp.zeros((q, q), jnp.float32))
    )
    dscores = dscores.astype(dtype)
    db += jnp.dot(dscores.T, cmat, preferred_element_type=jnp.float32)
    dc += jnp.dot(dscores, refs.b[...], preferred_element_type=jnp.float32)
    refs.db[...] = db.astype(refs.db.dtype)
    refs.dc[...] = dc.astype(refs.dc.dtype)


def _state_terms(x, dy, dt, s, b, c, seq, states, gstates, *, static, blocks, plan):
    """(db, dc, passing, carried): dB and dC (B, Tp, G, Np) in b's dtype, and the log-decay
    gradient's terms through the states, float32: passing (B, H, nc), exp(s_last) <G, H> per
    chunk (the gradient of each of the chunk's log-decays through the state passed on), and
    carried (B, H, Tp), dY_l . exp(s_l) (C H^T)_l (the output's part from the state entering
    the chunk, its spans starting at the chunk start).

    dB and dC sum over the group's heads: the intra-chunk terms dS^T C and dS B with the
    head-summed score gradient dS = sum_h L_h o (dY_h xbar_h^T), and the state terms
    sum_{h, p} xbar to_end G (dB) and dY from_start H (dC). x, dy (B, Tp, H, Pp); b, c
    (B, Tp, G, Np); states H and gstates G (B, nc, H, Pp, Np). One program per (chunk, group,
    batch row) loops over the group's heads. It loads H and G anyway, so the log-decay terms cost
    no extra read here (the state-gradient walk would have to read H for <G, H>, and the chunk
    kernel, short of registers, H for C H^T).
    """
    batch, t_pad, heads, p_pad = x.shape
    groups, n_pad = b.shape[2], b.shape[3]
    hpg, q, nc = heads // groups, blocks.block_t, plan.num_chunks
    tokens = pl.BlockSpec((None, q, hpg, p_pad), lambda ci, g, i: (i, ci, g, 0))
    per_head = pl.BlockSpec((None, hpg, t_pad), lambda ci, g, i: (i, g, 0))
    chunk_states = pl.BlockSpec((None, None, hpg, p_pad, n_pad), lambda ci, g, i: (i, ci, g, 0, 0))
    group_tokens = pl.BlockSpec((None, q, None, n_pad), lambda ci, g, i: (i, ci, g, 0))
    inputs = (Operands()
              .add("x", tokens, x).add("dy", tokens, dy)
              .add("dt", per_head, dt).add("s", per_head, s)
              .add("b", group_tokens, b).add("c", group_tokens, c)
              .add("states", chunk_states, states).add("gstates", chunk_states, gstates)
              .add("seq", pl.BlockSpec((None, t_pad), lambda ci, g, i: (i, 0)), seq))
    outputs = (Operands()
               .add("db", group_tokens, jax.ShapeDtypeStruct(b.shape, b.dtype))
               .add("dc", group_tokens, jax.ShapeDtypeStruct(b.shape, b.dtype))
               .add("passing",
                    pl.BlockSpec((None, hpg, None, p_pad), lambda ci, g, i: (i, g, ci, 0)),
                    jax.ShapeDtypeStruct((batch, heads, nc, p_pad), jnp.float32))
               .add("carried", pl.BlockSpec((None, hpg, q), lambda ci, g, i: (i, g, ci)),
                    jax.ShapeDtypeStruct((batch, heads, t_pad), jnp.float32)))
    out = _operands.call(
        functools.partial(_state_terms_kernel, block_t=q),
        inputs, outputs,
        grid=(nc, groups, batch),
        num_warps=blocks.terms_num_warps, num_stages=blocks.terms_num_stages,
        interpret=static.interpret,
        name="ssd_state_terms",
    )
    return out["db"], out["dc"], out["passing"].sum(axis=3), out["carried"]
