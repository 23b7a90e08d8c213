"""Pieces shared by the SSD kernels: the static configuration and the per-chunk decay masks."""

import dataclasses
import math
from typing import NamedTuple

import jax.numpy as jnp
from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True)
class Static:
    """What the kernels know at trace time (hashable: keys custom_vjp and jit)."""

    block_t: int  # chunk length Q of the kernels (a power of two)
    block_p: int  # head-dim rows per program of the scan kernels
    heads_per_program: int  # heads per program of the chunk-gradient kernel (divides H / G)
    num_chunks: int
    # The forward scan walks its first `whole_walks` walks whole and splits the others' chunks
    # into `num_segments` runs walked by separate programs (`segments`); the backward's walks
    # are all split into `backward_num_segments` runs (1: none).
    whole_walks: int
    num_segments: int
    backward_num_segments: int
    has_seq_idx: bool
    has_d: bool
    has_z: bool
    has_initial_states: bool
    seq_len: int  # real tokens T (the kernels see Tp = num_chunks * block_t)
    dt_softplus: bool  # dt preprocessing (`reference.preprocess_dt`)
    dt_limit: tuple[float, float]
    num_warps: int  # scan kernels
    num_stages: int  # scan kernels but the forward
    forward_num_stages: int
    grad_num_warps: int  # chunk-gradient kernel
    grad_num_stages: int
    terms_num_warps: int  # dB/dC state-term kernel
    terms_num_stages: int
    interpret: bool

    @classmethod
    def from_blocks(cls, blocks, *, block_t, p_pad, batch, heads, heads_per_group, num_chunks,
                    multiprocessors, interpret, **flags):
        """The Static of a tuning.SSDBlocks row; `flags` are the has_*, seq_len and dt_* fields.

        A walk is one (batch row, head, head-dim block): a serial pass over all chunks. With
        fewer than `blocks.segment_walks_below` walks, every walk of the forward scan is split
        into equal segments of at least `blocks.min_segment_chunks` chunks, as many as keep the
        programs (one per walk and segment) within `blocks.scan_programs`; the backward's walks
        likewise below `blocks.backward_segment_walks_below` walks. With more walks, the forward
        splits only the walks that would run in a last, partial round of programs (the
        remainder of the walks over the programs that run at once, `blocks.programs_per_sm` on
        each of `multiprocessors`): each into as many segments as that round has room for, so
        the split walks finish soon after the whole ones.
        """
        block_p = min(blocks.block_p, p_pad)
        walks = batch * heads * (p_pad // block_p)

        def most_segments(split_walks, programs):
            """Most segments (dividing the chunks, each long enough) that keep `split_walks`
            split walks within `programs` programs; 1 where there are none."""
            return max((
                s for s in range(2, num_chunks + 1)
                if num_chunks % s == 0 and num_chunks // s >= blocks.min_segment_chunks
                and s * split_walks <= programs
            ), default=1)

        def few_walks_segments(walks_below):
            return most_segments(walks, blocks.scan_programs) if walks < walks_below else 1

        whole_walks, num_segments = 0, few_walks_segments(blocks.segment_walks_below)
        if walks >= blocks.segment_walks_below:
            at_once = blocks.programs_per_sm * multiprocessors
            num_segments = most_segments(walks % at_once, at_once)
            whole_walks = walks - walks % at_once if num_segments > 1 else 0

        return cls(
            block_t=block_t,
            block_p=block_p,
            heads_per_program=max(
                k for k in range(1, blocks.heads_per_program + 1) if heads_per_group % k == 0
            ),
            num_chunks=num_chunks,
            whole_walks=whole_walks,
            num_segments=num_segments,
            backward_num_segments=few_walks_segments(blocks.backward_segment_walks_below),
            num_warps=blocks.num_warps,
            num_stages=blocks.num_stages,
            forward_num_stages=blocks.forward_num_stages or blocks.num_stages,
            grad_num_warps=blocks.grad_num_warps,
            grad_num_stages=blocks.grad_num_stages,
            terms_num_warps=blocks.terms_num_warps or blocks.num_warps,
            terms_num_stages=blocks.terms_num_stages or blocks.num_stages,
            interpret=interpret,
            **flags,
        )

    def for_backward(self):
        """This Static with the backward walks' segments (see `from_blocks`)."""
        return dataclasses.replace(
            self, whole_walks=0, num_segments=self.backward_num_segments
        )

    @property
    def segment_chunks(self):
        """Chunks per segment of the scan kernels (num_segments divides num_chunks)."""
        return self.num_chunks // self.num_segments


def chunk_log2_decays(dt, A, block_t):
    """The kernels' `s`: the in-chunk inclusive cumsum of a = dt * A in base 2, (B, H, Tp) float32.

    dt (B, H, Tp) float32 with Tp a multiple of block_t; A (H,). Decays are exp2 of differences
    of s, which the GPU evaluates in one instruction (exp needs a range reduction first).
    """
    a = dt * (A.astype(jnp.float32) * math.log2(math.e))[None, :, None]
    chunks = a.reshape(*a.shape[:-1], a.shape[-1] // block_t, block_t)
    return jnp.cumsum(chunks, axis=-1).reshape(a.shape)


def chunk_tokens(c, static):
    """The token slice of chunk c."""
    return pl.ds(pl.multiple_of(c * static.block_t, static.block_t), static.block_t)


class ChunkMasks(NamedTuple):
    """Decays of one chunk, with sequence boundaries (seq_idx) folded in.

    With s from `chunk_log2_decays` (so exp2 of its differences are the decays):
    decay (Q, Q): L[l, j] = exp2(min(s_l - s_j, 0)) for j <= l in the same sequence, else 0.
    from_start (Q,): exp2(min(s_l, 0)) where token l continues the sequence live at the chunk
      start (it sees the carried state), else 0.
    to_end (Q,): exp2(min(s_last - s_j, 0)) where token j is in the chunk's last sequence (it
      reaches the state leaving the chunk), else 0.
    chunk_decay (): exp2(min(s_last, 0)) when no sequence starts inside the chunk, else 0.
    """

    decay: jnp.ndarray
    from_start: jnp.ndarray
    to_end: jnp.ndarray
    chunk_decay: jnp.ndarray


def chunk_masks(c, s_ref, seq_ref, static, head=None):
    """ChunkMasks of chunk c from `s_ref` (`chunk_log2_decays`) and `seq_ref` (Tp,) or None.

    `s_ref` is (Tp,), or (heads, Tp) read at row `head`.
    """
    q = static.block_t
    tok = chunk_tokens(c, static)
    last = c * q + (q - 1)
    s, s_last = (s_ref[tok], s_ref[last]) if head is None else (s_ref[head, tok], s_ref[head, last])
    row = jnp.arange(q, dtype=jnp.int32)[:, None]
    col = jnp.arange(q, dtype=jnp.int32)[None, :]
    visible = row >= col
    from_start = jnp.exp2(jnp.minimum(s, 0.0))
    to_end = jnp.exp2(jnp.minimum(s_last - s, 0.0))
    chunk_decay = jnp.exp2(jnp.minimum(s_last, 0.0))
    if seq_ref is not None:
        seq = seq_ref[tok]
        seq_start = seq_ref[jnp.maximum(c * q - 1, 0)]  # the sequence live when the chunk starts
        seq_last = seq_ref[last]
        visible &= seq[:, None] == seq[None, :]
        from_start = jnp.where(seq == seq_start, from_start, 0.0)
        to_end = jnp.where(seq == seq_last, to_end, 0.0)
        chunk_decay = jnp.where(seq_last == seq_start, chunk_decay, 0.0)
    decay = jnp.where(visible, jnp.exp2(jnp.minimum(s[:, None] - s[None, :], 0.0)), 0.0)
    return ChunkMasks(decay, from_start, to_end, chunk_decay)
