"""Attention benchmark: pallas_kernels' FlashAttention against JAX, tokamax and torch kernels.

On the GPU machine, from the repository root (device_setup.sh installs tokamax from .whl/):

    source benchmarks/device_setup.sh
    python -m benchmarks.attention --out-dir "$OUT" --tag h200

CPU smoke test (Pallas kernels in interpret mode; the GPU-only baselines record errors):

    python -m benchmarks.attention --quick --interpret

Sweep: self-attention, bf16, hidden size 2048 (N = 2048 / H heads), 16384 tokens per batch
(B = 16384 // T, at least 1), causal and full, forward and forward+backward, at head dims 64 and
128 with T 2048 and 8192, head dim 128 with T 16384 and 32768, head dim 256 with T 2048 and 8192.
FLOPs: forward 4·B·N·T²·H, halved when causal; forward+backward 3.5 times the forward.

Each (shape, implementation, mode) is measured on its own; a failure (unsupported shape, OOM,
missing package) is recorded as an error and the sweep goes on. Forward outputs are checked
against a float32 reference on the last 256 query rows of batch row 0. See _timing.py for the two
timing methods; the per-call median is the primary number. JAX functions are compiled ahead of
time, so the compile time and XLA's temp buffer size (memory_analysis) are recorded too.

Writes {out_dir}/attention_{tag}.json (environment and every measurement, rewritten after each
shape) and {out_dir}/attention_{tag}.png, and prints a TFLOP/s table last.
"""

import os

# Before jax is first imported: JAX preallocates this share of GPU memory; torch, in the same
# process, gets the rest.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")

import argparse
import dataclasses
import functools
import importlib
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
HIDDEN = 2048
# (head dim, sequence length) of the full sweep; each is run causal and full.
SWEEP = [
    (64, 2048), (64, 8192), (128, 2048), (128, 8192),
    (128, 16384), (128, 32768), (256, 2048), (256, 8192),
]
QUICK_SHAPE = dict(batch=2, seq_len=256, heads=2, head_dim=64)
MODES = ("fwd", "fwdbwd")
FWDBWD_FLOP_FACTOR = 3.5
REFERENCE_ROWS = 256
REL_ERR_TOLERANCE = 2e-2


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    seq_len: int
    heads: int
    head_dim: int
    causal: bool

    @property
    def label(self):
        return f"d{self.head_dim} T{self.seq_len} {'causal' if self.causal else 'full'}"

    @property
    def scale(self):
        return 1.0 / math.sqrt(self.head_dim)

    def flops(self, mode):
        forward = 4 * self.batch * self.heads * self.seq_len**2 * self.head_dim
        if self.causal:
            forward /= 2
        return forward * (FWDBWD_FLOP_FACTOR if mode == "fwdbwd" else 1)


class SkippedError(Exception):
    """An implementation deliberately not run at a shape (recorded as 'skipped')."""


# --- JAX implementations: each builds attn(q, k, v) -> out for a shape, layout (B, T, N, H). ---


def ours_block_sizes(overrides, head_dim):
    """The tuned BlockSizes for this device and head dim, fields replaced by `overrides`.

    `overrides` maps a kernel ("forward", "dkv", "dq") to the KernelBlocks fields to change, e.g.
    {"forward": {"block_q": 128, "block_k": 64, "num_warps": 8, "num_stages": 3}}.
    """
    tuning = importlib.import_module("pallas_kernels.attention.tuning")
    # The sweep's head dims are powers of two, as the table's lookup expects.
    tuned = tuning.block_sizes_for(jax.devices()[0].device_kind, head_dim)
    return dataclasses.replace(tuned, **{
        kernel: dataclasses.replace(getattr(tuned, kernel), **fields)
        for kernel, fields in overrides.items()
    })


def build_ours(shape, opts):
    import pallas_kernels

    block_sizes = None
    if opts.block_sizes is not None:
        block_sizes = ours_block_sizes(opts.block_sizes, shape.head_dim)
    return functools.partial(
        pallas_kernels.dot_product_attention, scale=shape.scale, is_causal=shape.causal,
        implementation="pallas", block_sizes=block_sizes, interpret=opts.interpret or None,
    )


def build_jax_cudnn(shape, opts):
    return functools.partial(
        jax.nn.dot_product_attention, scale=shape.scale, is_causal=shape.causal,
        implementation="cudnn",
    )


def build_jax_xla(shape, opts):
    logits_gib = 4 * shape.batch * shape.heads * shape.seq_len**2 / 2**30
    if logits_gib > opts.xla_max_logits_gib:
        raise SkippedError(
            f"float32 logits would take {logits_gib:.0f} GiB > {opts.xla_max_logits_gib} GiB"
        )
    return functools.partial(
        jax.nn.dot_product_attention, scale=shape.scale, is_causal=shape.causal,
        implementation="xla",
    )


def build_jax_pallas_mha(shape, opts):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention

    # Its sm_scale defaults to 1.0; segment_ids is a required positional argument.
    return lambda q, k, v: attention.mha(
        q, k, v, None, sm_scale=shape.scale, causal=shape.causal, interpret=opts.interpret
    )


def tokamax_builder(implementation):
    def build(shape, opts):
        import tokamax

        return functools.partial(
            tokamax.dot_product_attention, scale=shape.scale, is_causal=shape.causal,
            implementation=implementation,
        )

    return build


JAX_IMPLS = {
    "ours": build_ours,
    "jax_cudnn": build_jax_cudnn,
    "jax_xla": build_jax_xla,
    "jax_pallas_mha": build_jax_pallas_mha,
    "tokamax_triton": tokamax_builder("triton"),
    "tokamax_mosaic": tokamax_builder("mosaic"),
}
TORCH_DEVICE = "cuda"
# torch.nn.functional.scaled_dot_product_attention restricted to one SDPBackend member.
TORCH_IMPLS = {"torch_flash": "FLASH_ATTENTION", "torch_cudnn": "CUDNN_ATTENTION"}
DEFAULT_IMPLS = [
    "ours", "jax_cudnn", "jax_xla", "jax_pallas_mha", "tokamax_triton", "torch_flash",
    "torch_cudnn",
]


# --- Inputs and the reference. ---


def make_inputs(shape, seed):
    """Fresh standard-normal q, k, v and output cotangent, (B, T, N, H) bfloat16."""
    dims = (shape.batch, shape.seq_len, shape.heads, shape.head_dim)
    keys = jax.random.split(jax.random.key(seed), 4)
    return tuple(jax.random.normal(key, dims, jnp.bfloat16) for key in keys)


@functools.partial(jax.jit, static_argnames=("causal", "rows"))
def reference_tail(q, k, v, *, causal, rows):
    """float32 attention output of the last `rows` queries of batch row 0: (rows, N, H)."""
    t, head_dim = q.shape[1], q.shape[3]
    hi = jax.lax.Precision.HIGHEST
    q_tail, k0, v0 = (x.astype(jnp.float32) for x in (q[0, t - rows:], k[0], v[0]))
    logits = jnp.einsum("qnh,knh->nqk", q_tail, k0, precision=hi) / math.sqrt(head_dim)
    if causal:
        visible = jnp.arange(t)[None, :] <= jnp.arange(t - rows, t)[:, None]
        logits = jnp.where(visible[None], logits, -jnp.inf)
    return jnp.einsum("nqk,knh->qnh", jax.nn.softmax(logits, axis=-1), v0, precision=hi)


def relative_error(out_tail, reference):
    """max |out - ref| / max |ref| over the reference rows."""
    out_tail = np.asarray(out_tail, np.float32)
    return float(np.max(np.abs(out_tail - reference)) / np.max(np.abs(reference)))


# --- Measurements. ---


def measure_jax(attn, shape, mode, inputs, reference, opts):
    q, k, v, dout = inputs
    if mode == "fwd":
        step, args = attn, (q, k, v)
    else:

        def step(q, k, v, dout):
            out, vjp = jax.vjp(attn, q, k, v)
            return (out, *vjp(dout))

        args = (q, k, v, dout)
    start = time.perf_counter()
    compiled = jax.jit(step).lower(*args).compile()
    result = {"compile_s": time.perf_counter() - start}
    memory = compiled.memory_analysis()
    if memory is not None:
        result["temp_bytes"] = int(memory.temp_size_in_bytes)
    if mode == "fwd":
        result["fwd_rel_err"] = relative_error(compiled(*args)[0, -reference.shape[0]:], reference)
    return result, _timing.time_jax(compiled, args, iters=opts.iters, warmup=opts.warmup)


def import_torch_cuda():
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device")
    return torch


def measure_torch(backend_name, shape, mode, inputs, reference, opts):
    torch = import_torch_cuda()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    # The JAX inputs, bit for bit (bf16 -> f32 -> bf16 is exact), in torch's (B, N, T, H).
    q, k, v, dout = (
        torch.from_numpy(np.asarray(x, np.float32)).to(TORCH_DEVICE, torch.bfloat16)
        .transpose(1, 2).contiguous()
        for x in inputs
    )

    def forward():
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=shape.causal, scale=shape.scale
            )

    result = {}
    if mode == "fwd":
        out_tail = forward()[0, :, -reference.shape[0]:].transpose(0, 1)
        result["fwd_rel_err"] = relative_error(out_tail.float().cpu().numpy(), reference)
        step = forward
    else:
        for x in (q, k, v):
            x.requires_grad_(True)

        def step():
            return torch.autograd.grad(forward(), (q, k, v), dout)

    return result, _timing.time_torch(step, iters=opts.iters, warmup=opts.warmup)


def release_torch_memory():
    """Hands torch's cached GPU memory back to the device (JAX may need it), if torch is in use."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def run_one(impl, shape, mode, inputs, reference, opts):
    """One measurement as a flat record; never raises (short of KeyboardInterrupt)."""
    record = {**dataclasses.asdict(shape), "label": shape.label, "impl": impl, "mode": mode,
              "flops": shape.flops(mode)}
    try:
        if impl in TORCH_IMPLS:
            result, timing = measure_torch(TORCH_IMPLS[impl], shape, mode, inputs, reference, opts)
        else:
            attn = JAX_IMPLS[impl](shape, opts)
            result, timing = measure_jax(attn, shape, mode, inputs, reference, opts)
    except SkippedError as e:
        return {**record, "status": "skipped", "error": str(e)}
    except Exception as e:  # any failure is a result to record
        return {**record, "status": "error", "error": f"{type(e).__name__}: {e}"}
    finally:
        if impl in TORCH_IMPLS:
            release_torch_memory()
    return {
        **record, **result, "status": "ok",
        "ms": timing.median_ms, "ms_min": timing.min_ms, "ms_max": timing.max_ms,
        "ms_amortised": timing.amortised_ms, "iters": timing.iters,
        "tflops": _timing.tflops(record["flops"], timing.median_ms),
        "tflops_amortised": _timing.tflops(record["flops"], timing.amortised_ms),
    }


def progress_line(index, total, record):
    head = f"[{index}/{total}] {record['label']:<18} {record['impl']:<15} {record['mode']:<6}"
    if record["status"] != "ok":
        return f"{head} {record['status']}: {record['error'].splitlines()[0][:160]}"
    line = (f"{head} {record['ms']:9.3f} ms {record['tflops']:6.1f} TFLOP/s "
            f"(amortised {record['tflops_amortised']:6.1f})")
    if "compile_s" in record:
        line += f" compile {record['compile_s']:.1f}s"
    if "fwd_rel_err" in record:
        line += f" rel_err {record['fwd_rel_err']:.1e}"
    return line


# --- Reports. ---


def metric_of(record, metric):
    if record is None or record["status"] != "ok":
        return None
    return record["tflops" if metric == "per_call" else "tflops_amortised"]


def index_records(records):
    return {(r["label"], r["impl"], r["mode"]): r for r in records}


def cell_text(record, metric):
    if record is None:
        return "-"
    if record["status"] != "ok":
        return "skip" if record["status"] == "skipped" else "err"
    flag = "!" if record.get("fwd_rel_err", 0.0) > REL_ERR_TOLERANCE else ""
    return f"{metric_of(record, metric):.3g}{flag}"


def results_table(records, labels, impls, metric):
    by_key = index_records(records)
    rows = [
        [label, *(" / ".join(cell_text(by_key.get((label, impl, mode)), metric) for mode in MODES)
                  for impl in impls)]
        for label in labels
    ]
    legend = (f"TFLOP/s ({metric.replace('_', '-')}), cells fwd / fwdbwd; err: failed, skip: "
              f"skipped (JSON has why); !: fwd output off the reference by > {REL_ERR_TOLERANCE}")
    return legend + "\n" + _timing.format_table(["shape", *impls], rows)


def ratio_summary(records, labels, metric):
    """ours' fwd+bwd TFLOP/s, its speed relative to two baselines, and its XLA temp memory."""
    by_key = index_records(records)
    baselines = ["tokamax_triton", "torch_flash"]
    rows = []
    for label in labels:
        ours = by_key.get((label, "ours", "fwdbwd"))
        ours_tf = metric_of(ours, metric)
        row = [label, "-" if ours_tf is None else f"{ours_tf:.3g}"]
        for name in baselines:
            theirs = metric_of(by_key.get((label, name, "fwdbwd")), metric)
            row.append("-" if None in (ours_tf, theirs) else f"{ours_tf / theirs:.2f}x")
        temp = None if ours is None else ours.get("temp_bytes")
        row.append("-" if temp is None else f"{temp / 2**20:.0f}")
        rows.append(row)
    header = ["shape", "ours fwdbwd", *(f"vs {name}" for name in baselines), "ours temp MiB"]
    return "ours, forward+backward\n" + _timing.format_table(header, rows)


def save_plot(path, records, labels, impls, metric, device_kind):
    by_key = index_records(records)
    panels = [
        (title, {impl: [metric_of(by_key.get((label, impl, mode)), metric) for label in labels]
                 for impl in impls})
        for mode, title in (("fwdbwd", "forward + backward"), ("fwd", "forward"))
        if any(r["mode"] == mode for r in records)
    ]
    _timing.save_grouped_bar_plot(
        path, labels, panels, ylabel=f"TFLOP/s ({metric.replace('_', '-')})",
        title=f"attention, bf16, {device_kind}",
    )


# --- Command line. ---


def comma_list(item_type):
    return lambda text: [item_type(item) for item in text.split(",") if item]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.attention", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--head-dims", type=comma_list(int), help="e.g. 64,128 (default: all)")
    parser.add_argument("--seq-lens", type=comma_list(int), help="e.g. 2048,8192 (default: all)")
    parser.add_argument("--causal", choices=["both", "causal", "full"], default="both")
    parser.add_argument("--impls", type=comma_list(str), default=DEFAULT_IMPLS,
                        help=f"of {','.join([*JAX_IMPLS, *TORCH_IMPLS])} "
                             f"(default: {','.join(DEFAULT_IMPLS)})")
    parser.add_argument("--modes", type=comma_list(str), default=list(MODES), help="fwd,fwdbwd")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: one tiny shape {QUICK_SHAPE}, 3 iterations")
    parser.add_argument("--interpret", action="store_true",
                        help="run Pallas kernels (ours, jax_pallas_mha) in interpret mode (CPU)")
    parser.add_argument("--block-sizes", type=json.loads,
                        help="JSON overriding ours' tuned block sizes, e.g. "
                             '\'{"forward": {"block_q": 128, "block_k": 64}}\'')
    parser.add_argument("--iters", type=int, default=30, help="timed calls per measurement")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls after compiling")
    parser.add_argument("--metric", choices=["per_call", "amortised"], default="per_call",
                        help="timing shown in the table and plot (the JSON has both)")
    parser.add_argument("--xla-max-logits-gib", type=float, default=16.0,
                        help="skip jax_xla where float32 logits would exceed this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--tag", default=time.strftime("%Y%m%d_%H%M%S"),
                        help="file names: attention_{tag}.json/.png")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.impls) - set(JAX_IMPLS) - set(TORCH_IMPLS))
    if unknown:
        parser.error(f"unknown implementations: {','.join(unknown)}")
    if not set(args.modes) <= set(MODES):
        parser.error(f"modes must be among {','.join(MODES)}, got {','.join(args.modes)}")
    args.modes = [mode for mode in MODES if mode in args.modes]
    if args.quick:
        args.iters, args.warmup = 3, 1
    return args


def build_sweep(args):
    causal_values = {"both": (True, False), "causal": (True,), "full": (False,)}[args.causal]
    if args.quick:
        return [Shape(**QUICK_SHAPE, causal=causal) for causal in causal_values]
    return [
        Shape(batch=max(1, TOKENS_PER_BATCH // seq_len), seq_len=seq_len,
              heads=HIDDEN // head_dim, head_dim=head_dim, causal=causal)
        for head_dim, seq_len in SWEEP
        if (not args.head_dims or head_dim in args.head_dims)
        and (not args.seq_lens or seq_len in args.seq_lens)
        for causal in causal_values
    ]


def main(argv=None):
    args = parse_args(argv)
    # jax.experimental.pallas.ops.gpu.attention and the Pallas-Triton lowering warn on each use.
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    shapes = build_sweep(args)
    environment = _timing.environment_info("benchmarks.attention")
    config = {k: v for k, v in vars(args).items() if k not in ("out_dir", "tag")}
    json_path = os.path.join(args.out_dir, f"attention_{args.tag}.json")
    png_path = os.path.join(args.out_dir, f"attention_{args.tag}.png")
    print(f"{environment['device_kind']}, jax {environment['versions']['jax']}: "
          f"{len(shapes)} shapes x {len(args.impls)} implementations x {len(args.modes)} modes",
          flush=True)

    records = []
    total = len(shapes) * len(args.impls) * len(args.modes)
    for shape_index, shape in enumerate(shapes):
        inputs = make_inputs(shape, args.seed + shape_index)
        rows = min(REFERENCE_ROWS, shape.seq_len)
        reference = np.asarray(reference_tail(*inputs[:3], causal=shape.causal, rows=rows))
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

    labels = [shape.label for shape in shapes]
    print(f"\nwrote {json_path} and {png_path}\n")
    if "ours" in args.impls and "fwdbwd" in args.modes:
        print(ratio_summary(records, labels, args.metric) + "\n")
    print(results_table(records, labels, args.impls, args.metric))


if __name__ == "__main__":
    main()
