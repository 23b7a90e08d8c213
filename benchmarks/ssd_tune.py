"""Times each SSD kernel alone on a GPU for candidate tiles, then the best tiles end to end.

    python -m benchmarks.ssd_tune --states 64,128 --groups 1 --out "$OUT/ssd_tune.json"

Inputs as in benchmarks/ssd.py (16k tokens, H 80, P 64, bf16, dt' in mamba's range). For each
chunk tile `block_t`, the scan-family kernels (forward, state recompute, state gradients, each
alone and the last two launched together as the backward runs them) are timed for every
(block_p, num_warps, num_stages) in SCAN_CANDIDATES (ranked by the forward plus the backward's
launch of the two walks) and the chunk-gradient kernel (with
the dB/dC state-term kernel after it) for every (heads_per_program, grad_num_warps, num_stages)
in GRAD_CANDIDATES; the fastest of each, combined with the table's other fields, are then timed
through `mamba_chunk_scan_combined` (forward and forward+backward).
Times are per call of 20 calls chained in one jitted function (`_timing.chained_seconds`:
device time, also for kernels shorter than a Python dispatch), the median of 5 runs.
"""

import argparse
import dataclasses
import functools
import itertools
import json
from unittest import mock

import jax
import jax.numpy as jnp

import pallas_kernels
from benchmarks import _timing, ssd
from pallas_kernels import _device
from pallas_kernels.mamba2 import backward, common, forward, schedule, semantics, tuning, walks

BLOCK_TS = (64, 128)
SCAN_CANDIDATES = list(itertools.product((32, 64), (4, 8), (2, 3, 4)))  # block_p, warps, stages
GRAD_CANDIDATES = list(itertools.product((8, 16, 40), (4, 8), (1, 2)))  # heads, warps, stages


def time_call(fn, *args):
    """Median milliseconds per call of 20 chained calls in one jitted function (device time,
    also for kernels shorter than a Python dispatch: `_timing.chained_seconds`)."""
    return 1e3 * _timing.chained_seconds(fn, *args)


def configure(blocks, shape, block_t, interpret=False):
    """(static, fitted blocks, plan) of the kernels for a table row at chunk `block_t`."""
    static = common.Static(has_seq_idx=False, has_d=True, has_z=False, has_initial_states=False,
                           seq_len=shape.seq_len, dt_softplus=True,
                           dt_limit=(0.0, float("inf")), interpret=interpret)
    blocks = blocks.fit(block_t, shape.head_dim, shape.heads // shape.groups)
    plan = schedule.plan(blocks, batch=shape.batch, heads=shape.heads, p_pad=shape.head_dim,
                         num_chunks=shape.seq_len // blocks.block_t,
                         multiprocessors=_device.multiprocessors(_device.target()[0]))
    return static, blocks, plan


def kernel_inputs(shape):
    """Padded kernel operands (P and N are powers of two here, T a multiple of every tile)."""
    x, dt, A, B, C, D, dt_bias, dy = ssd.make_inputs(shape, seed=0)
    dt_step = semantics.step_sizes(dt, dt_bias, True)
    dt_step = jnp.swapaxes(dt_step.astype(jnp.float32), 1, 2)
    d = jnp.broadcast_to(D[:, None], (shape.heads, shape.head_dim)).astype(jnp.float32)
    return x, dt_step, A, B, C, d, dy


def time_parts(shape, block_t, blocks, operands, interpret):
    """Milliseconds of each kernel for one set of tiles (None where it failed)."""
    x, dt_step, A, B, C, d, dy = operands
    static, blocks, plan = configure(blocks, shape, block_t, interpret)
    kw = dict(static=static, blocks=blocks)
    backward_plan = plan.for_backward()  # the backward's walks split by their own rule
    s = common.chunk_log2_decays(dt_step, A, block_t)
    run = jax.jit
    parts = {}
    try:
        parts["forward"] = time_call(run(lambda *a: forward.forward(
            *a, None, d, None, None, plan=plan, **kw)), x, dt_step, s, B, C)
        # The state recompute as the backward runs it: the forward's programs from the states
        # they started from where it cut its walks, else the backward's own cut.
        entries = run(lambda *a: forward.forward(
            *a, None, d, None, None, plan=plan, save_entries=True, **kw)[3])(
                x, dt_step, s, B, C)
        recompute_plan = backward_plan if entries is None else plan
        states_fn = run(lambda *a, entries: forward.forward(
            *a, None, None, None, None, plan=recompute_plan, emit="states", entries=entries,
            **kw)[0])
        parts["states"] = time_call(functools.partial(states_fn, entries=entries),
                                    x, dt_step, s, B, C)
        states = states_fn(x, dt_step, s, B, C, entries=entries)
        parts["state_gradients"] = time_call(run(lambda *a: walks.launch(
            [backward.state_gradients_call(*a, plan=backward_plan, **kw)],
            num_warps=blocks.num_warps, num_stages=blocks.num_stages,
            interpret=static.interpret)[0]["gstates"]), dy, dt_step, s, C, None, None)
        # The two walks as the backward launches them, together.
        walks_fn = run(lambda *a, entries: backward.states_and_gradients(
            *a, None, None, None, entries, plan=plan, **kw)[:2])
        parts["backward_walks"] = time_call(functools.partial(walks_fn, entries=entries),
                                            x, dy, dt_step, s, B, C)
        parts["chunk_gradients"] = time_call(run(lambda *a: backward.chunk_gradients(
            *a, plan=backward_plan, **kw)), x, dy, dt_step, s, B, C, None, d, states, states)
    except Exception as error:  # noqa: BLE001 - a tile that fails to compile is a result
        parts["error"] = f"{type(error).__name__}: {str(error)[:200]}"
    return parts


def end_to_end(shape, blocks, inputs, interpret):
    """(forward ms, forward+backward ms) of the public call with `blocks` as the table's tiles."""
    x, dt, A, B, C, D, dt_bias, dy = inputs

    def ssd_call(x, dt, A, B, C, D, dt_bias):
        return pallas_kernels.mamba_chunk_scan_combined(
            x, dt, A, B, C, 256, D=D, dt_bias=dt_bias, dt_softplus=True,
            implementation="pallas", interpret=interpret)

    def fwd_bwd(x, dt, A, B, C, D, dt_bias, dy):
        y, vjp = jax.vjp(ssd_call, x, dt, A, B, C, D, dt_bias)
        return y, vjp(dy)

    with mock.patch.object(tuning, "blocks_for", lambda kind, n: blocks):
        fwd_ms = time_call(jax.jit(ssd_call), x, dt, A, B, C, D, dt_bias)
        both_ms = time_call(jax.jit(fwd_bwd), x, dt, A, B, C, D, dt_bias, dy)
    return fwd_ms, both_ms


def tune_shape(shape, log, quick=False, block_ts=BLOCK_TS):
    operands = kernel_inputs(shape)
    block_ts, scan_candidates, grad_candidates = (
        ((16,), SCAN_CANDIDATES[:1], GRAD_CANDIDATES[:1]) if quick
        else (block_ts, SCAN_CANDIDATES, GRAD_CANDIDATES)
    )
    default = tuning.blocks_for(_device.target()[0], shape.state)
    rows, best = [], {}
    fwd_ms, both_ms = end_to_end(shape, default, ssd.make_inputs(shape, seed=1), quick)
    best["table"] = dict(blocks=dataclasses.asdict(default), fwd_ms=fwd_ms, fwd_bwd_ms=both_ms)
    log(dict(kind="end_to_end", **best["table"]))
    for block_t in block_ts:
        scan_best, grad_best = None, None
        for block_p, warps, stages in scan_candidates:
            blocks = dataclasses.replace(default, block_t=block_t,
                                         block_p=min(block_p, shape.head_dim), num_warps=warps,
                                         num_stages=stages, forward_num_stages=stages)
            parts = time_parts(shape, block_t, blocks, operands, quick)
            parts.pop("chunk_gradients", None)
            row = dict(kind="scan", block_t=block_t, block_p=block_p, warps=warps,
                       stages=stages, **parts)
            rows.append(row)
            log(row)
            if "error" not in parts:
                total = parts["forward"] + parts["backward_walks"]
                if scan_best is None or total < scan_best[0]:
                    scan_best = (total, row)
        for heads, warps, stages in grad_candidates:
            blocks = dataclasses.replace(default, block_t=block_t, heads_per_program=heads,
                                         grad_num_warps=warps, grad_num_stages=stages)
            parts = time_parts(shape, block_t, blocks, operands, quick)
            row = dict(kind="grad", block_t=block_t, heads=heads, warps=warps, stages=stages,
                       chunk_gradients=parts.get("chunk_gradients"), error=parts.get("error"))
            rows.append(row)
            log(row)
            if row["chunk_gradients"] is not None and (
                grad_best is None or row["chunk_gradients"] < grad_best[0]
            ):
                grad_best = (row["chunk_gradients"], row)
        if scan_best and grad_best:
            s, g = scan_best[1], grad_best[1]
            # The fastest of each family; the table's other fields (the state-term kernel's
            # warps, the segment rules) stay.
            blocks = dataclasses.replace(
                default, block_t=block_t, block_p=min(s["block_p"], shape.head_dim),
                heads_per_program=g["heads"], num_warps=s["warps"], num_stages=s["stages"],
                forward_num_stages=s["stages"], grad_num_warps=g["warps"],
                grad_num_stages=g["stages"])
            fwd_ms, both_ms = end_to_end(shape, blocks, ssd.make_inputs(shape, seed=1),
                                         quick)
            best[block_t] = dict(blocks=dataclasses.asdict(blocks), fwd_ms=fwd_ms,
                                 fwd_bwd_ms=both_ms)
            log(dict(kind="end_to_end", **best[block_t]))
    return rows, best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--states", default="64,128")
    parser.add_argument("--groups", default="1")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--block-ts", default=",".join(map(str, BLOCK_TS)),
                        help="chunk tiles to sweep")
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true",
                        help="CPU smoke test: a tiny shape, one candidate each, interpret mode")
    args = parser.parse_args(argv)
    results = []
    for n in (int(v) for v in args.states.split(",")):
        for g in (int(v) for v in args.groups.split(",")):
            shape = (
                ssd.Shape(batch=1, seq_len=32, heads=4, head_dim=16, state=n, groups=g, chunk=16)
                if args.quick
                else ssd.Shape(batch=ssd.TOKENS_PER_BATCH // args.seq_len, seq_len=args.seq_len,
                               heads=ssd.HEADS, head_dim=ssd.HEAD_DIM, state=n, groups=g,
                               chunk=256)
            )
            print(f"== {shape.label}", flush=True)
            rows, best = tune_shape(shape, lambda row: print(json.dumps(row), flush=True),
                                    args.quick, tuple(int(v) for v in args.block_ts.split(",")))
            results.append(dict(shape=dataclasses.asdict(shape), rows=rows, best=best))
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)
    for result in results:
        print(result["shape"], json.dumps(result["best"]))


if __name__ == "__main__":
    main()
