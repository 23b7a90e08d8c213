"""Attention benchmark: pallas_kernels' FlashAttention against JAX, tokamax and torch kernels.

On the GPU machine, from the repository root (device_setup.sh installs tokamax from .whl/):

    source benchmarks/device_setup.sh
    python -m benchmarks.attention --out-dir "$OUT" --tag h200

CPU smoke test (Pallas kernels in interpret mode; the GPU-only baselines record errors):

    python -m benchmarks.attention --quick --interpret

Sweep: self-attention, bf16, hidden size 2048 (N = 2048 / H query heads), 16384 tokens per batch
(B = 16384 // T, at least 1), causal and full, forward and forward+backward, at head dims 64 and
128 with T 2048 and 8192, head dim 128 with T 16384 and 32768, head dim 256 with T 2048 and 8192
(`--product`: every `--head-dims` with every `--seq-lens`). `--groups 1,4,8,mqa` adds grouped
key/value heads (N / G of them; MQA: one), `--masks causal,full,window` a causal sliding window
of `--window` keys (1024). Issue 28's sweep is 99 shapes; split it over device calls by head dim
and length (its JSON is rewritten after each shape, so a call cut short keeps what it measured):

    python -m benchmarks.attention --product --head-dims 128 --seq-lens 2048,8192 \
        --groups 1,4,8,mqa --masks causal,full,window --metric amortised \
        --impls ours,jax_cudnn,tokamax_triton,torch_flash --tag h200_sweep_d128

FLOPs: 4·B·N·H per visible (query, key) pair (T² full, T(T+1)/2 causal, fewer in a window);
forward+backward 3.5 times the forward. Peers that cannot run a case (jax's Pallas mha with
grouped heads or a window; torch's SDPA with a window) are recorded as skipped.

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
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import _harness, _timing

TOKENS_PER_BATCH = 16384
HIDDEN = 2048
# (head dim, sequence length) of the full sweep; each is run causal and full.
SWEEP = [
    (64, 2048), (64, 8192), (128, 2048), (128, 8192),
    (128, 16384), (128, 32768), (256, 2048), (256, 8192),
]
QUICK_SHAPE = dict(batch=2, seq_len=256, heads=2, head_dim=64)
MASKS = ("causal", "full", "window")
FWDBWD_FLOP_FACTOR = 3.5
REFERENCE_ROWS = 256
# The record field that --metric shows in the tables and plot.
METRIC_FIELDS = {"per_call": "tflops", "amortised": "tflops_amortised",
                 "device": "tflops_device"}


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    seq_len: int
    heads: int
    head_dim: int
    causal: bool
    kv_heads: int | None = None  # None: heads (MHA)
    window: int | None = None  # a causal window: keys at most `window` before the query

    @property
    def label(self):
        mask = (f"window{self.window}" if self.window is not None
                else "causal" if self.causal else "full")
        heads = "" if self.groups == 1 else f" {self.heads}:{self.kv_heads}"
        return f"d{self.head_dim} T{self.seq_len} {mask}{heads}"

    @property
    def groups(self):
        return 1 if self.kv_heads is None else self.heads // self.kv_heads

    @property
    def scale(self):
        return 1.0 / math.sqrt(self.head_dim)

    def visible_pairs(self):
        """(query, key) pairs a row attends to."""
        t = self.seq_len
        if self.window is not None:
            w = min(self.window, t - 1)  # query i sees keys max(0, i - w) .. i
            return (w + 1) * (w + 2) // 2 + (t - w - 1) * (w + 1)
        return t * (t + 1) // 2 if self.causal else t * t

    def flops(self, mode):
        forward = 4 * self.batch * self.heads * self.visible_pairs() * self.head_dim
        return forward * (FWDBWD_FLOP_FACTOR if mode == "fwdbwd" else 1)

    def window_args(self):
        """jax.nn's `local_window_size` keyword for this shape (none without a window)."""
        return {} if self.window is None else {"local_window_size": (self.window, 0)}


# --- JAX implementations: each builds attn(q, k, v) -> out for a shape, layout (B, T, N, H). ---


def ours_block_sizes(overrides, head_dim):
    """The tuned AttentionBlocks for this device and head dim, fields replaced by `overrides`.

    `overrides` maps a kernel ("forward", "dkv", "dq") to the KernelBlocks fields to change, e.g.
    {"forward": {"block_q": 128, "block_k": 64, "num_warps": 8, "num_stages": 3}}.
    """
    tuning = importlib.import_module("pallas_kernels.attention.tuning")
    # The sweep's head dims are powers of two, as the table's lookup expects.
    tuned = tuning.blocks_for(jax.devices()[0].device_kind, head_dim)
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
        **shape.window_args(),
    )


def build_jax_cudnn(shape, opts):
    return functools.partial(
        jax.nn.dot_product_attention, scale=shape.scale, is_causal=shape.causal,
        implementation="cudnn", **shape.window_args(),
    )


def build_jax_xla(shape, opts):
    logits_gib = 4 * shape.batch * shape.heads * shape.seq_len**2 / 2**30
    if logits_gib > opts.xla_max_logits_gib:
        raise _harness.SkippedError(
            f"float32 logits would take {logits_gib:.0f} GiB > {opts.xla_max_logits_gib} GiB"
        )
    return functools.partial(
        jax.nn.dot_product_attention, scale=shape.scale, is_causal=shape.causal,
        implementation="xla", **shape.window_args(),
    )


def build_jax_pallas_mha(shape, opts):
    if shape.groups != 1 or shape.window is not None:
        raise _harness.SkippedError("jax's Pallas mha takes equal query and key heads, no window")
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
            implementation=implementation, **shape.window_args(),
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
    """Fresh standard-normal q and output cotangent (B, T, N, H) and k, v (B, T, K, H),
    bfloat16."""
    dims = (shape.batch, shape.seq_len, shape.heads, shape.head_dim)
    kv_dims = (*dims[:2], shape.heads // shape.groups, shape.head_dim)
    keys = jax.random.split(jax.random.key(seed), 4)
    return tuple(jax.random.normal(key, d, jnp.bfloat16)
                 for key, d in zip(keys, (dims, kv_dims, kv_dims, dims), strict=True))


@functools.partial(jax.jit, static_argnames=("causal", "rows", "window"))
def reference_tail(q, k, v, *, causal, rows, window=None):
    """float32 attention output of the last `rows` queries of batch row 0: (rows, N, H)."""
    t, heads, head_dim = q.shape[1], q.shape[2], q.shape[3]
    hi = jax.lax.Precision.HIGHEST
    q_tail, k0, v0 = (x.astype(jnp.float32) for x in (q[0, t - rows:], k[0], v[0]))
    k0, v0 = (jnp.repeat(x, heads // x.shape[1], axis=1) for x in (k0, v0))  # grouped heads
    logits = jnp.einsum("qnh,knh->nqk", q_tail, k0, precision=hi) / math.sqrt(head_dim)
    if causal:
        keys, queries = jnp.arange(t)[None, :], jnp.arange(t - rows, t)[:, None]
        visible = keys <= queries
        if window is not None:
            visible &= keys >= queries - window
        logits = jnp.where(visible[None], logits, -jnp.inf)
    return jnp.einsum("nqk,knh->qnh", jax.nn.softmax(logits, axis=-1), v0, precision=hi)


def inputs_and_reference(shape, seed):
    """make_inputs and the reference_tail of up to REFERENCE_ROWS rows, as numpy."""
    inputs = make_inputs(shape, seed)
    rows = min(REFERENCE_ROWS, shape.seq_len)
    return inputs, np.asarray(reference_tail(*inputs[:3], causal=shape.causal, rows=rows,
                                             window=shape.window))


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
    forward_error = None
    if mode == "fwd":

        def forward_error(out):
            return _harness.relative_error(out[0, -reference.shape[0]:], reference)

    return _harness.measure_jax(step, args, opts, forward_error)


def measure_torch(backend_name, shape, mode, inputs, reference, opts):
    torch = _harness.import_torch_cuda()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if shape.window is not None:
        raise _harness.SkippedError("torch's SDPA backends take no sliding window")
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
                q, k, v, is_causal=shape.causal, scale=shape.scale,
                enable_gqa=shape.groups != 1,
            )

    result = {}
    if mode == "fwd":
        out_tail = forward()[0, :, -reference.shape[0]:].transpose(0, 1)
        result["fwd_rel_err"] = _harness.relative_error(out_tail.float().cpu().numpy(), reference)
        step = forward
    else:
        for x in (q, k, v):
            x.requires_grad_(True)

        def step():
            return torch.autograd.grad(forward(), (q, k, v), dout)

    return result, _timing.time_torch(step, iters=opts.iters, warmup=opts.warmup)


def run_one(impl, shape, mode, inputs, reference, opts):
    """One measurement as a flat record, with FLOPs and TFLOP/s; never raises."""
    record = {**_harness.base_record(shape, impl, mode), "flops": shape.flops(mode)}
    if impl in TORCH_IMPLS:
        measure = functools.partial(
            measure_torch, TORCH_IMPLS[impl], shape, mode, inputs, reference, opts
        )
    else:

        def measure():
            attn = JAX_IMPLS[impl](shape, opts)
            return measure_jax(attn, shape, mode, inputs, reference, opts)

    record = _harness.measured_record(record, measure, uses_torch=impl in TORCH_IMPLS)
    if record["status"] == "ok":
        record["tflops"] = _timing.tflops(record["flops"], record["ms"])
        record["tflops_amortised"] = _timing.tflops(record["flops"], record["ms_amortised"])
        if record["ms_device"] is not None:
            record["tflops_device"] = _timing.tflops(record["flops"], record["ms_device"])
    return record


def progress_line(index, total, record):
    """The line printed after a measurement: ms, TFLOP/s and the checks."""
    return _harness.format_progress(
        index, total, record, label_width=18, impl_width=15, show_temp=False,
        timing_text=lambda r: (f"{r['ms']:9.3f} ms {r['tflops']:6.1f} TFLOP/s "
                               f"(amortised {r['tflops_amortised']:6.1f})"),
    )


# --- Reports. ---


def results_table(records, labels, impls, metric):
    by_key = _harness.index_records(records)
    field = METRIC_FIELDS[metric]
    rows = [[label, *(_harness.mode_cells(by_key, label, impl, field) for impl in impls)]
            for label in labels]
    legend = (f"TFLOP/s ({_harness.metric_text(metric)}), cells fwd / fwdbwd; err: failed, skip: "
              f"skipped (JSON has why); !: fwd output off the reference by > "
              f"{_harness.REL_ERR_TOLERANCE}")
    return legend + "\n" + _timing.format_table(["shape", *impls], rows)


def ratio_summary(records, labels, metric):
    """ours' fwd+bwd TFLOP/s, its speed relative to two baselines, and its XLA temp memory."""
    by_key = _harness.index_records(records)
    field = METRIC_FIELDS[metric]
    baselines = ["tokamax_triton", "torch_flash", "jax_cudnn"]
    rows = []
    for label in labels:
        ours = by_key.get((label, "ours", "fwdbwd"))
        ours_tf = _harness.metric_value(ours, field)
        row = [label, "-" if ours_tf is None else f"{ours_tf:.3g}"]
        for name in baselines:
            theirs = _harness.metric_value(by_key.get((label, name, "fwdbwd")), field)
            row.append("-" if None in (ours_tf, theirs) else f"{ours_tf / theirs:.2f}x")
        temp = None if ours is None else ours.get("temp_bytes")
        row.append("-" if temp is None else f"{temp / 2**20:.0f}")
        rows.append(row)
    header = ["shape", "ours fwdbwd", *(f"vs {name}" for name in baselines), "ours temp MiB"]
    return "ours, forward+backward\n" + _timing.format_table(header, rows)


def save_plot(path, records, labels, impls, metric, device_kind):
    panels = _harness.plot_panels(
        records, labels, impls, METRIC_FIELDS[metric],
        (("fwdbwd", "forward + backward"), ("fwd", "forward")),
    )
    _timing.save_grouped_bar_plot(
        path, labels, panels, ylabel=f"TFLOP/s ({_harness.metric_text(metric)})",
        title=f"attention, bf16, {device_kind}",
    )


# --- Command line. ---


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.attention", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--head-dims", type=_harness.comma_list(int),
                        help="e.g. 64,128 (default: all)")
    parser.add_argument("--seq-lens", type=_harness.comma_list(int),
                        help="e.g. 2048,8192 (default: all)")
    parser.add_argument("--product", action="store_true",
                        help="every --head-dims with every --seq-lens (not only the sweep's pairs)")
    parser.add_argument("--masks", type=_harness.comma_list(str), default=["causal", "full"],
                        help="of causal, full, window (default: causal,full)")
    parser.add_argument("--window", type=int, default=1024,
                        help="the 'window' mask's keys before each query (default 1024)")
    parser.add_argument("--groups", type=_harness.comma_list(str), default=["1"],
                        help="query heads per key/value head, e.g. 1,4,8,mqa (default: 1)")
    _harness.add_selection_arguments(
        parser, default_impls=DEFAULT_IMPLS,
        impls_help=f"of {','.join([*JAX_IMPLS, *TORCH_IMPLS])} "
                   f"(default: {','.join(DEFAULT_IMPLS)})",
        quick_help=f"smoke test: one tiny shape {QUICK_SHAPE}, 3 iterations",
        interpret_help="run Pallas kernels (ours, jax_pallas_mha) in interpret mode (CPU)",
    )
    parser.add_argument("--block-sizes", type=json.loads,
                        help="JSON overriding ours' tuned block sizes, e.g. "
                             '\'{"forward": {"block_q": 128, "block_k": 64}}\'')
    _harness.add_timing_arguments(parser, warmup_help="untimed calls after compiling")
    parser.add_argument("--xla-max-logits-gib", type=float, default=16.0,
                        help="skip jax_xla where float32 logits would exceed this")
    _harness.add_output_arguments(parser, "attention")
    args = parser.parse_args(argv)
    _harness.check_common_arguments(parser, args, [*JAX_IMPLS, *TORCH_IMPLS])
    unknown = sorted(set(args.masks) - set(MASKS))
    if unknown:
        parser.error(f"--masks: unknown {','.join(unknown)} (of {','.join(MASKS)})")
    if args.window < 1:
        parser.error(f"--window must be at least 1, got {args.window}")
    for group in args.groups:
        if group != "mqa" and not (group.isdigit() and int(group) >= 1):
            parser.error(f"--groups: {group!r} is neither a positive integer nor mqa")
    if args.product and not (args.head_dims and args.seq_lens):
        parser.error("--product needs --head-dims and --seq-lens")
    return args


def _masks(args):
    """(causal, window) of each --masks entry."""
    return [{"causal": (True, None), "full": (False, None), "window": (True, args.window)}[m]
            for m in args.masks]


def _kv_heads(heads, group):
    """Key/value heads for `heads` query heads at a --groups entry; None: not a divisor."""
    if group == "mqa":
        return 1
    return heads // int(group) if heads % int(group) == 0 else None


def build_sweep(args):
    if args.quick:
        pairs, base = [(QUICK_SHAPE["head_dim"], QUICK_SHAPE["seq_len"])], QUICK_SHAPE
    elif args.product:
        pairs, base = [(d, t) for d in args.head_dims for t in args.seq_lens], None
    else:
        pairs = [(d, t) for d, t in SWEEP if (not args.head_dims or d in args.head_dims)
                 and (not args.seq_lens or t in args.seq_lens)]
        base = None
    shapes = []
    for head_dim, seq_len in pairs:
        batch = base["batch"] if base else max(1, TOKENS_PER_BATCH // seq_len)
        heads = base["heads"] if base else HIDDEN // head_dim
        for group in args.groups:
            kv_heads = _kv_heads(heads, group)
            if kv_heads is None:
                continue
            for causal, window in _masks(args):
                shapes.append(Shape(batch=batch, seq_len=seq_len, heads=heads, head_dim=head_dim,
                                    causal=causal, kv_heads=None if kv_heads == heads else kv_heads,
                                    window=window))
    return list(dict.fromkeys(shapes))  # MQA may repeat a group


def main(argv=None):
    args = parse_args(argv)
    # jax.experimental.pallas.ops.gpu.attention and the Pallas-Triton lowering warn on each use.
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    shapes = build_sweep(args)
    environment = _timing.environment_info("benchmarks.attention")
    records, json_path, png_path = _harness.run_sweep(
        "attention", shapes, environment, args, inputs_and_reference=inputs_and_reference,
        run_one=run_one, progress_line=progress_line, save_plot=save_plot,
    )
    labels = [shape.label for shape in shapes]
    print(f"\nwrote {json_path} and {png_path}\n")
    if "ours" in args.impls and "fwdbwd" in args.modes:
        print(ratio_summary(records, labels, args.metric) + "\n")
    print(results_table(records, labels, args.impls, args.metric))


if __name__ == "__main__":
    main()
