"""SSD backward kernels (Pallas, Triton lowering), deterministic: no atomics.

After the forward kernel recomputes the state entering each chunk (`forward(emit="states")`):

* `state_gradients`: one program per (batch row, head, head-dim block) walks the chunks in
  reverse, G <- dH_local + exp(s_last) G, writing G (the gradient of the state leaving each
  chunk), the initial-state gradient and the per-chunk state-passing term of the log-decay
  gradient, exp(s_last) <G, H>, while G is in registers.
* `chunk_gradients`: one program per (chunk, block of one group's heads, batch row) loops over
  its heads. It computes C B^T once, writes dx and per-token float32 vectors per head (the dt'
  term of dx and the chunk-local parts of the gradient of the log decay a = dt' A). For dB
  and dC it sums the (Q, Q) score gradient over its heads (C and B are shared by the group, so
  two matmuls per program give the intra-chunk terms) and writes the decay-scaled x and dY
  that XLA contracts with the states over (heads, P) in one batched matmul per chunk (the
  state terms). No per-head (Q, N) tensor is accumulated or stored.

The recurrences carry states and their gradients in float32; the copies that pass between the
kernels (matmul operands there) are stored in the inputs' dtype, as mamba_ssm stores its states.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.mamba2 import common


def _state_gradients_kernel(dy_ref, s_ref, c_ref, states_ref, *refs, static, has_final):
    refs = list(refs)
    seq_ref = refs.pop(0) if static.has_seq_idx else None
    dfinal_ref = refs.pop(0) if has_final else None
    gstates_ref, passing_ref, dh0_ref = refs
    nc = static.num_chunks

    def chunk(i, grad):
        c = nc - 1 - i
        gstates_ref[c] = grad.astype(gstates_ref.dtype)
        tok = common.chunk_tokens(c, static)
        dy = dy_ref[tok, :]
        cmat = c_ref[tok, :]
        masks = common.chunk_masks(c, s_ref, seq_ref, static)
        # The state-passing term of the log-decay gradient: exp(s_last) <G, H entering>.
        # One axis at a time: a two-axis reduction fails to lower under an abstract mesh.
        overlap = jnp.sum(grad * states_ref[c].astype(jnp.float32), axis=1)
        passing_ref[c] = masks.chunk_decay * jnp.sum(overlap, axis=0)
        dy_weighted = (dy.astype(jnp.float32) * masks.from_start[:, None]).astype(cmat.dtype)
        local = jnp.dot(dy_weighted.T, cmat, preferred_element_type=jnp.float32)  # (P, N)
        return local + masks.chunk_decay * grad

    grad = (
        dfinal_ref[...].astype(jnp.float32)
        if dfinal_ref is not None
        else jnp.zeros(dh0_ref.shape, jnp.float32)
    )
    dh0_ref[...] = jax.lax.fori_loop(0, nc, chunk, grad)


def state_gradients(dy, s, c, seq, dfinal, states, *, static):
    """Gradients of the chunk-leaving states and of h0, and the state-passing decay term.

    dy (B, Tp, H, Pp) is the gradient of the pre-gate output; s (B, H, Tp); c (B, Tp, G, Np);
    seq (B, Tp) or None; dfinal (B, H, Pp, Np) float32 or None; states (B, nc, H, Pp, Np), the
    states entering each chunk. Returns gstates (B, nc, H, Pp, Np) in dy's dtype, passing
    (B, H, nc) float32 (exp(s_last) <G, H> per chunk: the gradient of each of the chunk's
    log-decays through the state passed on) and dh0 (B, H, Pp, Np) float32.
    """
    batch, t_pad, heads, p_pad = dy.shape
    n_pad = c.shape[-1]
    bp, nc = static.block_p, static.num_chunks
    hpg = heads // c.shape[2]
    state_spec = pl.BlockSpec((None, None, bp, n_pad), lambda p, h, i: (i, h, p, 0))
    chunk_states = pl.BlockSpec((None, nc, None, bp, n_pad), lambda p, h, i: (i, 0, h, p, 0))
    in_specs = [
        pl.BlockSpec((None, t_pad, None, bp), lambda p, h, i: (i, 0, h, p)),
        pl.BlockSpec((None, None, t_pad), lambda p, h, i: (i, h, 0)),
        pl.BlockSpec((None, t_pad, None, n_pad), lambda p, h, i: (i, 0, h // hpg, 0)),
        chunk_states,
    ]
    args = [dy, s, c, states]
    if static.has_seq_idx:
        in_specs.append(pl.BlockSpec((None, t_pad), lambda p, h, i: (i, 0)))
        args.append(seq)
    if dfinal is not None:
        in_specs.append(state_spec)
        args.append(dfinal)
    gstates, passing, dh0 = pl.pallas_call(
        functools.partial(_state_gradients_kernel, static=static, has_final=dfinal is not None),
        grid=(p_pad // bp, heads, batch),
        in_specs=in_specs,
        out_specs=[
            chunk_states,
            pl.BlockSpec((None, None, None, nc), lambda p, h, i: (i, h, p, 0)),
            state_spec,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, nc, heads, p_pad, n_pad), dy.dtype),
            jax.ShapeDtypeStruct((batch, heads, p_pad // bp, nc), jnp.float32),
            jax.ShapeDtypeStruct((batch, heads, p_pad, n_pad), jnp.float32),
        ],
        compiler_params=_compat.triton_params(static.num_warps, static.num_stages),
        interpret=static.interpret,
        name="ssd_state_gradients",
    )(*args)
    return gstates, passing.sum(axis=2), dh0


def _chunk_gradients_kernel(
    x_ref, dy_ref, dt_ref, s_ref, b_ref, c_ref, states_ref, gstates_ref, *refs, static,
    heads_per_program,
):
    refs = list(refs)
    seq_ref = refs.pop(0) if static.has_seq_idx else None
    d_ref = refs.pop(0) if static.has_d else None
    (dx_ref, ddt_ref, intra_ref, into_state_ref, from_state_ref, x_to_end_ref, dy_from_start_ref,
     db_ref, dc_ref) = refs
    c = pl.program_id(0)
    b = b_ref[...]
    cmat = c_ref[...]
    dtype = b.dtype
    scores = jnp.dot(cmat, b.T, preferred_element_type=jnp.float32)  # C B^T, (Q, Q)
    q = static.block_t
    row = jnp.arange(q, dtype=jnp.int32)[:, None]
    col = jnp.arange(q, dtype=jnp.int32)[None, :]
    at_or_after = row >= col  # at_or_after[l, t] = [l >= t]
    # The prefix-sum matmul runs in bf16 (float32's range) unless the inputs are float32.
    prefix_dtype = jnp.float32 if dtype == jnp.float32 else jnp.bfloat16
    before = (row < col).astype(prefix_dtype)  # before[j, t] = [j < t]

    def head(j, dscores_sum):
        x = x_ref[:, j, :]
        dy = dy_ref[:, j, :]
        dt = dt_ref[j, common.chunk_tokens(c, static)]
        masks = common.chunk_masks(c, s_ref, seq_ref, static, head=j)
        state = states_ref[j].astype(dtype)  # (P, N): entering the chunk
        grad = gstates_ref[j].astype(dtype)  # (P, N): gradient of the state leaving it
        x32, dy32 = x.astype(jnp.float32), dy.astype(jnp.float32)
        x_bar = (x32 * dt[:, None]).astype(dtype)

        grad_b = jnp.dot(b, grad.T, preferred_element_type=jnp.float32)  # B G^T, (Q, P)
        carried = jnp.dot(cmat, state.T, preferred_element_type=jnp.float32)  # C H^T, (Q, P)
        dx_bar = masks.to_end[:, None] * grad_b + jnp.dot(
            (scores * masks.decay).T.astype(dtype), dy, preferred_element_type=jnp.float32
        )
        dx = dx_bar * dt[:, None]
        if d_ref is not None:
            dx += d_ref[j, :][None, :] * dy32
        dx_ref[:, j, :] = dx.astype(dx_ref.dtype)
        ddt_ref[j, :] = jnp.sum(dx_bar * x32, axis=1)
        # The state terms of dB and dC, summed over the group's heads by XLA as one matmul each.
        x_to_end_ref[:, j, :] = (x_bar.astype(jnp.float32) * masks.to_end[:, None]).astype(dtype)
        dy_from_start_ref[:, j, :] = (dy32 * masks.from_start[:, None]).astype(dtype)
        dscores = masks.decay * jnp.dot(dy, x_bar.T, preferred_element_type=jnp.float32)

        # The log-decay gradient's per-token parts (see `chunk_gradients`). Prefix sums over
        # the (Q, Q) tile run as a matmul with a triangular 0/1 matrix, not a cumsum: Triton's
        # scan across wavefronts is wrong on gfx942 (ROCm/triton#947).
        prefix = jnp.dot((scores * dscores).astype(prefix_dtype), before,
                         preferred_element_type=jnp.float32)  # sum_{j<t} M[l, j]
        intra_ref[j, :] = jnp.sum(jnp.where(at_or_after, prefix, 0.0), axis=0)
        into_state_ref[j, :] = masks.to_end * jnp.sum(x_bar.astype(jnp.float32) * grad_b, axis=1)
        from_state_ref[j, :] = masks.from_start * jnp.sum(dy32 * carried, axis=1)
        return dscores_sum + dscores

    # C and B are shared by the group's heads: the intra-chunk terms of dB, dC need only the
    # head-summed dscores, two matmuls per program instead of two per head.
    dscores_sum = jax.lax.fori_loop(
        0, heads_per_program, head, jnp.zeros(scores.shape, jnp.float32)
    )
    db_ref[...] = jnp.dot(dscores_sum.T.astype(dtype), cmat, preferred_element_type=jnp.float32)
    dc_ref[...] = jnp.dot(dscores_sum.astype(dtype), b, preferred_element_type=jnp.float32)


def chunk_gradients(x, dy, dt, s, b, c, seq, d, states, gstates, passing, *, static):
    """dx, the per-head float32 vectors (ddt_x, dlog_decay) and the group-summed dB, dC.

    x, dy (B, Tp, H, Pp); dt, s (B, H, Tp) float32; b, c (B, Tp, G, Np); seq (B, Tp) or None;
    d (H, Pp) float32 or None; states, gstates (B, nc, H, Pp, Np); passing (B, H, nc) float32
    from `state_gradients`. Returns dx (B, Tp, H, Pp) in x's dtype; ddt_x (the dt' term of dx)
    and dlog_decay (the gradient of a = dt' A) (B, H, Tp) float32; db and dc (B, Tp, G, Np) in
    b's dtype.

    One program per (chunk, block of `static.heads_per_program` heads of one group, batch row).
    The head blocks' float32 partial sums, the state terms and the log-decay gradient's prefix
    sums are done by XLA in a fixed order (deterministic, no atomics).
    """
    batch, t_pad, heads, p_pad = x.shape
    groups, n_pad = b.shape[2], b.shape[3]
    hpg, q, nc = heads // groups, static.block_t, static.num_chunks
    hb = static.heads_per_program
    blocks_per_group = hpg // hb
    tokens = pl.BlockSpec((None, q, hb, p_pad), lambda ci, k, i: (i, ci, k, 0))
    per_head_full = pl.BlockSpec((None, hb, t_pad), lambda ci, k, i: (i, k, 0))
    per_head_chunk = pl.BlockSpec((None, hb, q), lambda ci, k, i: (i, k, ci))
    group = pl.BlockSpec(
        (None, q, None, n_pad), lambda ci, k, i: (i, ci, k // blocks_per_group, 0)
    )
    partial = pl.BlockSpec((None, None, q, n_pad), lambda ci, k, i: (i, k, ci, 0))
    chunk_states = pl.BlockSpec((None, None, hb, p_pad, n_pad), lambda ci, k, i: (i, ci, k, 0, 0))
    in_specs = [tokens, tokens, per_head_full, per_head_full, group, group, chunk_states,
                chunk_states]
    args = [x, dy, dt, s, b, c, states, gstates]
    if static.has_seq_idx:
        in_specs.append(pl.BlockSpec((None, t_pad), lambda ci, k, i: (i, 0)))
        args.append(seq)
    if static.has_d:
        in_specs.append(pl.BlockSpec((hb, p_pad), lambda ci, k, i: (k, 0)))
        args.append(d)
    per_token = jax.ShapeDtypeStruct((batch, heads, t_pad), jnp.float32)
    scaled = jax.ShapeDtypeStruct(x.shape, b.dtype)
    partial_shape = jax.ShapeDtypeStruct((batch, heads // hb, t_pad, n_pad), jnp.float32)
    (dx, ddt_x, intra, into_state, from_state, x_to_end, dy_from_start, db_parts,
     dc_parts) = pl.pallas_call(
        functools.partial(_chunk_gradients_kernel, static=static, heads_per_program=hb),
        grid=(nc, heads // hb, batch),
        in_specs=in_specs,
        out_specs=[tokens, *[per_head_chunk] * 4, tokens, tokens, partial, partial],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), *[per_token] * 4, scaled, scaled,
                   partial_shape, partial_shape],
        compiler_params=_compat.triton_params(static.grad_num_warps, static.grad_num_stages),
        interpret=static.interpret,
        name="ssd_chunk_gradients",
    )(*args)

    # float32 inputs keep float32 products (no TF32); bf16 and fp16 run as they are.
    precision = jax.lax.Precision.HIGHEST if b.dtype == jnp.float32 else None

    def state_term(scaled_tokens, chunk_states):
        # sum over the group's heads and P of (Q, P) @ (P, N) per chunk: one batched matmul.
        lhs = scaled_tokens.reshape(batch, nc, q, groups, hpg, p_pad)
        rhs = chunk_states.reshape(batch, nc, groups, hpg, p_pad, n_pad)
        out = jnp.einsum("bcqgkp,bcgkpn->bcqgn", lhs, rhs, preferred_element_type=jnp.float32,
                         precision=precision)
        return out.reshape(batch, t_pad, groups, n_pad)

    def intra_term(parts):
        parts = parts.reshape(batch, groups, blocks_per_group, t_pad, n_pad).sum(axis=2)
        return jnp.swapaxes(parts, 1, 2)

    db = intra_term(db_parts) + state_term(x_to_end, gstates)
    dc = intra_term(dc_parts) + state_term(dy_from_start, states)

    def in_chunks(per_token):
        return per_token.reshape(batch, heads, nc, q)

    # Gradient of the log-decay a_t, in mamba_ssm's non-cancelling parts: intra-chunk
    # sum_{l>=t} sum_{j<t} M[l, j] with M = C B^T o L o (dY xbar^T); the chunk state
    # sum_{j<t} dB_state_j . B_j; the carried state sum_{l>=t} dY_l . Y_off_l; the state passed
    # on, exp(s_last) <G, H>, for every t. The kernel gives the first and the per-token dot
    # products (over P: dB_state_j . B_j = to_end_j xbar_j . (B G^T)_j, dY_l . Y_off_l =
    # from_start_l dY_l . (C H^T)_l); the chunk-local prefix sums run here.
    into_state, from_state = in_chunks(into_state), in_chunks(from_state)
    dlog_decay = (
        in_chunks(intra)
        + jnp.cumsum(into_state, axis=-1) - into_state
        + jax.lax.cumsum(from_state, axis=3, reverse=True)
        + passing[..., None]
    ).reshape(batch, heads, t_pad)
    return dx, ddt_x, dlog_decay, db.astype(b.dtype), dc.astype(b.dtype)
