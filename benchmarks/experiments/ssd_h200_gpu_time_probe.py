"""The probe behind results/ssd_h200_gpu_time_probe.jsonl (benchmarks/NOTES.md), kept as
it ran: mamba_ssm's SSD at one shape, eager amortised ms, host ms per call and CUDA-graph replay
ms (the device time of its kernels without Python's launch costs), with ours amortised beside it.
On the GPU machine, from the repository root, one process per shape:

    source benchmarks/peers_setup.sh
    for s in 8192:64:1 4096:64:1 8192:128:1 4096:128:1 8192:64:8 4096:64:8 8192:128:8 \
        4096:128:8; do python benchmarks/experiments/ssd_h200_gpu_time_probe.py $s; done

(PYTHONPATH=$PWD; rows are appended to $OUT/rows.jsonl). `python -m benchmarks.ssd --metric
device` measures the same (`_timing._torch_graph_seconds`) and supersedes it.
"""
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

import pallas_kernels
from benchmarks import _timing, ssd

T, N, G = map(int, sys.argv[1].split(":"))
shape = ssd.Shape(batch=16384 // T, seq_len=T, heads=80, head_dim=64, state=N, groups=G, chunk=256)
inputs = ssd.make_inputs(shape, seed=0)
row = {"shape": f"T{T} N{N} G{G}"}


def call(x, dt, A, B, C, D, dt_bias):
    return pallas_kernels.mamba_chunk_scan_combined(
        x, dt, A, B, C, 256, D=D, dt_bias=dt_bias, dt_softplus=True, implementation="pallas")


def both(x, dt, A, B, C, D, dt_bias, dy):
    y, vjp = jax.vjp(call, x, dt, A, B, C, D, dt_bias)
    return y, vjp(dy)


row["ours_fwd"] = 1e3 * _timing.amortised_seconds(jax.jit(call), *inputs[:-1], calls=30, repeats=7)
row["ours_fb"] = 1e3 * _timing.amortised_seconds(jax.jit(both), *inputs, calls=30, repeats=7)

from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined  # noqa: E402

dev = "cuda"
tx, tdt, tA, tB, tC, tD, tbias, tdy = (
    torch.from_numpy(np.asarray(v, np.float32)).to(dev, torch.bfloat16 if v.dtype == jnp.bfloat16
                                                   else torch.float32) for v in inputs)
leaves = (tx, tdt, tA, tB, tC, tD, tbias)


def fwd():
    return mamba_chunk_scan_combined(tx, tdt, tA, tB, tC, 256, D=tD, dt_bias=tbias,
                                     dt_softplus=True)


def fb():
    return torch.autograd.grad(fwd(), leaves, tdy)


def eager(fn, calls=30, repeats=7):
    samples, host = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / calls)
    return 1e3 * statistics.median(samples), 1e3 * statistics.median(host)


def graphed(fn, calls=30, repeats=7):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples)


for name, fn in (("fwd", fwd), ("fb", None)):
    if name == "fb":
        for leaf in leaves:
            leaf.requires_grad_(True)
        fn = fb
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    row[f"mamba_{name}_eager"], row[f"mamba_{name}_host"] = eager(fn)
    try:
        row[f"mamba_{name}_graph"] = graphed(fn)
    except Exception as e:  # noqa: BLE001
        row[f"mamba_{name}_graph"] = float("nan")
        print("graph failed", name, repr(e)[:300], file=sys.stderr)
    row[f"mamba_{name}_eager2"], _ = eager(fn)
print(json.dumps(row), flush=True)
out = os.environ.get("OUT", "/tmp")
with open(f"{out}/rows.jsonl", "a") as f:
    f.write(json.dumps(row) + "\n")
