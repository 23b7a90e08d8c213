"""FlashAttention backward kernels (Pallas, Triton lowering), deterministic: no atomics.

Given delta = rowsum(dO * O) - dlse (computed in XLA), the probabilities are recomputed from the
saved log-sum-exp and two kernels run:

* dK/dV: one program per key block and key/value head. It loops over the G query heads of its
  group and over the query blocks that see the key block, accumulating dK and dV in registers,
  so GQA gradients are summed in the kernel with no G-times-larger buffer.
* dQ: one program per query block and query head, looping over the key blocks it sees.

Each gradient element is written once by one program, so reruns are bitwise identical.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _device, _operands
from pallas_kernels._operands import Operands
from pallas_kernels.attention import common, masking


def _probabilities(scores, lse2, static, bias2):
    """(capped, probabilities): the base-2 logits before the bias (for the soft cap's
    derivative) and exp2(logits + bias - lse) for raw scores, the base-2 bias tile (or 0.0) and
    the base-2 lse broadcast to the scores' shape."""
    capped = common.base2_logits(scores, static)
    return capped, jnp.exp2(capped + bias2 - lse2)


def _tile_gradient(q, k, v, do, lse2, delta, mask, static, bias2):
    """(capped, dlogits) of one (block_q, block_k) tile: the base-2 logits before the bias and
    the gradient of the logits after it, probs * (dprobs - delta), with the probabilities
    zeroed where `mask` (or None) is False. dprobs or delta may be NaN where masked: callers
    that need it select dlogits too. lse2 and delta are (block_q,) rows."""
    scores = jnp.dot(q, k.T, preferred_element_type=jnp.float32)
    capped, probs = _probabilities(scores, lse2[:, None], static, bias2)
    if mask is not None:
        probs = jnp.where(mask, probs, 0.0)
    dprobs = jnp.dot(do, v.T, preferred_element_type=jnp.float32)
    return capped, probs * (dprobs - delta[:, None])


def _dkv_kernel(refs, *, static, block_q, block_k, heads):
    k_block = pl.program_id(0)
    k = refs.k[...]
    v = refs.v[...]
    kv_seg = None if refs.kv_seg is None else refs.kv_seg[...]
    key_band = masking.transpose_band(static.band)

    def head(g, carry):
        def step(i, carry, masked):
            dk, dv = carry
            q = refs.q[_device.block_slice(i, block_q), g, :]
            do = refs.do[_device.block_slice(i, block_q), g, :]
            if masked and static.has_q_len:
                q, do = common.zero_past(refs.table, masking.COL_LEN, i * block_q, q, do)
            rows = _device.block_slice(i, block_q)
            lse2 = refs.lse[g, rows] * common.LOG2E
            delta = refs.delta[g, rows]
            scores_t = jnp.dot(k, q.T, preferred_element_type=jnp.float32)  # (block_k, block_q)
            logits_t, probs_t = _probabilities(
                scores_t, lse2[None, :], static,
                common.pair_logits(refs, rows, slice(None), g, transpose=True))
            if masked:
                q_seg = None if refs.q_seg is None else refs.q_seg[rows]
                mask = common.block_mask(
                    refs.table, k_block * block_k, block_k, i * block_q, block_q, static,
                    key_band, kv_seg, q_seg,
                ) & common.pair_visible(refs, rows, slice(None), g, transpose=True)
                probs_t = jnp.where(mask, probs_t, 0.0)
            dv += jnp.dot(probs_t.astype(do.dtype), do, preferred_element_type=jnp.float32)
            dprobs_t = jnp.dot(v, do.T, preferred_element_type=jnp.float32)
            dlogits_t = probs_t * (dprobs_t - delta[None, :])
            if static.logits_soft_cap is not None:
                dlogits_t *= common.soft_cap_derivative(logits_t, static)
            if masked and static.has_lengths:  # a masked pair's dprobs or delta may be NaN
                dlogits_t = jnp.where(mask, dlogits_t, 0.0)
            dk += jnp.dot(dlogits_t.astype(q.dtype), q, preferred_element_type=jnp.float32)
            return dk, dv

        return common.visit_blocks(refs.table, step, carry, static)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, heads, head, (zeros, zeros))
    refs.dk[...] = (dk * static.scale).astype(refs.dk.dtype)
    refs.dv[...] = dv.astype(refs.dv.dtype)


def _dq_kernel(refs, *, static, block_q, block_k):
    """dQ, or with a `dbias` output instead the logits' gradient of each (query, key) pair of
    the program's query block (zero where masked or not visited)."""
    q_block = pl.program_id(0)
    q = refs.q[...]
    do = refs.do[...]
    lse2 = refs.lse[...] * common.LOG2E
    delta = refs.delta[...]
    q_seg = None if refs.q_seg is None else refs.q_seg[...]

    def step(j, dq, masked):
        cols = _device.block_slice(j, block_k)
        k = refs.k[cols, :]
        v = refs.v[cols, :]
        if masked and static.has_kv_len:  # (v's NaN dprobs are masked out of dlogits)
            (k,) = common.zero_past(refs.table, masking.COL_LEN, j * block_k, k)
        mask = None
        if masked:
            kv_seg = None if refs.kv_seg is None else refs.kv_seg[cols]
            mask = common.block_mask(
                refs.table, q_block * block_q, block_q, j * block_k, block_k, static,
                static.band, q_seg, kv_seg,
            ) & common.pair_visible(refs, slice(None), cols)
        logits, dlogits = _tile_gradient(q, k, v, do, lse2, delta, mask, static,
                                         common.pair_logits(refs, slice(None), cols))
        if refs.dbias is not None:  # the bias is added after the soft cap
            if masked:  # a masked pair's dprobs or delta may be NaN
                dlogits = jnp.where(mask, dlogits, 0.0)
            refs.dbias[:, cols] = dlogits.astype(refs.dbias.dtype)
            return dq
        if static.logits_soft_cap is not None:
            dlogits *= common.soft_cap_derivative(logits, static)
        if masked and static.has_lengths:  # a masked pair's dprobs or delta may be NaN
            dlogits = jnp.where(mask, dlogits, 0.0)
        return dq + jnp.dot(dlogits.astype(k.dtype), k, preferred_element_type=jnp.float32)

    dq = common.visit_blocks(refs.table, step, jnp.zeros(q.shape, jnp.float32), static)
    if refs.dbias is None:
        refs.dq[...] = (dq * static.scale).astype(refs.dq.dtype)
        return

    def zero(j, carry):  # the blocks the table skips
        refs.dbias[:, _device.block_slice(j, block_k)] = jnp.zeros(
            (block_q, block_k), refs.dbias.dtype)
        return carry

    jax.lax.fori_loop(0, refs.table[masking.LO], zero, 0)
    jax.lax.fori_loop(refs.table[masking.HI], refs.dbias.shape[-1] // block_k, zero, 0)


def dkv(q, k, v, do, lse, delta, q_seg, kv_seg, table, *, static, blocks, mask=None,
        bias=None):
    """dk, dv for padded inputs (shapes as in `forward.forward`), summed over each GQA group.

    lse and delta are (B, N, Tp) float32; `table` is the `masking.block_table` of key blocks over
    query blocks (transposed band); `blocks` a `tuning.KernelBlocks`; mask and bias as in
    `forward.forward`. With `blocks.head_splits` > 1 a group's query heads are split across
    that many programs (at most the group size, a divisor of it): each writes its part of dK
    and dV in float32, and the parts are added in a fixed order (bitwise reproducible).
    """
    batch, t_pad, _, d_pad = q.shape
    s_pad, kv_heads = k.shape[1], k.shape[2]
    bq, bk = blocks.block_q, blocks.block_k
    splits = math.gcd(blocks.head_splits, static.groups)
    per = static.groups // splits  # query heads a program loops over

    def kv_head(h):  # program axis 1 runs over (KV head, split) pairs, h * splits + split
        return h // splits

    group_spec = pl.BlockSpec((None, t_pad, per, d_pad), lambda j, h, b: (b, 0, h, 0))
    group_rows = pl.BlockSpec((None, per, t_pad), lambda j, h, b: (b, h, 0))
    kv_spec = pl.BlockSpec((None, bk, None, d_pad), lambda j, h, b: (b, j, kv_head(h), 0))
    inputs = _inputs(
        pl.BlockSpec((None, None, table.shape[-1]), lambda j, h, b: (b, j, 0)), table,
        group_spec, kv_spec, group_rows, q, k, v, do, lse, delta,
        pl.BlockSpec((None, t_pad), lambda j, h, b: (b, 0)), q_seg,
        pl.BlockSpec((None, bk), lambda j, h, b: (b, j)), kv_seg,
    )
    common.add_pairs(inputs, mask, bias, heads=per, rows=t_pad, cols=bk,
                     index=lambda j, h, b: (b, h, 0, j))
    if splits == 1:
        out_spec, out_shapes = kv_spec, (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (k, v))
    else:  # (splits, B, Sp, K, Dp) float32 parts
        out_spec = pl.BlockSpec((None, None, bk, None, d_pad),
                                lambda j, h, b: (h % splits, b, j, kv_head(h), 0))
        out_shapes = (jax.ShapeDtypeStruct((splits, *x.shape), jnp.float32) for x in (k, v))
    outputs = Operands()
    for name, shape in zip(("dk", "dv"), out_shapes, strict=True):
        outputs.add(name, out_spec, shape)
    out = _operands.call(
        functools.partial(_dkv_kernel, static=static, block_q=bq, block_k=bk, heads=per),
        inputs, outputs,
        grid=common.shared_pairs_grid((s_pad // bk, kv_heads * splits, batch), inputs, outputs,
                                      mask, bias),
        num_warps=blocks.num_warps, num_stages=blocks.num_stages,
        interpret=static.interpret,
        name="flash_attention_dkv",
    )
    if splits == 1:
        return out["dk"], out["dv"]
    return tuple(functools.reduce(jnp.add, list(out[name])).astype(x.dtype)  # fixed order
                 for name, x in (("dk", k), ("dv", v)))


def dq(q, k, v, do, lse, delta, q_seg, kv_seg, table, *, static, blocks, mask=None, bias=None,
       emit="dq"):
    """dq for padded inputs; `table` is the `masking.block_table` of query over key blocks.

    `emit="dbias"` runs the same kernel for the gradient of the logits instead, (B, N, Tp, Sp)
    float32 (the bias's gradient before its broadcast dims are summed; zero where masked).
    """
    batch, t_pad, heads, d_pad = q.shape
    s_pad = k.shape[1]
    bq, bk, groups = blocks.block_q, blocks.block_k, static.groups
    q_spec = pl.BlockSpec((None, bq, None, d_pad), lambda i, h, b: (b, i, h, 0))
    rows_spec = pl.BlockSpec((None, None, bq), lambda i, h, b: (b, h, i))
    kv_spec = pl.BlockSpec((None, s_pad, None, d_pad), lambda i, h, b: (b, 0, h // groups, 0))
    inputs = _inputs(
        pl.BlockSpec((None, None, table.shape[-1]), lambda i, h, b: (b, i, 0)), table,
        q_spec, kv_spec, rows_spec, q, k, v, do, lse, delta,
        pl.BlockSpec((None, bq), lambda i, h, b: (b, i)), q_seg,
        pl.BlockSpec((None, s_pad), lambda i, h, b: (b, 0)), kv_seg,
    )
    common.add_pairs(inputs, mask, bias, heads=None, rows=bq, cols=s_pad,
                     index=lambda i, h, b: (b, h, i, 0))
    if emit == "dq":
        outputs = Operands().add("dq", q_spec, jax.ShapeDtypeStruct(q.shape, q.dtype))
    else:
        outputs = Operands().add(
            "dbias", pl.BlockSpec((None, None, bq, s_pad), lambda i, h, b: (b, h, i, 0)),
            jax.ShapeDtypeStruct((batch, heads, t_pad, s_pad), jnp.float32))
    return _operands.call(
        functools.partial(_dq_kernel, static=static, block_q=bq, block_k=bk),
        inputs, outputs,
        grid=common.shared_pairs_grid((t_pad // bq, heads, batch), inputs, outputs, mask, bias),
        num_warps=blocks.num_warps, num_stages=blocks.num_stages,
        interpret=static.interpret,
        name=f"flash_attention_{emit}",
    )[emit]


def _dbias_rows_kernel(refs, *, static, block_q, block_k):
    """The logits' gradient of one query block and head summed over the batch rows (a bias
    that they share): for each key block any row visits, every row's tile in row order (a
    fixed order), written once; the other key blocks get zeros. Every ref but the bias and
    the output holds all batch rows."""
    q_block = pl.program_id(0)
    batch = refs.q.shape[0]
    tile_shape = (block_q, block_k)

    def widen(b, bounds):  # the key blocks row b visits, if any
        lo, hi = refs.table[b, masking.LO], refs.table[b, masking.HI]
        return jnp.where(hi > lo, jnp.minimum(bounds[0], lo), bounds[0]), jnp.maximum(
            bounds[1], hi)

    lo, hi = jax.lax.fori_loop(0, batch, widen, (jnp.int32(refs.dbias.shape[-1] // block_k),
                                                 jnp.int32(0)))
    lo = jnp.minimum(lo, hi)

    def row_tile(j, b):
        cols = _device.block_slice(j, block_k)
        k = refs.k[b, cols, :]  # past a length k and v may hold NaN: the mask selects it away
        v = refs.v[b, cols, :]
        mask = common.block_mask(
            refs.table, q_block * block_q, block_q, j * block_k, block_k, static, static.band,
            None if refs.q_seg is None else refs.q_seg[b],
            None if refs.kv_seg is None else refs.kv_seg[b, cols], batch_row=b,
        ) & common.pair_visible(refs, slice(None), cols, b)
        _, dlogits = _tile_gradient(refs.q[b], k, v, refs.do[b], refs.lse[b] * common.LOG2E,
                                    refs.delta[b], mask, static,
                                    common.pair_logits(refs, slice(None), cols))
        return jnp.where(mask, dlogits, 0.0)  # a masked pair's dprobs or delta may be NaN

    def visit(j, carry):
        tile = jax.lax.fori_loop(0, batch, lambda b, acc: acc + row_tile(j, b),
                                 jnp.zeros(tile_shape, jnp.float32))
        refs.dbias[:, _device.block_slice(j, block_k)] = tile.astype(refs.dbias.dtype)
        return carry

    def zero(j, carry):
        refs.dbias[:, _device.block_slice(j, block_k)] = jnp.zeros(tile_shape, refs.dbias.dtype)
        return carry

    jax.lax.fori_loop(0, lo, zero, 0)
    jax.lax.fori_loop(lo, hi, visit, 0)
    jax.lax.fori_loop(hi, refs.dbias.shape[-1] // block_k, zero, 0)


# The row loop pipelines q and dO tiles besides k, v and the pair tiles: 3 stages at head dim
# 128 took 303,104 B of sm_90a's 232,448 B of shared memory; 2 take 204,800 B (d64 and d256
# fit too; `tests/test_machine_code.py`).
ROWS_STAGES = 2


def dbias_over_rows(q, k, v, do, lse, delta, q_seg, kv_seg, table, *, static, blocks, mask,
                    bias):
    """The logits' gradient summed over the batch rows, (1, N, Tp, Sp) float32, for a bias
    whose batch dim is 1 (zero where no row sees a pair): one program per query block and
    head loops over the rows, so no (B, N, Tp, Sp) buffer is made. Arguments as in `dq`."""
    batch, t_pad, heads, d_pad = q.shape
    s_pad = k.shape[1]
    bq, bk, groups = blocks.block_q, blocks.block_k, static.groups
    q_spec = pl.BlockSpec((batch, bq, None, d_pad), lambda i, h, _: (0, i, h, 0))
    rows_spec = pl.BlockSpec((batch, None, bq), lambda i, h, _: (0, h, i))
    kv_spec = pl.BlockSpec((batch, s_pad, None, d_pad), lambda i, h, _: (0, 0, h // groups, 0))
    inputs = _inputs(
        pl.BlockSpec((batch, None, table.shape[-1]), lambda i, h, _: (0, i, 0)), table,
        q_spec, kv_spec, rows_spec, q, k, v, do, lse, delta,
        pl.BlockSpec((batch, bq), lambda i, h, _: (0, i)), q_seg,
        pl.BlockSpec((batch, s_pad), lambda i, h, _: (0, 0)), kv_seg,
    )
    common.add_pairs(inputs, mask, bias, heads=None, rows=bq, cols=s_pad, batch=batch,
                     index=lambda i, h, _: (0, h, i, 0))
    outputs = Operands().add(
        "dbias", pl.BlockSpec((None, None, bq, s_pad), lambda i, h, _: (0, h, i, 0)),
        jax.ShapeDtypeStruct((1, heads, t_pad, s_pad), jnp.float32))
    return _operands.call(
        functools.partial(_dbias_rows_kernel, static=static, block_q=bq, block_k=bk),
        inputs, outputs, grid=(t_pad // bq, heads, 1),
        num_warps=blocks.num_warps, num_stages=min(blocks.num_stages, ROWS_STAGES),
        interpret=static.interpret, name="flash_attention_dbias",
    )["dbias"]


def _inputs(table_spec, table, q_spec, kv_spec, rows_spec, q, k, v, do, lse, delta,
            q_seg_spec, q_seg, kv_seg_spec, kv_seg):
    """The named inputs of a backward kernel: q and dO share `q_spec`, k and v `kv_spec`, lse
    and delta `rows_spec`; the segment ids (or None) their own."""
    return (Operands().add("table", table_spec, table)
            .add("q", q_spec, q).add("k", kv_spec, k).add("v", kv_spec, v).add("do", q_spec, do)
            .add("lse", rows_spec, lse).add("delta", rows_spec, delta)
            .add("q_seg", q_seg_spec, q_seg).add("kv_seg", kv_seg_spec, kv_seg))
