"""Checks the attention kernels at real sizes on a GPU and sweeps their block sizes.

    python -m benchmarks.attention_tune --check --head-dims 64,128 --seq-lens 8192 \
        --out benchmarks/results/attention_tune_h200_d128.json

GQA: `--groups 8`; a dK/dV candidate's fifth entry is its `head_splits`, e.g.
`--candidates '{"dkv": [[64, 64, 4, 2, 1], [64, 64, 4, 2, 2], [64, 64, 4, 2, 4]]}'`.

`--check` compares the kernels (bf16) with the float32 reference and with a bf16 reference at
sizes where the reference fits. The sweep times each kernel alone (forward, dK/dV, dQ) for each
candidate tile of `CANDIDATES`, with inputs of the FlashAttention-3 sweep (16k tokens, hidden
2048), and prints the best tile per kernel. Times are medians of back-to-back calls, synced once
per batch of calls.
"""

import argparse
import dataclasses
import functools
import itertools
import json
import sys

import jax
import jax.numpy as jnp

import pallas_kernels
from benchmarks import _timing
from pallas_kernels import _compat
from pallas_kernels.attention import api, backward, common, forward, reference, tuning

CANDIDATES = {
    "forward": [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 128, 8, 3),
                (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 4, 2), (128, 64, 8, 4)],
    "dkv": [(64, 128, 8, 2), (32, 128, 4, 2), (64, 64, 4, 2), (128, 128, 8, 2), (64, 128, 8, 3),
            (32, 64, 4, 3), (64, 128, 4, 2), (32, 128, 8, 2), (128, 64, 8, 2)],
    "dq": [(128, 64, 8, 2), (64, 64, 4, 2), (128, 128, 8, 2), (64, 128, 8, 2), (128, 32, 8, 3),
           (128, 64, 8, 3), (128, 64, 4, 2), (64, 64, 4, 3)],
}
# Matmuls per (query, key) pair relative to the forward's two.
MATMUL_SHARE = {"forward": 1.0, "dkv": 2.0, "dq": 1.5}


def attention_flops(batch, heads, t, head_dim, causal):
    return 4 * batch * heads * t * t * head_dim / (2 if causal else 1)


def rel_error(x, ref):
    x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


def check(out_rows):
    """Kernels vs the float32 reference at real sizes; the bf16 reference's error alongside."""
    cases = [
        dict(b=2, t=1024, s=1024, n=16, k=16, h=128, kw=dict(is_causal=True)),
        dict(b=2, t=1024, s=1024, n=16, k=4, h=128, kw={}),
        dict(b=1, t=777, s=1025, n=8, k=1, h=80, kw=dict(local_window_size=(200, 50))),
        dict(b=2, t=2048, s=2048, n=8, k=2, h=64, kw=dict(is_causal=True, logits_soft_cap=20.0)),
        dict(b=2, t=1000, s=1000, n=4, k=4, h=256, kw=dict(is_causal=True)),
        dict(b=2, t=1536, s=1536, n=8, k=8, h=96, kw=dict(segments=True)),
        dict(b=2, t=512, s=700, n=8, k=8, h=192, kw=dict(lengths=True)),
    ]
    for i, case in enumerate(cases):
        keys = jax.random.split(jax.random.key(i), 4)
        b, t, s, n, k, h = (case[x] for x in "btsnkh")
        q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
        kk = jax.random.normal(keys[1], (b, s, k, h), jnp.bfloat16)
        v = jax.random.normal(keys[2], (b, s, k, h), jnp.bfloat16)
        dout = jax.random.normal(keys[3], (b, t, n, h), jnp.bfloat16)
        kw = dict(case["kw"])
        if kw.pop("segments", False):
            kw["q_segment_ids"] = jnp.broadcast_to(jnp.arange(t) // 300, (b, t)).astype(jnp.int32)
            kw["kv_segment_ids"] = jnp.broadcast_to(jnp.arange(s) // 300, (b, s)).astype(jnp.int32)
        if kw.pop("lengths", False):
            kw["query_seq_lengths"] = jnp.array([t, t // 3], jnp.int32)
            kw["key_value_seq_lengths"] = jnp.array([s // 2, s], jnp.int32)

        def run(fn, q, kk, v, kw=kw, dout=dout):
            out, vjp = jax.vjp(lambda q, kk, v: fn(q, kk, v, **kw), q, kk, v)
            return (out, *vjp(dout.astype(out.dtype)))

        ours_fn = functools.partial(pallas_kernels.dot_product_attention, implementation="pallas")
        low_fn = functools.partial(reference.dot_product_attention, upcast=False)
        ours = jax.jit(functools.partial(run, ours_fn))(q, kk, v)
        low = jax.jit(functools.partial(run, low_fn))(q, kk, v)
        exact = jax.jit(functools.partial(run, reference.dot_product_attention))(
            q.astype(jnp.float32), kk.astype(jnp.float32), v.astype(jnp.float32))
        names = ("out", "dq", "dk", "dv")
        row = dict(case=i, shape=(b, t, s, n, k, h), kw=sorted(case["kw"]))
        for name, x, ref, lo in zip(names, ours, exact, low, strict=True):
            row[name] = (rel_error(x, ref), rel_error(lo, ref), bool(jnp.all(jnp.isfinite(x))))
        out_rows.append(row)
        print("check", row, flush=True)


INTERPRET = False  # --interpret: a CPU smoke test of this script


def make_inputs(b, t, n, k, h, causal):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
    kk = jax.random.normal(keys[1], (b, t, k, h), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, k, h), jnp.bfloat16)
    do = jax.random.normal(keys[3], (b, t, n, h), jnp.bfloat16)
    static = common.Static(
        scale=h**-0.5, band=(None, 0) if causal else (None, None), logits_soft_cap=None,
        groups=n // k, has_segments=False, may_mask=causal, interpret=INTERPRET,
    )
    return q, kk, v, do, static


def sweep_kernel(kernel, b, t, n, k, h, causal, rows):
    q, kk, v, do, static = make_inputs(b, t, n, k, h, causal)
    flops = attention_flops(b, n, t, h, causal) * MATMUL_SHARE[kernel]
    for cand in CANDIDATES[kernel]:
        blocks = tuning.KernelBlocks(*cand)
        sizes = tuning.AttentionBlocks(blocks, blocks, blocks)
        config = api._Config(static, sizes, (b, t, t), (t, t, h))
        try:
            table = api._tables(config, t, t, None, None, None, None, None, None, kernel)
            if kernel == "forward":
                fn = jax.jit(lambda q, kk, v, table=table, blocks=blocks: forward.forward(
                    q, kk, v, None, None, table, static=static, blocks=blocks))
                args = (q, kk, v)
            else:
                out, lse = pallas_kernels.dot_product_attention(
                    q, kk, v, is_causal=causal, implementation="pallas", return_residual=True,
                    interpret=static.interpret)
                lse = jnp.swapaxes(lse, 1, 2)
                delta = jnp.swapaxes(jnp.sum(do.astype(jnp.float32) * out, -1), 1, 2)
                kernel_fn = getattr(backward, kernel)
                fn = jax.jit(lambda q, kk, v, do, lse, delta, table=table, blocks=blocks,
                             kernel_fn=kernel_fn: kernel_fn(
                    q, kk, v, do, lse, delta, None, None, table, static=static, blocks=blocks))
                args = (q, kk, v, do, lse, delta)
            seconds = _timing.amortised_seconds(fn, *args)
            row = dict(kernel=kernel, shape=(b, t, n, k, h), causal=causal, blocks=cand,
                       ms=seconds * 1e3, tflops=flops / seconds / 1e12)
        except Exception as e:  # a tile that does not compile or fit is a result too
            row = dict(kernel=kernel, shape=(b, t, n, k, h), causal=causal, blocks=cand,
                       error=f"{type(e).__name__}: {str(e)[:200]}")
        rows.append(row)
        print("sweep", row, flush=True)


def end_to_end(b, t, n, k, h, causal, rows, block_sizes=None):
    """Forward and forward+backward through the public API, and jax.nn's cuDNN for scale."""
    q, kk, v, do, _ = make_inputs(b, t, n, k, h, causal)
    impls = {
        "ours": lambda q, kk, v: pallas_kernels.dot_product_attention(
            q, kk, v, is_causal=causal, implementation="pallas", block_sizes=block_sizes,
            interpret=INTERPRET),
        "cudnn": lambda q, kk, v: jax.nn.dot_product_attention(
            q, kk, v, is_causal=causal, implementation="cudnn"),
    }
    flops = attention_flops(b, n, t, h, causal)
    for name, fn in impls.items():
        try:
            fwd = jax.jit(fn)
            fwdbwd = jax.jit(lambda q, kk, v, fn=fn: jax.vjp(fn, q, kk, v)[1](do))
            t_f = _timing.amortised_seconds(fwd, q, kk, v)
            t_fb = _timing.amortised_seconds(fwdbwd, q, kk, v)
            row = dict(impl=name, shape=(b, t, n, k, h), causal=causal, fwd_ms=t_f * 1e3,
                       fwdbwd_ms=t_fb * 1e3, fwd_tflops=flops / t_f / 1e12,
                       fwdbwd_tflops=3.5 * flops / t_fb / 1e12)
        except Exception as e:
            row = dict(impl=name, shape=(b, t, n, k, h), causal=causal,
                       error=f"{type(e).__name__}: {str(e)[:200]}")
        rows.append(row)
        print("e2e", row, flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--head-dims", default="128")
    parser.add_argument("--seq-lens", default="8192")
    parser.add_argument("--causal", choices=("both", "causal", "full"), default="both")
    parser.add_argument("--kernels", default="forward,dkv,dq")
    parser.add_argument("--tokens", type=int, default=16384, help="batch = tokens // seq len")
    parser.add_argument("--groups", type=int, default=1,
                        help="query heads per key/value head (GQA; 1: MHA)")
    parser.add_argument("--interpret", action="store_true")
    parser.add_argument("--candidates", help='JSON {"forward": [[bq, bk, warps, stages], ...], ...}'
                        " replacing CANDIDATES for the kernels it names")
    parser.add_argument("--out", default="benchmarks/results/attention_tune.json")
    args = parser.parse_args(argv)
    global INTERPRET
    INTERPRET = args.interpret
    if args.candidates:
        given = json.loads(args.candidates)
        CANDIDATES.update({kernel: [tuple(c) for c in tiles] for kernel, tiles in given.items()})
    _compat.silence_triton_deprecation()
    result = dict(command=" ".join(sys.argv), device=jax.devices()[0].device_kind,
                  jax=jax.__version__, check=[], sweep=[], e2e=[])
    if args.check:
        check(result["check"])
    causal_modes = {"both": (False, True), "causal": (True,), "full": (False,)}[args.causal]
    shapes = itertools.product(
        map(int, args.head_dims.split(",")), map(int, args.seq_lens.split(",")), causal_modes)
    for h, t, causal in shapes:
        b, n = max(1, args.tokens // t), 2048 // h
        k = n // args.groups
        for kernel in filter(None, args.kernels.split(",")):
            sweep_kernel(kernel, b, t, n, k, h, causal, result["sweep"])
        best = {}
        for kernel in ("forward", "dkv", "dq"):
            timed = [r for r in result["sweep"] if r["kernel"] == kernel and "ms" in r
                     and r["shape"] == (b, t, n, k, h) and r["causal"] == causal]
            if timed:
                best[kernel] = tuning.KernelBlocks(*min(timed, key=lambda r: r["ms"])["blocks"])
        default = tuning.blocks_for(jax.devices()[0].device_kind, h, groups=n // k,
                                    causal=causal)
        tuned = dataclasses.replace(default, **best)
        end_to_end(b, t, n, k, h, causal, result["e2e"], block_sizes=tuned)
        result["e2e"][-2]["blocks"] = dataclasses.asdict(tuned)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("\n== best tiles ==")
    for row in sorted((r for r in result["sweep"] if "ms" in r),
                      key=lambda r: (r["kernel"], r["shape"], r["causal"], r["ms"])):
        print(f"{row['kernel']:8s} {row['shape']} causal={row['causal']!s:5s} "
              f"{row['blocks']} {row['ms']:.3f} ms {row['tflops']:.0f} TF/s")
    print("== end to end (fwd / fwd+bwd TFLOP/s) ==")
    for row in result["e2e"]:
        if "error" in row:
            print(row["impl"], row["shape"], row["causal"], row["error"])
        else:
            print(f"{row['impl']:6s} {row['shape']} causal={row['causal']!s:5s} "
                  f"{row['fwd_tflops']:.0f} / {row['fwdbwd_tflops']:.0f}")
    for row in result["check"]:
        print("check", row["case"], row["shape"], row["kw"],
              {k: tuple(round(x, 5) if isinstance(x, float) else x for x in row[k])
               for k in ("out", "dq", "dk", "dv")})


if __name__ == "__main__":
    main()
