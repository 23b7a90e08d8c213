"""SSD forward kernel (Pallas, Triton lowering): the chunked scan fused into one pass.

One program owns one (batch row, head, block of head-dim rows, part of the sequence) and walks
the part's chunks in order, keeping the (P_block, N) state in float32 registers. Per chunk of
Q tokens it computes

    y   = (L o C B^T o dt) x + exp(s) * (C h^T) + D x          (intra-chunk + carried state)
    h  <- exp(s_last) h + (x * dt * exp(s_last - s))^T B        (state passing)

where s is the in-chunk inclusive cumsum of a = dt * A and L[l, j] = exp(min(s_l - s_j, 0)) for
j <= l (the kernels hold s in base 2: `common.chunk_log2_decays`). Chunk states never leave the
program; the backward's recompute pass asks the same kernel to write the state entering each
chunk instead of the output (`emit="states"`), and a sequence shard's first pass (`context`)
for the final state alone (`emit="final"`: only the programs walking a walk's last part run).

Walks can be cut into parts walked in parallel, and the first parts that would run in a last,
partial round into shorter units (`schedule.forward_schedule` picks the cut, `walks` numbers the
programs); each program starts from the state entering its part, built from `walks.unit_sums`.
Where walks are cut, the forward saves the state each program starts from (one per program), so
that the backward's recompute can run the same programs again from them, without the sums.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _device
from pallas_kernels._operands import Operands
from pallas_kernels.mamba2 import common, walks


def _forward_kernel(program, refs, *, static, blocks, plan, emit, save_entries):
    part = walks.walk_part(program, plan)
    q = blocks.block_t

    def chunk(i, state):
        c = part.first_chunk + i
        tok = _device.block_slice(c, q)
        x = refs.x[tok, :]
        dt = refs.dt[tok]
        b = refs.b[tok, :]
        cmat = refs.c[tok, :]
        masks = common.chunk_masks(c, refs.s, refs.seq, q)
        if emit == "states":
            refs.states[c] = state.astype(refs.states.dtype)
        elif emit == "output":
            scores = jnp.dot(cmat, b.T, preferred_element_type=jnp.float32)  # (Q, Q)
            weights = masks.weigh(scores * dt[None, :]).astype(x.dtype)
            y = jnp.dot(weights, x, preferred_element_type=jnp.float32)
            carried = jnp.dot(cmat, state.astype(cmat.dtype).T, preferred_element_type=jnp.float32)
            y += masks.carried_in(carried)
            if refs.d is not None:
                y += refs.d[...][None, :] * x.astype(jnp.float32)
            if refs.z is None:
                refs.y[tok, :] = y.astype(refs.y.dtype)
            else:
                refs.y_pre[tok, :] = y.astype(refs.y_pre.dtype)
                z = refs.z[tok, :].astype(jnp.float32)
                refs.y[tok, :] = (y * z * jax.nn.sigmoid(z)).astype(refs.y.dtype)
        x_weighted = masks.to_state(x.astype(jnp.float32), dt).astype(x.dtype)
        chunk_state = jnp.dot(x_weighted.T, masks.of_last(b),
                              preferred_element_type=jnp.float32)  # (P, N)
        return masks.pass_on(state) + chunk_state

    def walk():
        if refs.entries is not None:  # the state this program started from in the forward
            state = refs.entries[...]
        elif refs.h0 is not None:
            state = refs.h0[...].astype(jnp.float32)
        else:
            state = jnp.zeros(refs.final.shape, jnp.float32)
        if refs.unit_sums is not None:
            # The state entering this part: the earlier units' own states passed along.
            def enter(j, state):
                return walks.pass_on(refs.unit_decays[j, 0], state, static) + refs.unit_sums[j]

            state = jax.lax.fori_loop(0, part.first_unit, enter, state)
        if save_entries:
            refs.saved_entries[...] = state
        return jax.lax.fori_loop(0, part.num_chunks, chunk, state)

    last = part.end_unit == plan.schedule.num_units
    if emit == "final":  # only the programs walking a walk's last part have work

        @pl.when(last)
        def _():
            refs.final[...] = walk()

        return
    state = walk()

    @pl.when(last)
    def _():
        refs.final[...] = state


def forward(x, dt, s, b, c, seq, d, z, h0, *, static, blocks, plan, emit="output",
            save_entries=False, entries=None):
    """Runs the scan kernel on padded, preprocessed inputs.

    x (B, Tp, H, Pp) and z (same, or None); dt, s (B, H, Tp) float32 (dt after softplus/clamp and
    the in-chunk cumsum of dt * A); b, c (B, Tp, G, Np); seq (B, Tp) int32 or None; d (H, Pp)
    float32 or None; h0 (B, H, Pp, Np) float32 or None. Tp is a multiple of the chunk
    `blocks.block_t`, Pp and Np powers of two; `plan` (`schedule.Plan`) cuts the walks.

    emit="output": returns (y, y_pre, final, entries) with y (B, Tp, H, Pp) in x's dtype, y_pre
    the output before the z gate (None without z), final (B, H, Pp, Np) float32 and entries the
    state each program starts from, (programs, P block, Np) float32, where `save_entries` and
    the walks are cut (more programs than walks), else None. emit="states": returns (states,
    final), states (B, num_chunks, H, Pp, Np) in x's dtype (carried in float32), the state
    entering each chunk; given `entries` from the forward (and the forward's `plan`), each
    program starts from the state it started from there, without sums. emit="final": returns
    final alone (the walks write nothing else).
    """
    call = scan_call(x, dt, s, b, c, seq, d, z, h0, static=static, blocks=blocks, plan=plan,
                     emit=emit, save_entries=save_entries, entries=entries)
    num_stages = blocks.forward_num_stages if emit == "output" else blocks.num_stages
    (out,) = walks.launch([call], num_warps=blocks.num_warps, num_stages=num_stages,
                          interpret=static.interpret)
    if emit == "final":
        return out["final"]
    if emit == "states":
        return out["states"], out["final"]
    return out["y"], out.get("y_pre"), out["final"], out.get("saved_entries")


def scan_call(x, dt, s, b, c, seq, d, z, h0, *, static, blocks, plan, emit, save_entries=False,
              entries=None):
    """The `walks.ScanCall` of `forward` (same arguments), to launch alone or beside another
    scan kernel."""
    batch, t_pad, heads, p_pad = x.shape
    n_pad = b.shape[-1]
    bp, num_p_blocks = blocks.block_p, p_pad // blocks.block_p
    hpg = heads // b.shape[2]
    output = emit == "output"

    index = walks.program_index(plan, heads, num_p_blocks, hpg)
    tokens = pl.BlockSpec((None, t_pad, None, bp), index.tokens)
    per_head = pl.BlockSpec((None, None, t_pad), index.per_head)
    group = pl.BlockSpec((None, t_pad, None, n_pad), index.group)
    state_spec = pl.BlockSpec((None, None, bp, n_pad), index.state)
    entries_spec = pl.BlockSpec((None, bp, n_pad), lambda k: (k, 0, 0))
    inputs = (Operands()
              .add("x", tokens, x).add("dt", per_head, dt).add("s", per_head, s)
              .add("b", group, b).add("c", group, c)
              .add("seq", pl.BlockSpec((None, t_pad), index.row), seq)
              .add("d", pl.BlockSpec((None, bp), index.head_rows), d if output else None)
              .add("z", tokens, z if output else None)
              .add("h0", state_spec, h0 if entries is None else None)
              .add("entries", entries_spec, entries))
    if emit not in ("output", "states", "final"):
        raise ValueError(f"emit must be output, states or final, got {emit!r}")
    if entries is None and walks.summed(plan, "states")[1] > 0:
        sums = walks.unit_sums(x, dt, s, b, seq, static=static, blocks=blocks, plan=plan,
                               kind="states")
        walks.add_unit_sums(inputs, *sums, plan, n_pad, bp, "states")
    num_programs = walks.num_programs(plan)
    save_entries = save_entries and output and num_programs > plan.walks
    final_shape = jax.ShapeDtypeStruct((batch, heads, p_pad, n_pad), jnp.float32)
    outputs = Operands()
    if output:
        y_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
        (outputs.add("y", tokens, y_shape)
         .add("y_pre", tokens, y_shape if z is not None else None)
         .add("final", state_spec, final_shape)
         .add("saved_entries", entries_spec, jax.ShapeDtypeStruct(
             (num_programs, bp, n_pad), jnp.float32) if save_entries else None))
    else:
        nc = plan.num_chunks
        (outputs.add("states", pl.BlockSpec((None, nc, None, bp, n_pad), index.chunk_states),
                     jax.ShapeDtypeStruct((batch, nc, heads, p_pad, n_pad), x.dtype)
                     if emit == "states" else None)
         .add("final", state_spec, final_shape))
    kernel = functools.partial(_forward_kernel, static=static, blocks=blocks, plan=plan,
                               emit=emit, save_entries=save_entries)
    return walks.ScanCall(kernel, num_programs, inputs, outputs, f"ssd_forward_{emit}")
