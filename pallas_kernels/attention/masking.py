"""Which keys each query sees, shared by the reference and the kernels.

Query i of batch row b sees key j when all of these hold:

* ``i < query_seq_lengths[b]`` and ``j < key_value_seq_lengths[b]``;
* ``lo <= j - i + shift <= hi`` for the diagonal band ``(lo, hi)`` built from ``is_causal``
  (hi <= 0) and ``local_window_size = (left, right)`` (lo = -left, hi = right); ``None`` leaves a
  side open. ``shift`` is 0 unless the queries and keys are pieces of longer sequences (context
  parallelism): then it is the keys' first global position minus the queries', a traced int32
  scalar, so that the band holds between global positions while i and j stay local;
* ``q_segment_ids[b, i] == kv_segment_ids[b, j]``.

The same rule, with rows and columns swapped and the band negated (`transpose_band`), gives the
queries that see each key, which is what the dK/dV kernel loops over.
"""

import jax.numpy as jnp

from pallas_kernels import _device

# Columns of the per-block table that `block_table` builds for the kernels.
LO, HI, FULL_LO, FULL_HI, ROW_LEN, COL_LEN, SHIFT = range(7)
TABLE_WIDTH = 8  # a power of two, as Triton requires of every in-kernel array

_OPEN = 1 << 30  # stands in for an unbounded band side in integer block arithmetic
MAX_WINDOW = _OPEN  # window sides are clipped to it: no sequence is that long


def band(is_causal, local_window_size):
    """The diagonal band (lo, hi) of visible ``j - i``; either side may be None (unbounded)."""
    lo = hi = None
    if local_window_size is not None:
        if isinstance(local_window_size, int):
            left = right = local_window_size
        else:
            left, right = local_window_size
        lo, hi = -left, right
    if is_causal:
        hi = 0 if hi is None else min(hi, 0)
    return lo, hi


def transpose_band(band_):
    """The band of ``i - j`` (rows are keys, columns are queries); its shift is the negated
    shift."""
    lo, hi = band_
    return (None if hi is None else -hi, None if lo is None else -lo)


def visible(rows, cols, *, band, row_len, col_len, row_segments=None, col_segments=None,
            shift=None):
    """Elementwise visibility for broadcastable row and column positions (int32 arrays)."""
    mask = (rows < row_len) & (cols < col_len)
    lo, hi = band
    if band != (None, None):
        diagonal = cols - rows if shift is None else cols - rows + shift
        if lo is not None:
            mask &= diagonal >= lo
        if hi is not None:
            mask &= diagonal <= hi
    if row_segments is not None:
        mask &= row_segments == col_segments
    return mask


def dense_mask(
    t, s, *, band, q_segment_ids=None, kv_segment_ids=None, query_seq_lengths=None,
    key_value_seq_lengths=None, shift=None,
):
    """The (B, T, S) boolean visibility matrix (B is 1 when nothing depends on the batch row)."""
    q_len = t if query_seq_lengths is None else query_seq_lengths[:, None, None]
    kv_len = s if key_value_seq_lengths is None else key_value_seq_lengths[:, None, None]
    has_segments = q_segment_ids is not None
    mask = visible(
        jnp.arange(t, dtype=jnp.int32)[None, :, None],
        jnp.arange(s, dtype=jnp.int32)[None, None, :],
        band=band,
        row_len=q_len,
        col_len=kv_len,
        row_segments=q_segment_ids[:, :, None] if has_segments else None,
        col_segments=kv_segment_ids[:, None, :] if has_segments else None,
        shift=shift,
    )
    return mask if mask.ndim == 3 else mask[None]


def block_table(
    *, num_row_blocks, row_block, num_col_blocks, col_block, band, row_len, col_len,
    row_segments=None, col_segments=None, shift=None, xp=jnp,
):
    """Per row block, the column blocks a kernel must visit, (B, num_row_blocks, TABLE_WIDTH) int32.

    Column blocks ``[LO, HI)`` hold every visible (row, column) pair of the row block; inside it,
    ``[FULL_LO, FULL_HI)`` are blocks where every pair is visible, so the kernel skips the mask
    there (empty, at ``HI``, when segments are given). ``ROW_LEN``/``COL_LEN`` repeat the lengths
    for the in-kernel mask. ``row_len``/``col_len`` are (B,) int32; segments (B, rows)/(B, cols)
    int32 padded to whole blocks; `shift` None or the band's int32 scalar shift (then also in
    column ``SHIFT`` for the in-kernel mask). Segment ranges are conservative (they are exact
    for sorted ids, as in packed documents); the in-kernel mask keeps any other order correct.
    With `xp=numpy` and numpy inputs the table is computed on the host (a constant of the
    traced program).
    """
    row_len = row_len[:, None]
    col_len = col_len[:, None]
    row_start = xp.arange(num_row_blocks, dtype=xp.int32)[None, :] * row_block
    valid_end = xp.minimum(row_start + row_block, row_len)  # rows past row_len see nothing
    lo, hi = band
    if shift is not None:  # the band of local positions
        lo, hi = (None if side is None else side - shift for side in band)
    first = xp.maximum(row_start + (-_OPEN if lo is None else lo), 0)
    last = xp.minimum(valid_end - 1 + (_OPEN if hi is None else hi), col_len - 1)  # inclusive
    if row_segments is not None:
        blocks = row_segments.reshape(row_segments.shape[0], num_row_blocks, row_block)
        rows_valid = (row_start[..., None] + xp.arange(row_block)) < row_len[..., None]
        seg_min = xp.min(xp.where(rows_valid, blocks, xp.iinfo(xp.int32).max), axis=-1)
        seg_max = xp.max(xp.where(rows_valid, blocks, xp.iinfo(xp.int32).min), axis=-1)
        cols = xp.arange(col_segments.shape[1], dtype=xp.int32)
        hit = (
            (col_segments[:, None, :] >= seg_min[..., None])
            & (col_segments[:, None, :] <= seg_max[..., None])
            & (cols < col_len[..., None])
        )
        first = xp.maximum(first, xp.argmax(hit, axis=-1))
        last = xp.minimum(last, cols.shape[0] - 1 - xp.argmax(hit[..., ::-1], axis=-1))
        last = xp.where(xp.any(hit, axis=-1), last, -1)
    empty = last < first
    lo_block = xp.where(empty, 0, first // col_block)
    hi_block = xp.where(empty, 0, last // col_block + 1)

    if row_segments is not None:
        full_lo = full_hi = hi_block
    else:
        row_end = row_start + row_block
        full_lo = xp.maximum(0 if lo is None else _device.cdiv(row_end - 1 + lo, col_block),
                             lo_block)
        full_hi = col_len // col_block
        if hi is not None:
            full_hi = xp.minimum(full_hi, (row_start + hi + 1) // col_block)
        full_hi = xp.minimum(full_hi, hi_block)
        no_full = (full_lo >= full_hi) | (row_end > row_len)
        full_lo = xp.where(no_full, hi_block, full_lo)
        full_hi = xp.where(no_full, hi_block, full_hi)

    shape = lo_block.shape
    columns = [lo_block, hi_block, full_lo, full_hi, row_len, col_len]
    if shift is not None:
        columns.append(shift)
    columns = [xp.broadcast_to(c, shape).astype(xp.int32) for c in columns]
    columns += [xp.zeros(shape, xp.int32)] * (TABLE_WIDTH - len(columns))
    return xp.stack(columns, axis=-1)


PACKED_KEYS = 8  # keys a byte of a packed mask holds


def pack_mask(mask, t_pad, s_pad, *, packed=True):
    """A user's boolean mask (B', N', T', S') as the kernels read it: T' and S' padded with
    False to Tp and Sp unless 1 (broadcast; T'' below is Tp or 1, S'' Sp or 1). With S' > 1 and
    `packed`, uint8 (B', N', T'', Sp / 8) whose byte c holds keys 8c .. 8c + 7, key 8c + k in
    bit k (an eighth of the bytes of one entry a pair); else int8 (B', N', T'', S''), 1 where
    visible."""
    pad_rows = t_pad if mask.shape[2] > 1 else None
    if mask.shape[3] == 1 or not packed:
        pad_cols = s_pad if mask.shape[3] > 1 else None
        return _device.pad_end(mask.astype(jnp.int8), (None, None, pad_rows, pad_cols))
    bits = _device.pad_end(mask, (None, None, pad_rows, s_pad)).astype(jnp.uint8)
    bits = bits.reshape(*bits.shape[:3], s_pad // PACKED_KEYS, PACKED_KEYS)
    bytes_ = bits[..., 0]
    for k in range(1, PACKED_KEYS):  # elementwise (jnp.packbits sums: a reduction over 8)
        bytes_ = bytes_ | (bits[..., k] << k)
    return bytes_


def is_packed(mask):
    """Whether a mask from `pack_mask` holds 8 keys a byte (else one int8 entry a pair)."""
    return mask.dtype == jnp.uint8


def unpack_mask(mask):
    """`pack_mask`'s output as booleans (B', N', T'', S'')."""
    if not is_packed(mask):
        return mask != 0
    return jnp.unpackbits(mask, axis=-1, bitorder="little") != 0


def pair_blocks(pair_mask, *, num_row_blocks, row_block, num_col_blocks, col_block,
                transpose=False):
    """Which blocks of a user's mask hold a visible pair, and which hold only visible pairs.

    `pair_mask` from `pack_mask` (its last dim in bytes where packed), padded to whole blocks;
    a dim of size 1 broadcasts. Rows are query blocks, columns key blocks (`transpose`: rows are
    key blocks). Heads are merged (a block is visible if any head sees a pair in it, full if
    every head sees all). Returns (any, all), each (B', num_row_blocks, num_col_blocks) bool.
    """
    visible_any = pair_mask != 0  # an entry, or a byte with a visible key
    visible_all = pair_mask == 0xFF if is_packed(pair_mask) else visible_any
    if is_packed(pair_mask):  # a key block is block / 8 bytes
        if transpose:
            row_block //= PACKED_KEYS
        else:
            col_block //= PACKED_KEYS
    return tuple(_reduce_blocks(reduce, entries, num_row_blocks, row_block, num_col_blocks,
                                col_block, transpose)
                 for reduce, entries in ((jnp.any, visible_any), (jnp.all, visible_all)))


def _reduce_blocks(reduce, entries, num_row_blocks, row_block, num_col_blocks, col_block,
                   transpose):
    """`reduce` (jnp.any or jnp.all) of booleans (B', N', T', S'), one a pair or a packed byte
    (the block sizes then counted in its units), over heads and each block: (B',
    num_row_blocks, num_col_blocks)."""
    if transpose:
        entries = jnp.swapaxes(entries, 2, 3)
    b, n, rows, cols = entries.shape
    blocks = entries.reshape(
        b, n, 1 if rows == 1 else num_row_blocks, 1 if rows == 1 else row_block,
        1 if cols == 1 else num_col_blocks, 1 if cols == 1 else col_block)
    return jnp.broadcast_to(reduce(blocks, axis=(1, 3, 5)), (b, num_row_blocks, num_col_blocks))


def narrow_to_pairs(table, visible_any, visible_all):
    """`block_table`'s table (B, R, TABLE_WIDTH) narrowed to the blocks a user's mask leaves
    (`pair_blocks`' any and all, (B' , R, C)): [LO, HI) shrinks to the first and last block
    with a visible pair, and [FULL_LO, FULL_HI) to the first run of blocks whose pairs are all
    visible inside it (masked blocks between visible ones are still visited, with the mask)."""
    table = jnp.asarray(table)
    lo, hi, full_lo, full_hi = (table[..., c][..., None] for c in (LO, HI, FULL_LO, FULL_HI))
    num_col_blocks = visible_any.shape[-1]
    index = jnp.arange(num_col_blocks, dtype=jnp.int32)

    def first(hits, default):  # (..., 1) the first column where hits, else default
        return jnp.where(jnp.any(hits, -1, keepdims=True),
                         jnp.argmax(hits, -1, keepdims=True).astype(jnp.int32), default)

    inside = (index >= lo) & (index < hi)
    new_lo = first(visible_any & inside, num_col_blocks)
    new_hi = num_col_blocks - first((visible_any & inside)[..., ::-1], num_col_blocks)
    empty = new_hi <= new_lo
    new_lo, new_hi = jnp.where(empty, 0, new_lo), jnp.where(empty, 0, new_hi)
    run_lo = first(visible_all & (index >= full_lo) & (index < full_hi), num_col_blocks)
    run_hi = jnp.minimum(first(~visible_all & (index >= run_lo), num_col_blocks), full_hi)
    no_run = run_hi <= run_lo
    run_lo, run_hi = jnp.where(no_run, new_hi, run_lo), jnp.where(no_run, new_hi, run_hi)
    columns = {LO: new_lo, HI: new_hi, FULL_LO: run_lo, FULL_HI: run_hi}
    shape = jnp.broadcast_shapes(table.shape[:-1], new_lo.shape[:-1])
    table = jnp.broadcast_to(table, (*shape, table.shape[-1]))
    return jnp.stack(
        [jnp.broadcast_to(columns[c][..., 0], shape) if c in columns else table[..., c]
         for c in range(table.shape[-1])], axis=-1).astype(jnp.int32)
