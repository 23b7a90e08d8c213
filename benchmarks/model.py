"""The language models' train step where users run it: `examples/train_hybrid_lm.py`'s step
(AdamW after global-norm clipping, bf16 compute, next-token loss), timed at issue 28's shapes
for HybridLM and at Zamba2-1.2B's real architecture (`Zamba2LM`, random weights).

For each run and implementation: compile time, step time (median of `--steps` steps after two
warm-up steps, each synced), tokens/s, MFU (the example's `model_flops_per_token` over the
device's peak, `_device.peak_flops`) and the compiled step's peak memory (XLA's buffer
assignment, so that runs in one process do not read each other's peaks). `--profile` traces
one more step and sums its GPU kernels by class (attention, SSD, norm and conv kernels,
matmuls, reductions, layout copies, other fusions): the share of the step each class takes,
and lists the 40 longest kernels with their launches and, for XLA's fusions, what they fuse
(`_profile.fusion_contents`).

    python -m benchmarks.model --out-dir "$OUT" --tag h200 [--profile] [--impls pallas,xla]

Runs (RUNS): HybridLM's zamba2-like 1.1B model at B 4 x T 4096 and B 1 x T 16384, its small
preset at B 32 x T 512, and Zamba2LM's zamba2-1.2b at B 4 x T 4096 (`--models` picks). "xla"
runs the pure-jnp references (quadratic attention; at the 1.1B shape issue 28 measured it
asking for 196 GiB): an out-of-memory is recorded as the run's error. "xla-cudnn" is the best
pure-XLA alternative that fits: jax.nn's cuDNN attention, the jnp SSD, every block
rematerialised in the backward.

CPU smoke test (tiny models, interpret mode):

    JAX_PLATFORMS=cpu python -m benchmarks.model --quick --tag smoke --out-dir /tmp/model
"""

import argparse
import collections
import re
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks import _profile, _timing
from flax_layers import HybridLM, HybridLMConfig, Zamba2Config, Zamba2LM
from pallas_kernels import _device

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train_hybrid_lm as trainer  # noqa: E402  (the example's step, as users run it)

# (model, preset, batch rows, tokens per row)
RUNS = [("hybrid", "zamba2-1.2b", 4, 4096), ("hybrid", "zamba2-1.2b", 1, 16384),
        ("hybrid", "small", 32, 512), ("zamba2", "zamba2-1.2b", 4, 4096)]
QUICK_RUNS = [("hybrid", "tiny", 2, 64), ("zamba2", "tiny", 2, 64)]
MODELS = ("hybrid", "zamba2")
IMPLS = ("pallas", "xla", "xla-cudnn")
# Zamba2LM's "tiny": two Mamba2 layers, the second hybrid, for the CPU smoke test.
ZAMBA2_TINY = dict(vocab_size=256, d_model=32, num_layers=2, hybrid_layers=(1,), d_state=16,
                   mamba_heads=4, chunk_size=16, num_heads=2, num_kv_heads=2, mlp_hidden=64,
                   attention_adapters=True, adapter_rank=4, rope_theta=10000.0)
# Kernel name patterns, first match wins: what each GPU kernel of a step counts as.
KERNEL_CLASSES = [
    ("attention kernels", r"flash_attention"),
    ("SSD kernels", r"^ssd_"),
    ("norm kernels", r"^rms_norm_gated"),
    ("conv kernels", r"^causal_conv1d"),
    ("matmuls", r"gemm|cublas|cutlass|xmma|nvjet|matmul|dot"),
    ("reductions (norms, softmax, loss)", r"reduce"),
    ("layout copies", r"copy|transpose"),
    ("other fusions", r""),
]


def kernel_class(name):
    return next(label for label, pattern in KERNEL_CLASSES if re.search(pattern, name))


def zamba2_flops_per_token(config, params, seq_len):
    """`trainer.model_flops_per_token` for a Zamba2LM: 6 x the parameters each token multiplies
    with (a shared block's weights once per use, its adapters and the hybrid layers' linears
    once), plus causal attention and the SSD scan, counted as that function counts them."""
    uses = len(config.hybrid_layers)
    shared = 0
    for b, block in enumerate(params["shared"].values()):
        block_uses = len(range(b, uses, config.num_mem_blocks))
        core = trainer.count_params(block) - trainer.count_params(block["adapters"])
        shared += (block_uses - 1) * core
    matmul_params = trainer.count_params(params) + shared
    attention = 6 * uses * seq_len * config.num_heads * config.head_dim
    q, n, p = min(config.chunk_size, seq_len), config.d_state, config.mamba_headdim
    heads = config.mamba_heads
    ssd = 3 * config.num_layers * (config.ngroups * q * n + heads * (q * p + 4 * n * p))
    return float(6 * matmul_params + attention + ssd)


def build(model, preset, implementation):
    """(config, graphdef, params, FLOPs per token at T) of a run's model, bf16 compute.
    "xla-cudnn" (HybridLM only): the best pure-XLA alternative, jax.nn's cuDNN attention and
    the jnp SSD, every block recomputed in the backward (`remat`) so that it fits."""
    options = dict(dtype=jnp.bfloat16, implementation=implementation)
    if implementation == "xla-cudnn":
        if model != "hybrid":
            raise ValueError("xla-cudnn is built for HybridLM only")
        options = dict(dtype=jnp.bfloat16, implementation="xla",
                       attention_implementation="cudnn", remat=True)
    if model == "zamba2":
        config = (Zamba2Config(**ZAMBA2_TINY, **options) if preset == "tiny"
                  else Zamba2Config.preset(preset, **options))
        graphdef, params = nnx.split(Zamba2LM(config, rngs=nnx.Rngs(0)))
        return config, graphdef, params, lambda t: zamba2_flops_per_token(config, params, t)
    config = HybridLMConfig.preset(preset, **options)
    graphdef, params = nnx.split(HybridLM(config, rngs=nnx.Rngs(0)))
    return config, graphdef, params, lambda t: trainer.model_flops_per_token(config, params, t)


def measure(run, implementation, opts):
    """One run's record: compile_s, step_ms (median), tokens_per_s, mfu, peak_bytes (the
    compiled step's) and, with `opts.profile`, the step's GPU time by kernel class."""
    model, preset, batch, seq_len = run
    config, graphdef, params, flops = build(model, preset, implementation)
    tx, _ = trainer.make_optimizer(3e-4, 10, 1000, 0.1, 1.0)
    opt_state = jax.jit(tx.init)(params)
    train_step, _ = trainer.make_steps(graphdef, tx)
    data = jax.random.randint(jax.random.key(1), (batch, seq_len + 1), 0, config.vocab_size)
    flops_per_token = flops(seq_len)
    record_params = trainer.count_params(params)
    start = time.perf_counter()
    step = train_step.lower(params, opt_state, data).compile()
    compile_s = time.perf_counter() - start

    def one_step():
        nonlocal params, opt_state
        params, opt_state, loss = step(params, opt_state, data)
        return loss.block_until_ready()

    for _ in range(2):
        one_step()
    times = []
    for _ in range(opts.steps):
        start = time.perf_counter()
        one_step()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    peak = _device.peak_flops(jax.devices()[0].device_kind)
    tokens_per_s = batch * seq_len / seconds
    record = dict(
        compile_s=compile_s, step_ms=1e3 * seconds, step_ms_min=1e3 * min(times),
        step_ms_max=1e3 * max(times), tokens_per_s=tokens_per_s,
        flops_per_token=flops_per_token, params=record_params,
        mfu=None if peak is None else tokens_per_s * flops_per_token / peak,
        peak_bytes=step.memory_analysis().peak_memory_in_bytes)
    if opts.profile:
        events, planes = _profile.kernel_events(one_step)
        if not events:
            record["trace_planes"] = planes
        busy, by_name, launches = (collections.Counter() for _ in range(3))
        for name, _, duration in events:
            busy[kernel_class(name)] += duration
            by_name[name] += duration
            launches[name] += 1
        total = sum(busy.values())
        fuses = _profile.fusion_contents(step.as_text())
        record["kernels"] = len(events)
        record["kernel_ms"] = total / 1e6
        record["top_kernels"] = [
            dict(name=name[:120], ms=ns / 1e6, launches=launches[name], kind=kernel_class(name),
                 **({"fuses": fuses[name]} if name in fuses else {}))
            for name, ns in by_name.most_common(40)]
        record["classes"] = {label: dict(ms=ns / 1e6, share=ns / total)
                             for label, ns in busy.most_common()} if total else {}
    return record


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.model",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--impls", type=lambda s: s.split(","), default=["pallas"],
                        help=f"of {','.join(IMPLS)} (default: pallas)")
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS),
                        help=f"of {','.join(MODELS)} (default: both)")
    parser.add_argument("--only", default="",
                        help="run only the runs whose label holds this text (e.g. B4)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--profile", action="store_true",
                        help="trace one more step and sum its kernels by class")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: {QUICK_RUNS} (preset, batch, tokens), 2 steps")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--tag", required=True)
    opts = parser.parse_args(argv)
    for flag, given, known in (("--impls", opts.impls, IMPLS),
                               ("--models", opts.models, MODELS)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            parser.error(f"unknown {flag}: {','.join(unknown)}")
    if opts.quick:
        opts.steps = min(opts.steps, 2)
    records = []
    for run in QUICK_RUNS if opts.quick else RUNS:
        if run[0] not in opts.models:
            continue
        for implementation in opts.impls:
            name = "Zamba2LM" if run[0] == "zamba2" else "HybridLM"
            label = f"{name} {run[1]} B{run[2]} T{run[3]} {implementation}"
            if opts.only not in label:
                continue
            record = dict(label=label, model=run[0], preset=run[1], batch=run[2],
                          seq_len=run[3], implementation=implementation)
            try:
                record.update(measure(run, implementation, opts), status="ok")
            except Exception as error:  # noqa: BLE001 - an OOM or a failure is a result too
                record.update(status="error", error=f"{type(error).__name__}: {error}"[:500])
            records.append(record)
            print(label + ": " + (
                f"{record['step_ms']:.1f} ms, {record['tokens_per_s']:,.0f} tokens/s, MFU "
                + ("n/a" if record["mfu"] is None else f"{100 * record['mfu']:.1f}%")
                + f", compile {record['compile_s']:.0f} s"
                if record["status"] == "ok" else record["error"]), flush=True)
    stem = f"{opts.out_dir}/model_{opts.tag}"
    Path(opts.out_dir).mkdir(parents=True, exist_ok=True)
    _timing.write_json(stem + ".json", dict(
        environment=_timing.environment_info("benchmarks.model"), records=records))
    rows = [[r["label"], f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:,.0f}",
             "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%", f"{r['compile_s']:.0f}",
             f"{r['peak_bytes'] / 2**30:.1f}"]
            if r["status"] == "ok" else [r["label"], "error", "", "", "", ""] for r in records]
    print(_timing.format_table(["run", "step ms", "tokens/s", "MFU", "compile s", "peak GiB"],
                               rows))
    profiled = [r for r in records if r.get("classes")]
    if profiled:
        labels = [label for label, _ in KERNEL_CLASSES]
        _timing.save_grouped_bar_plot(
            stem + ".png", [r["label"] for r in profiled],
            [("share of the step's kernel time",
              {label: [r["classes"].get(label, {}).get("share", 0.0) for r in profiled]
               for label in labels})],
            ylabel="share", title="Train step: GPU kernel time by class")
        for r in profiled:
            print(r["label"], {k: f"{100 * v['share']:.1f}%" for k, v in r["classes"].items()})


if __name__ == "__main__":
    main()
