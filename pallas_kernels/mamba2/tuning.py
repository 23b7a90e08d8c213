"""Chunk length, head-dim block, warps and stages of the SSD kernels, per GPU and state size.

The SSD result does not depend on the chunk length (it only regroups the same sums), so the kernels
use min(chunk_size, table's block_t): the table caps the chunk where the (Q, Q) decay tile would
spill registers. AMD entries keep the tiles inside 64 KiB of LDS and use one stage.
"""

import dataclasses

from pallas_kernels.attention.tuning import family


@dataclasses.dataclass(frozen=True)
class SSDBlocks:
    block_t: int  # largest chunk the kernels process at once
    block_p: int  # head-dim rows per program in the scan kernels
    heads_per_program: int  # most heads per program in the chunk-gradient kernel
    num_warps: int  # scan kernels (forward, state recompute, state gradients, segment sums)
    num_stages: int  # scan kernels but the forward
    grad_num_warps: int  # chunk-gradient kernel
    grad_num_stages: int
    forward_num_stages: int | None = None  # the forward scan (None: num_stages)
    terms_num_warps: int | None = None  # the dB/dC state-term kernel (None: num_warps)
    terms_num_stages: int | None = None  # the same (None: num_stages)
    # The forward scan cuts its walks (batch row, head, head-dim block) into programs by the
    # cheapest cut (common.forward_schedule): `programs_per_sm` of its programs run at once on
    # each multiprocessor; a segment sum's chunk step costs `sum_step_cost` of a walk's, a round
    # of programs `round_cost` walk steps. The backward's walks (state recompute, state
    # gradients) are cut below `backward_segment_walks_below` walks, into up to `scan_programs`
    # programs. Cuts are at least `min_segment_chunks` chunks long. The two costs are from an
    # H200 (N 64: a sum's chunk step ~0.95 us per program against a walk's ~2.3; a round's
    # program start and first loads about two steps) and kept for every family.
    programs_per_sm: int = 1
    sum_step_cost: float = 0.4
    round_cost: float = 2.0
    backward_segment_walks_below: int = 320
    scan_programs: int = 1280
    min_segment_chunks: int = 8


# On an H200 the backward's walks run faster unsplit at 160 walks (b 2, T 8192, 80 heads); below
# that (fewer walks than SMs) the split is kept.
_HOPPER_SEGMENTS = dict(backward_segment_walks_below=160)
# Two forward programs fit on an H200 multiprocessor at N <= 128 (registers and shared memory).
_HOPPER_FORWARD = dict(programs_per_sm=2, **_HOPPER_SEGMENTS)

# family -> [(largest padded state size N it covers, SSDBlocks)]. The hopper rows are measured on an
# H200 (benchmarks/ssd_tune.py, benchmarks/results/ssd_tune_h200_*.json; stages and segments by
# end-to-end runs, benchmarks/NOTES.md; N 256 is not measured); the rest are estimates.
_TABLE = {
    "hopper": [
        (64, SSDBlocks(64, 64, 40, 4, 4, 4, 1, forward_num_stages=4, terms_num_stages=3,
                       **_HOPPER_FORWARD)),
        (128, SSDBlocks(64, 64, 40, 4, 3, 4, 1, forward_num_stages=2, terms_num_warps=8,
                        **_HOPPER_FORWARD)),
        (256, SSDBlocks(64, 64, 40, 4, 2, 4, 1, terms_num_warps=8, **_HOPPER_SEGMENTS)),
    ],
    "ampere": [(64, SSDBlocks(64, 64, 16, 4, 2, 4, 1)), (256, SSDBlocks(64, 32, 16, 4, 2, 4, 1))],
    "cdna": [(64, SSDBlocks(64, 32, 8, 4, 1, 4, 1)), (256, SSDBlocks(32, 16, 8, 4, 1, 4, 1))],
    "fallback": [(64, SSDBlocks(64, 32, 8, 4, 1, 4, 1)), (256, SSDBlocks(32, 16, 8, 4, 1, 4, 1))],
}


# Multiprocessors where the device does not say (ahead-of-time lowering for an abstract device).
_MULTIPROCESSORS = {"hopper": 132, "ampere": 108, "cdna": 304, "fallback": 100}


def multiprocessors(device_kind, known):
    """`known` (the device's multiprocessor count) or the family's usual count."""
    return known or _MULTIPROCESSORS[family(device_kind)]


def blocks_for(device_kind, state_size):
    """The table's SSDBlocks for a device kind and a padded state size N <= 256."""
    for max_n, blocks in _TABLE[family(device_kind)]:
        if state_size <= max_n:
            return blocks
    raise ValueError(f"state size {state_size} is above the largest supported (256)")
