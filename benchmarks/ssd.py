"""Mamba2 SSD benchmark: pallas_kernels' mamba_chunk_scan_combined against XLA and mamba_ssm.

On the GPU machine, from the repository root, with `.peers` carried (peers_setup.sh makes
mamba_ssm's Triton kernels importable from the sdist in .peers/):

    source benchmarks/peers_setup.sh
    python -m benchmarks.ssd --chunks 256 --states 64 --out-dir "$OUT" --tag h200_c256_n64

CPU smoke test (ours in interpret mode; mamba_ssm needs CUDA and is left out):

    python -m benchmarks.ssd --quick --interpret --impls ours,jnp_ref --out-dir /tmp/ssd

Separate runs' JSON files combine into one report (table, JSON and PNG) without measuring:

    python -m benchmarks.ssd --merge a.json b.json --tag h200

Implementations, all with mamba_ssm's `mamba_chunk_scan_combined` semantics (D (H,), dt_bias,
dt_softplus=True, no z, no initial states): ours = pallas_kernels' kernels
(implementation="pallas"); jnp_ref = the same call with implementation="xla", the chunked jnp
reference under XLA; mamba_ssm = mamba_ssm's Triton kernels through torch (from the PyPI sdist
of mamba-ssm 2.3.2.post1 in .peers/, git-ignored; `pip download --no-deps --no-binary :all:`
fetches it but runs its setup.py, which imports torch: a stub torch package on PYTHONPATH with
MAMBA_SKIP_CUDA_BUILD=TRUE and --no-build-isolation gets past that).

Sweep: 16384 tokens per batch (b = 16384 // T), H 80 heads of P 64, state size N 64 and 128,
groups G 1 and 8, T 4096 and 8192, chunk sizes 256 and 64, forward and forward+backward (the
gradients of x, dt, A, B, C, D and dt_bias for a fixed random output cotangent). Inputs are fresh
random values: x, B, C standard normal bf16; dt raw bf16 0.1·normal with dt_bias the inverse
softplus of log-uniform [0.001, 0.1] (so softplus(dt + dt_bias) is mamba's dt range);
A = -exp(uniform[log 1, log 16]); D uniform [0.5, 1.5]; A, D, dt_bias float32. torch gets the
same values bit for bit.

Each (shape, implementation, mode) is measured on its own; a failure (unsupported shape, OOM,
missing package) is recorded as an error and the sweep goes on. Forward outputs are checked
against the jnp reference run in float32 on upcast inputs for batch row 0 (max |y - ref| /
max |ref|). See _timing.py for the two timing methods; the per-call median is the primary number.
JAX functions are compiled ahead of time, so the compile time and XLA's temp buffer size
(memory_analysis) are recorded too. mamba_ssm's Triton autotuning runs in its warm-up calls.

Writes {out_dir}/ssd_{tag}.json (environment and every measurement, rewritten after each shape)
and {out_dir}/ssd_{tag}.png, and prints a table of milliseconds and ratios last.
"""

import os

# Before jax is first imported: JAX preallocates this share of GPU memory; torch, in the same
# process, gets the rest.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import _timing

TOKENS_PER_BATCH = 16384
HEADS = 80
HEAD_DIM = 64
STATES = (64, 128)
GROUPS = (1, 8)
SEQ_LENS = (4096, 8192)
CHUNKS = (256, 64)
QUICK_SHAPE = dict(batch=1, seq_len=64, heads=4, head_dim=16, state=16, groups=1)
QUICK_CHUNKS = (16, 32)
MODES = ("fwd", "fwdbwd")
IMPLS = ("ours", "jnp_ref", "mamba_ssm")
DT_RANGE = (0.001, 0.1)
A_MAGNITUDE_RANGE = (1.0, 16.0)
REL_ERR_TOLERANCE = 2e-2


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    seq_len: int
    heads: int
    head_dim: int
    state: int
    groups: int
    chunk: int

    @property
    def label(self):
        return f"T{self.seq_len} N{self.state} G{self.groups} c{self.chunk}"


# --- JAX implementations: each builds ssd(x, dt, A, B, C, D, dt_bias) -> y for a shape. ---


def jax_builder(implementation):
    def build(shape, opts):
        import pallas_kernels

        interpret = (opts.interpret or None) if implementation == "pallas" else None

        def ssd(x, dt, A, B, C, D, dt_bias):
            return pallas_kernels.mamba_chunk_scan_combined(
                x, dt, A, B, C, shape.chunk, D=D, dt_bias=dt_bias, dt_softplus=True,
                implementation=implementation, interpret=interpret,
            )

        return ssd

    return build


JAX_IMPLS = {"ours": jax_builder("pallas"), "jnp_ref": jax_builder("xla")}
TORCH_DEVICE = "cuda"


# --- Inputs and the reference. ---


def inverse_softplus(y):
    return y + jnp.log(-jnp.expm1(-y))


def make_inputs(shape, seed):
    """Fresh (x, dt, A, B, C, D, dt_bias, dy): the SSD arguments and an output cotangent."""
    b, t, h, p, n, g = (shape.batch, shape.seq_len, shape.heads, shape.head_dim, shape.state,
                        shape.groups)
    keys = jax.random.split(jax.random.key(seed), 8)
    log_dt = jax.random.uniform(keys[6], (h,), minval=math.log(DT_RANGE[0]),
                                maxval=math.log(DT_RANGE[1]))
    log_a = jax.random.uniform(keys[2], (h,), minval=math.log(A_MAGNITUDE_RANGE[0]),
                               maxval=math.log(A_MAGNITUDE_RANGE[1]))
    return (
        jax.random.normal(keys[0], (b, t, h, p), jnp.bfloat16),
        (0.1 * jax.random.normal(keys[1], (b, t, h))).astype(jnp.bfloat16),
        -jnp.exp(log_a),
        jax.random.normal(keys[3], (b, t, g, n), jnp.bfloat16),
        jax.random.normal(keys[4], (b, t, g, n), jnp.bfloat16),
        jax.random.uniform(keys[5], (h,), minval=0.5, maxval=1.5),
        inverse_softplus(jnp.exp(log_dt)),
        jax.random.normal(keys[7], (b, t, h, p), jnp.bfloat16),
    )


@functools.partial(jax.jit, static_argnames=("chunk",))
def reference_row0(x, dt, A, B, C, D, dt_bias, *, chunk):
    """float32 SSD output (T, H, P) of batch row 0 on upcast inputs, by the chunked reference."""
    from pallas_kernels.mamba2 import reference

    x0, dt0, B0, C0 = (v[:1].astype(jnp.float32) for v in (x, dt, B, C))
    y = reference.mamba_chunk_scan_combined(
        x0, dt0, A, B0, C0, chunk, D=D, dt_bias=dt_bias, dt_softplus=True
    )
    return y[0]


def relative_error(out, reference):
    """max |out - ref| / max |ref|."""
    out = np.asarray(out, np.float32)
    return float(np.max(np.abs(out - reference)) / np.max(np.abs(reference)))


# --- Measurements. ---


def measure_jax(ssd, shape, mode, inputs, reference, opts):
    args, dy = inputs[:-1], inputs[-1]
    if mode == "fwd":
        step = ssd
    else:

        def step(*args_and_dy):
            y, vjp = jax.vjp(ssd, *args_and_dy[:-1])
            return (y, *vjp(args_and_dy[-1]))

        args = (*args, dy)
    start = time.perf_counter()
    compiled = jax.jit(step).lower(*args).compile()
    result = {"compile_s": time.perf_counter() - start}
    memory = compiled.memory_analysis()
    if memory is not None:
        result["temp_bytes"] = int(memory.temp_size_in_bytes)
    if mode == "fwd":
        result["fwd_rel_err"] = relative_error(compiled(*args)[0], reference)
    return result, _timing.time_jax(compiled, args, iters=opts.iters, warmup=opts.warmup)


def import_torch_cuda():
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device")
    return torch


def measure_mamba_ssm(shape, mode, inputs, reference, opts):
    torch = import_torch_cuda()
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    dtypes = {jnp.dtype(jnp.bfloat16): torch.bfloat16, jnp.dtype(jnp.float32): torch.float32}
    # The JAX inputs, bit for bit (bf16 -> f32 -> bf16 is exact), in the same layout.
    x, dt, A, B, C, D, dt_bias, dy = (
        torch.from_numpy(np.asarray(v, np.float32)).to(TORCH_DEVICE, dtypes[v.dtype])
        for v in inputs
    )

    def forward():
        return mamba_chunk_scan_combined(
            x, dt, A, B, C, shape.chunk, D=D, dt_bias=dt_bias, dt_softplus=True
        )

    result = {}
    if mode == "fwd":
        result["fwd_rel_err"] = relative_error(forward()[0].float().cpu().numpy(), reference)
        step = forward
    else:
        leaves = (x, dt, A, B, C, D, dt_bias)
        for leaf in leaves:
            leaf.requires_grad_(True)

        def step():
            return torch.autograd.grad(forward(), leaves, dy)

    return result, _timing.time_torch(step, iters=opts.iters, warmup=opts.warmup)


def release_torch_memory():
    """Hands torch's cached GPU memory back to the device (JAX may need it), if torch is in use."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def run_one(impl, shape, mode, inputs, reference, opts):
    """One measurement as a flat record; never raises (short of KeyboardInterrupt)."""
    record = {**dataclasses.asdict(shape), "label": shape.label, "impl": impl, "mode": mode}
    try:
        if impl == "mamba_ssm":
            result, timing = measure_mamba_ssm(shape, mode, inputs, reference, opts)
        else:
            ssd = JAX_IMPLS[impl](shape, opts)
            result, timing = measure_jax(ssd, shape, mode, inputs, reference, opts)
    except Exception as e:  # any failure is a result to record
        return {**record, "status": "error", "error": f"{type(e).__name__}: {e}"}
    finally:
        if impl == "mamba_ssm":
            release_torch_memory()
    return {
        **record, **result, "status": "ok",
        "ms": timing.median_ms, "ms_min": timing.min_ms, "ms_max": timing.max_ms,
        "ms_amortised": timing.amortised_ms, "iters": timing.iters,
    }


def progress_line(index, total, record):
    head = f"[{index}/{total}] {record['label']:<22} {record['impl']:<9} {record['mode']:<6}"
    if record["status"] != "ok":
        return f"{head} {record['status']}: {record['error'].splitlines()[0][:160]}"
    line = f"{head} {record['ms']:9.3f} ms (amortised {record['ms_amortised']:9.3f})"
    if "compile_s" in record:
        line += f" compile {record['compile_s']:.1f}s"
    if "temp_bytes" in record:
        line += f" temp {record['temp_bytes'] / 2**20:.0f} MiB"
    if "fwd_rel_err" in record:
        line += f" rel_err {record['fwd_rel_err']:.1e}"
    return line


# --- Reports. ---


def metric_of(record, metric):
    if record is None or record["status"] != "ok":
        return None
    return record["ms" if metric == "per_call" else "ms_amortised"]


def index_records(records):
    return {(r["label"], r["impl"], r["mode"]): r for r in records}


def cell_text(record, metric):
    if record is None:
        return "-"
    if record["status"] != "ok":
        return "err"
    flag = "!" if record.get("fwd_rel_err", 0.0) > REL_ERR_TOLERANCE else ""
    return f"{metric_of(record, metric):.3g}{flag}"


def ratio_text(by_key, label, numerator, denominator, metric):
    cells = []
    for mode in MODES:
        top = metric_of(by_key.get((label, numerator, mode)), metric)
        bottom = metric_of(by_key.get((label, denominator, mode)), metric)
        cells.append("-" if None in (top, bottom) else f"{top / bottom:.2f}")
    return " / ".join(cells)


# (numerator, denominator) of the ratio columns: ours against mamba_ssm (< 1: ours is faster) and
# XLA against ours (> 1: ours is faster).
RATIOS = (("ours", "mamba_ssm"), ("jnp_ref", "ours"))


def results_table(records, labels, impls, metric):
    by_key = index_records(records)
    ratios = [(a, b) for a, b in RATIOS if a in impls and b in impls]
    rows = [
        [label,
         *(" / ".join(cell_text(by_key.get((label, impl, mode)), metric) for mode in MODES)
           for impl in impls),
         *(ratio_text(by_key, label, a, b, metric) for a, b in ratios)]
        for label in labels
    ]
    legend = (f"ms ({metric.replace('_', '-')}), cells fwd / fwdbwd; err: failed (JSON has why); "
              f"!: fwd output off the reference by > {REL_ERR_TOLERANCE}; ratios of ms "
              "(ours/mamba_ssm < 1 and jnp_ref/ours > 1: ours faster)")
    header = ["shape", *impls, *(f"{a}/{b}" for a, b in ratios)]
    return legend + "\n" + _timing.format_table(header, rows)


def accuracy_memory_table(records, labels, impls):
    """Forward relative error of each implementation, and XLA temp memory of the JAX ones."""
    by_key = index_records(records)
    jax_impls = [impl for impl in impls if impl in JAX_IMPLS]
    rows = []
    for label in labels:
        row = [label]
        for impl in impls:
            record = by_key.get((label, impl, "fwd"))
            err = None if record is None else record.get("fwd_rel_err")
            row.append("-" if err is None else f"{err:.1e}")
        for impl in jax_impls:
            cells = []
            for mode in MODES:
                record = by_key.get((label, impl, mode))
                temp = None if record is None else record.get("temp_bytes")
                cells.append("-" if temp is None else f"{temp / 2**20:.0f}")
            row.append(" / ".join(cells))
        rows.append(row)
    header = ["shape", *(f"{impl} rel err" for impl in impls),
              *(f"{impl} temp MiB" for impl in jax_impls)]
    title = ("fwd relative error (max |y - ref| / max |ref|, batch row 0, float32 reference); "
             "XLA temp memory, fwd / fwdbwd")
    return title + "\n" + _timing.format_table(header, rows)


def save_plot(path, records, labels, impls, metric, device_kind):
    by_key = index_records(records)
    panels = [
        (title, {impl: [metric_of(by_key.get((label, impl, mode)), metric) for label in labels]
                 for impl in impls})
        for mode, title in (("fwd", "forward"), ("fwdbwd", "forward + backward"))
        if any(r["mode"] == mode for r in records)
    ]
    sizes = sorted({(r["heads"], r["head_dim"], r["batch"] * r["seq_len"]) for r in records})
    size_text = ", ".join(f"H{h} P{p} {tokens} tokens" for h, p, tokens in sizes)
    _timing.save_grouped_bar_plot(
        path, labels, panels, ylabel=f"ms ({metric.replace('_', '-')}), lower is better",
        title=f"Mamba2 SSD, bf16, {size_text} per batch, {device_kind}",
    )


def report(records, impls, metric, json_path, png_path):
    labels = list(dict.fromkeys(r["label"] for r in records))
    print(f"\nwrote {json_path} and {png_path}\n")
    print(accuracy_memory_table(records, labels, impls) + "\n")
    print(results_table(records, labels, impls, metric))


def merge(args):
    """Combines the results of earlier runs' JSON files into one report; measures nothing."""
    sources, records = [], []
    for path in args.merge:
        with open(path) as f:
            payload = json.load(f)
        sources.append({"path": path, "environment": payload.get("environment"),
                        "config": payload.get("config")})
        records.extend(payload["results"])
    # A (shape, implementation, mode) measured in several files: the last file's record counts.
    records = list(index_records(records).values())
    impls = [impl for impl in IMPLS if any(r["impl"] == impl for r in records)]
    device_kind = (sources[0]["environment"] or {}).get("device_kind", "unknown device")
    json_path = os.path.join(args.out_dir, f"ssd_{args.tag}.json")
    png_path = os.path.join(args.out_dir, f"ssd_{args.tag}.png")
    _timing.write_json(json_path, {"merged_from": sources, "results": records})
    labels = list(dict.fromkeys(r["label"] for r in records))
    save_plot(png_path, records, labels, impls, args.metric, device_kind)
    report(records, impls, args.metric, json_path, png_path)


# --- Command line. ---


def comma_list(item_type):
    return lambda text: [item_type(item) for item in text.split(",") if item]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.ssd", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--states", type=comma_list(int),
                        help=f"state sizes N, e.g. 64 (default: {','.join(map(str, STATES))})")
    parser.add_argument("--groups", type=comma_list(int),
                        help=f"groups G of B and C (default: {','.join(map(str, GROUPS))})")
    parser.add_argument("--seq-lens", type=comma_list(int),
                        help=f"T, with b = {TOKENS_PER_BATCH} // T "
                             f"(default: {','.join(map(str, SEQ_LENS))})")
    parser.add_argument("--chunks", type=comma_list(int),
                        help=f"chunk sizes (default: {','.join(map(str, CHUNKS))}; with --quick "
                             f"{','.join(map(str, QUICK_CHUNKS))})")
    parser.add_argument("--impls", type=comma_list(str), default=list(IMPLS),
                        help=f"of {','.join(IMPLS)} (default: all)")
    parser.add_argument("--modes", type=comma_list(str), default=list(MODES), help="fwd,fwdbwd")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: tiny shapes {QUICK_SHAPE}, 3 iterations")
    parser.add_argument("--interpret", action="store_true",
                        help="run ours' Pallas kernels in interpret mode (CPU)")
    parser.add_argument("--iters", type=int, default=30, help="timed calls per measurement")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed calls after compiling (mamba_ssm autotunes in the first)")
    parser.add_argument("--metric", choices=["per_call", "amortised"], default="per_call",
                        help="timing shown in the table and plot (the JSON has both)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--tag", default=time.strftime("%Y%m%d_%H%M%S"),
                        help="file names: ssd_{tag}.json/.png")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="combine these results files (the last wins where they overlap) "
                             "into ssd_{tag}.json/.png and the tables, measuring nothing")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.impls) - set(IMPLS))
    if unknown:
        parser.error(f"unknown implementations: {','.join(unknown)}")
    if not set(args.modes) <= set(MODES):
        parser.error(f"modes must be among {','.join(MODES)}, got {','.join(args.modes)}")
    args.modes = [mode for mode in MODES if mode in args.modes]
    bad_chunks = [c for c in args.chunks or () if c < 1 or c & (c - 1)]
    if bad_chunks:
        parser.error(f"chunk sizes must be powers of two, got {bad_chunks}")
    if args.quick:
        args.iters, args.warmup = 3, 1
    return args


def build_sweep(args):
    """Shapes ordered chunk, N, T, G: mamba_ssm autotunes once per (chunk, N) and reuses it."""
    chunks = args.chunks or (QUICK_CHUNKS if args.quick else CHUNKS)
    if args.quick:
        return [Shape(**QUICK_SHAPE, chunk=chunk) for chunk in chunks]
    return [
        Shape(batch=max(1, TOKENS_PER_BATCH // seq_len), seq_len=seq_len, heads=HEADS,
              head_dim=HEAD_DIM, state=state, groups=groups, chunk=chunk)
        for chunk in chunks
        for state in args.states or STATES
        for seq_len in args.seq_lens or SEQ_LENS
        for groups in args.groups or GROUPS
    ]


def main(argv=None):
    args = parse_args(argv)
    if args.merge:
        merge(args)
        return
    # The Pallas-Triton lowering warns on each use.
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    shapes = build_sweep(args)
    environment = _timing.environment_info("benchmarks.ssd")
    # mamba_ssm is extracted, not installed (peers_setup.sh), so its version is the sdist's name.
    environment["mamba_ssm_sdist"] = os.environ.get("PEERS_MAMBA_SSM")
    config = {k: v for k, v in vars(args).items() if k not in ("out_dir", "tag", "merge")}
    json_path = os.path.join(args.out_dir, f"ssd_{args.tag}.json")
    png_path = os.path.join(args.out_dir, f"ssd_{args.tag}.png")
    print(f"{environment['device_kind']}, jax {environment['versions']['jax']}: "
          f"{len(shapes)} shapes x {len(args.impls)} implementations x {len(args.modes)} modes",
          flush=True)

    records = []
    total = len(shapes) * len(args.impls) * len(args.modes)
    for shape_index, shape in enumerate(shapes):
        inputs = make_inputs(shape, args.seed + shape_index)
        reference = np.asarray(reference_row0(*inputs[:-1], chunk=shape.chunk))
        for impl in args.impls:
            for mode in args.modes:
                record = run_one(impl, shape, mode, inputs, reference, args)
                records.append(record)
                print(progress_line(len(records), total, record), flush=True)
        del inputs
        jax.clear_caches()
        labels = [s.label for s in shapes[: shape_index + 1]]
        _timing.write_json(
            json_path, {"environment": environment, "config": config, "results": records}
        )
        save_plot(png_path, records, labels, args.impls, args.metric,
                  environment["device_kind"])

    report(records, args.impls, args.metric, json_path, png_path)


if __name__ == "__main__":
    main()
