"""The decode step's matmuls at M = 64 rows (B 64, one token each) at the 1.1B model's shapes,
through XLA's default GEMM emitter (its Triton GEMMs, autotuned) and through cuBLAS
(`xla_gpu_enable_triton_gemm=False`, as a per-jit compiler option), each shape over enough
distinct bf16 weight matrices (at least 600 MB) that none stays in L2; the copy bandwidth first.
Per shape: microseconds a matmul, its weight bytes per second, and its milliseconds in a decode
step (times its uses a step). On the GPU machine, from the repository root:

    python -m benchmarks.experiments.decode_gemm_ab "$OUT/decode_gemm_ab.jsonl"
"""
import json
import sys

import jax
import jax.numpy as jnp

from benchmarks._timing import amortised_seconds

ROWS = 64
SHAPES = {  # name: (K, N, uses a step) at the zamba2-like 1.1B shape
    "in_proj": (2048, 8384, 36), "out_proj": (4096, 2048, 36),
    "qkv": (4096, 12288, 6), "o": (4096, 2048, 6), "up": (2048, 8192, 6),
    "down": (8192, 2048, 6), "lm_head": (2048, 32000, 1),
}
OPTIONS = {"xla": None, "cublas": {"xla_gpu_enable_triton_gemm": False}}


def main(path):
    key = jax.random.key(0)
    block = jnp.ones((1 << 30,), jnp.bfloat16)
    copy_s = amortised_seconds(jax.jit(lambda a: a * 2), block)
    rows = [dict(what="copy", gbps=2 * block.nbytes / copy_s / 1e9)]
    del block
    for name, (k, n, uses) in SHAPES.items():
        count = max(8, (600 << 20) // (k * n * 2))
        weights = [jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.bfloat16)
                   for i in range(count)]
        x = jax.random.normal(key, (ROWS, k), jnp.bfloat16)

        def chain(x, weights, n=n):
            acc = jnp.zeros((ROWS, n), jnp.float32)
            for w in weights:
                acc = acc + jnp.dot(x, w, preferred_element_type=jnp.float32)
            return acc

        for option, compiler_options in OPTIONS.items():
            s = amortised_seconds(jax.jit(chain, compiler_options=compiler_options), x,
                                  weights) / count
            rows.append(dict(what=name, emitter=option, K=k, N=n, uses=uses, us=1e6 * s,
                             gbps=k * n * 2 / s / 1e9, step_ms=1e3 * s * uses))
        del weights
    with open(path, "w") as log:
        for row in rows:
            log.write(json.dumps(row) + "\n")
    print(f"copy {rows[0]['gbps']:.0f} GB/s\n{'matmul':9s} {'emitter':7s} {'us':>7s} "
          f"{'GB/s':>6s} {'ms/step':>8s}")
    for row in rows[1:]:
        print(f"{row['what']:9s} {row['emitter']:7s} {row['us']:7.1f} {row['gbps']:6.0f} "
              f"{row['step_ms']:8.3f}")


if __name__ == "__main__":
    main(sys.argv[1])
