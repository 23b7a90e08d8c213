"""The sweep behind kv_cache/tuning.py's rows (benchmarks/NOTES.md): attention_with_kv_cache's
device time (`_timing.chained_seconds`) at decode.py's three shapes, bf16 and int8 caches, over
the tile (block_k, num_warps, num_stages), at the GPU family's reads (`gather_rows`, ...), and,
for the long row, the number of splits. The tile stands in for tuning's table (`tuning.table`)
before each traced call. The best tile can change with jaxlib, whose Triton compiles the
kernel: each line records the jaxlib version. On the GPU machine, from the repository root:

    python -m benchmarks.experiments.decode_tune --out "$OUT/decode_tune.jsonl"

One JSON line per (shape, dtype, tile, splits): ms and the fraction of the copy bandwidth.
"""
import argparse
import dataclasses
import itertools
import json

import jax
import jaxlib

import pallas_kernels
from benchmarks import _timing, decode
from pallas_kernels import _device
from pallas_kernels.kv_cache import tuning

# The tile's choices (block_k, warps, stages), each a --flag of comma-separated integers.
BLOCK_KS, WARPS, STAGES = (32, 64, 128), (4, 8), (2, 3, 4)
# The long row: every tile at the op's splits, then these splits at 4 warps and 3 stages.
LONG_SPLITS = (64, 128, 256, 512)


def _ints(text):
    return tuple(int(item) for item in text.split(","))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="gqa,mha,long")
    parser.add_argument("--block-ks", type=_ints, default=BLOCK_KS)
    parser.add_argument("--warps", type=_ints, default=WARPS)
    parser.add_argument("--stages", type=_ints, default=STAGES)
    parser.add_argument("--splits", default="",
                        help="comma-separated splits every tile also runs at, besides the op's")
    parser.add_argument("--dtypes", default="bfloat16,int8")
    parser.add_argument("--quick", action="store_true",
                        help="CPU smoke test: decode.py's tiny shapes, interpret mode, 2 tiles")
    args = parser.parse_args()
    family = _device.family(jax.devices()[0].device_kind)
    copy_gbs = decode.copy_bandwidth(1 / 64 if args.quick else 1.0)["gbps"]
    # The family's reads (gather_rows, zero_int8_past_length) as its table row has them.
    table_row = tuning.table(tuning.row_bytes(decode.HEAD_DIM, "bfloat16"))[family]
    tiles = [dataclasses.replace(table_row, block_k=bk, num_warps=warps, num_stages=stages)
             for bk, warps, stages in itertools.product(args.block_ks, args.warps, args.stages)]
    tiles = tiles[:2] if args.quick else tiles
    extra_splits = _ints(args.splits) if args.splits else ()
    int8s = [dtype == "int8" for dtype in args.dtypes.split(",")]
    with open(args.out, "a") as log:
        for name in args.shapes.split(","):
            sweep, head_dim = ((decode.QUICK_SWEEP, decode.QUICK_HEAD_DIM) if args.quick
                               else (decode.SWEEP, decode.HEAD_DIM))
            shape = decode.Shape(name, *sweep[name], head_dim, decode.PAGE_SIZE)
            inputs = decode.make_inputs(shape, seed=0)
            q, k_pages, v_pages, table, seqlens = inputs[:5]
            (k8, k_scale), (v8, v_scale) = decode.quantise_int8(k_pages), decode.quantise_int8(
                v_pages)
            configs = [(tile, splits) for tile in tiles for splits in (None, *extra_splits)]
            if name == "long":
                configs += [(dataclasses.replace(table_row, block_k=bk, num_warps=4,
                                                 num_stages=3), s)
                            for bk, s in itertools.product((32, 64, 128), LONG_SPLITS)]
            for int8, (tile, splits) in itertools.product(int8s, configs):
                tuning.table = lambda key_row_bytes, tile=tile: {family: tile}

                def step(q, k, v, seqlens, table, ks, vs, splits=splits, scale=shape.scale):
                    return pallas_kernels.attention_with_kv_cache(
                        q, k, v, seqlens, block_table=table, k_scale=ks, v_scale=vs,
                        scale=scale, num_splits=splits, implementation="pallas",
                        interpret=args.quick or None)

                arrays = ((q, k8, v8, seqlens, table, k_scale, v_scale) if int8
                          else (q, k_pages, v_pages, seqlens, table, None, None))
                row = dict(shape=name, int8=int8, **dataclasses.asdict(tile), splits=splits,
                           jaxlib=jaxlib.__version__)
                try:
                    seconds = _timing.chained_seconds(jax.jit(step), *arrays, calls=20)
                except Exception as error:  # noqa: BLE001 - a tile that does not compile
                    row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
                else:
                    gbs = decode.bytes_read(shape, inputs, int8=int8) / seconds / 1e9
                    row.update(ms=1e3 * seconds, gbs=gbs, copy_fraction=gbs / copy_gbs)
                print(json.dumps(row), flush=True)
                log.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
