"""Pieces shared by the SSD kernels: the static configuration and the per-chunk decay masks."""

import dataclasses
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
    has_seq_idx: bool
    has_d: bool
    has_z: bool
    has_initial_states: bool
    num_warps: int  # scan kernels
    num_stages: int
    grad_num_warps: int  # chunk-gradient kernel
    grad_num_stages: int
    interpret: bool

    @classmethod
    def from_blocks(cls, blocks, *, block_t, p_pad, heads_per_group, num_chunks, interpret,
                    **flags):
        """The Static of a tuning.SSDBlocks row; `flags` are the has_* fields."""
        return cls(
            block_t=block_t,
            block_p=min(blocks.block_p, p_pad),
            heads_per_program=max(
                k for k in range(1, blocks.heads_per_program + 1) if heads_per_group % k == 0
            ),
            num_chunks=num_chunks,
            num_warps=blocks.num_warps,
            num_stages=blocks.num_stages,
            grad_num_warps=blocks.grad_num_warps,
            grad_num_stages=blocks.grad_num_stages,
            interpret=interpret,
            **flags,
        )


def chunk_tokens(c, static):
    """The token slice of chunk c."""
    return pl.ds(pl.multiple_of(c * static.block_t, static.block_t), static.block_t)


class ChunkMasks(NamedTuple):
    """Decays of one chunk, with sequence boundaries (seq_idx) folded in.

    decay (Q, Q): L[l, j] = exp(min(s_l - s_j, 0)) for j <= l in the same sequence, else 0.
    from_start (Q,): exp(min(s_l, 0)) where token l continues the sequence live at the chunk
      start (it sees the carried state), else 0.
    to_end (Q,): exp(min(s_last - s_j, 0)) where token j is in the chunk's last sequence (it
      reaches the state leaving the chunk), else 0.
    chunk_decay (): exp(min(s_last, 0)) when no sequence starts inside the chunk, else 0.
    """

    decay: jnp.ndarray
    from_start: jnp.ndarray
    to_end: jnp.ndarray
    chunk_decay: jnp.ndarray


def chunk_masks(c, s_ref, seq_ref, static, head=None):
    """ChunkMasks of chunk c from the in-chunk cumsum `s_ref` and `seq_ref` (Tp,) or None.

    `s_ref` is (Tp,), or (heads, Tp) read at row `head`.
    """
    q = static.block_t
    tok = chunk_tokens(c, static)
    last = c * q + (q - 1)
    s, s_last = (s_ref[tok], s_ref[last]) if head is None else (s_ref[head, tok], s_ref[head, last])
    row = jnp.arange(q, dtype=jnp.int32)[:, None]
    col = jnp.arange(q, dtype=jnp.int32)[None, :]
    visible = row >= col
    from_start = jnp.exp(jnp.minimum(s, 0.0))
    to_end = jnp.exp(jnp.minimum(s_last - s, 0.0))
    chunk_decay = jnp.exp(jnp.minimum(s_last, 0.0))
    if seq_ref is not None:
        seq = seq_ref[tok]
        seq_start = seq_ref[jnp.maximum(c * q - 1, 0)]  # the sequence live when the chunk starts
        seq_last = seq_ref[last]
        visible &= seq[:, None] == seq[None, :]
        from_start = jnp.where(seq == seq_start, from_start, 0.0)
        to_end = jnp.where(seq == seq_last, to_end, 0.0)
        chunk_decay = jnp.where(seq_last == seq_start, chunk_decay, 0.0)
    decay = jnp.where(visible, jnp.exp(jnp.minimum(s[:, None] - s[None, :], 0.0)), 0.0)
    return ChunkMasks(decay, from_start, to_end, chunk_decay)
