"""The backward's gradient walks cut into 2, 4 and 8 parts against the table's rule.

Prints one JSON line per (shape, variant): fwd and fwd+bwd ms of the public call
(`ssd_tune.end_to_end`) with the table's tiles ("table") or with `backward_segment_walks_below`
above the walks and `scan_programs` k x the walks ("cutK"); results/ssd_h200_cut_walks.jsonl.
Run from the repository root: `PYTHONPATH=$PWD python benchmarks/experiments/ssd_h200_cut_walks.py`.
"""

import dataclasses
import json

from benchmarks import ssd, ssd_tune
from pallas_kernels import _compat
from pallas_kernels.mamba2 import tuning

SHAPES = [(8192, 128, 1), (8192, 64, 1), (8192, 128, 8), (8192, 64, 8), (4096, 128, 1),
          (4096, 64, 1)]

for t, n, g in SHAPES:
    shape = ssd.Shape(batch=16384 // t, seq_len=t, heads=80, head_dim=64, state=n, groups=g,
                      chunk=256)
    table = tuning.blocks_for(_compat.target_device()[0], n)
    walks = shape.batch * 80
    variants = [("table", table)] + [
        (f"cut{k}", dataclasses.replace(table, backward_segment_walks_below=walks + 1,
                                        scan_programs=k * walks))
        for k in ((2, 4) if t == 4096 else (2, 4, 8))
    ]
    inputs = ssd.make_inputs(shape, seed=1)
    for name, blocks in variants:
        fwd, both = ssd_tune.end_to_end(shape, blocks, inputs, False)
        print(json.dumps(dict(shape=shape.label, variant=name, fwd=round(fwd, 4),
                              fwdbwd=round(both, 4))), flush=True)
