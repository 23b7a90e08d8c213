"""Block sizes, warps and pipeline stages for the attention kernels, per GPU and head dim.

`block_sizes_for(device_kind, head_dim)` reads the table; `dot_product_attention(...,
block_sizes=BlockSizes(...))` overrides it. Entries for AMD fit the 64 KiB of shared memory
(LDS) of a gfx942/gfx90a compute unit by `shared_memory_bytes`' estimate and use one stage.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class KernelBlocks:
    """Tile of one kernel: `block_q` query rows by `block_k` key rows; Triton launch knobs."""

    block_q: int
    block_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self):
        for name in ("block_q", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a positive power of two, got {value}")
        if self.block_q < 16 or self.block_k < 16:
            raise ValueError(f"blocks must be at least 16 (Triton's dot), got {self}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")

    def fit(self, t, s):
        """The same tile, shrunk (to at least 16) where the sequence is shorter than the block."""
        return dataclasses.replace(
            self, block_q=min(self.block_q, pow2_at_least(t)),
            block_k=min(self.block_k, pow2_at_least(s)),
        )


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles of the three kernels: the forward, the dK/dV backward and the dQ backward."""

    forward: KernelBlocks
    dkv: KernelBlocks
    dq: KernelBlocks

    def fit(self, t, s):
        """Every tile shrunk to a query length t and a key length s (see `KernelBlocks.fit`)."""
        return BlockSizes(self.forward.fit(t, s), self.dkv.fit(t, s), self.dq.fit(t, s))


def pow2_at_least(n, minimum=16):
    """The smallest power of two >= n and >= minimum (Triton needs power-of-two arrays)."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def padded_head_dim(head_dim):
    """The power of two (at least 16) that the kernels pad a head dim to."""
    return pow2_at_least(head_dim)


def _b(block_q, block_k, num_warps, num_stages):
    return KernelBlocks(block_q, block_k, num_warps, num_stages)


# family -> [(largest head dim it covers, BlockSizes)]; the first entry that covers the padded head
# dim wins. Hopper entries come from sweeps on an H200 (benchmarks/attention_tune.py, results in
# benchmarks/results/ and benchmarks/NOTES.md); the others are estimates, not yet measured.
_TABLE = {
    "hopper": [
        (64, BlockSizes(_b(128, 64, 8, 3), _b(64, 64, 4, 2), _b(128, 64, 4, 3))),
        (128, BlockSizes(_b(128, 128, 8, 3), _b(64, 64, 4, 2), _b(128, 64, 8, 3))),
        (256, BlockSizes(_b(128, 64, 8, 2), _b(64, 32, 4, 2), _b(64, 32, 4, 3))),
    ],
    "ampere": [
        (64, BlockSizes(_b(128, 64, 4, 3), _b(64, 128, 8, 2), _b(128, 64, 8, 2))),
        (128, BlockSizes(_b(128, 64, 8, 2), _b(64, 64, 4, 2), _b(64, 64, 4, 2))),
        (256, BlockSizes(_b(64, 32, 8, 2), _b(32, 32, 4, 2), _b(32, 32, 4, 2))),
    ],
    "cdna": [  # gfx942 (MI300X/MI325X), gfx90a (MI250X): 64 KiB LDS, wavefront 64
        (64, BlockSizes(_b(128, 64, 4, 1), _b(64, 64, 4, 1), _b(64, 64, 4, 1))),
        (128, BlockSizes(_b(64, 64, 4, 1), _b(32, 64, 4, 1), _b(64, 32, 4, 1))),
        (256, BlockSizes(_b(32, 32, 4, 1), _b(16, 32, 4, 1), _b(32, 16, 4, 1))),
    ],
    "fallback": [
        (64, BlockSizes(_b(64, 64, 4, 2), _b(64, 64, 4, 2), _b(64, 64, 4, 2))),
        (128, BlockSizes(_b(64, 32, 4, 2), _b(32, 64, 4, 2), _b(64, 32, 4, 2))),
        (256, BlockSizes(_b(32, 32, 4, 1), _b(16, 32, 4, 1), _b(32, 16, 4, 1))),
    ],
}

LDS_BYTES = {"cdna": 64 * 1024}


def family(device_kind):
    """Maps a jax `device_kind` ("NVIDIA H200", "gfx942", ...) to a row family of the table."""
    kind = device_kind.lower()
    if any(name in kind for name in ("h100", "h200", "h800", "h20", "gh200")):
        return "hopper"
    if any(name in kind for name in ("a100", "a800", "a10", "a40", "l4", "l40", "rtx")):
        return "ampere"
    if any(name in kind for name in ("gfx942", "gfx90a", "mi300", "mi325", "mi250")):
        return "cdna"
    return "fallback"


def block_sizes_for(device_kind, head_dim):
    """The table's BlockSizes for a device kind and a (padded, power-of-two) head dim <= 256."""
    for max_dim, sizes in _TABLE[family(device_kind)]:
        if head_dim <= max_dim:
            return sizes
    raise ValueError(f"head dim {head_dim} is above the largest supported (256)")


def shared_memory_bytes(kernel, blocks, head_dim, itemsize=2):
    """An estimate of a kernel's shared memory: operand tiles times pipeline stages.

    Triton stages the streamed operands `num_stages` deep and keeps the resident ones once; the
    probability tile of the second matmul also passes through shared memory. It is a model for
    keeping table entries inside a GPU's limit, not a measurement.
    """
    bq, bk, stages = blocks.block_q, blocks.block_k, blocks.num_stages
    if kernel == "forward":
        tiles = (bq + 2 * bk * stages) * head_dim + bq * bk
    elif kernel == "dkv":
        tiles = (2 * bk + 2 * bq * stages) * head_dim + 2 * bq * bk
    elif kernel == "dq":
        tiles = (2 * bq + 2 * bk * stages) * head_dim + 2 * bq * bk
    else:
        raise ValueError(f"unknown kernel {kernel!r}")
    return tiles * itemsize
