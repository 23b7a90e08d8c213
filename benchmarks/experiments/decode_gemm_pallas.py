"""Whether a Pallas-Triton matmul reads the decode step's weights faster than XLA's autotuned
Triton GEMMs at M = 64 rows (B 64, one token each), at the 1.1B model's shapes
(`decode_gemm_ab.SHAPES`), each over at least 600 MB of distinct bf16 weights (none stays in
L2). In a B 64 int8 `generate` step XLA's GEMM fusions take about 1.7 ms for 2.2 GB of weights
(1.3 TB/s, against a copy bandwidth of 2.9): the largest part of the step after attention.

The kernel: program (j, s) of (N / block_n, splits) reads x's rows whole over its share of K
and its (K / splits, block_n) column block of w in `block_k` steps (pipelined over
`num_stages`), and writes a float32 partial; XLA sums the splits (a small kernel) where
splits > 1. Per shape and tile: microseconds a matmul and weight GB/s; then each shape's best
tile against XLA's. On the GPU machine, from the repository root:

    python -m benchmarks.experiments.decode_gemm_pallas "$OUT/decode_gemm_pallas.jsonl" \\
        [--shapes in_proj,out_proj]
"""
import argparse
import functools
import itertools
import json

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from benchmarks._timing import amortised_seconds
from benchmarks.experiments.decode_gemm_ab import ROWS, SHAPES
from pallas_kernels import _compat


def matmul(x, w, *, block_n, block_k, splits, num_warps, num_stages, interpret=False):
    """x (M, K) @ w (K, N) in float32, M a power of two; N a multiple of block_n; K of
    splits * block_k."""
    m, k = x.shape
    n = w.shape[1]
    part = k // splits

    def kernel(x_ref, w_ref, out_ref):
        def step(i, acc):
            start = pl.multiple_of(i * block_k, block_k)
            return acc + jnp.dot(x_ref[:, pl.ds(start, block_k)],
                                 w_ref[pl.ds(start, block_k), :],
                                 preferred_element_type=jnp.float32)

        out_ref[...] = jax.lax.fori_loop(0, part // block_k, step,
                                         jnp.zeros((m, block_n), jnp.float32))

    partials = pl.pallas_call(
        kernel, grid=(n // block_n, splits),
        in_specs=[pl.BlockSpec((m, part), lambda j, s: (0, s)),
                  pl.BlockSpec((part, block_n), lambda j, s: (s, j))],
        out_specs=pl.BlockSpec((None, m, block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((splits, m, n), jnp.float32),
        compiler_params=_compat.triton_params(num_warps, num_stages),
        interpret=interpret, name="decode_matmul")(x, w)
    return partials[0] if splits == 1 else partials.sum(axis=0)


def tiles(k, n):
    """The tiles tried at (K, N): every one that tiles both and launches 64 to 1024 programs."""
    for block_n, block_k, splits, stages in itertools.product(
            (32, 64, 128), (64, 128, 256), (1, 2, 4, 8), (3, 4)):
        programs = n // block_n * splits
        if n % block_n or k % (splits * block_k) or not 64 <= programs <= 1024:
            continue
        yield dict(block_n=block_n, block_k=block_k, splits=splits, num_warps=4,
                   num_stages=stages)


def seconds(product, x, weights):
    """Seconds a matmul, `product` chained over the distinct weights in one jit."""
    def chain(x, weights):
        acc = jnp.zeros((x.shape[0], weights[0].shape[1]), jnp.float32)
        for w in weights:
            acc = acc + product(x, w)
        return acc

    return amortised_seconds(jax.jit(chain), x, weights) / len(weights)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    key = jax.random.key(0)
    rows = []
    for name in args.shapes.split(","):
        k, n, uses = SHAPES[name]
        count = max(8, (600 << 20) // (k * n * 2))
        weights = [jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.bfloat16)
                   for i in range(count)]
        x = jax.random.normal(key, (ROWS, k), jnp.bfloat16)
        want = jnp.dot(x, weights[0], preferred_element_type=jnp.float32)
        candidates = [("xla", None, functools.partial(jnp.dot,
                                                      preferred_element_type=jnp.float32))]
        candidates += [("pallas", t, functools.partial(matmul, **t)) for t in tiles(k, n)]
        for emitter, tile, product in candidates:
            try:
                error = float(jnp.max(jnp.abs(jax.jit(product)(x, weights[0]) - want)))
                s = seconds(product, x, weights)
            except Exception as failure:  # noqa: BLE001 (a tile that does not compile)
                rows.append(dict(what=name, emitter=emitter, tile=tile, error=str(failure)[:200]))
                continue
            rows.append(dict(what=name, emitter=emitter, tile=tile, K=k, N=n, uses=uses,
                             us=1e6 * s, gbps=k * n * 2 / s / 1e9, step_ms=1e3 * s * uses,
                             max_abs_diff=error))
            print(json.dumps(rows[-1]), flush=True)
        del weights
    with open(args.out, "w") as log:
        for row in rows:
            log.write(json.dumps(row) + "\n")
    print(f"{'matmul':9s} {'xla us':>7s} {'best us':>8s} {'GB/s':>11s} {'ms/step':>15s}  tile")
    for name in args.shapes.split(","):
        timed = [r for r in rows if r["what"] == name and "us" in r]
        xla = next(r for r in timed if r["emitter"] == "xla")
        best = min((r for r in timed if r["emitter"] == "pallas"), key=lambda r: r["us"])
        print(f"{name:9s} {xla['us']:7.1f} {best['us']:8.1f} {xla['gbps']:5.0f}/"
              f"{best['gbps']:5.0f} {xla['step_ms']:7.3f}/{best['step_ms']:7.3f}  {best['tile']}")


if __name__ == "__main__":
    main()
