"""The causal conv forward kernel (Pallas, Triton lowering).

One program per (batch row, tile of `block_t` tokens, block of `block_c` channels). Tap k of
output token t reads input token t - (W - 1 - k): the program gathers those rows of x (a row
vector of indices, clamped to the sequence; the tiles overlap by W - 1 rows, cache hits), and
rows before the first token from the initial states, which come padded at the front to a power
of two of rows. The sum of the taps and the bias goes through the SiLU in float32 and is stored
in x's dtype.

x may be wider than the conv: its channels start at column `column_offset` (a packed
projection, read in place), and the output may come in two arrays split at channel `split`;
both are multiples of the channel blocks, so that a program's block lies in one part.

Edge tiles (T or C not a multiple of the tile) load and store through explicit masks: jax 0.11's
Pallas-Triton lowering masks no block that overhangs its array (0.12's does), and a tile past
the end would read and write other buffers.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import _device, _operands
from pallas_kernels._operands import Operands


@dataclasses.dataclass(frozen=True)
class Static:
    """What the kernels know of a call besides its arrays (hashable: keys custom_vjp)."""

    width: int  # W, taps
    channels: int  # C
    history_rows: int  # the initial states' rows, padded at the front to a power of two
    silu: bool
    initial_states: bool  # given by the caller (else zeros, whose gradient is not needed)
    forward_tiles: object  # tuning.ConvTiles
    backward_tiles: object
    interpret: bool
    column_offset: int = 0  # x's first conv channel
    split: int | None = None  # the output as [0, split) and [split, C) (None: one array)


@dataclasses.dataclass(frozen=True)
class Tile:
    """A program's tile: its token rows (block_t,) and channel columns (block_c,) in x, and
    which of them are inside x (`col_ok` None where every tile's columns are: C a multiple of
    block_c)."""

    rows: jax.Array
    cols: jax.Array
    row_ok: jax.Array
    col_ok: jax.Array | None

    @staticmethod
    def of_program(block_t, block_c, length, static, first_row=None):
        """The program's tile: rows from `first_row` (None: program_id(1) * block_t), its
        block of channels."""
        if first_row is None:
            first_row = pl.program_id(1) * block_t
        rows = first_row + jax.lax.broadcasted_iota(jnp.int32, (block_t,), 0)
        cols = pl.program_id(2) * block_c + jax.lax.broadcasted_iota(jnp.int32, (block_c,), 0)
        col_ok = None if static.channels % block_c == 0 else cols < static.channels
        return Tile(rows, cols, rows < length, col_ok)

    def moved(self, first_row, length):
        """The tile of the same columns and size starting at token `first_row`."""
        rows = first_row + jax.lax.broadcasted_iota(jnp.int32, self.rows.shape, 0)
        return dataclasses.replace(self, rows=rows, row_ok=rows < length)

    @property
    def inside(self):
        """(block_t, block_c): the tile's entries inside x."""
        return self.mask(self.row_ok)

    def mask(self, rows_valid=None):
        """(n, block_c): `rows_valid` (n,) (None: every row) and the columns inside x; None
        where nothing is masked."""
        parts = [m for m in (None if rows_valid is None else rows_valid[:, None],
                             None if self.col_ok is None else self.col_ok[None, :])
                 if m is not None]
        if not parts:
            return None
        n = self.rows.shape[0] if rows_valid is None else rows_valid.shape[0]
        return jnp.broadcast_to(functools.reduce(jnp.logical_and, parts),
                                (n, self.cols.shape[0]))


def load_tile(ref, tile):
    """A (block_t, block_c) block ref, float32, zeros outside x."""
    return plt.load(ref, mask=tile.inside, other=0).astype(jnp.float32)


def store_tile(ref, value, tile):
    """Writes value's entries inside x to a (block_t, block_c) block ref, in the ref's dtype."""
    plt.store(ref, value.astype(ref.dtype), mask=tile.inside)


def load_channels(ref, tile):
    """A (block_c,) row of a per-channel ref (a weight row, the bias), float32, zeros past C."""
    return plt.load(ref, mask=tile.col_ok, other=None if tile.col_ok is None else 0
                    ).astype(jnp.float32)


def gather_rows(ref, rows, tile, valid=None):
    """ref's rows `rows` (n,) of the tile's channels, float32 (n, block_c), zeros where `valid`
    (n,) is false or past C (indices clamped to the ref besides; None: every row valid)."""
    local = jax.lax.broadcasted_iota(jnp.int32, (1, tile.cols.shape[0]), 1)
    mask = tile.mask(valid)
    index = jnp.clip(rows, 0, ref.shape[0] - 1)[:, None]
    return plt.load(ref.at[index, local], mask=mask, other=None if mask is None else 0
                    ).astype(jnp.float32)


def taps(refs, tile, static, reaches_back):
    """The W taps of the tile's rows, one at a time: tap k is x's rows `rows - (W - 1 - k)`, the
    initial states' rows where negative (only if `reaches_back`: the tile starts before row
    W - 1), float32 (block_t, block_c). (A generator: the forward adds each tap as it is read,
    keeping one tile live.)"""
    for k in range(static.width):
        source = tile.rows - (static.width - 1 - k)
        if not reaches_back:
            yield gather_rows(refs.x, source, tile)
            continue
        inside = gather_rows(refs.x, source, tile, source >= 0)
        before = gather_rows(refs.history, source + static.history_rows, tile, source < 0)
        yield inside + before


def by_reach(kernel_body, first_row, static, *operands):
    """`kernel_body(reaches_back, *operands)` with reaches_back True for the tile starting at
    `first_row` if its taps reach before the first token (into the initial states), False for
    the rest: those load no initial-state rows and mask no rows before the sequence."""
    return jax.lax.cond(first_row < static.width - 1, functools.partial(kernel_body, True),
                        functools.partial(kernel_body, False), *operands)


def pre_activation(refs, tile, row_taps):
    """bias + sum over k of weight[k] * tap k, float32 (block_t, block_c)."""
    total = None
    for k, tap in enumerate(row_taps):
        term = load_channels(refs.weight.at[jnp.int32(k), :], tile)[None, :] * tap
        total = term if total is None else total + term
    if refs.bias is not None:
        total = total + load_channels(refs.bias, tile)[None, :]
    return total


def sigmoid(u):
    return 1.0 / (1.0 + jnp.exp(-u))


def _forward_kernel(refs, *, static):
    tiles = static.forward_tiles
    tile = Tile.of_program(tiles.block_t, tiles.block_c, refs.x.shape[0], static)
    in_first = in_first_part(static, tiles.block_c)

    def body(reaches_back):
        u = pre_activation(refs, tile, taps(refs, tile, static, reaches_back))
        if static.silu:
            u = u * sigmoid(u)
        by_part(refs, "out", in_first, lambda out: store_tile(out, u, tile))

    by_reach(body, pl.program_id(1) * tiles.block_t, static)


def operands(x, weight, bias, history, tiles, static):
    """The inputs every conv kernel reads, by grid (b, t, c): x's conv channels and the padded
    initial states whole along the tokens, weight (W, block_c), bias (block_c,)."""
    block_c = tiles.block_c
    offset = static.column_offset // block_c
    return (Operands()
            .add("x", pl.BlockSpec((None, x.shape[1], block_c),
                                   lambda b, t, c: (b, 0, c + offset)), x)
            .add("history", pl.BlockSpec((None, history.shape[1], block_c),
                                         lambda b, t, c: (b, 0, c)), history)
            .add("weight", pl.BlockSpec((weight.shape[0], block_c), lambda b, t, c: (0, c)),
                 weight)
            .add("bias", pl.BlockSpec((block_c,), lambda b, t, c: (c,)), bias))


def add_parts(operands, name, block_rows, tiles, static, arrays):
    """`operands` with the (B, T, C) output or its gradient, by blocks of (block_rows,
    block_c) at grid (b, t, c): `name` (the whole, or channels [0, split)) and, with a
    split, `name`_rest (channels [split, C)), each program's block in the part it lies in
    (the other part's index is clamped; the program touches only its own, `by_part`)."""
    block = (None, block_rows, tiles.block_c)
    if static.split is None:
        return operands.add(name, pl.BlockSpec(block, lambda b, t, c: (b, t, c)), arrays[0])
    first = static.split // tiles.block_c
    return (operands
            .add(name, pl.BlockSpec(block, lambda b, t, c: (b, t, jnp.minimum(c, first - 1))),
                 arrays[0])
            .add(name + "_rest", pl.BlockSpec(block, lambda b, t, c: (b, t, jnp.maximum(
                c - first, 0))), arrays[1]))


def in_first_part(static, block_c):
    """Whether this program's channels lie in the output's first part (None without a split).
    (Taken at the kernel's top: interpret mode reads program ids only outside loops.)"""
    return None if static.split is None else pl.program_id(2) < static.split // block_c


def by_part(refs, name, in_first, use):
    """`use(ref)` with the part of `name` (`add_parts`) that the program's channels lie in,
    `in_first` from `in_first_part`."""
    if in_first is None:
        return use(getattr(refs, name))
    return jax.lax.cond(in_first, lambda: use(getattr(refs, name)),
                        lambda: use(getattr(refs, name + "_rest")))


def output_shapes(x, static):
    """The (B, T, C) output's arrays: one, or the two parts of a split."""
    b, t = x.shape[:2]
    widths = ((static.channels,) if static.split is None
              else (static.split, static.channels - static.split))
    return [jax.ShapeDtypeStruct((b, t, width), x.dtype) for width in widths]


def convolve(x, weight, bias, history, *, static):
    """The conv's output (B, T, C) in x's dtype, or its two parts with a split: x (B, T, C_x)
    (its channels from `column_offset`), weight (W, C), bias (C,) or None, history (B,
    history_rows, C) (the initial states after zero rows)."""
    tiles = static.forward_tiles
    b, t = x.shape[:2]
    outputs = add_parts(Operands(), "out", tiles.block_t, tiles, static,
                        output_shapes(x, static))
    result = _operands.call(
        functools.partial(_forward_kernel, static=static),
        operands(x, weight, bias, history, tiles, static), outputs,
        grid=(b, _device.cdiv(t, tiles.block_t), _device.cdiv(static.channels, tiles.block_c)),
        num_warps=tiles.num_warps, num_stages=1, interpret=static.interpret,
        name="causal_conv1d_forward", masks_edges=True)
    return result["out"] if static.split is None else (result["out"], result["out_rest"])
