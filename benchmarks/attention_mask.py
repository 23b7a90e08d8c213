"""What a mask or a bias costs `dot_product_attention`: forward + backward at d128 T8192.

Each case runs the same call (bf16, B 2, 16 heads of 128, T = S = 8192) with and without a
user's mask or bias, in one process, in `--rounds` rounds whose order alternates; each round
times every case amortised (`_timing.amortised_seconds`: 10 calls, one sync), and the table
gives medians and the ratio to the case's baseline. Issue 29's lines: a mask or bias costs at
most 1.15x the call without it; a mask equal to the causal one runs within 1.05x of
`is_causal=True` (the block table skips the same blocks). "causal at the pair tiles" runs
`is_causal=True` at the tiles a call with a mask or bias gets (`tuning.AttentionBlocks.fit`),
which parts the tile's cost from the pairs' own.

    python -m benchmarks.attention_mask --out-dir benchmarks/results --tag h200
"""

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from benchmarks import _timing
from pallas_kernels.attention import tuning

BATCH, HEADS, HEAD_DIM, LENGTH = 2, 16, 128, 8192


def cases(length):
    """name -> (baseline name or None, keywords of the call, differentiate the bias). The
    causal-equal mask is a constant of the step (a program's fixed mask); the random per-row
    mask, like the bias, is an argument of the jitted step (a batch's mask), not a 2 GB
    constant folded into the executable."""
    rng = np.random.default_rng(0)
    causal = np.tril(np.ones((length, length), bool))[None, None]
    keep = rng.random((BATCH, HEADS, length, length), dtype=np.float32) < 0.9
    bias = jnp.asarray(rng.standard_normal((1, HEADS, length, length), np.float32),
                       jnp.bfloat16)
    pair_tiles = tuning.blocks_for(jax.devices()[0].device_kind, HEAD_DIM).fit(
        length, length, has_pairs=True)
    return {
        "full": (None, {}, False),
        "causal": (None, dict(is_causal=True), False),
        "causal at the pair tiles": ("causal", dict(is_causal=True, block_sizes=pair_tiles),
                                     False),
        "mask = causal (1,1,T,S)": ("causal", dict(mask=jnp.asarray(causal)), False),
        "mask 90% random (B,N,T,S)": ("full", dict(mask=jnp.asarray(keep)), False),
        "bias (1,N,T,S) bf16": ("full", dict(bias=bias), False),
        "bias (1,N,T,S) bf16 + dbias": ("full", dict(bias=bias), True),
        "causal + bias (1,N,T,S)": ("causal", dict(is_causal=True, bias=bias), False),
    }


def step(keywords, with_bias_gradient):
    """A jitted forward + backward of a sum of the output, for q, k, v (and the bias). The bias
    and a (B, N, T, S) mask are arguments of the jitted step; other keywords are constants."""
    bias = keywords.get("bias")
    mask = keywords.get("mask")
    traced_mask = mask is not None and mask.shape[0] > 1
    others = {k: v for k, v in keywords.items()
              if k != "bias" and not (k == "mask" and traced_mask)}

    def loss(q, k, v, bias, mask):
        extra = {"mask": mask} if traced_mask else {}
        out = pallas_kernels.dot_product_attention(q, k, v, bias, **others, **extra)
        return jnp.sum(out.astype(jnp.float32))

    argnums = (0, 1, 2, 3) if with_bias_gradient else (0, 1, 2)
    grad = jax.jit(jax.grad(loss, argnums=argnums))
    return lambda q, k, v: grad(q, k, v, bias, mask if traced_mask else None)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention_mask",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=LENGTH)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--tag", required=True)
    parser.add_argument("--causal-only", action="store_true",
                        help="only causal and the cases measured against it")
    args = parser.parse_args(argv)
    key = jax.random.key(0)
    shape = (BATCH, args.length, HEADS, HEAD_DIM)
    q, k, v = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in jax.random.split(key, 3))
    table = cases(args.length)
    if args.causal_only:
        table = {name: case for name, case in table.items()
                 if name == "causal" or case[0] == "causal"}
    steps = {name: step(kw, dbias) for name, (_, kw, dbias) in table.items()}
    samples = {name: [] for name in table}
    for r in range(args.rounds):
        names = list(table) if r % 2 == 0 else list(reversed(table))
        for name in names:
            samples[name].append(_timing.amortised_seconds(steps[name], q, k, v) * 1e3)
            print(f"round {r} {name}: {samples[name][-1]:.3f} ms", flush=True)
    medians = {name: statistics.median(s) for name, s in samples.items()}
    rows, records = [], []
    for name, (baseline, _, _) in table.items():
        ratio = None if baseline is None else medians[name] / medians[baseline]
        records.append(dict(case=name, baseline=baseline, ms=medians[name], ms_rounds=samples[name],
                            ratio=ratio))
        rows.append([name, f"{medians[name]:.3f}", baseline or "-",
                     "-" if ratio is None else f"{ratio:.3f}"])
    stem = f"{args.out_dir}/attention_mask_{args.tag}"
    _timing.write_json(stem + ".json", dict(
        environment=_timing.environment_info("benchmarks.attention_mask"),
        shape=dict(batch=BATCH, heads=HEADS, head_dim=HEAD_DIM, length=args.length,
                   dtype="bfloat16"), records=records))
    ratios = [r for r in records if r["ratio"] is not None]
    _timing.save_grouped_bar_plot(
        stem + ".png", [r["case"] for r in ratios],
        [("forward + backward, ms / baseline's ms", {"ratio": [r["ratio"] for r in ratios]})],
        ylabel="x baseline", title=f"mask and bias cost, d{HEAD_DIM} T{args.length} bf16")
    print(_timing.format_table(["case", "ms", "baseline", "ratio"], rows))


if __name__ == "__main__":
    main()
