"""What SSD context parallelism adds to one device's compute, timed on one GPU by standing in
for the collectives (all_gather copies the local shard n times; the device is the last along
the axis, so the entering state is live), for both ways of `pallas_kernels.mamba2.context`:
the entering state's correction in XLA (`state_passing` over the kernels: cumulative decays,
C . h, the merge into y) and the kernels' way (`kernel_state_passing`, what a mesh runs: one
extra walk each way: the final state alone before the forward, the gradient of the entering
state from dy alone before the backward).

    python -m benchmarks.experiments.ssd_state_passing_cost [--parts 2] [--rounds 5] [--profile]

Prints the direct call and both paths, forward+backward, amortised ms, at T 4096 N 128 G 1
chunk 256 (b 4, 80 heads of 64), bf16.
"""

import argparse
import collections
import statistics

import jax
import jax.numpy as jnp

import pallas_kernels
from benchmarks import _timing
from pallas_kernels.mamba2 import api, checks, context, semantics


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shape", default="4,4096,80", help="batch,T,heads")
    parser.add_argument("--profile", action="store_true",
                        help="also print each kernel's GPU time, direct and walks")
    args = parser.parse_args()
    parts = args.parts
    jax.lax.all_gather = lambda a, axis_name, **_: jnp.stack([a] * parts)  # the stand-ins
    jax.lax.axis_index = lambda axis_name: jnp.int32(parts - 1)

    (b, t, h), p, n = (int(v) for v in args.shape.split(",")), 64, 128
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (b, t, h, p), jnp.bfloat16)
    dt = (jax.random.normal(keys[1], (b, t, h)) * 0.5 - 1.0).astype(jnp.bfloat16)
    A = -jnp.exp(jax.random.uniform(keys[2], (h,), minval=-1.0, maxval=1.5))
    B, C = (jax.random.normal(k, (b, t, 1, n), jnp.bfloat16) for k in keys[3:5])
    dy = jax.random.normal(keys[5], x.shape, jnp.bfloat16)
    D, dt_bias = jnp.ones((h,)), jnp.zeros((h,))

    def compute(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx):
        return pallas_kernels.mamba_chunk_scan_combined(
            x, dt, A, B, C, 256, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
            seq_idx=seq_idx, dt_softplus=True, return_final_states=True,
            implementation="pallas")

    def direct(x, dt, B, C):
        return compute(x, dt, A, B, C, D, None, dt_bias, None, None)[0]

    limit = checks.check_dt_limit((0.0, float("inf")))

    def correction(x, dt, B, C):
        return context.state_passing(compute, "context", parts, x, dt, A, B, C, D, None,
                                     dt_bias, None, None, dt_softplus=True, dt_limit=limit)[0]

    def walks(x, dt, B, C):
        return api._pallas_ssd(x, dt, semantics.decay_rates(A), B, C, 256, D, None, dt_bias,
                               None, None, True, limit, False,
                               sequence_axis=("context", parts))[0]

    def step(fn):
        def run(x, dt, B, C, dy):
            out, vjp = jax.vjp(fn, x, dt, B, C)
            return out, *vjp(dy)
        return jax.jit(run)

    steps = {"direct": step(direct), "correction": step(correction), "walks": step(walks)}
    results = {name: jax.block_until_ready(s(x, dt, B, C, dy)) for name, s in steps.items()}
    # The two ways compute the same function (the stand-ins make every shard the same one).
    names = ("y", "dx", "ddt", "dB", "dC")
    agree = {name: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                         / jnp.max(jnp.abs(b.astype(jnp.float32))))
             for name, a, b in zip(names, results["walks"], results["correction"], strict=True)}
    print("walks against correction, max |difference| / max |correction|: "
          + ", ".join(f"{name} {error:.1e}" for name, error in agree.items()))
    times = {name: [] for name in steps}
    for r in range(args.rounds):
        for name in (list(steps) if r % 2 == 0 else list(reversed(steps))):
            times[name].append(1e3 * _timing.amortised_seconds(steps[name], x, dt, B, C, dy))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"parts {parts}: direct {med['direct']:.3f} ms; " + "; ".join(
        f"{name} {med[name]:.3f} ms ({med[name] / med['direct']:.3f}x)"
        for name in ("correction", "walks")))
    if args.profile:
        for name in ("direct", "walks"):
            _print_kernel_times(name, steps[name], x, dt, B, C, dy)


def _print_kernel_times(name, step, *args, calls=5):
    """The GPU time of the 10 longest kernels of `step`, by name, per call."""
    from benchmarks import _profile

    events, _ = _profile.kernel_events(
        lambda: [jax.block_until_ready(step(*args)) for _ in range(calls)])
    totals = collections.Counter()
    for kernel, _, duration in events:
        totals[kernel] += duration / calls / 1e6
    print(f"{name}: GPU busy {sum(totals.values()):.3f} ms; " + "; ".join(
        f"{kernel} {ms:.3f}" for kernel, ms in totals.most_common(10)))


if __name__ == "__main__":
    main()
