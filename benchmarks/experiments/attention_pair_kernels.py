"""What a user's bias or mask costs each attention kernel alone, and at which tiles.

Issue 29's end-to-end rows (`benchmarks/attention_mask.py`) give the whole fwd+bwd: a
(1, N, T, S) bias 1.26x, a 90% random (B, N, T, S) mask 1.43x, against the line's 1.15. This
splits them by kernel. Each of the forward, dK/dV and dQ kernels runs alone (as
`benchmarks/attention_tune.py` runs them) at d128, T = S = 8192, B 2, 16 heads, bf16, over
several tiles, three ways: no pair, the bias, the packed random mask. Then the public call
fwd+bwd: no pair, each pair at the table's tiles, and each at the tiles this sweep found best
(after `AttentionBlocks.fit`, which caps a pair call's keys a block at 64).

What the machine code says going in (sm_90a, upstream Triton): the forward and dQ kernels copy
the bias tile into shared memory in their pipeline (cp.async, 3 stages); the dK/dV kernel,
which reads it transposed, loads it into registers one block ahead instead. If a kernel's bias
cost is its 2.1 GB at copy bandwidth (~0.65 ms on an H100) the read is not overlapped with the
matmuls, which at ~0.8 TB/s of need it could be.

On the GPU machine, from the repository root:

    python -m benchmarks.experiments.attention_pair_kernels --out "$OUT/attention_pair_kernels.json"

`--smoke` runs the same in interpret mode at a tiny shape (a CPU check of the script; no times).
"""

import argparse
import functools

import jax
import jax.numpy as jnp

import pallas_kernels
from benchmarks import _timing
from pallas_kernels.attention import api, backward, common, forward, masking, tuning

SHAPE = (2, 16, 8192, 128)  # B, N, T = S, head dim
SMOKE_SHAPE = (1, 2, 256, 128)
# (block_q, block_k, warps, stages) per kernel; the first is the table's pair tile on Hopper.
TILES = {
    "forward": [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4),
                (128, 32, 8, 3), (64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 2)],
    "dkv": [(64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2), (32, 64, 4, 2), (64, 32, 4, 2),
            (128, 64, 8, 2), (64, 128, 8, 2), (32, 64, 4, 3)],
    "dq": [(128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (64, 64, 4, 3), (128, 32, 8, 3),
           (128, 64, 4, 3), (64, 64, 4, 2)],
}
PAIRS = ("none", "bias", "mask")
MATMUL_SHARE = {"forward": 1.0, "dkv": 2.0, "dq": 1.5}  # matmuls a pair, the forward's = 1


class Case:
    """The inputs at one shape: q, k, v, dO; a bf16 (1, N, T, S) bias; a 90% random
    (B, N, T, S) mask, boolean and packed as the kernels read it."""

    def __init__(self, shape, interpret):
        self.batch, self.heads, self.length, self.head_dim = shape
        self.interpret = interpret
        keys = jax.random.split(jax.random.key(0), 6)
        qshape = (self.batch, self.length, self.heads, self.head_dim)
        self.q, self.k, self.v, self.do = (jax.random.normal(key, qshape, jnp.bfloat16)
                                           for key in keys[:4])
        self.bias = jax.random.normal(keys[4], (1, self.heads, self.length, self.length),
                                      jnp.bfloat16)
        self.mask = jax.random.uniform(keys[5], (self.batch, self.heads, self.length,
                                                 self.length)) < 0.9
        self.packed = masking.pack_mask(self.mask, self.length, self.length)
        self._residuals = {}

    def static(self, pair):
        return common.Static(
            scale=self.head_dim**-0.5, band=(None, None), logits_soft_cap=None, groups=1,
            has_segments=False, may_mask=pair == "mask", interpret=self.interpret)

    def pair_arrays(self, pair):
        """(bias, mask) as the kernels take them."""
        return (self.bias if pair == "bias" else None,
                self.packed if pair == "mask" else None)

    def residuals(self, pair):
        """(lse, delta), (B, N, T) float32, of the public call with this pair."""
        if pair not in self._residuals:
            out, lse = pallas_kernels.dot_product_attention(
                self.q, self.k, self.v, bias=self.pair_arrays(pair)[0],
                mask=self.mask if pair == "mask" else None, implementation="pallas",
                return_residual=True, interpret=self.interpret)
            self._residuals[pair] = (jnp.swapaxes(lse, 1, 2),
                                     jnp.swapaxes(common.softmax_delta(out, self.do), 1, 2))
        return self._residuals[pair]

    def kernel_call(self, kernel, tile, pair):
        """(jitted fn, its arguments) running one kernel alone at `tile`."""
        t, d = self.length, self.head_dim
        blocks = tuning.KernelBlocks(*tile)
        static = self.static(pair)
        config = api._Config(static, tuning.AttentionBlocks(blocks, blocks, blocks),
                             (self.batch, t, t), (t, t, d))
        bias, mask = self.pair_arrays(pair)
        table = api._tables(config, t, t, None, None, None, None, None, mask, kernel)
        options = dict(static=static, blocks=blocks)
        if kernel == "forward":
            def run(q, k, v, bias, mask):
                return forward.forward(q, k, v, None, None, table, bias=bias, mask=mask,
                                       **options)
            return jax.jit(run), (self.q, self.k, self.v, bias, mask)
        kernel_fn = getattr(backward, kernel)

        def run(q, k, v, do, lse, delta, bias, mask):
            return kernel_fn(q, k, v, do, lse, delta, None, None, table, bias=bias, mask=mask,
                             **options)
        return jax.jit(run), (self.q, self.k, self.v, self.do, *self.residuals(pair), bias,
                              mask)

    def public_call(self, pair, block_sizes=None):
        """(jitted fwd+bwd of the public call, its arguments)."""
        bias = self.bias if pair == "bias" else None
        mask = self.mask if pair == "mask" else None

        def run(q, k, v, bias, mask, do):
            attention = functools.partial(
                pallas_kernels.dot_product_attention, bias=bias, mask=mask,
                block_sizes=block_sizes, implementation="pallas", interpret=self.interpret)
            return jax.vjp(attention, q, k, v)[1](do)
        return jax.jit(run), (self.q, self.k, self.v, bias, mask, self.do)


def milliseconds(fn, args, smoke):
    if smoke:
        jax.block_until_ready(fn(*args))
        return None
    return 1e3 * _timing.amortised_seconds(fn, *args)


def sweep(case, smoke):
    rows = []
    flops = 4 * case.batch * case.heads * case.length**2 * case.head_dim
    for kernel, tiles in TILES.items():
        for tile in tiles:
            for pair in PAIRS:
                row = dict(kernel=kernel, tile=tile, pair=pair)
                try:
                    ms = milliseconds(*case.kernel_call(kernel, tile, pair), smoke)
                    row.update(ms=ms, tflops=ms and flops * MATMUL_SHARE[kernel] / ms / 1e9)
                except Exception as e:  # a tile that does not fit is a result too
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                print(row, flush=True)
    return rows


def best_blocks(rows, pair):
    """The fastest tile of each kernel with this pair (the first tile where none ran)."""
    picks = []
    for kernel, tiles in TILES.items():
        timed = [(r["ms"], tuple(r["tile"])) for r in rows
                 if r["kernel"] == kernel and r["pair"] == pair and r.get("ms") is not None]
        picks.append(tuning.KernelBlocks(*(min(timed)[1] if timed else tiles[0])))
    return tuning.AttentionBlocks(*picks)


def public_calls(case, rows, smoke, rounds=2):
    out = []
    variants = [("none", None, "table"), ("bias", None, "table"), ("mask", None, "table"),
                ("bias", best_blocks(rows, "bias"), "best"),
                ("mask", best_blocks(rows, "mask"), "best")]
    for _ in range(rounds):
        for pair, blocks, tiles in variants:
            row = dict(public=pair, tiles=tiles, blocks=None if blocks is None else str(blocks))
            try:
                row["ms"] = milliseconds(*case.public_call(pair, blocks), smoke)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            out.append(row)
            print(row, flush=True)
    return out


def table(rows):
    lines = []
    for kernel, tiles in TILES.items():
        for tile in tiles:
            got = {r["pair"]: r.get("ms") for r in rows
                   if r["kernel"] == kernel and tuple(r["tile"]) == tile}
            base = got.get("none")
            cells = [f"{kernel} {tile}", _fmt(base)]
            for pair in PAIRS[1:]:
                ms = got.get(pair)
                cells += [_fmt(ms), _fmt(ms / base if ms and base else None, 3)]
            lines.append(cells)
    return _timing.format_table(
        ["kernel tile", "none ms", "bias ms", "x", "mask ms", "x"], lines)


def _fmt(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSON to write")
    parser.add_argument("--smoke", action="store_true",
                        help="interpret mode at a tiny shape: a CPU check of the script")
    args = parser.parse_args(argv)
    case = Case(SMOKE_SHAPE if args.smoke else SHAPE, interpret=args.smoke)
    rows = sweep(case, args.smoke)
    calls = public_calls(case, rows, args.smoke)
    _timing.write_json(args.out, dict(
        environment=_timing.environment_info("benchmarks.experiments.attention_pair_kernels"),
        shape=dict(zip(("batch", "heads", "length", "head_dim"),
                       SMOKE_SHAPE if args.smoke else SHAPE, strict=True)),
        kernels=rows, public=calls))
    print(table(rows))
    for row in calls:
        print(row["public"], row["tiles"], _fmt(row.get("ms")), row.get("error", ""))


if __name__ == "__main__":
    main()
