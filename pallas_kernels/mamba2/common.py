"""Pieces shared by the SSD kernels: what a call is (`Static`) and the per-chunk decay masks."""

import dataclasses
import math
from typing import NamedTuple

import jax.numpy as jnp

from pallas_kernels import _device


@dataclasses.dataclass(frozen=True)
class Static:
    """What a call is, beyond its arrays (hashable: keys custom_vjp and jit). The kernels'
    sizes are in `tuning.SSDBlocks` (fitted to the call), the cut of their work in
    `schedule.Plan`."""

    has_seq_idx: bool
    has_d: bool
    has_z: bool
    has_initial_states: bool
    seq_len: int  # real tokens T (the kernels see Tp, whole chunks)
    dt_softplus: bool  # dt preprocessing (`semantics.step_sizes`)
    dt_limit: tuple[float, float]
    interpret: bool


def chunk_log2_decays(dt, A, block_t):
    """The kernels' `s`: the in-chunk inclusive cumsum of a = dt * A in base 2, (B, H, Tp) float32.

    dt (B, H, Tp) float32 with Tp a multiple of block_t; A (H,). Decays are exp2 of differences
    of s, which the GPU evaluates in one instruction (exp needs a range reduction first).
    """
    a = dt * (A.astype(jnp.float32) * math.log2(math.e))[None, :, None]
    chunks = a.reshape(*a.shape[:-1], a.shape[-1] // block_t, block_t)
    return jnp.cumsum(chunks, axis=-1).reshape(a.shape)


class ChunkMasks(NamedTuple):
    """Decays of one chunk and its sequence boundaries (seq_idx), applied by its methods.

    With s from `chunk_log2_decays` (so exp2 of its differences are the decays):
    decay (Q, Q): exp2(min(s_l - s_j, 0)); visible (Q, Q): j <= l in the same sequence.
    from_start (Q,): exp2(min(s_l, 0)); continues (Q,): token l continues the sequence live at
      the chunk start (it sees the carried state).
    to_end (Q,): exp2(min(s_last - s_j, 0)); in_last (Q,): token j is in the chunk's last
      sequence (it reaches the state leaving the chunk).
    chunk_decay (): exp2(min(s_last, 0)); carries (): no sequence starts inside the chunk.
    Without seq_idx, continues, in_last and carries are None (always true).

    The methods select zero where a mask is false instead of multiplying by zero, so a
    non-finite value (of another sequence, or a later token) never reaches a product that the
    mask removes. Without seq_idx they are plain products, at no extra cost.
    """

    decay: jnp.ndarray
    visible: jnp.ndarray
    from_start: jnp.ndarray
    continues: jnp.ndarray | None
    to_end: jnp.ndarray
    in_last: jnp.ndarray | None
    chunk_decay: jnp.ndarray
    carries: jnp.ndarray | None

    def weigh(self, values):
        """values (Q, Q) times the decays where visible, else 0: L o values."""
        return jnp.where(self.visible, values * self.decay, 0.0)

    def carried_in(self, values, scale=None):
        """values (Q,) or (Q, k) per token, decayed from the chunk start (and times the
        per-token `scale`) where the token sees the carried state, else 0."""
        factor = self.from_start if scale is None else self.from_start * scale
        return _select_rows(self.continues, values * _rows(factor, values))

    def to_state(self, values, scale=None):
        """values (Q,) or (Q, k) per token, decayed to the chunk end (and times the per-token
        `scale`) where the token reaches the leaving state, else 0."""
        factor = self.to_end if scale is None else self.to_end * scale
        return _select_rows(self.in_last, values * _rows(factor, values))

    def of_continuing(self, values):
        """values (Q, k) where the token sees the carried state, else 0."""
        return _select_rows(self.continues, values)

    def of_last(self, values):
        """values (Q, k) where the token reaches the leaving state, else 0."""
        return _select_rows(self.in_last, values)

    def pass_on(self, state):
        """A state (or its gradient) passed across the chunk: times the chunk's decay, or 0
        where a sequence starts inside it."""
        passed = self.chunk_decay * state
        return passed if self.carries is None else jnp.where(self.carries, passed, 0.0)


def _rows(vector, values):
    """A per-token vector (Q,) shaped to broadcast against values (Q,) or (Q, k)."""
    return vector if values.ndim == 1 else vector[:, None]


def _select_rows(mask, values):
    return values if mask is None else jnp.where(_rows(mask, values), values, 0.0)


def chunk_masks(c, s_ref, seq_ref, block_t, head=None):
    """ChunkMasks of chunk c (of `block_t` tokens) from `s_ref` (`chunk_log2_decays`) and
    `seq_ref` (Tp,) or None.

    `s_ref` is (Tp,), or (heads, Tp) read at row `head`.
    """
    q = block_t
    tok = _device.block_slice(c, q)
    last = c * q + (q - 1)
    s, s_last = (s_ref[tok], s_ref[last]) if head is None else (s_ref[head, tok], s_ref[head, last])
    row = jnp.arange(q, dtype=jnp.int32)[:, None]
    col = jnp.arange(q, dtype=jnp.int32)[None, :]
    visible = row >= col
    continues = in_last = carries = None
    if seq_ref is not None:
        seq = seq_ref[tok]
        seq_start = seq_ref[jnp.maximum(c * q - 1, 0)]  # the sequence live when the chunk starts
        seq_last = seq_ref[last]
        visible &= seq[:, None] == seq[None, :]
        continues, in_last, carries = seq == seq_start, seq == seq_last, seq_last == seq_start
    return ChunkMasks(
        decay=jnp.exp2(jnp.minimum(s[:, None] - s[None, :], 0.0)),
        visible=visible,
        from_start=jnp.exp2(jnp.minimum(s, 0.0)),
        continues=continues,
        to_end=jnp.exp2(jnp.minimum(s_last - s, 0.0)),
        in_last=in_last,
        chunk_decay=jnp.exp2(jnp.minimum(s_last, 0.0)),
        carries=carries,
    )
