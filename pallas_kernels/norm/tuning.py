"""Tiles of the gated RMSNorm kernels: how many rows a program normalises at once, its warps,
and how many rows a backward program walks (its weight-gradient partial covers them).

A row's group (a power of two of channels) is read whole, so the rows per tile shrink as groups
grow to keep a tile at `TILE_ENTRIES` entries. The norm is
bandwidth-bound: these keep every multiprocessor streaming several tiles at once.
"""

import dataclasses

from pallas_kernels import _device

TILE_ENTRIES = 4096
# The widest group the kernels read whole.
MAX_GROUP = 8192
NUM_WARPS = 8
# The backward's warps per 4096 channels of a tile's row (H100, 4096 channels: 4 warps 424 µs,
# 8 warps 539 µs); wider groups get more, so that a thread's share of a row stays the same.
BACKWARD_WARPS = 4
BACKWARD_STAGES = 1
# Backward programs per multiprocessor: each sums its rows' weight gradient in registers and
# writes one (group,) partial; XLA adds the partials in a fixed order (deterministic).
BACKWARD_PROGRAMS_PER_MULTIPROCESSOR = 4


@dataclasses.dataclass(frozen=True)
class NormTiles:
    """`block_rows` rows of one group's channels per tile; the backward's programs each walk
    `backward_blocks` tiles; Triton's warps (and the backward's stages)."""

    block_rows: int
    backward_blocks: int
    num_warps: int
    backward_warps: int
    backward_stages: int


def tiles(device_kind, rows, group_size):
    """The NormTiles of `rows` rows of groups of `group_size` channels (a power of two): the
    most rows, a power of two dividing `rows` (so that no tile reads past the last row), that
    keep a tile within `TILE_ENTRIES`."""
    block_rows = 1
    while block_rows * 2 * group_size <= TILE_ENTRIES and rows % (block_rows * 2) == 0:
        block_rows *= 2
    row_blocks = rows // block_rows
    programs = BACKWARD_PROGRAMS_PER_MULTIPROCESSOR * _device.multiprocessors(device_kind)
    backward_warps = BACKWARD_WARPS * max(1, group_size // 4096)
    return NormTiles(block_rows, _device.cdiv(row_blocks, programs), NUM_WARPS,
                     backward_warps, BACKWARD_STAGES)
