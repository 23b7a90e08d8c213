"""Per-kernel device ms of the SSD kernels with the table's tiles, G 1, for the A/Bs in
results/ssd_h200_ab_launch.json. From a tree's root:
`PYTHONPATH=<tree> python benchmarks/experiments/ssd_h200_ab_parts.py TAG`.

`benchmarks.ssd_tune.time_parts` at T 4096 and 8192, N 64 and 128, and, where the tree has it,
`backward.states_and_gradients` (the two backward walks as launched together) as "both".
"""

import json
import sys

import jax

from benchmarks import ssd, ssd_tune
from pallas_kernels import _compat
from pallas_kernels.mamba2 import backward, common, forward, tuning

for t in (4096, 8192):
    for n in (64, 128):
        shape = ssd.Shape(batch=16384 // t, seq_len=t, heads=80, head_dim=64, state=n, groups=1,
                          chunk=256)
        blocks = tuning.blocks_for(_compat.target_device()[0], n)
        operands = ssd_tune.kernel_inputs(shape)
        parts = ssd_tune.time_parts(shape, blocks.block_t, blocks, operands, False)
        if hasattr(backward, "states_and_gradients"):
            x, dt_step, A, B, C, d, dy = operands
            static = ssd_tune.static_for(blocks, shape, blocks.block_t)
            s = common.chunk_log2_decays(dt_step, A, blocks.block_t)
            entries = jax.jit(lambda *a, d=d, static=static: forward.forward(
                *a, None, d, None, None, static=static, save_entries=True)[3])(x, dt_step, s, B, C)
            both = jax.jit(lambda x, dy, dt, s, B, C, entries, static=static:
                           backward.states_and_gradients(x, dy, dt, s, B, C, None, None, None,
                                                         entries, static=static)[:2])
            parts["both"] = ssd_tune.time_call(both, x, dy, dt_step, s, B, C, entries)
        print(json.dumps(dict(tag=sys.argv[1], shape=shape.label, **parts)), flush=True)
