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
max |ref|). See _timing.py for the three timing methods; compare implementations by
`--metric device` (mamba_ssm launches its kernels from Python, at some shapes slower than they
run: benchmarks/NOTES.md, "Benchmarking method").
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
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import _harness, _timing

TOKENS_PER_BATCH = 16384
HEADS = 80
HEAD_DIM = 64
STATES = (64, 128)
GROUPS = (1, 8)
SEQ_LENS = (4096, 8192)
CHUNKS = (256, 64)
QUICK_SHAPE = dict(batch=1, seq_len=64, heads=4, head_dim=16, state=16, groups=1)
QUICK_CHUNKS = (16, 32)
IMPLS = ("ours", "jnp_ref", "mamba_ssm")
DT_RANGE = (0.001, 0.1)
A_MAGNITUDE_RANGE = (1.0, 16.0)
# The record field that --metric shows in the tables and plot.
METRIC_FIELDS = {"per_call": "ms", "amortised": "ms_amortised", "device": "ms_device"}


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


def inputs_and_reference(shape, seed):
    """make_inputs and the reference_row0, as numpy."""
    inputs = make_inputs(shape, seed)
    return inputs, np.asarray(reference_row0(*inputs[:-1], chunk=shape.chunk))


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
    forward_error = None
    if mode == "fwd":

        def forward_error(y):
            return _harness.relative_error(y[0], reference)

    return _harness.measure_jax(step, args, opts, forward_error)


def measure_mamba_ssm(shape, mode, inputs, reference, opts):
    torch = _harness.import_torch_cuda()
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
        result["fwd_rel_err"] = _harness.relative_error(
            forward()[0].float().cpu().numpy(), reference
        )
        step = forward
    else:
        leaves = (x, dt, A, B, C, D, dt_bias)
        for leaf in leaves:
            leaf.requires_grad_(True)

        def step():
            return torch.autograd.grad(forward(), leaves, dy)

    return result, _timing.time_torch(step, iters=opts.iters, warmup=opts.warmup)


def run_one(impl, shape, mode, inputs, reference, opts):
    """One measurement as a flat record; never raises (short of KeyboardInterrupt)."""
    if impl == "mamba_ssm":
        measure = functools.partial(measure_mamba_ssm, shape, mode, inputs, reference, opts)
    else:

        def measure():
            ssd = JAX_IMPLS[impl](shape, opts)
            return measure_jax(ssd, shape, mode, inputs, reference, opts)

    return _harness.measured_record(
        _harness.base_record(shape, impl, mode), measure, uses_torch=impl == "mamba_ssm"
    )


def progress_line(index, total, record):
    """The line printed after a measurement: ms, XLA temp memory and the checks."""
    return _harness.format_progress(
        index, total, record, label_width=22, impl_width=9, show_temp=True,
        timing_text=lambda r: (f"{r['ms']:9.3f} ms (amortised {r['ms_amortised']:9.3f}, "
                               f"device {_device_text(r['ms_device'])})"),
    )


def _device_text(ms):
    return "n/a" if ms is None else f"{ms:.3f}"


# --- Reports. ---


def ratio_text(by_key, label, numerator, denominator, field):
    cells = []
    for mode in _harness.MODES:
        top = _harness.metric_value(by_key.get((label, numerator, mode)), field)
        bottom = _harness.metric_value(by_key.get((label, denominator, mode)), field)
        cells.append("-" if None in (top, bottom) else f"{top / bottom:.2f}")
    return " / ".join(cells)


# (numerator, denominator) of the ratio columns: ours against mamba_ssm (< 1: ours is faster) and
# XLA against ours (> 1: ours is faster).
RATIOS = (("ours", "mamba_ssm"), ("jnp_ref", "ours"))


def results_table(records, labels, impls, metric):
    by_key = _harness.index_records(records)
    field = METRIC_FIELDS[metric]
    ratios = [(a, b) for a, b in RATIOS if a in impls and b in impls]
    rows = [
        [label,
         *(_harness.mode_cells(by_key, label, impl, field) for impl in impls),
         *(ratio_text(by_key, label, a, b, field) for a, b in ratios)]
        for label in labels
    ]
    legend = (f"ms ({_harness.metric_text(metric)}), cells fwd / fwdbwd; err: failed (JSON has "
              f"why); !: fwd output off the reference by > {_harness.REL_ERR_TOLERANCE}; ratios "
              "of ms (ours/mamba_ssm < 1 and jnp_ref/ours > 1: ours faster)")
    header = ["shape", *impls, *(f"{a}/{b}" for a, b in ratios)]
    return legend + "\n" + _timing.format_table(header, rows)


def accuracy_memory_table(records, labels, impls):
    """Forward relative error of each implementation, and XLA temp memory of the JAX ones."""
    by_key = _harness.index_records(records)
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
            for mode in _harness.MODES:
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
    panels = _harness.plot_panels(
        records, labels, impls, METRIC_FIELDS[metric],
        (("fwd", "forward"), ("fwdbwd", "forward + backward")),
    )
    sizes = sorted({(r["heads"], r["head_dim"], r["batch"] * r["seq_len"]) for r in records})
    size_text = ", ".join(f"H{h} P{p} {tokens} tokens" for h, p, tokens in sizes)
    _timing.save_grouped_bar_plot(
        path, labels, panels, ylabel=f"ms ({_harness.metric_text(metric)}), lower is better",
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
        # A merged file contributes the sources it was merged from.
        sources.extend(payload.get("merged_from") or [
            {"path": path, "environment": payload.get("environment"),
             "config": payload.get("config")}])
        records.extend(payload["results"])
    # A (shape, implementation, mode) measured in several files: the last file's record counts.
    records = list(_harness.index_records(records).values())
    impls = [impl for impl in IMPLS if any(r["impl"] == impl for r in records)]
    device_kind = (sources[0]["environment"] or {}).get("device_kind", "unknown device")
    json_path, png_path = _harness.output_paths(args.out_dir, "ssd", args.tag)
    _timing.write_json(json_path, {"merged_from": sources, "results": records})
    labels = list(dict.fromkeys(r["label"] for r in records))
    save_plot(png_path, records, labels, impls, args.metric, device_kind)
    report(records, impls, args.metric, json_path, png_path)


# --- Command line. ---


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.ssd", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--states", type=_harness.comma_list(int),
                        help=f"state sizes N, e.g. 64 (default: {','.join(map(str, STATES))})")
    parser.add_argument("--groups", type=_harness.comma_list(int),
                        help=f"groups G of B and C (default: {','.join(map(str, GROUPS))})")
    parser.add_argument("--seq-lens", type=_harness.comma_list(int),
                        help=f"T, with b = {TOKENS_PER_BATCH} // T "
                             f"(default: {','.join(map(str, SEQ_LENS))})")
    parser.add_argument("--chunks", type=_harness.comma_list(int),
                        help=f"chunk sizes (default: {','.join(map(str, CHUNKS))}; with --quick "
                             f"{','.join(map(str, QUICK_CHUNKS))})")
    _harness.add_selection_arguments(
        parser, default_impls=IMPLS, impls_help=f"of {','.join(IMPLS)} (default: all)",
        quick_help=f"smoke test: tiny shapes {QUICK_SHAPE}, 3 iterations",
        interpret_help="run ours' Pallas kernels in interpret mode (CPU)",
    )
    _harness.add_timing_arguments(
        parser, warmup_help="untimed calls after compiling (mamba_ssm autotunes in the first)"
    )
    _harness.add_output_arguments(parser, "ssd")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="combine these results files (the last wins where they overlap) "
                             "into ssd_{tag}.json/.png and the tables, measuring nothing")
    args = parser.parse_args(argv)
    _harness.check_common_arguments(parser, args, IMPLS)
    bad_chunks = [c for c in args.chunks or () if c < 1 or c & (c - 1)]
    if bad_chunks:
        parser.error(f"chunk sizes must be powers of two, got {bad_chunks}")
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
    records, json_path, png_path = _harness.run_sweep(
        "ssd", shapes, environment, args, inputs_and_reference=inputs_and_reference,
        run_one=run_one, progress_line=progress_line, save_plot=save_plot,
    )
    report(records, args.impls, args.metric, json_path, png_path)


if __name__ == "__main__":
    main()
