"""SSD forward kernel (Pallas, Triton lowering): the chunked scan fused into one pass.

One program owns one (batch row, head, block of head-dim rows, part of the sequence) and walks
the part's chunks in order, keeping the (P_block, N) state in float32 registers. Per chunk of
Q tokens it computes

    y   = (L o C B^T o dt) x + exp(s) * (C h^T) + D x          (intra-chunk + carried state)
    h  <- exp(s_last) h + (x * dt * exp(s_last - s))^T B        (state passing)

where s is the in-chunk inclusive cumsum of a = dt * A and L[l, j] = exp(min(s_l - s_j, 0)) for
j <= l (the kernels hold s in base 2: `common.chunk_log2_decays`). Chunk states never leave the
program; the backward's recompute pass asks the same kernel to write the state entering each
chunk instead of the output (`emit="states"`).

A serial walk over all chunks leaves most of the GPU idle when batch x heads is small (160 walks
on 132 SMs that could each run two), and with more walks than run at once, the last round of
walks runs alone. So walks can be cut into parts walked in parallel, and the first parts that
would run in a last, partial round into shorter units (`common.forward_schedule` picks the cut,
`segments` numbers the programs); each program starts from the state entering its part, built
from `segments.segment_sums`. Where walks are cut, the forward saves the state each program
starts from (one per program), so that the backward's recompute can run the same programs
again from them, without the sums.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.mamba2 import common, segments


def _forward_kernel(program, *refs, static, emit, save_entries, has_entries):
    refs = list(refs)
    x_ref, dt_ref, s_ref, b_ref, c_ref = (refs.pop(0) for _ in range(5))
    seq_ref = refs.pop(0) if static.has_seq_idx else None
    d_ref = refs.pop(0) if static.has_d and emit == "output" else None
    z_ref = refs.pop(0) if static.has_z and emit == "output" else None
    h0_ref = refs.pop(0) if static.has_initial_states and not has_entries else None
    has_sums = not has_entries and segments.summed(static, "states")[1] > 0
    if has_sums:
        unit_states_ref, unit_decays_ref = refs.pop(0), refs.pop(0)
    entries_ref = refs.pop(0) if has_entries else None
    if emit == "output":
        y_ref = refs.pop(0)
        y_pre_ref = refs.pop(0) if static.has_z else None
    else:
        states_ref = refs.pop(0)
    final_ref = refs.pop(0)
    if save_entries:
        entries_ref = refs.pop(0)
    part = segments.walk_part(program, static)

    def chunk(i, state):
        c = part.first_chunk + i
        tok = common.chunk_tokens(c, static)
        x = x_ref[tok, :]
        dt = dt_ref[tok]
        b = b_ref[tok, :]
        cmat = c_ref[tok, :]
        masks = common.chunk_masks(c, s_ref, seq_ref, static)
        if emit == "states":
            states_ref[c] = state.astype(states_ref.dtype)
        else:
            scores = jnp.dot(cmat, b.T, preferred_element_type=jnp.float32)  # (Q, Q)
            weights = masks.weigh(scores * dt[None, :]).astype(x.dtype)
            y = jnp.dot(weights, x, preferred_element_type=jnp.float32)
            carried = jnp.dot(cmat, state.astype(cmat.dtype).T, preferred_element_type=jnp.float32)
            y += masks.carried_in(carried)
            if d_ref is not None:
                y += d_ref[...][None, :] * x.astype(jnp.float32)
            if z_ref is None:
                y_ref[tok, :] = y.astype(y_ref.dtype)
            else:
                y_pre_ref[tok, :] = y.astype(y_pre_ref.dtype)
                z = z_ref[tok, :].astype(jnp.float32)
                y_ref[tok, :] = (y * z * jax.nn.sigmoid(z)).astype(y_ref.dtype)
        x_weighted = masks.to_state(x.astype(jnp.float32), dt).astype(x.dtype)
        chunk_state = jnp.dot(x_weighted.T, masks.of_last(b),
                              preferred_element_type=jnp.float32)  # (P, N)
        return masks.pass_on(state) + chunk_state

    if has_entries:  # the state this program started from in the forward
        state = entries_ref[...]
    elif h0_ref is not None:
        state = h0_ref[...].astype(jnp.float32)
    else:
        state = jnp.zeros(final_ref.shape, jnp.float32)
    if has_sums:
        # The state entering this part: the earlier units' own states passed along.
        def enter(j, state):
            return segments.pass_on(unit_decays_ref[j, 0], state, static) + unit_states_ref[j]

        state = jax.lax.fori_loop(0, part.first_unit, enter, state)
    if save_entries:
        entries_ref[...] = state

    state = jax.lax.fori_loop(0, part.num_chunks, chunk, state)

    @pl.when(part.end_unit == static.schedule.num_units)
    def _():
        final_ref[...] = state


def forward(x, dt, s, b, c, seq, d, z, h0, *, static, emit="output", save_entries=False,
            entries=None):
    """Runs the scan kernel on padded, preprocessed inputs.

    x (B, Tp, H, Pp) and z (same, or None); dt, s (B, H, Tp) float32 (dt after softplus/clamp and
    the in-chunk cumsum of dt * A); b, c (B, Tp, G, Np); seq (B, Tp) int32 or None; d (H, Pp)
    float32 or None; h0 (B, H, Pp, Np) float32 or None. Tp is a multiple of the chunk
    `static.block_t`, Pp and Np powers of two.

    emit="output": returns (y, y_pre, final, entries) with y (B, Tp, H, Pp) in x's dtype, y_pre
    the output before the z gate (None without z), final (B, H, Pp, Np) float32 and entries the
    state each program starts from, (programs, P block, Np) float32, where `save_entries` and
    the walks are cut (more programs than walks), else None. emit="states": returns (states,
    final), states (B, num_chunks, H, Pp, Np) in x's dtype (carried in float32), the state
    entering each chunk; given `entries` from the forward (and the forward's `static`), each
    program starts from the state it started from there, without sums.
    """
    call = scan_call(x, dt, s, b, c, seq, d, z, h0, static=static, emit=emit,
                     save_entries=save_entries, entries=entries)
    num_stages = static.forward_num_stages if emit == "output" else static.num_stages
    (outs,) = segments.launch([call], num_warps=static.num_warps, num_stages=num_stages,
                              interpret=static.interpret)
    if emit == "states":
        return tuple(outs)
    y = outs.pop(0)
    y_pre = outs.pop(0) if static.has_z else None
    final = outs.pop(0)
    return y, y_pre, final, outs.pop(0) if outs else None


def scan_call(x, dt, s, b, c, seq, d, z, h0, *, static, emit, save_entries=False, entries=None):
    """The `segments.ScanCall` of `forward` (same arguments), to launch alone or beside another
    scan kernel."""
    batch, t_pad, heads, p_pad = x.shape
    n_pad = b.shape[-1]
    bp, num_p_blocks = static.block_p, p_pad // static.block_p
    hpg = heads // b.shape[2]

    index = segments.program_index(static, heads, num_p_blocks, hpg)
    tokens = pl.BlockSpec((None, t_pad, None, bp), index.tokens)
    per_head = pl.BlockSpec((None, None, t_pad), index.per_head)
    group = pl.BlockSpec((None, t_pad, None, n_pad), index.group)
    state_spec = pl.BlockSpec((None, None, bp, n_pad), index.state)
    in_specs = [tokens, per_head, per_head, group, group]
    args = [x, dt, s, b, c]
    if static.has_seq_idx:
        in_specs.append(pl.BlockSpec((None, t_pad), index.row))
        args.append(seq)
    if emit == "output" and static.has_d:
        in_specs.append(pl.BlockSpec((None, bp), index.head_rows))
        args.append(d)
    if emit == "output" and static.has_z:
        in_specs.append(tokens)
        args.append(z)
    entries_spec = pl.BlockSpec((None, bp, n_pad), lambda k: (k, 0, 0))
    if static.has_initial_states and entries is None:
        in_specs.append(state_spec)
        args.append(h0)
    if entries is not None:
        in_specs.append(entries_spec)
        args.append(entries)
    elif segments.summed(static, "states")[1] > 0:
        in_specs += segments.specs(static, n_pad, "states")
        args += segments.segment_sums(x, dt, s, b, seq, static=static, kind="states")
    num_programs = segments.num_programs(static)
    save_entries = save_entries and emit == "output" and num_programs > static.walks
    final_shape = jax.ShapeDtypeStruct((batch, heads, p_pad, n_pad), jnp.float32)
    if emit == "output":
        y_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
        out_specs = [tokens] + ([tokens] if static.has_z else []) + [state_spec]
        out_shape = [y_shape] + ([y_shape] if static.has_z else []) + [final_shape]
        if save_entries:
            out_specs.append(entries_spec)
            out_shape.append(jax.ShapeDtypeStruct((num_programs, bp, n_pad), jnp.float32))
    else:
        nc = static.num_chunks
        out_specs = [pl.BlockSpec((None, nc, None, bp, n_pad), index.chunk_states), state_spec]
        out_shape = [
            jax.ShapeDtypeStruct((batch, nc, heads, p_pad, n_pad), x.dtype), final_shape
        ]
    kernel = functools.partial(_forward_kernel, static=static, emit=emit,
                               save_entries=save_entries, has_entries=entries is not None)
    return segments.ScanCall(kernel, num_programs, in_specs, args, out_specs, out_shape,
                             f"ssd_forward_{emit}")
