"""What SSD context parallelism adds to one device's compute, timed on one GPU by standing in
for the collectives (all_gather copies the local shard n times; the device is the last along
the axis, so the entering state is live), for both ways of `pallas_kernels.mamba2.context`:
the entering state's correction in XLA (`state_passing` over the kernels: cumulative decays,
C . h, the merge into y) and the kernels' way (`kernel_state_passing`, what a mesh runs: one
extra walk each way: the final state alone before the forward, the gradient of the entering
state from dy alone before the backward).

    python -m benchmarks.experiments.ssd_state_passing_cost [--parts 2] [--rounds 5] [--profile]
        [--json benchmarks/results/NAME.json]
    python -m benchmarks.experiments.ssd_state_passing_cost --plot benchmarks/results/NAME.json

Prints the direct call and both paths, forward+backward, amortised ms, at T 4096 N 128 G 1
chunk 256 (b 4, 80 heads of 64), bf16; `--json` adds the run as a record to a results file,
`--plot` draws a file's records (each path against the direct call) as NAME.png.
"""

import argparse
import collections
import json
import os
import pathlib
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
    parser.add_argument("--json", help="a results file to add this run's record to")
    parser.add_argument("--plot", help="draw this results file's records (no run)")
    args = parser.parse_args()
    if args.plot:
        plot(args.plot)
        return
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
    kernels = ({name: _print_kernel_times(name, steps[name], x, dt, B, C, dy)
                for name in ("direct", "walks")} if args.profile else None)
    if args.json:
        payload = (json.loads(pathlib.Path(args.json).read_text()) if os.path.exists(args.json) else
                   dict(environment=_timing.environment_info(
                       "benchmarks.experiments.ssd_state_passing_cost"), records=[]))
        payload["records"].append(dict(
            parts=parts, batch=b, seq_len=t, heads=h, rounds=args.rounds,
            direct_ms=med["direct"], correction_ms=med["correction"], walks_ms=med["walks"],
            agreement=agree, kernels_ms=kernels))
        _timing.write_json(args.json, payload)


def plot(path):
    """path's records as bars, each path's time against the direct call's, beside NAME.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = json.loads(pathlib.Path(path).read_text())["records"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.38
    for i, (name, color) in enumerate((("correction", "tab:gray"), ("walks", "tab:blue"))):
        ratios = [r[f"{name}_ms"] / r["direct_ms"] for r in records]
        bars = ax.bar([k + (i - 0.5) * width for k in range(len(records))], ratios, width,
                      color=color, label="XLA correction" if name == "correction"
                      else "kernels' state passing")
        ax.bar_label(bars, fmt="%.3fx", fontsize=8)
    ax.axhline(1.0, color="k", lw=1, ls="--", label="direct call")
    ax.set_xticks(range(len(records)), [f"b {r['batch']} x T {r['seq_len']}\n{r['parts']} parts"
                                        for r in records])
    ax.set_ylabel("time / direct call (fwd+bwd)")
    ax.set_title("SSD state passing on one device (collectives stood in)", fontsize=10)
    ax.set_ylim(0, 1.25 * max(r["correction_ms"] / r["direct_ms"] for r in records))
    ax.legend(fontsize=8, ncol=3, loc="upper center")
    fig.tight_layout()
    fig.savefig(os.path.splitext(path)[0] + ".png", dpi=120)
    plt.close(fig)


def _print_kernel_times(name, step, *args, calls=5):
    """The GPU time of the 10 longest kernels of `step`, by name, per call (printed, and
    returned as {kernel: ms})."""
    from benchmarks import _profile

    events, _ = _profile.kernel_events(
        lambda: [jax.block_until_ready(step(*args)) for _ in range(calls)])
    totals = collections.Counter()
    for kernel, _, duration in events:
        totals[kernel] += duration / calls / 1e6
    top = dict(totals.most_common(10))
    print(f"{name}: GPU busy {sum(totals.values()):.3f} ms; " + "; ".join(
        f"{kernel} {ms:.3f}" for kernel, ms in top.items()))
    return top


if __name__ == "__main__":
    main()
