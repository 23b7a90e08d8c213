"""The split-K decode kernel's tile and launch knobs per GPU family, and the number of splits.

One program handles one (batch row, KV head, split): its rows are the KV head's G query heads
times the T new tokens, padded to at least 16 (Triton's dot), and it streams `block_k` keys at a
time. Splits cut the keys so that the programs fill the GPU: a long cache with few rows and
heads is otherwise read by a handful of multiprocessors. These rows are estimates until timed
on the GPU (benchmarks/decode.py).
"""

import dataclasses

import jax.numpy as jnp

from pallas_kernels import _compat, _device


@dataclasses.dataclass(frozen=True)
class DecodeBlocks:
    """`block_k` keys per step (a power of two, >= 16); Triton's warps and stages;
    `gather_rows`: a paged block read as one (block_k, H) gather, each key's row from its page,
    else as (pages, page_size, H) reshaped (`forward._read`); `zero_int8_past_length`: int8
    values in slots past a row's length zeroed by a select before the P.V matmul, as float
    values must be (they may be NaN; an int8 value never is, and its probability is 0)."""

    block_k: int
    num_warps: int
    num_stages: int
    gather_rows: bool = True
    zero_int8_past_length: bool = False


# NVIDIA's Triton stages a gathered block in shared memory as a dense one, and without the int8
# select converts int8 values in the matmul's layout (H100, B 64 at 8192 keys, jaxlib 0.11.2:
# int8 0.31 -> 0.25 -> 0.243 ms, bf16 0.40 -> 0.39; the jaxlib 0.12 row below takes both
# untimed). gfx942 keeps the pages read and the select: its int8 kernel's 160 VGPRs (3 waves
# per SIMD) become 212-261 with either change.
_TABLE = {
    "hopper": DecodeBlocks(64, 4, 3),
    "ampere": DecodeBlocks(64, 4, 2),
    "cdna": DecodeBlocks(64, 4, 1, gather_rows=False, zero_int8_past_length=True),
    "fallback": DecodeBlocks(64, 4, 2),
}
# Rows that jaxlib 0.12's Triton wants otherwise, for key rows of at most WIDE_ROW_BYTES (bf16 to
# head dim 128, 8-bit caches to 256). H100, B 64 at 8192 keys, 32:4 heads
# (benchmarks/experiments/decode_tune.py, results/decode_tune_h100{,_jaxlib012}.*): 64 keys a
# step took 0.41 ms with jaxlib 0.11.2 and 0.54 with 0.12 (int8 KV 0.31 -> 0.42); 128 keys take
# 0.41 with either (int8 0.32 and 0.34). Wider rows would spill at 128 keys (sm_90a: a float32
# cache at head dim 128 compiles to 255 registers and spills).
_TABLE_JAXLIB_0_12 = {"hopper": DecodeBlocks(128, 4, 3)}
WIDE_ROW_BYTES = 256
# Programs per multiprocessor that splitting aims for, and the fewest keys a split is worth.
PROGRAMS_PER_MULTIPROCESSOR = 2
MIN_KEYS_PER_SPLIT = 128
# A split of at most this many blocks runs unpipelined (one stage): the prefetch a few-block loop
# cannot repay (H100, B1 32k keys at 256 splits of 2 blocks: 6.5 µs at 1 stage, 9.0 at 2, 8.8
# at 3).
UNPIPELINED_BLOCKS = 4


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a call runs: its DecodeBlocks, `splits` per row and `blocks_per_split`."""

    blocks: DecodeBlocks
    splits: int
    blocks_per_split: int


def plan(device_kind, batch, kv_heads, capacity, page_size=None, num_splits=None, *,
         key_row_bytes):
    """The Plan of a call on `batch` rows of `capacity` keys over `kv_heads` heads, each key a
    row of `key_row_bytes` in the cache (`row_bytes(head_dim, dtype)`): the
    table's tile, whose `block_k` is a whole number of pages for a paged cache (at least one) and
    divides a dense cache's capacity; `num_splits` or `splits_for`'s, at most one per block,
    rounded up to a power of two (the merge reads every split's partial as one array; the
    splits past the last block are empty and exit at once)."""
    blocks = table(key_row_bytes)[_device.family(device_kind)]
    if page_size is not None:
        block_k = max(blocks.block_k, page_size)
    else:
        block_k = _dense_block(capacity, blocks.block_k)
    total = _device.cdiv(capacity, block_k)
    wanted = min(total, num_splits or splits_for(device_kind, batch, kv_heads, capacity,
                                                 block_k))
    # The power of two first, then the blocks per split: its splits share the blocks evenly.
    per_split = _device.cdiv(total, _device.pow2_at_least(wanted, minimum=1))
    if per_split <= UNPIPELINED_BLOCKS:
        blocks = dataclasses.replace(blocks, num_stages=1)
    return Plan(dataclasses.replace(blocks, block_k=block_k),
                _device.pow2_at_least(_device.cdiv(total, per_split), minimum=1), per_split)


def row_bytes(head_dim, dtype):
    """The bytes of one key's row as the kernel reads it: the head dim padded to a power of
    two, in the cache's element."""
    return _device.pow2_at_least(head_dim) * jnp.dtype(dtype).itemsize


def table(key_row_bytes):
    """The tile per GPU family for the installed jaxlib and a cache's key rows of
    `key_row_bytes`."""
    if _compat.jaxlib_at_least(0, 12) and key_row_bytes <= WIDE_ROW_BYTES:
        return {**_TABLE, **_TABLE_JAXLIB_0_12}
    return _TABLE


def _dense_block(capacity, block_k):
    """The largest power of two <= block_k (>= 16) that divides a dense cache's capacity; a
    ValueError when none does (the cache would have to be copied)."""
    while block_k >= 16:
        if capacity % block_k == 0:
            return block_k
        block_k //= 2
    raise ValueError(f"k_cache: a dense cache's capacity (axis 1, {capacity}) must be a "
                     "multiple of 16 (allocate it so: the kernel reads it in place)")


def splits_for(device_kind, batch, kv_heads, capacity, block_k):
    """How many splits to cut each row's keys into: enough programs (batch x kv_heads x splits)
    for `PROGRAMS_PER_MULTIPROCESSOR` per multiprocessor, no more than the cache's `capacity`
    (keys per row, the length bucket) allows at `MIN_KEYS_PER_SPLIT` keys (whole blocks) each."""
    wanted = _device.cdiv(PROGRAMS_PER_MULTIPROCESSOR * _device.multiprocessors(device_kind),
                          batch * kv_heads)
    keys_per_split = max(MIN_KEYS_PER_SPLIT, block_k)
    return max(1, min(wanted, _device.cdiv(capacity, keys_per_split)))
