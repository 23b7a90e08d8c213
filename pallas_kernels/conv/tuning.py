"""Tiles of the causal conv kernels: `block_t` tokens by `block_c` channels per program, and its
warps. A program reads its tile's taps as row gathers of x that overlap the neighbouring tiles'
by W - 1 rows (cache hits); the backward also writes a (W, block_c) partial of the weight's
gradient per tile. Bandwidth-bound: estimates until timed on the GPU (NOTES)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class ConvTiles:
    block_t: int
    block_c: int
    num_warps: int


FORWARD = ConvTiles(64, 128, 4)
BACKWARD = ConvTiles(64, 64, 8)
