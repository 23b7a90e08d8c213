"""Programs of the scan kernels, and the unit sums that let them walk a sequence in parallel.

A walk is one (batch row, head, head-dim block) of a scan kernel: a serial pass over the chunks,
carrying the (P block, N) state (or its gradient) from chunk to chunk. `plan.schedule`
(`schedule.Schedule`) cuts each of the W walks into U units of equal length, walked in K parts
of U / K units, one program per part, except the first part of walks 0 .. M - 1, which is
walked one unit per program. The scan kernels have a one-axis grid; programs are numbered

* first, parts 1 .. K - 1 of every walk: program p walks part 1 + p // W of walk p % W;
* then part 0 of walks M .. W - 1;
* then the units of part 0 of walks 0 .. M - 1, walk by walk,

so the whole parts fill the first rounds of programs and the short split units the last.
The backward's state recompute runs the forward's programs again, each from the state the
forward saved it started from (`forward.forward(save_entries=True)`).

A program starting inside its walk first needs what the walk's earlier units hand it (later
units, walking gradients back), built from the sums of this module's kernel:

* kind "states" (forward scan, state recompute): for units 0 .. R - 1 (R the latest unit a
  program starts at), the state leaving the unit when it is entered with zero, sum over its
  chunks c of (x dt to_end decay_after_c)^T B with decay_after_c the product of the decays of
  the unit's chunks after c. The state entering unit u is then h_u = decay_{u-1} h_{u-1} +
  sums_{u-1}, from h_0 = h0 (or zero). Sums are needed for every walk when K > 1, for the
  split walks 0 .. M - 1 only when K = 1.
* kind "gradients" (state gradients; their schedules have parts of one unit and no split
  walks): for units 1 .. U - 1, the gradient of the state entering the unit from the unit's
  own outputs, sum over c of (dY from_start decay_before_c)^T C. The gradient of the state
  leaving unit u is then G_u = sums_{u+1} + decay_{u+1} G_{u+1}, from G_{U-1} = the final
  state's cotangent (or zero).

Either sum is one matmul accumulation per program (the only dependence between chunks is the
running scalar product of decays); its floor is one read of x (or dY) for the summed units, and
on an H200 it takes well above that (benchmarks/NOTES.md), which is why walks are cut only where
the GPU would otherwise idle (`schedule.forward_schedule` weighs the two).
"""

import functools
import itertools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _device, _operands
from pallas_kernels._operands import Operands
from pallas_kernels.mamba2 import common


def num_programs(plan):
    """Programs of a scan kernel (see the module docstring)."""
    _, part_units, split_walks = plan.schedule
    return plan.walks * plan.schedule.num_parts + split_walks * (part_units - 1)


class WalkPart(NamedTuple):
    """What one scan-kernel program walks: its walk, and the units `first_unit` up to
    `end_unit` (exclusive) of it, which are `num_chunks` chunks from `first_chunk`
    (`num_chunks` a Python int where all programs walk as many)."""

    walk: jax.Array
    first_unit: jax.Array
    end_unit: jax.Array
    first_chunk: jax.Array
    num_chunks: jax.Array | int


def walk_part(program, plan):
    """The WalkPart of scan-kernel program `program` (see the module docstring)."""
    _, part_units, split_walks = plan.schedule
    walks = plan.walks
    later = (plan.schedule.num_parts - 1) * walks  # programs walking parts 1 ..
    whole = plan.schedule.num_parts * walks - split_walks  # programs walking whole parts
    # Flags as int32: Pallas-Triton does not mix booleans into integer arithmetic.
    is_later = (program < later).astype(jnp.int32)
    is_split = (program >= whole).astype(jnp.int32)
    unit = jnp.maximum(program - whole, 0)  # among the split units
    walk = jnp.where(is_split == 1, unit // part_units,
                     jnp.where(is_later == 1, program % walks, split_walks + program - later))
    first_unit = jnp.where(is_split == 1, unit % part_units,
                           is_later * (program // walks + 1) * part_units)
    units = (part_units if split_walks == 0 else 1 if whole == 0
             else part_units - (part_units - 1) * is_split)
    return WalkPart(
        walk=walk,
        first_unit=first_unit,
        end_unit=first_unit + units,
        first_chunk=first_unit * plan.unit_chunks,
        num_chunks=units * plan.unit_chunks,
    )


def summed(plan, kind):
    """(walks, units per walk) of the unit sums a scan kernel needs: see the module
    docstring; (0, 0) where it needs none."""
    num_units, part_units, split_walks = plan.schedule
    if kind == "gradients":
        return plan.walks, num_units - 1
    if plan.schedule.num_parts > 1:
        return plan.walks, num_units - part_units
    return split_walks, part_units - 1 if split_walks else 0


class WalkIndex:
    """Block index maps of the scan kernels' operands for a one-axis grid of programs, given
    `walk_of` (program -> walk). Walks are numbered batch row first, then head, then head-dim
    block; each method maps a program to its walk's block of one operand layout."""

    def __init__(self, walk_of, heads, num_p_blocks, heads_per_group):
        self.walk_of, self.heads, self.num_p_blocks = walk_of, heads, num_p_blocks
        self.heads_per_group = heads_per_group

    def blocks(self, program):
        """(batch row, head, head-dim block)."""
        walk, per_row = self.walk_of(program), self.heads * self.num_p_blocks
        return walk // per_row, walk // self.num_p_blocks % self.heads, walk % self.num_p_blocks

    def tokens(self, program):  # (B, Tp, H, Pp): x, dY, z, y
        i, h, j = self.blocks(program)
        return i, 0, h, j

    def per_head(self, program):  # (B, H, Tp): dt, s
        i, h, _ = self.blocks(program)
        return i, h, 0

    def group(self, program):  # (B, Tp, G, Np): B, C
        i, h, _ = self.blocks(program)
        return i, 0, h // self.heads_per_group, 0

    def row(self, program):  # (B, Tp): seq_idx
        return self.blocks(program)[0], 0

    def head_rows(self, program):  # (H, Pp): D
        return self.blocks(program)[1:]

    def state(self, program):  # (B, H, Pp, Np): h0, final state, their gradients
        i, h, j = self.blocks(program)
        return i, h, j, 0

    def chunk_states(self, program):  # (B, nc, H, Pp, Np): states per chunk, their gradients
        i, h, j = self.blocks(program)
        return i, 0, h, j, 0


class ScanCall(NamedTuple):
    """One scan kernel's programs, to launch alone or beside another kernel's (`launch`):
    `kernel(program, refs)` runs program 0 .. `num_programs` - 1 with its operands' refs by
    name (`_operands.Refs`); the BlockSpecs' index maps take the same program numbers."""

    kernel: Callable
    num_programs: int
    inputs: Operands
    outputs: Operands
    name: str


def launch(calls, *, num_warps, num_stages, interpret):
    """Runs the ScanCalls' programs in one pallas_call on a one-axis grid, `calls[0]`'s first,
    then `calls[1]`'s, and so on; returns each call's outputs as a dict by name.

    Independent walks launched together share the GPU: the programs of one fill the
    multiprocessors the other's leave idle (its last round, or too few walks to fill one).
    """
    starts = list(itertools.accumulate((c.num_programs for c in calls), initial=0))

    def shifted(spec, start, count):
        if len(calls) == 1:
            return spec
        return pl.BlockSpec(spec.block_shape,
                            lambda k: spec.index_map(jnp.clip(k - start, 0, count - 1)))

    inputs, outputs = Operands(), Operands()  # call i's operand "x" as "i:x"
    for i, (call, start) in enumerate(zip(calls, starts[:-1], strict=True)):
        for operands, merged in ((call.inputs, inputs), (call.outputs, outputs)):
            for name, spec, value in zip(operands.names, operands.specs, operands.values,
                                         strict=True):
                merged.add(f"{i}:{name}", shifted(spec, start, call.num_programs), value)

    def kernel(refs):
        program = pl.program_id(0)
        for i, (call, start, end) in enumerate(zip(calls, starts[:-1], starts[1:], strict=True)):
            names = call.inputs.names + call.outputs.names
            own = _operands.Refs(**{name: getattr(refs, f"{i}:{name}") for name in names})
            run = functools.partial(call.kernel, program - start, own)
            if len(calls) == 1:
                run()
            else:
                pl.when((program >= start) & (program < end))(run)

    flat = _operands.call(
        kernel, inputs, outputs,
        grid=(starts[-1],),
        num_warps=num_warps, num_stages=num_stages,
        interpret=interpret,
        name="_".join(c.name for c in calls),
    )
    return [{name: flat[f"{i}:{name}"] for name in call.outputs.names}
            for i, call in enumerate(calls)]


def program_index(plan, heads, num_p_blocks, heads_per_group):
    """The WalkIndex of a scan kernel's programs (see `walk_part`)."""
    return WalkIndex(lambda k: walk_part(k, plan).walk, heads, num_p_blocks, heads_per_group)


def _unit_sums_kernel(refs, *, static, block_t, plan, kind):
    length = plan.unit_chunks
    unit = pl.program_id(0) % summed(plan, kind)[1] + (kind == "gradients")

    def chunk(i, carry):
        acc, decay = carry
        # States walk their unit backwards (decay to its end), gradients forwards; `decay` is
        # the product of the decays of the unit's chunks walked so far (0 past a sequence start).
        c = unit * length + (length - 1 - i if kind == "states" else i)
        tok = _device.block_slice(c, block_t)
        masks = common.chunk_masks(c, refs.s, refs.seq, block_t)
        tokens, operand = refs.tokens[tok, :], refs.operand[tok, :]
        if kind == "states":
            scaled = masks.to_state(tokens.astype(jnp.float32), refs.dt[tok] * decay)
            operand = masks.of_last(operand)
        else:
            scaled = masks.carried_in(tokens.astype(jnp.float32), decay)
            operand = masks.of_continuing(operand)
        if static.has_seq_idx:  # nothing of a sequence that ends inside the unit reaches its end
            scaled, operand = (jnp.where(decay == 0.0, 0.0, v) for v in (scaled, operand))
        acc += jnp.dot(scaled.astype(tokens.dtype).T, operand, preferred_element_type=jnp.float32)
        return acc, masks.pass_on(decay)

    acc, decay = jax.lax.fori_loop(
        0, length, chunk, (jnp.zeros(refs.sums.shape, jnp.float32), jnp.float32(1.0))
    )
    refs.sums[...] = acc
    refs.decays[...] = jnp.full(refs.decays.shape, decay)


def pass_on(decay, state, static):
    """A state (or its gradient) passed across a unit whose decay (the product of its chunks')
    is `decay`; with seq_idx, 0 where the decay is 0 (a sequence starts inside the unit), even
    for a non-finite state."""
    passed = decay * state
    return jnp.where(decay == 0.0, 0.0, passed) if static.has_seq_idx else passed


def unit_sums(tokens, dt, s, operand, seq, *, static, blocks, plan, kind):
    """(sums, decays) of the units `summed(plan, kind)` names (see the module docstring).

    tokens (B, Tp, H, Pp) are x for kind "states" and dY for "gradients"; operand (B, Tp, G, Np)
    is B or C; dt, s (B, H, Tp) float32; seq (B, Tp) or None. For W walks of R summed units
    each, returns sums (W, R, P block, Np) float32 and decays (W, R, P block) float32 (each
    unit's product of chunk decays, repeated over the block), index j holding unit j for
    "states" and j + 1 for "gradients".
    """
    batch, t_pad, heads, p_pad = tokens.shape
    n_pad = operand.shape[-1]
    bp, num_p_blocks = blocks.block_p, p_pad // blocks.block_p
    hpg = heads // operand.shape[2]
    walks, per_walk = summed(plan, kind)

    # Program k sums unit k % per_walk (+ 1 for gradients) of walk k // per_walk.
    index = WalkIndex(lambda k: k // per_walk, heads, num_p_blocks, hpg)
    per_head = pl.BlockSpec((None, None, t_pad), index.per_head)
    inputs = (Operands()
              .add("tokens", pl.BlockSpec((None, t_pad, None, bp), index.tokens), tokens)
              .add("dt", per_head, dt)
              .add("s", per_head, s)
              .add("operand", pl.BlockSpec((None, t_pad, None, n_pad), index.group), operand)
              .add("seq", pl.BlockSpec((None, t_pad), index.row), seq))
    outputs = (Operands()
               .add("sums", pl.BlockSpec((None, None, bp, n_pad),
                                         lambda k: (k // per_walk, k % per_walk, 0, 0)),
                    jax.ShapeDtypeStruct((walks, per_walk, bp, n_pad), jnp.float32))
               .add("decays", pl.BlockSpec((None, None, bp),
                                           lambda k: (k // per_walk, k % per_walk, 0)),
                    jax.ShapeDtypeStruct((walks, per_walk, bp), jnp.float32)))
    out = _operands.call(
        functools.partial(_unit_sums_kernel, static=static, block_t=blocks.block_t, plan=plan,
                          kind=kind),
        inputs, outputs,
        grid=(walks * per_walk,),
        num_warps=blocks.num_warps, num_stages=blocks.num_stages,
        interpret=static.interpret,
        name=f"ssd_unit_{kind}",
    )
    return out["sums"], out["decays"]


def add_unit_sums(inputs, sums, decays, plan, n_pad, block_p, kind):
    """Adds (sums, decays) of `unit_sums` to a scan kernel's inputs, as "unit_sums" and
    "unit_decays": each program sees its walk's (a walk without sums: walk 0's, unused)."""
    walks, per_walk = summed(plan, kind)

    def summed_walk(k):
        return jnp.minimum(walk_part(k, plan).walk, walks - 1)

    inputs.add("unit_sums", pl.BlockSpec((None, per_walk, block_p, n_pad),
                                         lambda k: (summed_walk(k), 0, 0, 0)), sums)
    inputs.add("unit_decays", pl.BlockSpec((None, per_walk, block_p),
                                           lambda k: (summed_walk(k), 0, 0)), decays)
