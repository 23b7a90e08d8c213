"""Segment sums that let the scan kernels walk segments of a sequence in parallel.

A walk over all chunks of a row is serial, and with few (batch row, head) pairs it leaves most of
the GPU idle. When `static.num_segments` S > 1 the scan kernels split the chunks into S equal
segments walked by separate programs; each program first needs what its segment receives from
the others, built from the sums of this module's kernel:

* kind "states" (forward scan, state recompute): for segments 0 .. S-2, the state leaving the
  segment when it is entered with zero, sum over its chunks c of (x dt to_end decay_after_c)^T B
  with decay_after_c the product of the decays of the segment's chunks after c. The state
  entering segment k is then h_k = decay_{k-1} h_{k-1} + sums_{k-1}, from h_0 = h0 (or zero).
* kind "gradients" (state gradients): for segments 1 .. S-1, the gradient of the state entering
  the segment from the segment's own outputs, sum over c of (dY from_start decay_before_c)^T C.
  The gradient of the state leaving segment k is then G_k = sums_{k+1} + decay_{k+1} G_{k+1},
  from G_{S-1} = the final state's cotangent (or zero).

Either sum is one matmul accumulation per program (the only dependence between chunks is the
running scalar product of decays); its floor is one read of x (or dY), and on an H200 it takes
about 1.7x that (benchmarks/NOTES.md), which is why short lists of walks are not split.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.mamba2 import common


def _segment_sums_kernel(tokens_ref, dt_ref, s_ref, operand_ref, *refs, static, num_p_blocks,
                         kind):
    seq_ref = refs[0] if static.has_seq_idx else None
    sums_ref, decays_ref = refs[-2:]
    length = static.segment_chunks
    segment = pl.program_id(0) // num_p_blocks + (kind == "gradients")

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
    """(sums, decays) of S - 1 segments per row (see the module docstring).

    tokens (B, Tp, H, Pp) are x for kind "states" and dY for "gradients"; operand (B, Tp, G, Np)
    is B or C; dt, s (B, H, Tp) float32; seq (B, Tp) or None. Returns sums (B, S - 1, H, Pp, Np)
    float32 and decays (B, S - 1, H, Pp) float32 (each segment's product of chunk decays,
    repeated over Pp), index j holding segment j for "states" and j + 1 for "gradients".
    """
    batch, t_pad, heads, p_pad = tokens.shape
    n_pad = operand.shape[-1]
    bp, num_p_blocks = static.block_p, p_pad // static.block_p
    hpg = heads // operand.shape[2]
    in_specs = [
        pl.BlockSpec((None, t_pad, None, bp), lambda j, h, i: (i, 0, h, j % num_p_blocks)),
        pl.BlockSpec((None, None, t_pad), lambda j, h, i: (i, h, 0)),
        pl.BlockSpec((None, None, t_pad), lambda j, h, i: (i, h, 0)),
        pl.BlockSpec((None, t_pad, None, n_pad), lambda j, h, i: (i, 0, h // hpg, 0)),
    ]
    args = [tokens, dt, s, operand]
    if static.has_seq_idx:
        in_specs.append(pl.BlockSpec((None, t_pad), lambda j, h, i: (i, 0)))
        args.append(seq)
    segments = static.num_segments - 1
    return pl.pallas_call(
        functools.partial(_segment_sums_kernel, static=static, num_p_blocks=num_p_blocks,
                          kind=kind),
        grid=(segments * num_p_blocks, heads, batch),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, bp, n_pad),
                         lambda j, h, i: (i, j // num_p_blocks, h, j % num_p_blocks, 0)),
            pl.BlockSpec((None, None, None, bp),
                         lambda j, h, i: (i, j // num_p_blocks, h, j % num_p_blocks)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, segments, heads, p_pad, n_pad), jnp.float32),
            jax.ShapeDtypeStruct((batch, segments, heads, p_pad), jnp.float32),
        ],
        compiler_params=_compat.triton_params(static.num_warps, static.num_stages),
        interpret=static.interpret,
        name=f"ssd_segment_{kind}",
    )(*args)


def specs(static, n_pad, num_p_blocks):
    """BlockSpecs of (sums, decays) as inputs of a scan kernel with grid (S * P blocks, H, B)."""
    segments = static.num_segments - 1
    bp = static.block_p
    return [
        pl.BlockSpec((None, segments, None, bp, n_pad),
                     lambda j, h, i: (i, 0, h, j % num_p_blocks, 0)),
        pl.BlockSpec((None, segments, None, bp), lambda j, h, i: (i, 0, h, j % num_p_blocks)),
    ]
