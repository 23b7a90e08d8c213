"""Block sizes, warps and pipeline stages for the attention kernels, per GPU and head dim.

`blocks_for(device_kind, head_dim)` reads the table; `dot_product_attention(...,
block_sizes=AttentionBlocks(...))` overrides it. AMD rows use one stage; what each row costs in
registers and shared memory on gfx942 and sm_90a is measured by compiling it
(tests/test_machine_code.py, the table in benchmarks/REPORT.md).
"""

import dataclasses

from pallas_kernels import _device


@dataclasses.dataclass(frozen=True)
class KernelBlocks:
    """Tile of one kernel: `block_q` query rows by `block_k` key rows; Triton launch knobs.
    `head_splits` (the dK/dV kernel only): the programs a GQA group's query heads are split
    across (their float32 partial dK/dV added in a fixed order); 1 loops over the whole group
    in one program."""

    block_q: int
    block_k: int
    num_warps: int
    num_stages: int
    head_splits: int = 1

    def __post_init__(self):
        for name in ("block_q", "block_k", "num_warps", "head_splits"):
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
            self, block_q=min(self.block_q, _device.pow2_at_least(t)),
            block_k=min(self.block_k, _device.pow2_at_least(s)),
        )


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
    """Tiles of the three kernels: the forward, the dK/dV backward and the dQ backward."""

    forward: KernelBlocks
    dkv: KernelBlocks
    dq: KernelBlocks

    def fit(self, t, s, has_pairs=False):
        """Every tile shrunk to a query length t and a key length s (see `KernelBlocks.fit`).
        `has_pairs` (a user's mask or bias, whose tiles are pipelined with the keys and values):
        at most PAIR_BLOCK_K keys a block, so that sm_90a's shared memory holds every stage."""
        tiles = [b.fit(t, s) for b in (self.forward, self.dkv, self.dq)]
        if has_pairs:
            tiles = [dataclasses.replace(b, block_k=min(b.block_k, PAIR_BLOCK_K))
                     for b in tiles]
        return AttentionBlocks(*tiles)


# The forward's 128 x 128 tile in 3 stages at head dim 128 takes 229,376 B of sm_90a's 232,448 B
# of shared memory, leaving no room for a mask and a bias tile a stage; 128 x 64 in 3 stages
# with both takes 165,888 B, and the dQ kernel's 198,656 B (180,224 and 212,992 with a mask of
# int8 entries, as cdna's) (`tests/test_machine_code.py`).
# Halving the keys a block costs the causal forward 5% on the H200 (benchmarks/results/
# attention_tune_h200_d128.json); dropping to 2 stages, as before, cost it and the dQ kernel
# 13% each.
PAIR_BLOCK_K = 64


def padded_head_dim(head_dim):
    """The power of two (at least 16) that the kernels pad a head dim to."""
    return _device.pow2_at_least(head_dim)


def _b(block_q, block_k, num_warps, num_stages):
    return KernelBlocks(block_q, block_k, num_warps, num_stages)


# family -> [(largest head dim it covers, AttentionBlocks)]; the first entry that covers the
# padded head dim wins. Hopper entries come from sweeps on an H200 (benchmarks/attention_tune.py,
# results in benchmarks/results/ and benchmarks/NOTES.md); the others are estimates, not yet
# measured.
_TABLE = {
    "hopper": [
        (64, AttentionBlocks(_b(128, 64, 8, 3), _b(64, 64, 4, 2), _b(128, 64, 4, 3))),
        (128, AttentionBlocks(_b(128, 128, 8, 3), _b(64, 64, 4, 2), _b(128, 64, 8, 3))),
        (256, AttentionBlocks(_b(128, 64, 8, 2), _b(64, 32, 4, 2), _b(64, 32, 4, 3))),
    ],
    "ampere": [
        (64, AttentionBlocks(_b(128, 64, 4, 3), _b(64, 128, 8, 2), _b(128, 64, 8, 2))),
        (128, AttentionBlocks(_b(128, 64, 8, 2), _b(64, 64, 4, 2), _b(64, 64, 4, 2))),
        (256, AttentionBlocks(_b(64, 32, 8, 2), _b(32, 32, 4, 2), _b(32, 32, 4, 2))),
    ],
    "cdna": [  # gfx942 (MI300X/MI325X), gfx90a (MI250X)
        (64, AttentionBlocks(_b(128, 64, 4, 1), _b(64, 64, 4, 1), _b(64, 64, 4, 1))),
        (128, AttentionBlocks(_b(64, 64, 4, 1), _b(32, 64, 4, 1), _b(64, 32, 4, 1))),
        (256, AttentionBlocks(_b(32, 32, 4, 1), _b(16, 32, 4, 1), _b(32, 16, 4, 1))),
    ],
    "fallback": [
        (64, AttentionBlocks(_b(64, 64, 4, 2), _b(64, 64, 4, 2), _b(64, 64, 4, 2))),
        (128, AttentionBlocks(_b(64, 32, 4, 2), _b(32, 64, 4, 2), _b(64, 32, 4, 2))),
        (256, AttentionBlocks(_b(32, 32, 4, 1), _b(16, 32, 4, 1), _b(32, 16, 4, 1))),
    ],
}


# family -> (smallest GQA group, head splits): the causal dK/dV kernel of a group at least that
# large splits its query heads across that many programs. GQA 8:1, d128, T 8192 on an H100:
# 2.39 ms with 4 splits, 2.54 with 2, 2.91 with 1; without the causal mask one program a group
# stays best (4.09 ms against 4.21 with 4) (benchmarks/results/attention_tune_h100_gqa8.json).
_CAUSAL_GROUP_SPLITS = {"hopper": (4, 4)}


# Families whose kernels read a user's mask one int8 entry a pair instead of packed 8 keys a
# byte (`masking.pack_mask`): on gfx942 expanding the bits takes the d128 dQ kernel from 254 to
# 273 VGPRs, past the 256 that leave it 2 waves a SIMD (`tests/test_machine_code.py`).
_UNPACKED_MASKS = frozenset({"cdna"})


def packs_masks(device_kind):
    """Whether a user's mask reaches the kernels packed 8 keys a byte on this device kind."""
    return _device.family(device_kind) not in _UNPACKED_MASKS


def blocks_for(device_kind, head_dim, *, groups=1, causal=False):
    """The table's AttentionBlocks for a device kind and a (padded, power-of-two) head dim
    <= 256; with `causal` (keys past the diagonal skipped) and a GQA group of `groups` query
    heads, the dK/dV kernel's head splits for it."""
    sizes = next((sizes for max_dim, sizes in _TABLE[_device.family(device_kind)]
                  if head_dim <= max_dim), None)
    if sizes is None:
        raise ValueError(f"head dim {head_dim} is above the largest supported (256)")
    smallest, splits = _CAUSAL_GROUP_SPLITS.get(_device.family(device_kind), (0, 1))
    if causal and groups >= smallest > 0:
        sizes = dataclasses.replace(sizes, dkv=dataclasses.replace(sizes.dkv,
                                                                   head_splits=splits))
    return sizes
