"""The probe behind the decode-step notes in benchmarks/NOTES.md: where a `HybridLM.generate`
decode step on the 1.1B model spends its time. Times generate(1) (the prefill) and
generate(new) (median of 3 after a compile each), then traces one generate(new) with
jax.profiler and sums the GPU's kernel events: how many kernels a step launches and how long
they run (against the step time: the rest is the GPU idle between kernels), and the kernels
that take the most time. XLA_FLAGS are read at start-up, so compare them one process each:

    for flags in "" "--xla_gpu_enable_command_buffer=" ; do XLA_FLAGS="$flags" \\
        python -m benchmarks.experiments.generate_step_probe --out "$OUT/probe.jsonl"; done

`XLA_FLAGS="--xla_dump_to=$OUT/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=_generate"`
keeps the compiled program, whose decode loop body lists the kernels a step launches.
"""
import argparse
import collections
import json
import os
import re
import statistics
import time

import jax
from flax import nnx

from benchmarks import _profile
from flax_layers import HybridLM, HybridLMConfig


def seconds(model, prompt, new, kv_dtype, ssm_dtype, prefill_tokens):
    def call():
        model.generate(prompt, new, temperature=0.0, rng=jax.random.key(1), kv_dtype=kv_dtype,
                       page_size=16, ssm_dtype=ssm_dtype,
                       prefill_tokens=prefill_tokens).block_until_ready()

    call()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times), call


def family(name):
    """A kernel's name without numeric suffixes, so that fusion.12 and fusion.40 add up."""
    return re.sub(r"[._]\d+", "", name)[:60]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--kv-dtype", default="bfloat16")
    parser.add_argument("--ssm-dtype", default="float32")
    parser.add_argument("--prefill-tokens", type=int, help="generate's prefill group size")
    parser.add_argument("--preset", default="zamba2-1.2b")
    args = parser.parse_args()
    config = HybridLMConfig.preset(args.preset, dtype="bfloat16")
    model = HybridLM(config, rngs=nnx.Rngs(0))
    prompt = jax.random.randint(jax.random.key(0), (args.batch, args.prompt), 0,
                                config.vocab_size)
    run = (args.kv_dtype, args.ssm_dtype, args.prefill_tokens)
    prefill_s, _ = seconds(model, prompt, 1, *run)
    full_s, call = seconds(model, prompt, args.new, *run)
    steps = args.new - 1
    row = dict(flags=os.environ.get("XLA_FLAGS", ""), batch=args.batch, prompt=args.prompt,
               new=args.new, kv_dtype=args.kv_dtype, ssm_dtype=args.ssm_dtype,
               prefill_tokens=args.prefill_tokens, prefill_ms=1e3 * prefill_s,
               full_ms=1e3 * full_s, step_ms=1e3 * (full_s - prefill_s) / steps)
    events, planes = _profile.kernel_events(call)
    if not events:
        row["trace_planes"] = planes
    else:
        # The decode steps follow the prefill: they start at the first decode-attention kernel
        # (the prefill runs flash attention). A window of the step time x steps back from the
        # trace's end took in ~150 ms of prefill at B 64 (its step time is full - prefill).
        starts = [s for name, s, _ in events if name.startswith("attention_with_kv_cache")]
        row["decode_window"] = "from the first decode attention" if starts else "step x steps"
        start = min(starts, default=max(s + d for _, s, d in events)
                    - 1e6 * row["step_ms"] * steps)
        decode = [e for e in events if e[1] >= start]
        busy = sum(d for _, _, d in decode)
        by_family = collections.Counter()
        counts = collections.Counter()
        for name, _, duration in decode:
            by_family[family(name)] += duration
            counts[family(name)] += 1
        row.update(trace_kernels=len(events), decode_kernels_per_step=len(decode) / steps,
                   decode_busy_ms_per_step=busy / 1e6 / steps,
                   top=[(name, round(ns / 1e6 / steps, 4), counts[name] / steps)
                        for name, ns in by_family.most_common(25)])
    print(json.dumps(row, indent=1), flush=True)
    with open(args.out, "a") as log:
        log.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
