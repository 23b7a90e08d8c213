"""Pieces shared by the forward and backward attention kernels."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.attention import masking

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything about a call that is not an array: hashable, so it can key jit and custom_vjp.

    `band` is the visible diagonal band of ``j - i`` (see `masking`); `groups` = N // K query
    heads per key/value head; `has_segments` says whether segment-id arrays are passed;
    `has_q_len` / `has_kv_len` whether query / key-value lengths are (then the masked tiles
    zero the rows past them: `zero_past`); `shifted` whether the band is shifted by the table's
    `masking.SHIFT` column (context parallelism: local positions, global band).
    """

    scale: float
    band: tuple
    logits_soft_cap: float | None
    groups: int
    has_segments: bool
    may_mask: bool  # False when no pair can be masked: the kernels then skip the masked loops
    interpret: bool
    has_q_len: bool = False
    has_kv_len: bool = False
    shifted: bool = False

    @property
    def has_lengths(self):
        """Rows past a length may hold anything: the masked tiles then select dlogits too."""
        return self.has_q_len or self.has_kv_len


def softmax_delta(out, dout):
    """rowsum(dO * O) over the head dim, float32: (B, T, N) of (B, T, N, H) arrays (the dlse
    term is the caller's)."""
    return jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)


def base2_logits(scores, static: Static):
    """Raw q.k scores (f32) -> logits in base 2 (softmax scale and soft cap applied)."""
    cap = static.logits_soft_cap
    if cap is None:
        return scores * (static.scale * LOG2E)
    return jnp.tanh(scores * (static.scale / cap)) * (cap * LOG2E)


def soft_cap_derivative(logits2, static: Static):
    """d(capped logit)/d(scaled score) from the base-2 logits: 1 - tanh^2."""
    tanh = logits2 * (1.0 / (static.logits_soft_cap * LOG2E))
    return 1.0 - tanh * tanh


def block_mask(table_ref, row_start, rows, col_start, cols, static, band, row_seg, col_seg,
               batch_row=None):
    """Visibility of a (rows, cols) tile whose corner is (row_start, col_start). `batch_row`:
    the table ref holds every batch row's entry (B, TABLE_WIDTH); this one's is read."""

    def entry(column):
        return table_ref[column] if batch_row is None else table_ref[batch_row, column]

    row_pos = row_start + jnp.arange(rows, dtype=jnp.int32)[:, None]
    col_pos = col_start + jnp.arange(cols, dtype=jnp.int32)[None, :]
    return masking.visible(
        row_pos, col_pos, band=band,
        row_len=entry(masking.ROW_LEN), col_len=entry(masking.COL_LEN),
        row_segments=None if row_seg is None else row_seg[:, None],
        col_segments=None if col_seg is None else col_seg[None, :],
        shift=entry(masking.SHIFT) if static.shifted else None,
    )


def zero_past(table_ref, length_column, start, *blocks):
    """Blocks (rows, D) of consecutive positions from `start`, with the rows at or past the
    table's length (`masking.ROW_LEN` or `COL_LEN`) set to zero.

    Those positions are masked for every pair, so their values must never reach an output, not
    even as 0 x NaN in a matmul: stale cache slots and padding may hold anything.
    """
    rows = blocks[0].shape[0]
    valid = (start + jnp.arange(rows, dtype=jnp.int32) < table_ref[length_column])[:, None]
    return tuple(jnp.where(valid, block, jnp.zeros_like(block)) for block in blocks)


def visit_blocks(table_ref, step, carry, static: Static):
    """Runs `step(j, carry, masked)` over the column blocks listed in the kernel's table row.

    Masked blocks ([LO, FULL_LO) and [FULL_HI, HI)) apply the element mask; the blocks between
    need none. Each range is its own loop, so the unmasked loop carries no mask arithmetic.
    """
    lo, hi = table_ref[masking.LO], table_ref[masking.HI]
    if not static.may_mask:
        return jax.lax.fori_loop(lo, hi, functools.partial(step, masked=False), carry)
    full_lo, full_hi = table_ref[masking.FULL_LO], table_ref[masking.FULL_HI]
    carry = jax.lax.fori_loop(lo, full_lo, functools.partial(step, masked=True), carry)
    carry = jax.lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
    return jax.lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), carry)


def shared_pairs_grid(grid, inputs, outputs, mask, bias):
    """The grid to launch: `grid` (blocks, heads, batch), or (blocks, batch, heads) when a
    user's mask or bias is shared by the batch rows (its batch dim is 1, the batch's is not).
    Then the programs that read the same pair tiles for each row run side by side and read
    them once through L2, instead of heads x blocks programs apart. The `Operands`' specs are
    rewritten in place to keep their (block, head, batch) index maps; the kernels read only
    program_id(0), which stays the blocks."""
    blocks, heads, batch = grid
    if batch == 1 or all(p is None or p.shape[0] > 1 for p in (mask, bias)):
        return grid
    for operands in (inputs, outputs):
        operands.specs = [_batch_second(spec) for spec in operands.specs]
    return blocks, batch, heads


def _batch_second(spec):
    index_map = spec.index_map
    return dataclasses.replace(spec, index_map=lambda i, b, h: index_map(i, h, b))


def pair_spec(pair, *, heads, rows, cols, index, batch=None):
    """BlockSpec of a user's mask or bias, (B', N', T', S') with each dim 1 (broadcast) or
    full: a full dim gets the block size `batch` (None: one row, squeezed), `heads` (None: one
    head, squeezed), `rows` or `cols`, a broadcast one its single entry. `index(*program ids)`
    gives the (batch, head, row, col) block indices of full dims."""
    b, n, t, s = pair.shape
    block = (batch if b > 1 else None, heads if n > 1 else None, rows if t > 1 else 1,
             cols if s > 1 else 1)

    def index_map(*ids):
        return tuple(i if size > 1 else 0 for i, size in zip(index(*ids), pair.shape,
                                                             strict=True))

    return pl.BlockSpec(block, index_map)


def add_pairs(inputs, mask, bias, *, cols, **spec):
    """Adds a user's mask (from `masking.pack_mask`) and bias (either may be None) to a kernel's
    `Operands`, each with `pair_spec(pair, cols=cols, **spec)`, `cols` in keys (a packed mask's
    block is an eighth as wide in bytes)."""
    for name, pair in (("mask", mask), ("bias", bias)):
        if pair is not None:
            block_cols = cols // masking.PACKED_KEYS if masking.is_packed(pair) else cols
            inputs.add(name, pair_spec(pair, cols=block_cols, **spec), pair)


def pair_tile(ref, rows, cols, lead=None):
    """The tile of a `pair_spec` ref at `rows` x `cols` (slices of its block), in the block's
    (T, S) orientation; a broadcast dim (size 1) is read whole, so the tile broadcasts.
    `lead` indexes the block's leading dim when it has one: the heads of the dK/dV kernel's
    group, or the batch rows of `backward.dbias_over_rows`."""
    index = (lead,) if len(ref.shape) == 3 else ()
    rows = rows if ref.shape[-2] > 1 else slice(None)
    cols = cols if ref.shape[-1] > 1 else slice(None)
    return ref[(*index, rows, cols)]


def pair_logits(refs, rows, cols, lead=None, transpose=False):
    """The base-2 bias tile to add to the logits (0.0 without a bias), float32."""
    if refs.bias is None:
        return 0.0
    tile = pair_tile(refs.bias, rows, cols, lead).astype(jnp.float32) * LOG2E
    return tile.T if transpose else tile


def pair_visible(refs, rows, cols, lead=None, transpose=False):
    """The user's mask tile as booleans (True without a mask); `rows` and `cols` slices of
    queries and keys (a block slice or the whole block), read as their bytes from a packed mask
    (`masking.pack_mask`) and expanded in registers, bit k of byte c for key 8c + k."""
    if refs.mask is None:
        return True
    if masking.is_packed(refs.mask):
        if not isinstance(cols, slice):  # a block slice of keys -> of their bytes
            width = cols.size // masking.PACKED_KEYS
            cols = pl.ds(pl.multiple_of(cols.start // masking.PACKED_KEYS, width), width)
        tile = unpack_bits(pair_tile(refs.mask, rows, cols, lead))
    else:
        tile = pair_tile(refs.mask, rows, cols, lead) != 0
    return tile.T if transpose else tile


def unpack_bits(tile):
    """In a kernel: a packed mask's (R, C) bytes as (R, 8 C) booleans, key 8c + k from bit k of
    byte c."""
    rows, width = tile.shape
    keys = width * masking.PACKED_KEYS
    expanded = jnp.broadcast_to(tile[:, :, None], (rows, width, masking.PACKED_KEYS))
    bit = jax.lax.broadcasted_iota(jnp.int32, (1, keys), 1) % masking.PACKED_KEYS
    return (expanded.reshape(rows, keys) & (1 << bit).astype(tile.dtype)) != 0
