"""The sweep behind conv/tuning.py's tiles (benchmarks/NOTES.md): causal_conv1d's device time
(`_profile.kernel_span_seconds`), forward and forward+backward, against XLA (the reference), at
the zamba2-like mixer's conv (B 4 x T 4096 x 4224 channels, W 4, SiLU), bf16: the forward's
tiles first (with the table's backward), then the backward's with the fastest forward
(swapped into `tuning` before each traced call). On the GPU machine, from the repository root:

    python -m benchmarks.experiments.conv_tune --out "$OUT/conv_tune.json"
"""
import argparse
import functools
import json

import jax
import jax.numpy as jnp

import pallas_kernels
from benchmarks import _profile
from pallas_kernels.conv import tuning

SHAPE = (4, 4096, 4224)
FORWARD = [(64, 128, 4), (32, 128, 4), (64, 128, 8)]
# (block_t, block_c, warps, steps); (64, 64, 8, 1) sums the rows of every tile.
BACKWARD = [(64, 64, 8, 1), (32, 64, 4, 8), (16, 64, 4, 16), (32, 64, 8, 8), (16, 128, 4, 16),
            (64, 64, 8, 4), (32, 64, 4, 16), (16, 64, 2, 16)]


def times(implementation, x, weight, bias, dout):
    """(forward µs, forward+backward µs)."""
    conv = functools.partial(pallas_kernels.causal_conv1d, implementation=implementation)

    def both(x, weight, bias, dout):
        out, vjp = jax.vjp(conv, x, weight, bias)
        return out, vjp(dout)

    forward = _profile.kernel_span_seconds(conv, x, weight, bias)
    return 1e6 * forward, 1e6 * _profile.kernel_span_seconds(both, x, weight, bias, dout)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    opts = parser.parse_args()
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], SHAPE, jnp.bfloat16)
    weight = 0.3 * jax.random.normal(keys[1], (4, SHAPE[-1]), jnp.float32)
    dout = jax.random.normal(keys[2], SHAPE, jnp.bfloat16)
    args = (x, weight, jnp.zeros(SHAPE[-1:], jnp.float32), dout)
    forward, both = times("xla", *args)
    records = [dict(impl="xla", fwd=forward, both=both)]
    print(f"xla: fwd {forward:7.1f} µs, fwd+bwd {both:7.1f} µs", flush=True)

    def measure(forward_tiles, backward_tiles):
        tuning.FORWARD = tuning.ConvTiles(*forward_tiles)
        tuning.BACKWARD = tuning.ConvTiles(*backward_tiles)
        forward, both = times("pallas", *args)
        records.append(dict(impl="pallas", forward=forward_tiles, backward=backward_tiles,
                            fwd=forward, both=both))
        print(f"forward {forward_tiles}, backward {backward_tiles}: fwd {forward:7.1f} µs, "
              f"fwd+bwd {both:7.1f} µs", flush=True)
        return forward, both

    table_backward = tuple(vars(tuning.BACKWARD).values())
    best_forward = min(FORWARD, key=lambda tiles: measure(tiles, table_backward)[0])
    for tiles in BACKWARD:
        measure(best_forward, tiles)
    with open(opts.out, "w") as f:
        json.dump({"device_kind": jax.devices()[0].device_kind, "shape": SHAPE,
                   "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
