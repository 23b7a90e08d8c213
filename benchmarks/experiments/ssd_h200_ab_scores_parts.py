"""The forward alone, for the scores-precompute A/B (benchmarks/NOTES.md, SSD forward).

Prints one JSON line per shape: ms of `forward.forward` (segment sums and scan, no preprocess)
with the table's forward stages and with 2, and where the tree has `common.chunk_scores` (the
patched tree), the XLA scores einsum alone. Run from a tree's root:
`PYTHONPATH=$PWD python benchmarks/experiments/ssd_h200_ab_scores_parts.py TAG`.
"""

import dataclasses
import json
import sys

import jax

from benchmarks import ssd, ssd_tune
from pallas_kernels import _compat
from pallas_kernels.mamba2 import common, forward, tuning

SHAPES = [(4096, 64, 1), (8192, 64, 1), (4096, 128, 1), (8192, 128, 1), (4096, 64, 8),
          (4096, 128, 8)]

for t, n, g in SHAPES:
    shape = ssd.Shape(batch=16384 // t, seq_len=t, heads=80, head_dim=64, state=n, groups=g,
                      chunk=256)
    blocks = tuning.blocks_for(_compat.target_device()[0], n)
    x, dt_step, A, B, C, d, dy = ssd_tune.kernel_inputs(shape)
    s = common.chunk_log2_decays(dt_step, A, blocks.block_t)
    out = dict(tag=sys.argv[1], shape=shape.label)
    for stages in sorted({blocks.forward_num_stages or blocks.num_stages, 2}):
        static = ssd_tune.static_for(
            dataclasses.replace(blocks, forward_num_stages=stages), shape, blocks.block_t)
        out[f"fwd_s{stages}"] = ssd_tune.time_call(
            jax.jit(lambda *a, static=static, d=d: forward.forward(
                *a, None, d, None, None, static=static)), x, dt_step, s, B, C)
    if hasattr(common, "chunk_scores"):
        out["scores"] = ssd_tune.time_call(
            jax.jit(lambda b, c, q=blocks.block_t: common.chunk_scores(b, c, q)), B, C)
    print(json.dumps(out), flush=True)
