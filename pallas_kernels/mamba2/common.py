"""Pieces shared by the SSD kernels: the static configuration and the per-chunk decay masks."""

import dataclasses
import math
from typing import NamedTuple

import jax.numpy as jnp
from jax.experimental import pallas as pl


class Schedule(NamedTuple):
    """How a scan kernel's walks are cut into programs (`segments` has the program order).

    A walk (one batch row, head and head-dim block) is cut into `num_units` units of equal
    length and walked in parts of `part_units` units, one program per part, except the first
    part of walks 0 .. `split_walks` - 1, walked one unit per program. No cut: (1, 1, 0).
    """

    num_units: int
    part_units: int
    split_walks: int

    @property
    def num_parts(self):
        return self.num_units // self.part_units


def unit_counts(num_chunks, min_chunks):
    """The numbers of equal units a walk of `num_chunks` chunks can be cut into: 1, and the
    divisors that leave units of at least `min_chunks` chunks."""
    return [u for u in range(1, num_chunks + 1)
            if num_chunks % u == 0 and (u == 1 or num_chunks // u >= min_chunks)]


def forward_schedule(walks, num_chunks, at_once, blocks):
    """The forward scan's Schedule: the cheapest of all cuts by a count of chunk steps.

    `at_once` programs run at once. A cut's cost is the chunk steps of its rounds of programs
    (whole parts fill rounds first, the split units follow), the segment sums it needs (a sum's
    chunk step costs `blocks.sum_step_cost` of a walk's) and `blocks.round_cost` steps for each
    round of either kernel. Units are at least `blocks.min_segment_chunks` chunks long.
    """
    best = None
    for num_units in unit_counts(num_chunks, blocks.min_segment_chunks):
        unit_chunks = num_chunks // num_units
        for part_units in (u for u in range(1, num_units + 1) if num_units % u == 0):
            num_parts = num_units // part_units
            full_rounds, rest = divmod(walks * num_parts, at_once)
            split_walks = rest if part_units > 1 else 0
            if part_units > 1 and not 0 < rest <= walks:
                continue  # nothing to split (the same as part_units 1), or more than first parts
            whole_rounds = full_rounds + (rest > 0 and split_walks == 0)
            split_rounds = pl.cdiv(split_walks * part_units, at_once)
            steps = (whole_rounds * part_units + split_rounds) * unit_chunks
            summed = (walks * (num_units - part_units) if num_parts > 1
                      else split_walks * (part_units - 1))
            sum_rounds = pl.cdiv(summed, at_once)
            cost = (steps + sum_rounds * unit_chunks * blocks.sum_step_cost
                    + (whole_rounds + split_rounds + sum_rounds) * blocks.round_cost)
            if best is None or cost < best[0]:
                best = (cost, Schedule(num_units, part_units, split_walks))
    return best[1]


@dataclasses.dataclass(frozen=True)
class Static:
    """What the kernels know at trace time (hashable: keys custom_vjp and jit)."""

    block_t: int  # chunk length Q of the kernels (a power of two)
    block_p: int  # head-dim rows per program of the scan kernels
    heads_per_program: int  # heads per program of the chunk-gradient kernel (divides H / G)
    num_chunks: int
    walks: int  # walks of the scan kernels: batch rows x heads x head-dim blocks
    # How the scan kernels' walks are cut into programs (`Schedule`, `segments`): the forward's
    # cut; the backward's walks are cut into `backward_num_units` parts of one unit.
    schedule: Schedule
    backward_num_units: int
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

        A walk is one (batch row, head, head-dim block): a serial pass over all chunks. The
        forward scan cuts its walks by `forward_schedule`, with `blocks.programs_per_sm`
        programs at once on each of `multiprocessors`. Below `blocks.backward_segment_walks_below`
        walks, the backward's walks are cut into equal parts of at least
        `blocks.min_segment_chunks` chunks, as many as keep the programs within
        `blocks.scan_programs`.
        """
        block_p = min(blocks.block_p, p_pad)
        walks = batch * heads * (p_pad // block_p)
        backward_num_units = 1
        if walks < blocks.backward_segment_walks_below:
            backward_num_units = max((
                s for s in unit_counts(num_chunks, blocks.min_segment_chunks)
                if s * walks <= blocks.scan_programs
            ), default=1)
        return cls(
            block_t=block_t,
            block_p=block_p,
            heads_per_program=max(
                k for k in range(1, blocks.heads_per_program + 1) if heads_per_group % k == 0
            ),
            num_chunks=num_chunks,
            walks=walks,
            schedule=forward_schedule(
                walks, num_chunks, blocks.programs_per_sm * multiprocessors, blocks
            ),
            backward_num_units=backward_num_units,
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
        """This Static with the backward walks' schedule (see `from_blocks`)."""
        return dataclasses.replace(self, schedule=Schedule(self.backward_num_units, 1, 0))

    @property
    def unit_chunks(self):
        """Chunks per unit of the scan kernels' schedule."""
        return self.num_chunks // self.schedule.num_units


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
