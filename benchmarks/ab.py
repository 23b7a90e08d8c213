"""A/B of two versions of the kernels in one process: this checkout's against a base.

The base is another copy of the `pallas_kernels` package (for example `git archive <ref>
pallas_kernels | tar -x -C /tmp/base`); it is imported under the name `pallas_kernels_base`
(its imports rewritten), so both versions run on the same GPU, in the same process, in rounds
that alternate which goes first. Each case is timed amortised (10 calls back to back, one sync;
`_timing.amortised_seconds`) in every round; the table gives medians over rounds and the ratio
new / base with its spread over rounds.

    python -m benchmarks.ab --base /tmp/base --tag NAME
"""

import argparse
import dataclasses
import importlib
import json
import math
import pathlib
import re
import shutil
import statistics
import sys
import tempfile
import warnings

import jax
import jax.numpy as jnp

import pallas_kernels
from benchmarks import _timing, ssd


@dataclasses.dataclass(frozen=True)
class Case:
    """One timed call: `op` "attention" or "ssd", its shape and options, forward or fwd+bwd."""

    name: str
    op: str
    shape: dict
    options: dict
    mode: str  # "fwd" or "fwdbwd"


def _cases():
    attention = [
        ("d128 T8192 causal", dict(batch=2, seq_len=8192, heads=16, head_dim=128),
         dict(is_causal=True)),
        ("d128 T8192 full", dict(batch=2, seq_len=8192, heads=16, head_dim=128), {}),
        ("d64 T2048 causal", dict(batch=8, seq_len=2048, heads=32, head_dim=64),
         dict(is_causal=True)),
        ("d128 T8192 causal kv-lengths", dict(batch=2, seq_len=8192, heads=16, head_dim=128),
         dict(is_causal=True, key_value_seq_lengths=(8000, 7000))),
    ]
    scans = [
        ("T8192 N128 G1 c256", dict(seq_len=8192, state=128, groups=1), dict(chunk_size=256)),
        ("T4096 N128 G1 c256", dict(seq_len=4096, state=128, groups=1), dict(chunk_size=256)),
        ("T4096 N64 G8 c256", dict(seq_len=4096, state=64, groups=8), dict(chunk_size=256)),
        ("T8192 N64 G1 c64", dict(seq_len=8192, state=64, groups=1), dict(chunk_size=64)),
        ("T8192 N64 G1 c256 seq_idx", dict(seq_len=8192, state=64, groups=1),
         dict(chunk_size=256, seq_idx=(1000, 3000, 6500))),
    ]
    return [Case(f"attention {name} {mode}", "attention", shape, options, mode)
            for name, shape, options in attention for mode in ("fwd", "fwdbwd")] + [
        Case(f"ssd {name} {mode}", "ssd", shape, options, mode)
        for name, shape, options in scans for mode in ("fwd", "fwdbwd")]


def import_base(path):
    """The package `pallas_kernels` under `path`, imported as `pallas_kernels_base`."""
    source = pathlib.Path(path) / "pallas_kernels"
    if not source.is_dir():
        raise SystemExit(f"--base: no pallas_kernels package in {path}")
    root = pathlib.Path(tempfile.mkdtemp(prefix="ab_base_"))
    shutil.copytree(source, root / "pallas_kernels_base")
    for file in (root / "pallas_kernels_base").rglob("*.py"):
        file.write_text(re.sub(r"\bpallas_kernels\b", "pallas_kernels_base", file.read_text()))
    sys.path.insert(0, str(root))
    return importlib.import_module("pallas_kernels_base")


def _attention_call(package, case):
    b, t, n, h = (case.shape[k] for k in ("batch", "seq_len", "heads", "head_dim"))
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, dout = (jax.random.normal(key, (b, t, n, h), jnp.bfloat16) for key in keys)
    options = dict(case.options)
    if "key_value_seq_lengths" in options:
        options["key_value_seq_lengths"] = jnp.array(options["key_value_seq_lengths"])

    def attention(q, k, v):
        return package.dot_product_attention(q, k, v, implementation="pallas", **options)

    return _with_mode(attention, (q, k, v), dout, case.mode)


def _ssd_call(package, case):
    t = case.shape["seq_len"]
    shape = ssd.Shape(batch=ssd.TOKENS_PER_BATCH // t, seq_len=t, heads=ssd.HEADS,
                      head_dim=ssd.HEAD_DIM, state=case.shape["state"],
                      groups=case.shape["groups"], chunk=case.options["chunk_size"])
    x, dt, A, B, C, D, dt_bias, dy = ssd.make_inputs(shape, seed=0)
    options = dict(case.options)
    if "seq_idx" in options:  # packed documents starting at these tokens
        starts = jnp.array(options["seq_idx"])
        ids = jnp.sum(jnp.arange(t)[:, None] >= starts[None, :], axis=1).astype(jnp.int32)
        options["seq_idx"] = jnp.broadcast_to(ids, (shape.batch, t))

    def scan(x, dt, A, B, C, D, dt_bias):
        return package.mamba_chunk_scan_combined(
            x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True, implementation="pallas",
            **options)

    return _with_mode(scan, (x, dt, A, B, C, D, dt_bias), dy, case.mode)


def _with_mode(fn, args, cotangent, mode):
    """(jitted step, its arguments): the forward, or forward and backward through jax.vjp."""
    if mode == "fwd":
        return jax.jit(fn), args

    def step(*args_and_cotangent):
        out, vjp = jax.vjp(fn, *args_and_cotangent[:-1])
        return out, *vjp(args_and_cotangent[-1])

    return jax.jit(step), (*args, cotangent)


CALLS = {"attention": _attention_call, "ssd": _ssd_call}


def run(case, packages, rounds):
    """{version: [ms per round]} of one case, versions alternating which goes first."""
    steps = {name: CALLS[case.op](package, case) for name, package in packages.items()}
    for step, args in steps.values():
        jax.block_until_ready(step(*args))  # compile and warm up
    times = {name: [] for name in packages}
    for r in range(rounds):
        for name in (list(steps) if r % 2 == 0 else list(reversed(steps))):
            step, args = steps[name]
            times[name].append(1e3 * _timing.amortised_seconds(step, *args))
    return times


def summary(times):
    """Per case: medians, the ratio of medians and the spread of per-round ratios."""
    rows = {}
    for name, versions in times.items():
        ratios = [n / b for n, b in zip(versions["new"], versions["base"], strict=True)]
        rows[name] = dict(
            base_ms=statistics.median(versions["base"]),
            new_ms=statistics.median(versions["new"]),
            ratio=statistics.median(versions["new"]) / statistics.median(versions["base"]),
            ratio_min=min(ratios), ratio_max=max(ratios),
        )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ab",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="a directory holding pallas_kernels/")
    parser.add_argument("--only", help="run only cases whose name contains this text")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--tag", required=True, help="file name: ab_{tag}.json")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    packages = {"base": import_base(args.base), "new": pallas_kernels}
    cases = [c for c in _cases() if not args.only or args.only in c.name]
    path = pathlib.Path(args.out_dir) / f"ab_{args.tag}.json"
    times = {}
    for case in cases:  # the file is rewritten after each case: a cut-short run keeps its part
        times[case.name] = run(case, packages, args.rounds)
        rows = summary(times)
        row = rows[case.name]
        print(f"{case.name:44s} base {row['base_ms']:8.3f} ms  new {row['new_ms']:8.3f} ms  "
              f"new/base {row['ratio']:6.3f}", flush=True)
        path.write_text(json.dumps(dict(
            environment=_timing.environment_info("benchmarks.ab"), rounds=args.rounds,
            cases={c.name: dataclasses.asdict(c) for c in cases if c.name in times},
            times_ms=times, summary=rows), indent=1))
    print(f"\nwrote {path}\n\n| case | base ms | new ms | new / base (spread over rounds) |")
    print("|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['base_ms']:.3f} | {row['new_ms']:.3f} | {row['ratio']:.3f} "
              f"({row['ratio_min']:.3f}-{row['ratio_max']:.3f}) |")
    worst = max(rows.values(), key=lambda r: r["ratio"])
    print(f"\nworst ratio {worst['ratio']:.3f}; geometric mean "
          f"{math.exp(statistics.mean(math.log(r['ratio']) for r in rows.values())):.3f}")


if __name__ == "__main__":
    main()
