"""Chunk length, head-dim block, warps and stages of the SSD kernels, per GPU and state size.

The SSD result does not depend on the chunk length (it only regroups the same sums), so the
kernels use min(chunk_size, the row's block_t): the table caps the chunk where the (Q, Q) decay
tile would spill registers. AMD rows use one stage. `blocks_for(device_kind, state_size)` reads
the table; `SSDBlocks.fit` sizes a row to a call.
"""

import dataclasses

from pallas_kernels import _device


@dataclasses.dataclass(frozen=True)
class SSDBlocks:
    """The tuning knobs of the SSD kernels (the cut of the scan kernels' walks: `schedule`)."""

    block_t: int  # largest chunk the kernels process at once
    block_p: int  # head-dim rows per program in the scan kernels
    heads_per_program: int  # most heads per program in the chunk-gradient kernel
    num_warps: int  # scan kernels (forward, state recompute, state gradients, unit sums)
    num_stages: int  # scan kernels but the forward
    grad_num_warps: int  # chunk-gradient kernel
    grad_num_stages: int
    forward_num_stages: int | None = None  # the forward scan (None: num_stages)
    terms_num_warps: int | None = None  # the dB/dC state-term kernel (None: num_warps)
    terms_num_stages: int | None = None  # the same (None: num_stages)
    # The forward scan cuts its walks (batch row, head, head-dim block) into programs by the
    # cheapest cut (`schedule.forward_schedule`): `programs_per_sm` of its programs run at once
    # on each multiprocessor; a unit sum's chunk step costs `sum_step_cost` of a walk's, a round
    # of programs `round_cost` walk steps. The backward's walks (state recompute, state
    # gradients) are cut below `backward_segment_walks_below` walks, into up to `scan_programs`
    # programs. Cuts are at least `min_segment_chunks` chunks long. The two costs are from an
    # H200 (benchmarks/NOTES.md) and kept for every family.
    programs_per_sm: int = 1
    sum_step_cost: float = 0.4
    round_cost: float = 2.0
    backward_segment_walks_below: int = 320
    scan_programs: int = 1280
    min_segment_chunks: int = 8

    def fit(self, chunk_size, p_pad, heads_per_group):
        """This row sized to a call: the chunk min(chunk_size, block_t) (at least 16), at most
        p_pad head-dim rows, heads per program dividing `heads_per_group`, and every stage and
        warp count resolved (no None)."""
        return dataclasses.replace(
            self,
            block_t=max(16, min(chunk_size, self.block_t)),
            block_p=min(self.block_p, p_pad),
            heads_per_program=max(
                k for k in range(1, self.heads_per_program + 1) if heads_per_group % k == 0),
            forward_num_stages=self.forward_num_stages or self.num_stages,
            terms_num_warps=self.terms_num_warps or self.num_warps,
            terms_num_stages=self.terms_num_stages or self.num_stages,
        )


# On an H200 the backward's walks run faster unsplit at 160 walks (b 2, T 8192, 80 heads); below
# that (fewer walks than SMs) the split is kept.
_HOPPER_SEGMENTS = dict(backward_segment_walks_below=160)
# Two forward programs fit on an H200 multiprocessor at N <= 128 (registers and shared memory).
_HOPPER_FORWARD = dict(programs_per_sm=2, **_HOPPER_SEGMENTS)
_SCAN = dict(heads_per_program=40, grad_num_warps=4, grad_num_stages=1)
_SMALL = dict(heads_per_program=8, num_warps=4, num_stages=1, grad_num_warps=4, grad_num_stages=1)

# family -> [(largest padded state size N it covers, SSDBlocks)]. The hopper rows are measured on
# an H200 (benchmarks/ssd_tune.py, benchmarks/results/ssd_tune_h200_*.json; stages and cuts by
# end-to-end runs, benchmarks/NOTES.md; N 256 is not measured); the rest are estimates.
_TABLE = {
    "hopper": [
        (64, SSDBlocks(block_t=64, block_p=64, num_warps=4, num_stages=4, forward_num_stages=4,
                       terms_num_stages=3, **_SCAN, **_HOPPER_FORWARD)),
        (128, SSDBlocks(block_t=64, block_p=64, num_warps=4, num_stages=3, forward_num_stages=2,
                        terms_num_warps=8, **_SCAN, **_HOPPER_FORWARD)),
        (256, SSDBlocks(block_t=64, block_p=64, num_warps=4, num_stages=2, terms_num_warps=8,
                        **_SCAN, **_HOPPER_SEGMENTS)),
    ],
    "ampere": [
        (64, SSDBlocks(block_t=64, block_p=64, heads_per_program=16, num_warps=4, num_stages=2,
                       grad_num_warps=4, grad_num_stages=1)),
        (256, SSDBlocks(block_t=64, block_p=32, heads_per_program=16, num_warps=4, num_stages=2,
                        grad_num_warps=4, grad_num_stages=1)),
    ],
    "cdna": [(64, SSDBlocks(block_t=64, block_p=32, **_SMALL)),
             (256, SSDBlocks(block_t=32, block_p=16, **_SMALL))],
    "fallback": [(64, SSDBlocks(block_t=64, block_p=32, **_SMALL)),
                 (256, SSDBlocks(block_t=32, block_p=16, **_SMALL))],
}


def blocks_for(device_kind, state_size):
    """The table's SSDBlocks for a device kind and a padded state size N <= 256."""
    for max_n, blocks in _TABLE[_device.family(device_kind)]:
        if state_size <= max_n:
            return blocks
    raise ValueError(f"state size {state_size} is above the largest supported (256)")
