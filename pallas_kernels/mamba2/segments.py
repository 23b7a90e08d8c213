"""Programs of the scan kernels, and the segment sums that let them walk a sequence in parallel.

A walk is one (batch row, head, head-dim block) of a scan kernel: a serial pass over the chunks,
carrying the (P block, N) state (or its gradient) from chunk to chunk. A walk runs whole in one
program or split into `static.num_segments` S equal segments walked by separate programs. The
scan kernels have a one-axis grid: programs 0 .. F - 1 walk walks 0 .. F - 1 whole (F =
`static.whole_walks`); the rest walk segment g of split walk F + k, program F + k S + g.
Walks are numbered batch row first, then head, then head-dim block.

A program walking segment g first needs what the segment receives from the others, built from
the sums of this module's kernel, for each split walk:

* kind "states" (forward scan, state recompute): for segments 0 .. S-2, the state leaving the
  segment when it is entered with zero, sum over its chunks c of (x dt to_end decay_after_c)^T B
  with decay_after_c the product of the decays of the segment's chunks after c. The state
  entering segment k is then h_k = decay_{k-1} h_{k-1} + sums_{k-1}, from h_0 = h0 (or zero).
* kind "gradients" (state gradients): for segments 1 .. S-1, the gradient of the state entering
  the segment from the segment's own outputs, sum over c of (dY from_start decay_before_c)^T C.
  The gradient of the state leaving segment k is then G_k = sums_{k+1} + decay_{k+1} G_{k+1},
  from G_{S-1} = the final state's cotangent (or zero).

Either sum is one matmul accumulation per program (the only dependence between chunks is the
running scalar product of decays); its floor is one read of x (or dY) for the split walks, and
on an H200 it takes about 1.7x that (benchmarks/NOTES.md), which is why walks are split only
where the GPU would otherwise idle: when they are few, or in the last round of many.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.mamba2 import common


def num_programs(static, walks):
    """Programs of a scan kernel over `walks` walks (see the module docstring)."""
    return static.whole_walks + (walks - static.whole_walks) * static.num_segments


class WalkPart(NamedTuple):
    """What one scan-kernel program walks: its walk, the walk's index among the split walks (0
    for a whole walk), its segment of the walk and the walk's last segment (both 0 for a whole
    walk), and its chunks: `num_chunks` from `first_chunk` (a Python int unless the kernel has
    both whole and split walks)."""

    walk: jax.Array
    split_walk: jax.Array
    segment: jax.Array
    last_segment: jax.Array | int
    first_chunk: jax.Array
    num_chunks: jax.Array | int


def walk_part(program, static):
    """The WalkPart of scan-kernel program `program` (see the module docstring)."""
    count, length = static.num_segments, static.segment_chunks
    if static.whole_walks == 0:
        segment = program % count
        return WalkPart(program // count, program // count, segment, count - 1,
                        segment * length, length)
    # Whole walks have split = 0, so segment 0 and split walk 0.
    split = jnp.maximum(program - static.whole_walks, 0)
    is_split = (program >= static.whole_walks).astype(jnp.int32)
    segment = split % count
    return WalkPart(
        walk=jnp.where(is_split == 1, static.whole_walks + split // count, program),
        split_walk=split // count,
        segment=segment,
        last_segment=(count - 1) * is_split,
        first_chunk=segment * length,
        num_chunks=static.num_chunks - (static.num_chunks - length) * is_split,
    )


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


def program_index(static, heads, num_p_blocks, heads_per_group):
    """The WalkIndex of a scan kernel's programs (see `walk_part`)."""
    return WalkIndex(lambda k: walk_part(k, static).walk, heads, num_p_blocks, heads_per_group)


def _segment_sums_kernel(tokens_ref, dt_ref, s_ref, operand_ref, *refs, static, kind):
    seq_ref = refs[0] if static.has_seq_idx else None
    sums_ref, decays_ref = refs[-2:]
    length = static.segment_chunks
    segment = pl.program_id(0) % (static.num_segments - 1) + (kind == "gradients")

    def chunk(i, carry):
        acc, decay = carry
        # States walk their segment backwards (decay to its end), gradients forwards.
        c = segment * length + (length - 1 - i if kind == "states" else i)
        tok = common.chunk_tokens(c, static)
        masks = common.chunk_masks(c, s_ref, seq_ref, static)
        if kind == "states":
            weight = dt_ref[tok] * masks.to_end * decay
        else:
            weight = masks.from_start * decay
        tokens = tokens_ref[tok, :]
        scaled = (tokens.astype(jnp.float32) * weight[:, None]).astype(tokens.dtype)
        acc += jnp.dot(scaled.T, operand_ref[tok, :], preferred_element_type=jnp.float32)
        return acc, decay * masks.chunk_decay

    acc, decay = jax.lax.fori_loop(
        0, length, chunk, (jnp.zeros(sums_ref.shape, jnp.float32), jnp.float32(1.0))
    )
    sums_ref[...] = acc
    decays_ref[...] = jnp.full(decays_ref.shape, decay)


def segment_sums(tokens, dt, s, operand, seq, *, static, kind):
    """(sums, decays) of S - 1 segments of each split walk (see the module docstring).

    tokens (B, Tp, H, Pp) are x for kind "states" and dY for "gradients"; operand (B, Tp, G, Np)
    is B or C; dt, s (B, H, Tp) float32; seq (B, Tp) or None. With K split walks, returns sums
    (K, S - 1, P block, Np) float32 and decays (K, S - 1, P block) float32 (each segment's
    product of chunk decays, repeated over the block), index j holding segment j for "states"
    and j + 1 for "gradients".
    """
    batch, t_pad, heads, p_pad = tokens.shape
    n_pad = operand.shape[-1]
    bp, num_p_blocks = static.block_p, p_pad // static.block_p
    hpg = heads // operand.shape[2]
    split_walks = batch * heads * num_p_blocks - static.whole_walks
    per_walk = static.num_segments - 1

    # Program k sums segment k % per_walk of split walk k // per_walk.
    index = WalkIndex(lambda k: static.whole_walks + k // per_walk, heads, num_p_blocks, hpg)
    in_specs = [
        pl.BlockSpec((None, t_pad, None, bp), index.tokens),
        pl.BlockSpec((None, None, t_pad), index.per_head),
        pl.BlockSpec((None, None, t_pad), index.per_head),
        pl.BlockSpec((None, t_pad, None, n_pad), index.group),
    ]
    args = [tokens, dt, s, operand]
    if static.has_seq_idx:
        in_specs.append(pl.BlockSpec((None, t_pad), index.row))
        args.append(seq)
    return pl.pallas_call(
        functools.partial(_segment_sums_kernel, static=static, kind=kind),
        grid=(split_walks * per_walk,),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, bp, n_pad), lambda k: (k // per_walk, k % per_walk, 0, 0)),
            pl.BlockSpec((None, None, bp), lambda k: (k // per_walk, k % per_walk, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((split_walks, per_walk, bp, n_pad), jnp.float32),
            jax.ShapeDtypeStruct((split_walks, per_walk, bp), jnp.float32),
        ],
        compiler_params=_compat.triton_params(static.num_warps, static.num_stages),
        interpret=static.interpret,
        name=f"ssd_segment_{kind}",
    )(*args)


def specs(static, n_pad):
    """BlockSpecs of (sums, decays) as inputs of a scan kernel (one-axis grid of programs): each
    program sees its split walk's (a whole walk's: the first split walk's, unused)."""
    per_walk, bp = static.num_segments - 1, static.block_p

    def split_walk(k):
        return walk_part(k, static).split_walk

    return [
        pl.BlockSpec((None, per_walk, bp, n_pad), lambda k: (split_walk(k), 0, 0, 0)),
        pl.BlockSpec((None, per_walk, bp), lambda k: (split_walk(k), 0, 0)),
    ]
