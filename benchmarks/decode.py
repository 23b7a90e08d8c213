"""Decode-attention benchmark: attention_with_kv_cache against JAX, torch and vLLM decode kernels.

On the GPU machine, from the repository root, with `.peers` carried (peers_setup.sh makes
vLLM's Triton decode kernel importable from the sdist in .peers/):

    source benchmarks/peers_setup.sh
    python -m benchmarks.decode --out-dir "$OUT" --tag h200

CPU smoke test (Pallas kernels in interpret mode; torch and vLLM are recorded as skipped):

    JAX_PLATFORMS=cpu python -m benchmarks.decode --interpret --quick \
        --impls ours,ours-unsplit,ours-int8 --tag smoke --out-dir /tmp/decode_smoke

Sweep: one new token (T 1) per row, bf16 q, every row at full context length (`--ragged`:
lengths uniform in [1, context]), head dim 128, a paged cache of 16-token pages whose block
table is a random permutation of the pages (rows' pages scattered as after serving a while):
  gqa   B 64, context 8192, 32 query heads on 4 KV heads
  mha   B 64, context 8192, 32 on 32
  long  B 1, context 32768, 8 on 1
Each shape's keys and values are one logical cache, standard normal; each implementation gets
it in its own layout, built before timing (never timed):
  ours          pallas_kernels.attention_with_kv_cache on the paged cache (pages, page_size, K,
                H) with block_table (B, max_pages), splits chosen by the op (`num_splits` None)
  ours-unsplit  the same with num_splits=1 (one program per row and KV head)
  ours-int8     the same cache quantised to int8 with a float32 scale per token and KV head
                (quantization.encode), auto splits; checked against the reference run on the
                int8 cache, its distance from the bf16 reference recorded as int8_vs_bf16_err
  jax-paged     jax.experimental.pallas.ops.gpu.paged_attention.paged_attention: q (B, N, H)
                pre-scaled by 1/sqrt(H) (it has no scale argument), k/v pages (K, pages,
                page_size, H) (KV-head-major), the same block table, lengths int32; its k_splits
                must divide the pages per row (`--jax-k-splits`, default 16 = its default)
  jax-decode    jax.experimental.pallas.ops.gpu.decode_attention.gqa over a dense cache: q
                (B, N, H), k/v (B, S, K, H), kv_seq_len (B,); gqa swaps k/v to (B, K, S, H)
                inside, so the cache is held as (B, K, S, H) and passed through swapaxes, which
                XLA cancels against gqa's own (no transpose is timed); S % k_splits == 0
  torch-sdpa    torch.nn.functional.scaled_dot_product_attention(enable_gqa=True), q (B, N, 1,
                H), k/v dense (B, K, S, H) (the JAX arrays through DLPack); a boolean key mask
                only for ragged rows; torch chooses the backend
  vllm-triton   vLLM's Triton decode kernel (triton_decode_attention.decode_attention_fwd, from
                the sdist in .peers/, see peers_setup.sh): q (B, N, H), k/v buffers in ours'
                paged layout (pages, page_size, K, H), read in place, req_to_token = the block
                table, b_seq_len, scratch attn_logits (B, N, splits, H + 1) float32 and o (and
                lse in newer versions) allocated once outside the timing; num_kv_splits
                (`--vllm-kv-splits`) "best": the fastest power of two from 1 to 64 measured
                first (recorded with the rule vLLM's Triton MLA backend would choose)
The peers cannot read an int8 cache with per-token scales in these layouts (vLLM's kernel takes
one fp8 scale per tensor), so ours-int8 has no peer; ours-int8 ms / ours ms is its figure.

Bandwidth: the bytes a decode step must read (q, each row's visible keys and values, their
scales for int8, the block table; not the output) / time, in GB/s (1e9), and as a fraction of
the device's copy bandwidth, measured first in the same process: read + write bytes / time of
two passes over a `--copy-gib` buffer (jnp.copy and an elementwise uint32 + 1, the faster
counts), recorded in the JSON's environment.

Timing (_timing.py): per call, amortised and device. Decode kernels run for microseconds, less
than a Python dispatch, so a JAX implementation's device time is the span of its kernels in a
profile of `--chain-calls` calls chained in one jitted function (`_profile.kernel_span_seconds`:
first kernel start to last kernel end, per call; `ms_chained` keeps the chain's wall time,
which also counts the executable's dispatch, about 25 µs a call at 20 calls); torch's is
CUDA-graph replay, which likewise counts the gaps between kernels but not the host.
`--metric device` (the default here) is the time to compare kernels by. Outputs are checked
against pallas_kernels.kv_cache.reference (float32) on the first rows of the batch (max |out -
ref| / max |ref|). Each (shape, implementation) is measured on its own; a failure is recorded
as an error, a peer that cannot run a shape or is absent as skipped (the JSON has why).

Writes {out_dir}/decode_{tag}.json (environment and every measurement, rewritten after each
shape) and {out_dir}/decode_{tag}.png (fraction of copy bandwidth per shape and implementation),
and prints the tables last: fraction of copy bandwidth, ms, and the targets of issue 27.
`--generate` adds HybridLM.generate on the zamba2-like 1.1B model (GENERATE_RUNS; `--generate
B64:bfloat16` times only the runs it names).
"""

import os

# Before jax is first imported: JAX preallocates this share of GPU memory; torch, in the same
# process, gets the rest.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")

import argparse
import dataclasses
import functools
import importlib
import inspect
import itertools
import json
import math
import statistics
import time
import typing
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import _harness, _profile, _timing

NEW_TOKENS = 1
HEAD_DIM = 128
PAGE_SIZE = 16
# name -> (batch, context, query heads, KV heads) of the sweep, in this order.
SWEEP = {"gqa": (64, 8192, 32, 4), "mha": (64, 8192, 32, 32), "long": (1, 32768, 8, 1)}
# --quick: the same names at tiny sizes, head dim 64.
QUICK_SWEEP = {"gqa": (2, 256, 4, 2), "mha": (2, 256, 4, 4), "long": (1, 1024, 4, 1)}
QUICK_HEAD_DIM = 64
IMPLS = ("ours", "ours-unsplit", "ours-int8", "jax-paged", "jax-decode", "torch-sdpa",
         "vllm-triton")
TORCH_IMPLS = ("torch-sdpa", "vllm-triton")
# Batch rows whose outputs are checked against the float32 reference.
REFERENCE_ROWS = 4
# Where vLLM's Triton decode kernel has lived (newest first); peers_setup.sh extracts one.
VLLM_DECODE_MODULES = ("vllm.v1.attention.ops.triton_decode_attention",
                       "vllm.attention.ops.triton_decode_attention")
VLLM_SPLIT_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
# The record fields that --metric shows in the tables and plot.
FRACTION_FIELDS = {"per_call": "copy_fraction", "amortised": "copy_fraction_amortised",
                   "device": "copy_fraction_device"}
MS_FIELDS = {"per_call": "ms", "amortised": "ms_amortised", "device": "ms_device"}


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    context: int
    heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    ragged: bool = False

    @property
    def label(self):
        ragged = " ragged" if self.ragged else ""
        return f"B{self.batch} ctx{self.context} {self.heads}:{self.kv_heads}{ragged}"

    @property
    def pages_per_row(self):
        return -(-self.context // self.page_size)

    @property
    def scale(self):
        return 1.0 / math.sqrt(self.head_dim)


class Inputs(typing.NamedTuple):
    """One shape's logical cache in ours' layout, and what a step reads besides."""

    q: jax.Array  # (B, T, N, H) bf16
    k_pages: jax.Array  # (B * pages_per_row, page_size, K, H) bf16
    v_pages: jax.Array
    block_table: jax.Array  # (B, pages_per_row) int32, a permutation of the pages
    seqlens: jax.Array  # (B,) int32, the new token included
    visible_keys: int  # sum of seqlens: the keys a step must read per KV head


def bytes_read(shape, inputs, *, int8=False):
    """Bytes a decode step must read: q, the visible keys and values (and their float32 scales
    for an int8 cache) and the block table."""
    q = shape.batch * NEW_TOKENS * shape.heads * shape.head_dim * 2
    entries = 2 * inputs.visible_keys * shape.kv_heads
    kv = entries * shape.head_dim * (1 if int8 else 2) + (entries * 4 if int8 else 0)
    return q + kv + shape.batch * shape.pages_per_row * 4


# --- Inputs and the reference. ---


def make_inputs(shape, seed):
    """Fresh standard-normal q and cache; a random permutation of the pages as block table."""
    keys = jax.random.split(jax.random.key(seed), 5)
    pages = shape.batch * shape.pages_per_row
    cache_shape = (pages, shape.page_size, shape.kv_heads, shape.head_dim)
    q = jax.random.normal(keys[0], (shape.batch, NEW_TOKENS, shape.heads, shape.head_dim),
                          jnp.bfloat16)
    k_pages = jax.random.normal(keys[1], cache_shape, jnp.bfloat16)
    v_pages = jax.random.normal(keys[2], cache_shape, jnp.bfloat16)
    table = jax.random.permutation(keys[3], pages).astype(jnp.int32)
    table = table.reshape(shape.batch, shape.pages_per_row)
    if shape.ragged:
        seqlens = jax.random.randint(keys[4], (shape.batch,), 1, shape.context + 1, jnp.int32)
    else:
        seqlens = jnp.full((shape.batch,), shape.context, jnp.int32)
    return Inputs(q, k_pages, v_pages, table, seqlens, int(jnp.sum(seqlens)))


@jax.jit
def reference_rows(q, k_pages, v_pages, block_table, seqlens, k_scale=None, v_scale=None):
    """float32 output (R, T, N, H) of the first R = REFERENCE_ROWS rows by the pure-jnp
    reference (it gathers only those rows' pages)."""
    from pallas_kernels.kv_cache import reference

    rows = min(REFERENCE_ROWS, q.shape[0])
    return reference.attention_with_kv_cache(
        q[:rows].astype(jnp.float32), k_pages, v_pages, seqlens[:rows],
        block_table=block_table[:rows], k_scale=k_scale, v_scale=v_scale)


def inputs_and_reference(shape, seed):
    """make_inputs and the reference_rows of the bf16 cache, as numpy."""
    inputs = make_inputs(shape, seed)
    return inputs, np.asarray(reference_rows(*inputs[:5]))


@functools.partial(jax.jit, static_argnames=("head_major",))
def dense_cache(pages, block_table, *, head_major):
    """The paged cache read through the block table as a dense one: (B, S, K, H), or with
    `head_major` (B, K, S, H)."""
    rows = pages[block_table]  # (B, pages_per_row, page_size, K, H)
    dense = rows.reshape(rows.shape[0], -1, *rows.shape[3:])
    return jnp.swapaxes(dense, 1, 2) if head_major else dense


@jax.jit
def quantise_int8(pages):
    """(int8 entries, float32 scales (pages, K, page_size)) of a cache, one scale per token
    and KV head, as update_kv_cache writes them."""
    from pallas_kernels.kv_cache import quantization

    entries, scales = quantization.encode(pages, jnp.int8, True)
    return entries, jnp.swapaxes(scales, 1, 2)


def check_rows(out):
    """The checked rows of an output (B, T, N, H), as float32 numpy."""
    return np.asarray(out[:REFERENCE_ROWS], np.float32)


# --- JAX implementations: each returns (result fields, Timing). ---


def measure_jax_step(step, args, reference, opts, result=None):
    """_harness.measure_jax, its device time replaced by `_timing.chained_seconds` (decode
    steps are shorter than a dispatch, so the amortised time would count the host); `step`
    returns (B, T, N, H)."""

    def forward_error(out):
        return _harness.relative_error(check_rows(out), reference)

    fields, timing = _harness.measure_jax(step, args, opts, forward_error)
    chained_s = _timing.chained_seconds(step, *args, calls=opts.chain_calls)
    span_s = _profile.kernel_span_seconds(step, *args, calls=opts.chain_calls)
    fields = {**fields, "ms_chained": 1e3 * chained_s,
              "device_time": "chained" if span_s is None else "kernel_span"}
    device_s = chained_s if span_s is None else span_s
    return {**(result or {}), **fields}, dataclasses.replace(timing, device_ms=1e3 * device_s)


def ours_splits(shape, int8=False):
    """The number of splits attention_with_kv_cache chooses for `num_splits=None`."""
    from pallas_kernels.kv_cache import tuning

    return tuning.plan(jax.devices()[0].device_kind, shape.batch, shape.kv_heads,
                       shape.pages_per_row * shape.page_size, shape.page_size,
                       key_row_bytes=tuning.row_bytes(
                           shape.head_dim, jnp.int8 if int8 else jnp.bfloat16)).splits


def ours_builder(*, num_splits=None, int8=False):
    def measure(shape, inputs, reference, opts):
        import pallas_kernels

        q, k_pages, v_pages, table, seqlens = inputs[:5]
        result = {"num_splits": num_splits or ours_splits(shape, int8)}
        call = functools.partial(
            pallas_kernels.attention_with_kv_cache, scale=shape.scale, num_splits=num_splits,
            implementation="pallas", interpret=opts.interpret or None)
        if not int8:
            def step(q, k_pages, v_pages, seqlens, table):
                return call(q, k_pages, v_pages, seqlens, block_table=table)

            return measure_jax_step(step, (q, k_pages, v_pages, seqlens, table), reference,
                                    opts, result)

        (k8, k_scale), (v8, v_scale) = quantise_int8(k_pages), quantise_int8(v_pages)
        int8_reference = np.asarray(reference_rows(q, k8, v8, table, seqlens, k_scale, v_scale))
        result["int8_vs_bf16_err"] = _harness.relative_error(int8_reference, reference)

        def step(q, k8, v8, seqlens, table, k_scale, v_scale):
            return call(q, k8, v8, seqlens, block_table=table, k_scale=k_scale, v_scale=v_scale)

        return measure_jax_step(step, (q, k8, v8, seqlens, table, k_scale, v_scale),
                                int8_reference, opts, result)

    return measure


def measure_jax_paged(shape, inputs, reference, opts):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention

    k_splits = opts.jax_k_splits
    per_split = shape.pages_per_row // k_splits
    # Its asserts: k_splits divides the pages per row, and min(their share, 8 pages per compute
    # block) divides each split's pages.
    if shape.pages_per_row % k_splits or not per_split or per_split % min(per_split, 8):
        raise _harness.SkippedError(
            f"paged_attention needs k_splits ({k_splits}) to divide the pages per row "
            f"({shape.pages_per_row}) into a whole number of 8-page blocks (or fewer pages)")
    # Its layout: pages KV-head-major, (K, pages, page_size, H); no scale argument.
    k_pages, v_pages = (jnp.moveaxis(x, 2, 0) for x in inputs[1:3])
    q = (inputs.q[:, 0].astype(jnp.float32) * shape.scale).astype(inputs.q.dtype)

    def step(q, k_pages, v_pages, table, seqlens):
        out = paged_attention.paged_attention(
            q, k_pages, v_pages, table, seqlens, k_splits=k_splits, interpret=opts.interpret)
        return out[:, None]

    return measure_jax_step(step, (q, k_pages, v_pages, inputs.block_table, inputs.seqlens),
                            reference, opts, {"k_splits": k_splits})


def measure_jax_decode(shape, inputs, reference, opts):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import decode_attention

    k_splits = opts.jax_k_splits
    capacity = shape.pages_per_row * shape.page_size
    per_split = capacity // k_splits
    # Its asserts: k_splits divides the keys into pieces of >= 16, each a whole number of
    # min(its size, block_k 128) keys.
    if capacity % k_splits or per_split < 16 or per_split % min(per_split, 128):
        raise _harness.SkippedError(
            f"decode_attention needs k_splits ({k_splits}) to divide the context ({capacity}) "
            "into pieces of at least 16 keys and whole 128-key blocks (or fewer keys)")
    k_heads_major, v_heads_major = (
        dense_cache(x, inputs.block_table, head_major=True) for x in inputs[1:3])

    def step(q, k, v, seqlens):
        # gqa takes (B, S, K, H) and swaps it to (B, K, S, H) itself: the two swaps cancel.
        out = decode_attention.gqa(
            q[:, 0], jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), kv_seq_len=seqlens,
            sm_scale=shape.scale, k_splits=k_splits, interpret=opts.interpret)
        return out[:, None]

    return measure_jax_step(step, (inputs.q, k_heads_major, v_heads_major, inputs.seqlens),
                            reference, opts, {"k_splits": k_splits})


JAX_IMPLS = {
    "ours": ours_builder(),
    "ours-unsplit": ours_builder(num_splits=1),
    "ours-int8": ours_builder(int8=True),
    "jax-paged": measure_jax_paged,
    "jax-decode": measure_jax_decode,
}


# --- torch implementations. ---


def import_torch_or_skip():
    try:
        return _harness.import_torch_cuda()
    except (ImportError, RuntimeError) as e:
        raise _harness.SkippedError(f"needs torch with CUDA: {e}") from e


def to_torch(torch, x):
    """A JAX array as a torch tensor on the GPU: shared through DLPack, else copied by way of
    the host (bf16 -> float32 -> bf16 is exact)."""
    try:
        return torch.from_dlpack(x)
    except (TypeError, RuntimeError, BufferError):
        dtypes = {jnp.dtype(jnp.bfloat16): torch.bfloat16, jnp.dtype(jnp.int32): torch.int32}
        host = np.asarray(x, np.float32 if x.dtype == jnp.bfloat16 else x.dtype)
        return torch.from_numpy(host).to("cuda", dtypes[jnp.dtype(x.dtype)])


def measure_torch_sdpa(shape, inputs, reference, opts):
    torch = import_torch_or_skip()
    held = [dense_cache(x, inputs.block_table, head_major=True) for x in inputs[1:3]]
    k, v = (to_torch(torch, x).contiguous() for x in held)  # (B, K, S, H)
    q = to_torch(torch, inputs.q).transpose(1, 2).contiguous()  # (B, N, T, H)
    mask = None
    if shape.ragged:  # (B, 1, 1, S): the keys below each row's length
        seqlens = to_torch(torch, inputs.seqlens)
        mask = (torch.arange(k.shape[2], device=k.device)[None] < seqlens[:, None])[:, None, None]

    def step():
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=shape.scale, enable_gqa=True)

    out = step().transpose(1, 2)[:REFERENCE_ROWS].float().cpu().numpy()
    result = {"fwd_rel_err": _harness.relative_error(out, reference),
              "torch_backends_able": sdpa_backends_able(torch, step)}
    return result, _timing.time_torch(step, iters=opts.iters, warmup=opts.warmup)


def sdpa_backends_able(torch, step):
    """The fused SDPA backends that can run `step` alone (torch picks among them, by its
    priority order; the math backend always can)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    able = []
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        try:
            with sdpa_kernel([getattr(SDPBackend, name)]):
                step()
        except RuntimeError:
            continue
        able.append(name)
    return able


def vllm_decode_module():
    """vLLM's triton_decode_attention module, from wherever peers_setup.sh extracted it."""
    errors = []
    for name in VLLM_DECODE_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise _harness.SkippedError(
        "vLLM's Triton decode kernel is not importable (source benchmarks/peers_setup.sh with "
        ".peers/vllm-*.tar.gz carried): " + "; ".join(errors))


def vllm_rule_splits(shape, multiprocessors):
    """The num_kv_splits that vLLM's Triton MLA backend would choose (its only caller that
    picks one): a power of two, about one split per 512 keys, no more than twice the
    multiprocessors, and no more than it takes to fill them twice given the other grid axes
    (batch x head tiles of min(16, G) query heads; one head per tile for MHA)."""
    groups = shape.heads // shape.kv_heads
    tiles = shape.heads if groups == 1 else -(-shape.heads // min(16, groups))
    ideal = 1 << max(0, (max(1, shape.context // 512) - 1).bit_length())
    occupancy = -(-2 * multiprocessors // max(1, shape.batch * tiles))
    return min(ideal, 2 * multiprocessors, 1 << max(0, (occupancy - 1).bit_length()))


def torch_amortised_ms(torch, fn, iters):
    """Milliseconds per call of `iters` back-to-back calls between two CUDA events."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def measure_vllm_triton(shape, inputs, reference, opts):
    torch = import_torch_or_skip()
    module = vllm_decode_module()
    decode = module.decode_attention_fwd
    params = inspect.signature(decode).parameters
    q = to_torch(torch, inputs.q[:, 0])  # (B, N, H)
    # Its buffers are ours' paged layout, (pages, page_size, K, H), read in place.
    k_buffer, v_buffer, table, seqlens = (to_torch(torch, x) for x in inputs[1:5])
    batch, heads, head_dim = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((batch, heads), dtype=torch.float32, device=q.device)

    def call(splits):
        logits = torch.empty((batch, heads, splits, head_dim + 1), dtype=torch.float32,
                             device=q.device)
        kwargs = dict(q=q, k_buffer=k_buffer, v_buffer=v_buffer, o=out, req_to_token=table,
                      b_seq_len=seqlens, attn_logits=logits, num_kv_splits=splits,
                      sm_scale=shape.scale, page_size=shape.page_size, logit_cap=0.0)
        if "lse" in params:
            kwargs["lse"] = lse
        return lambda: decode(**kwargs)

    multiprocessors = torch.cuda.get_device_properties(q.device).multi_processor_count
    rule = vllm_rule_splits(shape, multiprocessors)
    result = {"vllm_module": module.__name__, "kv_splits_vllm_rule": rule}
    if opts.vllm_kv_splits == "vllm":
        splits = rule
    elif opts.vllm_kv_splits == "best":
        tried = {s: torch_amortised_ms(torch, call(s), opts.iters) for s in VLLM_SPLIT_CANDIDATES}
        result["kv_splits_tried_ms"] = {str(s): ms for s, ms in tried.items()}
        splits = min(tried, key=tried.get)
    else:
        splits = int(opts.vllm_kv_splits)
    result["kv_splits"] = splits
    step = call(splits)
    step()
    result["fwd_rel_err"] = _harness.relative_error(
        out[:REFERENCE_ROWS, None].float().cpu().numpy(), reference)
    return result, _timing.time_torch(step, iters=opts.iters, warmup=opts.warmup)


TORCH_MEASURES = {"torch-sdpa": measure_torch_sdpa, "vllm-triton": measure_vllm_triton}


# --- Measurements. ---


def run_one(impl, shape, mode, inputs, reference, opts, *, copy_gbps):
    """One measurement as a flat record, with bytes, GB/s and the fraction of the copy
    bandwidth; never raises."""
    int8 = impl == "ours-int8"
    record = {**_harness.base_record(shape, impl, mode), "kv_dtype": "int8" if int8 else
              "bfloat16", "bytes": bytes_read(shape, inputs, int8=int8), "copy_gbps": copy_gbps}
    measure = TORCH_MEASURES.get(impl) or JAX_IMPLS[impl]
    record = _harness.measured_record(
        record, functools.partial(measure, shape, inputs, reference, opts),
        uses_torch=impl in TORCH_IMPLS)
    if record["status"] == "ok":
        for metric, ms_field in MS_FIELDS.items():
            ms = record[ms_field]
            suffix = "" if metric == "per_call" else f"_{metric}"
            gbps = None if ms is None else record["bytes"] / (ms * 1e-3) / 1e9
            record[f"gbps{suffix}"] = gbps
            record[FRACTION_FIELDS[metric]] = None if gbps is None else gbps / copy_gbps
    return record


def progress_line(index, total, record):
    """The line printed after a measurement: ms, GB/s and the fraction of copy bandwidth."""

    def timing_text(r):
        device = "n/a" if r["ms_device"] is None else f"{1e3 * r['ms_device']:8.1f} us"
        fraction = r["copy_fraction_device"]
        fraction = "n/a" if fraction is None else f"{fraction:.2f}"
        return (f"{1e3 * r['ms']:8.1f} us/call, device {device} {fraction} of copy "
                f"bandwidth")

    return _harness.format_progress(index, total, record, label_width=22, impl_width=12,
                                    timing_text=timing_text, show_temp=True)


def copy_bandwidth(gib):
    """Read + write GB/s of two passes over a `gib` GiB buffer (jnp.copy and an elementwise
    uint32 + 1), each timed amortised; "gbps" is the faster, the ceiling bandwidth is
    measured against."""
    x = jnp.arange(max(1, int(gib * 2**30) // 4), dtype=jnp.uint32)
    nbytes = x.size * 4
    passes = {"copy": jax.jit(jnp.copy), "plus_one": jax.jit(lambda x: x + 1)}
    result = {"buffer_bytes": nbytes}
    for name, fn in passes.items():
        seconds = _timing.amortised_seconds(fn, x, calls=10, repeats=7)
        result[f"{name}_gbps"] = 2 * nbytes / seconds / 1e9
    del x
    result["gbps"] = max(result[f"{name}_gbps"] for name in passes)
    return result


# --- Generation (--generate). ---


# Issue 27's generation runs: the zamba2-like 1.1B HybridLM ("zamba2-1.2b" preset: 36 Mamba2
# blocks, d_model 2048, six uses of a 32-head shared block; bf16, random weights), greedy.
# (batch, prompt tokens, new tokens, KV dtype); h200-baselines.md measured the first before the
# serving path: prefill 596 tokens/s, decode 29.7 tokens/s.
GENERATE_RUNS = [(8, 1024, 128, "bfloat16"), (64, 7680, 512, "bfloat16"),
                 (64, 7680, 512, "int8")]
GENERATE_QUICK = [(2, 32, 8, "bfloat16"), (2, 32, 8, "int8")]  # the tiny preset


def measure_generate(run, ssm_dtype, opts):
    """`HybridLM.generate` at one of GENERATE_RUNS (`--quick`: the tiny preset), paged KV cache
    of 16-token pages, SSM states in `ssm_dtype`, each call timed after its compile (median
    of 3): prefill tokens/s from a call that generates one token (the prefill and its sample),
    decode tokens/s from the difference with the full call. Returns (result fields,
    _timing.Timing of the full call)."""
    from flax import nnx

    from flax_layers import HybridLM, HybridLMConfig

    batch, prompt_length, new_tokens, kv_dtype = run
    config = HybridLMConfig.preset("tiny" if opts.quick else "zamba2-1.2b", dtype=jnp.bfloat16)
    model = HybridLM(config, rngs=nnx.Rngs(0))
    prompt = jax.random.randint(jax.random.key(0), (batch, prompt_length), 0, config.vocab_size)

    def seconds(n):
        def call():
            model.generate(prompt, n, temperature=0.0, rng=jax.random.key(1), kv_dtype=kv_dtype,
                           page_size=16, prefill_tokens=opts.prefill_tokens,
                           ssm_dtype=ssm_dtype).block_until_ready()

        call()  # compiles
        times = []
        for _ in range(3):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return times

    prefill, full = seconds(1), seconds(new_tokens)
    prefill_s, full_s = statistics.median(prefill), statistics.median(full)
    decode_s = full_s - prefill_s  # None below: the difference drowned in the noise
    result = {"prefill_ms": 1e3 * prefill_s,
              "prefill_tokens_per_s": batch * prompt_length / prefill_s,
              "decode_ms_per_step": 1e3 * decode_s / (new_tokens - 1) if decode_s > 0 else None,
              "decode_tokens_per_s": (batch * (new_tokens - 1) / decode_s if decode_s > 0
                                      else None)}
    timing = _timing.Timing(median_ms=1e3 * full_s, min_ms=1e3 * min(full),
                            max_ms=1e3 * max(full), amortised_ms=1e3 * full_s, device_ms=None,
                            iters=len(full))
    return result, timing


def run_name(run):
    """B<batch>:<kv dtype>, how `--generate` names a generation run."""
    return f"B{run[0]}:{run[3]}"


def generate_records(opts):
    """One record per generation run that `--generate` names and SSM state dtype of
    `--ssm-dtypes` (see `measure_generate`), printed as it finishes."""
    from flax_layers import generation

    records = []
    runs = [run for run in (GENERATE_QUICK if opts.quick else GENERATE_RUNS)
            if opts.generate == "all" or run_name(run) in opts.generate.split(",")]
    for run, ssm_dtype in itertools.product(runs, opts.ssm_dtypes):
        batch, prompt_length, new_tokens, kv_dtype = run
        states = "" if ssm_dtype == "float32" else f", {ssm_dtype} SSM states"
        record = {"label": f"generate B{batch} prompt {prompt_length} +{new_tokens} "
                           f"{kv_dtype}{states}",
                  "impl": "ours", "mode": "generate", "batch": batch, "prompt": prompt_length,
                  "new_tokens": new_tokens, "kv_dtype": kv_dtype, "ssm_dtype": ssm_dtype,
                  "prefill_tokens": opts.prefill_tokens or generation.PREFILL_TOKENS}
        record = _harness.measured_record(
            record, functools.partial(measure_generate, run, ssm_dtype, opts), uses_torch=False)
        decode = record.get("decode_tokens_per_s")
        print(record["label"] + ": " + (
            f"prefill {record['prefill_tokens_per_s']:,.0f} tokens/s, decode "
            + ("not measurable" if decode is None else f"{decode:,.0f} tokens/s")
            if record["status"] == "ok" else f"{record['status']}: {record.get('error', '')}"))
        records.append(record)
    return records


# --- Reports. ---


def results_table(records, labels, impls, field, title):
    by_key = _harness.index_records(records)
    rows = [[label, *(_harness.cell_text(by_key.get((label, impl, "fwd")), field)
                      for impl in impls)]
            for label in labels]
    return title + "\n" + _timing.format_table(["shape", *impls], rows)


# (shape name, what, numerator (impl, field) / denominator (impl, field) or one value, bound).
# Issue 27's targets, on an H200; bounds are ">=" unless marked "<=".
TARGETS = [
    *((name, "ours, fraction of copy bandwidth", ("ours", "fraction"), None, (">=", bound))
      for name, bound in (("gqa", 0.80), ("mha", 0.75), ("long", 0.50))),
    ("long", "split-K speedup, ours-unsplit ms / ours ms", ("ours-unsplit", "ms"),
     ("ours", "ms"), (">=", 4.0)),
    ("gqa", "int8 KV, ours-int8 ms / ours ms", ("ours-int8", "ms"), ("ours", "ms"),
     ("<=", 0.6)),
    *((name, f"{peer} ms / ours ms", (peer, "ms"), ("ours", "ms"), (">=", bound))
      for peer, bound in (("jax-paged", 1.3), ("vllm-triton", 1.0))
      for name in SWEEP),
]


def targets_table(records, shapes, metric):
    """Issue 27's targets against this run's numbers (meaningful on an H200 at full size)."""
    by_key = _harness.index_records(records)
    fields = {"fraction": FRACTION_FIELDS[metric], "ms": MS_FIELDS[metric]}
    labels = {shape.name: shape.label for shape in shapes}

    def value(label, impl_field):
        impl, field = impl_field
        return _harness.metric_value(by_key.get((label, impl, "fwd")), fields[field])

    rows = []
    for name, what, top, bottom, (sense, bound) in TARGETS:
        if name not in labels:
            continue
        top_value = value(labels[name], top)
        bottom_value = 1.0 if bottom is None else value(labels[name], bottom)
        row = [f"{labels[name]}: {what}", f"{sense} {bound}"]
        if None in (top_value, bottom_value):
            rows.append([*row, "-", "-"])
            continue
        measured = top_value / bottom_value
        met = measured >= bound if sense == ">=" else measured <= bound
        rows.append([*row, f"{measured:.2f}", "yes" if met else "NO"])
    title = f"issue 27's targets ({_harness.metric_text(metric)} timing; set for an H200)"
    return title + "\n" + _timing.format_table(["shape: what", "target", "measured", "met"],
                                               rows)


def save_plot(path, records, labels, impls, metric, device_kind):
    panels = _harness.plot_panels(records, labels, impls, FRACTION_FIELDS[metric],
                                  (("fwd", "decode, one new token per row"),))
    _timing.save_grouped_bar_plot(
        path, labels, panels,
        ylabel=f"fraction of copy bandwidth ({_harness.metric_text(metric)})",
        title=f"decode attention over a paged KV cache, bf16 q, head dim "
              f"{records[0]['head_dim']}; copy {records[0]['copy_gbps']:.0f} GB/s, "
              f"{device_kind}",
    )


def report(records, shapes, args, json_path, png_path):
    labels = [shape.label for shape in shapes]
    legend = (f"err: failed, skip: skipped (the JSON has why); !: output off the reference by > "
              f"{_harness.REL_ERR_TOLERANCE}")
    metric = _harness.metric_text(args.metric)
    print(f"\nwrote {json_path} and {png_path}\n")
    print(results_table(records, labels, args.impls, "fwd_rel_err",
                        "relative error against the float32 reference") + "\n")
    print(results_table(records, labels, args.impls, MS_FIELDS[args.metric],
                        f"ms ({metric}); {legend}") + "\n")
    print(targets_table(records, shapes, args.metric) + "\n")
    print(results_table(records, labels, args.impls, FRACTION_FIELDS[args.metric],
                        f"fraction of copy bandwidth ({metric}); {legend}"))


# --- Command line. ---


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.decode", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--shapes", type=_harness.comma_list(str), default=list(SWEEP),
                        help=f"of {','.join(SWEEP)} (default: all)")
    parser.add_argument("--ragged", action="store_true",
                        help="row lengths uniform in [1, context] instead of all full")
    _harness.add_selection_arguments(
        parser, default_impls=IMPLS, impls_help=f"of {','.join(IMPLS)} (default: all)",
        quick_help=f"smoke test: tiny shapes {QUICK_SWEEP} (B, context, N, K), head dim "
                   f"{QUICK_HEAD_DIM}, 3 iterations",
        interpret_help="run the Pallas kernels (ours, jax-paged, jax-decode) in interpret "
                       "mode (CPU)",
    )
    parser.set_defaults(modes=["fwd"])
    _harness.add_timing_arguments(parser, warmup_help="untimed calls after compiling")
    parser.set_defaults(metric="device")
    parser.add_argument("--chain-calls", type=int, default=20,
                        help="calls per jitted chain for JAX implementations' device time")
    parser.add_argument("--copy-gib", type=float, default=1.0,
                        help="buffer of the copy-bandwidth measurement (--quick: 1/64)")
    parser.add_argument("--jax-k-splits", type=int, default=16,
                        help="k_splits of jax-paged and jax-decode (16: their default)")
    parser.add_argument("--vllm-kv-splits", default="best",
                        help='vllm-triton\'s num_kv_splits: "best" (fastest power of two from '
                             '1 to 64), "vllm" (the rule of its Triton MLA backend) or a number')
    parser.add_argument("--generate", nargs="?", const="all", default=None,
                        help="also time HybridLM.generate on the 1.1B model: every run of "
                             "GENERATE_RUNS, or those named as B<batch>:<kv dtype>, comma "
                             "separated (B64:bfloat16)")
    parser.add_argument("--ssm-dtypes", type=_harness.comma_list(str), default=["float32"],
                        help="generate's ssm_dtype (the Mamba2 states' storage), each of "
                             "float32,bfloat16 named (comma separated) timed in turn")
    parser.add_argument("--prefill-tokens", type=int, default=None,
                        help="generate's prefill_tokens (prompt tokens a prefill group holds; "
                             "default flax_layers.generation.PREFILL_TOKENS)")
    _harness.add_output_arguments(parser, "decode")
    args = parser.parse_args(argv)
    _harness.check_common_arguments(parser, args, IMPLS)
    if not args.impls or not args.shapes:
        parser.error("--impls and --shapes must name at least one each")
    if args.modes != ["fwd"]:
        parser.error("decode attention has a forward only: --modes fwd")
    unknown = sorted(set(args.shapes) - set(SWEEP))
    if unknown:
        parser.error(f"unknown shapes: {','.join(unknown)}")
    if args.vllm_kv_splits not in ("best", "vllm") and not args.vllm_kv_splits.isdigit():
        parser.error(f'--vllm-kv-splits must be "best", "vllm" or a number, got '
                     f"{args.vllm_kv_splits}")
    runs = {run_name(run) for run in GENERATE_RUNS + GENERATE_QUICK}
    if args.generate not in (None, "all") and not set(args.generate.split(",")) <= runs:
        parser.error(f"--generate names runs of {sorted(runs)}, got {args.generate}")
    if not args.ssm_dtypes or not set(args.ssm_dtypes) <= {"float32", "bfloat16"}:
        parser.error(f"--ssm-dtypes names float32 and/or bfloat16, got {args.ssm_dtypes}")
    if args.prefill_tokens is not None and args.prefill_tokens < 1:
        parser.error(f"--prefill-tokens must be >= 1, got {args.prefill_tokens}")
    if args.quick:
        args.chain_calls = min(args.chain_calls, 3)
        args.copy_gib = min(args.copy_gib, 1 / 64)
    return args


def build_sweep(args):
    sizes, head_dim = (QUICK_SWEEP, QUICK_HEAD_DIM) if args.quick else (SWEEP, HEAD_DIM)
    return [
        Shape(name, batch, context, heads, kv_heads, head_dim, PAGE_SIZE, args.ragged)
        for name, (batch, context, heads, kv_heads) in sizes.items()
        if name in args.shapes
    ]


def main(argv=None):
    args = parse_args(argv)
    # jax's Pallas GPU ops and the Pallas-Triton lowering warn on each use.
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    shapes = build_sweep(args)
    environment = _timing.environment_info("benchmarks.decode")
    # vLLM is extracted, not installed (peers_setup.sh), so its version is the sdist's name.
    environment["vllm_sdist"] = os.environ.get("PEERS_VLLM")
    environment["copy_bandwidth"] = copy_bandwidth(args.copy_gib)
    copy_gbps = environment["copy_bandwidth"]["gbps"]
    print(f"copy bandwidth {copy_gbps:.0f} GB/s (read + write, "
          f"{environment['copy_bandwidth']['buffer_bytes'] / 2**30:.3g} GiB buffer)")
    records, json_path, png_path = _harness.run_sweep(
        "decode", shapes, environment, args, inputs_and_reference=inputs_and_reference,
        run_one=functools.partial(run_one, copy_gbps=copy_gbps), progress_line=progress_line,
        save_plot=save_plot,
    )
    if args.generate is not None:
        generated = generate_records(args)
        with open(json_path) as f:
            payload = json.load(f)
        _timing.write_json(json_path, {**payload, "generate": generated})
    report(records, shapes, args, json_path, png_path)


if __name__ == "__main__":
    main()
