"""Where int8 decode attention loses to the bytes (benchmarks/NOTES.md, "Serving"): the split-K
kernel's device time at decode.py's 32:4 shape (B 64, 8192 keys, head dim 128) with a bf16 and
an int8 cache, laid out as the benchmark's (16-slot pages, KV heads interleaved), with one KV
head per row (B 256, 8:1: each program's keys contiguous within a page), with 64-slot pages,
as a dense cache (no block table), with the pages in order (row b's pages b·P .. b·P + P - 1:
the dense cache's bytes where they lie, read through the table), and int8 with its scales not
read (wrong values: only the time counts); and at 32:32 heads the benchmark's layout and a
dense cache, each with and without int8 scales read.
`--stages` times each at those Triton stages instead of the tuning table's. On the GPU
machine, from the repository root:

    python -m benchmarks.experiments.decode_layout_probe --out "$OUT/decode_layout_probe.jsonl"
    python -m benchmarks.experiments.decode_layout_probe --stages 1,3 --variants 0,4 \
        --out "$OUT/decode_layout_stages.jsonl"
    python -m benchmarks.experiments.decode_layout_probe --variants 6,7,8,9 \
        --out "$OUT/ladder.jsonl"
    # results/decode_scales_ladder_h100.jsonl: `measure` at these four variants' arguments,
    # int8 only, two runs each, labelled "mha pages", "mha dense", ..., with the layout of
    # the scales (before and after they lay along the keys) added to each row
"""
import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp

import pallas_kernels
from benchmarks import _timing, decode
from pallas_kernels.kv_cache import forward, tuning

# (label, batch, query heads, KV heads, page size, dense, pages shuffled, int8 scales read)
VARIANTS = [
    ("pages of 16", 64, 32, 4, 16, False, True, True),
    ("pages of 16 in order", 64, 32, 4, 16, False, False, True),
    ("one KV head", 256, 8, 1, 16, False, True, True),
    ("pages of 64", 64, 32, 4, 64, False, True, True),
    ("dense", 64, 32, 4, 16, True, True, True),
    ("pages of 16, int8 scales not read", 64, 32, 4, 16, False, True, False),
    ("32:32 heads, pages of 16", 64, 32, 32, 16, False, True, True),
    ("32:32 heads, pages of 16, int8 scales not read", 64, 32, 32, 16, False, True, False),
    ("32:32 heads, dense", 64, 32, 32, 16, True, True, True),
    ("32:32 heads, dense, int8 scales not read", 64, 32, 32, 16, True, True, False),
]


def _cache(pages, table, dense):
    return decode.dense_cache(pages, table, head_major=False) if dense else pages


def measure(label, batch, heads, kv_heads, page, dense, shuffled, scales_read, int8, copy_gbs,
            quick):
    context = 8192
    if quick:  # CPU smoke test: a few rows of 256 keys in interpret mode
        batch, context = batch // 32, 256
    shape = decode.Shape(label, batch, context, heads, kv_heads, decode.HEAD_DIM, page)
    inputs = decode.make_inputs(shape, seed=0)
    q, k, v, table, seqlens = inputs[:5]
    if not shuffled:
        table = jnp.arange(table.size, dtype=table.dtype).reshape(table.shape)
    k_scale = v_scale = None
    if int8:
        (k, k_scale), (v, v_scale) = decode.quantise_int8(k), decode.quantise_int8(v)
        if dense:
            k_scale, v_scale = (jnp.swapaxes(_cache(jnp.swapaxes(s, 1, 2)[..., None], table,
                                                    True)[..., 0], 1, 2)
                                for s in (k_scale, v_scale))
    k, v = _cache(k, table, dense), _cache(v, table, dense)
    read = forward._read
    if not scales_read:
        forward._read = lambda *args: (read(*args)[0], None)
    try:
        def step(q, k, v, seqlens, table, k_scale, v_scale):
            return pallas_kernels.attention_with_kv_cache(
                q, k, v, seqlens, block_table=table, k_scale=k_scale, v_scale=v_scale,
                scale=shape.scale, implementation="pallas", interpret=quick or None)

        seconds = _timing.chained_seconds(jax.jit(step), q, k, v, seqlens,
                                          None if dense else table, k_scale, v_scale)
    finally:
        forward._read = read
    gbs = decode.bytes_read(shape, inputs, int8=int8) / seconds / 1e9
    return dict(variant=label, int8=int8, ms=1e3 * seconds, copy_fraction=gbs / copy_gbs)


def _stages_fixed(table, stages):
    """The tuning `table` with every family's row at `stages` (None: as it is)."""
    if stages is None:
        return table
    return lambda key_row_bytes: {family: dataclasses.replace(row, num_stages=stages)
                                  for family, row in table(key_row_bytes).items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants", help="indices into VARIANTS, comma-separated (default: all)")
    parser.add_argument("--stages", help="Triton stages to time at, comma-separated (default: "
                        "the tuning table's)")
    parser.add_argument("--quick", action="store_true", help="CPU smoke test, interpret mode")
    args = parser.parse_args()
    copy_gbs = decode.copy_bandwidth(1 / 64 if args.quick else 1.0)["gbps"]
    variants = VARIANTS if args.variants is None else [
        VARIANTS[int(i)] for i in args.variants.split(",")]
    table = tuning.table
    with open(args.out, "a") as log:
        for stages in [None] if args.stages is None else map(int, args.stages.split(",")):
            tuning.table = _stages_fixed(table, stages)
            try:
                for variant in variants:
                    for int8 in (False, True) if variant[-1] else (True,):
                        row = measure(*variant, int8=int8, copy_gbs=copy_gbs, quick=args.quick)
                        row["stages"] = stages
                        print(json.dumps(row), flush=True)
                        log.write(json.dumps(row) + "\n")
            finally:
                tuning.table = table


if __name__ == "__main__":
    main()
