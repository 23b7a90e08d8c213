"""The sweep behind norm/tuning.py's warps (benchmarks/NOTES.md): rms_norm_gated's device time
(`_profile.kernel_span_seconds`), forward and forward+backward, against XLA (the reference), at
the zamba2-like mixer's gated norm (B 4 x T 4096 x 4096, gate first) and its model width without
a gate (x 2048), bf16, over the tile's entries, the forward's and the backward's warps and the
backward's stages (swapped into `tuning` before each traced call). On the GPU machine, from the
repository root:

    python -m benchmarks.experiments.norm_tune --out "$OUT/norm_tune.json"
"""
import argparse
import functools
import json

import jax
import jax.numpy as jnp

import pallas_kernels
from benchmarks import _profile
from pallas_kernels.norm import tuning

SHAPES = [((4, 4096, 4096), True, False), ((4, 4096, 2048), False, True)]  # (shape, z, order)
# (tile entries, forward warps, backward warps, backward stages)
VARIANTS = [(4096, 8, 8, 1), (4096, 8, 16, 1), (4096, 8, 8, 2), (4096, 8, 16, 2), (4096, 8, 4, 1),
            (2048, 4, 8, 1), (2048, 8, 16, 2), (8192, 16, 16, 1), (4096, 16, 16, 2),
            (4096, 4, 4, 2)]


def times(implementation, x, weight, z, dout, norm_before_gate):
    """(forward µs, forward+backward µs)."""
    norm = functools.partial(pallas_kernels.rms_norm_gated, norm_before_gate=norm_before_gate,
                             implementation=implementation)

    def both(x, weight, z, dout):
        if z is None:
            out, vjp = jax.vjp(lambda x, weight: norm(x, weight), x, weight)
        else:
            out, vjp = jax.vjp(norm, x, weight, z)
        return out, vjp(dout)

    forward = _profile.kernel_span_seconds(norm, x, weight, z)
    return 1e6 * forward, 1e6 * _profile.kernel_span_seconds(both, x, weight, z, dout)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    opts = parser.parse_args()
    records = []
    for shape, gated, norm_before_gate in SHAPES:
        keys = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(keys[0], shape, jnp.bfloat16)
        z = jax.random.normal(keys[1], shape, jnp.bfloat16) if gated else None
        dout = jax.random.normal(keys[2], shape, jnp.bfloat16)
        weight = jnp.ones(shape[-1:], jnp.float32)
        args = (x, weight, z, dout, norm_before_gate)
        forward, both = times("xla", *args)
        records.append(dict(shape=shape, impl="xla", fwd=forward, both=both))
        print(f"{shape} xla: fwd {forward:7.1f} µs, fwd+bwd {both:7.1f} µs", flush=True)
        for tile, warps, backward_warps, backward_stages in VARIANTS:
            (tuning.TILE_ENTRIES, tuning.NUM_WARPS, tuning.BACKWARD_WARPS,
             tuning.BACKWARD_STAGES) = tile, warps, backward_warps, backward_stages
            forward, both = times("pallas", *args)
            records.append(dict(shape=shape, impl="pallas", tile=tile, fw=warps,
                                bw=backward_warps, bs=backward_stages, fwd=forward, both=both))
            print(f"{shape} tile {tile}, warps {warps}/{backward_warps}, stages "
                  f"{backward_stages}: fwd {forward:7.1f} µs, fwd+bwd {both:7.1f} µs", flush=True)
    with open(opts.out, "w") as f:
        json.dump({"device_kind": jax.devices()[0].device_kind, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
