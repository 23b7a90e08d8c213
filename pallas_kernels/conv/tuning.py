"""Tiles of the causal conv kernels: `block_t` tokens by `block_c` channels per program, and its
warps. A program reads its tile's taps as row gathers of x that overlap the neighbouring tiles'
by W - 1 rows (cache hits); a backward program walks `steps` tiles and writes one (W, block_c)
partial of the weight's gradient for them. Bandwidth-bound: estimates until timed on the GPU
(NOTES)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class ConvTiles:
    block_t: int
    block_c: int
    num_warps: int
    steps: int = 1  # the backward's tiles a program walks


FORWARD = ConvTiles(64, 128, 8)
BACKWARD = ConvTiles(32, 64, 4, steps=16)
UPDATE = ConvTiles(1, 256, 4)  # one token: a launch of a few MB, timed in generate (NOTES)
