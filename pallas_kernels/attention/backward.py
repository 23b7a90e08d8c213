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

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _device, _operands
from pallas_kernels._operands import Operands
from pallas_kernels.attention import common, masking


def _probabilities(scores, lse2, static):
    """exp2(logits - lse) for raw scores and base-2 lse broadcast to the scores' shape."""
    logits = common.base2_logits(scores, static)
    return logits, jnp.exp2(logits - lse2)


def _dkv_kernel(refs, *, static, block_q, block_k):
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
            lse2 = refs.lse[g, _device.block_slice(i, block_q)] * common.LOG2E
            delta = refs.delta[g, _device.block_slice(i, block_q)]
            scores_t = jnp.dot(k, q.T, preferred_element_type=jnp.float32)  # (block_k, block_q)
            logits_t, probs_t = _probabilities(scores_t, lse2[None, :], static)
            if masked:
                q_seg = None if refs.q_seg is None else refs.q_seg[_device.block_slice(i, block_q)]
                mask = common.block_mask(
                    refs.table, k_block * block_k, block_k, i * block_q, block_q, static,
                    key_band, kv_seg, q_seg,
                )
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
    dk, dv = jax.lax.fori_loop(0, static.groups, head, (zeros, zeros))
    refs.dk[...] = (dk * static.scale).astype(refs.dk.dtype)
    refs.dv[...] = dv.astype(refs.dv.dtype)


def _dq_kernel(refs, *, static, block_q, block_k):
    q_block = pl.program_id(0)
    q = refs.q[...]
    do = refs.do[...]
    lse2 = refs.lse[...] * common.LOG2E
    delta = refs.delta[...]
    q_seg = None if refs.q_seg is None else refs.q_seg[...]

    def step(j, dq, masked):
        k = refs.k[_device.block_slice(j, block_k), :]
        v = refs.v[_device.block_slice(j, block_k), :]
        if masked and static.has_kv_len:  # (v's NaN dprobs are masked out of dlogits)
            (k,) = common.zero_past(refs.table, masking.COL_LEN, j * block_k, k)
        scores = jnp.dot(q, k.T, preferred_element_type=jnp.float32)
        logits, probs = _probabilities(scores, lse2[:, None], static)
        if masked:
            kv_seg = None if refs.kv_seg is None else refs.kv_seg[_device.block_slice(j, block_k)]
            mask = common.block_mask(
                refs.table, q_block * block_q, block_q, j * block_k, block_k, static,
                static.band, q_seg, kv_seg,
            )
            probs = jnp.where(mask, probs, 0.0)
        dprobs = jnp.dot(do, v.T, preferred_element_type=jnp.float32)
        dlogits = probs * (dprobs - delta[:, None])
        if static.logits_soft_cap is not None:
            dlogits *= common.soft_cap_derivative(logits, static)
        if masked and static.has_lengths:  # a masked pair's dprobs or delta may be NaN
            dlogits = jnp.where(mask, dlogits, 0.0)
        return dq + jnp.dot(dlogits.astype(k.dtype), k, preferred_element_type=jnp.float32)

    dq = common.visit_blocks(refs.table, step, jnp.zeros(q.shape, jnp.float32), static)
    refs.dq[...] = (dq * static.scale).astype(refs.dq.dtype)


def dkv(q, k, v, do, lse, delta, q_seg, kv_seg, table, *, static, blocks):
    """dk, dv for padded inputs (shapes as in `forward.forward`), summed over each GQA group.

    lse and delta are (B, N, Tp) float32; `table` is the `masking.block_table` of key blocks over
    query blocks (transposed band); `blocks` a `tuning.KernelBlocks`.
    """
    batch, t_pad, _, d_pad = q.shape
    s_pad, kv_heads = k.shape[1], k.shape[2]
    bq, bk, groups = blocks.block_q, blocks.block_k, static.groups
    group_spec = pl.BlockSpec((None, t_pad, groups, d_pad), lambda j, h, b: (b, 0, h, 0))
    group_rows = pl.BlockSpec((None, groups, t_pad), lambda j, h, b: (b, h, 0))
    kv_spec = pl.BlockSpec((None, bk, None, d_pad), lambda j, h, b: (b, j, h, 0))
    inputs = _inputs(
        pl.BlockSpec((None, None, table.shape[-1]), lambda j, h, b: (b, j, 0)), table,
        group_spec, kv_spec, group_rows, q, k, v, do, lse, delta,
        pl.BlockSpec((None, t_pad), lambda j, h, b: (b, 0)), q_seg,
        pl.BlockSpec((None, bk), lambda j, h, b: (b, j)), kv_seg,
    )
    outputs = (Operands().add("dk", kv_spec, jax.ShapeDtypeStruct(k.shape, k.dtype))
               .add("dv", kv_spec, jax.ShapeDtypeStruct(v.shape, v.dtype)))
    out = _operands.call(
        functools.partial(_dkv_kernel, static=static, block_q=bq, block_k=bk),
        inputs, outputs,
        grid=(s_pad // bk, kv_heads, batch),
        num_warps=blocks.num_warps, num_stages=blocks.num_stages,
        interpret=static.interpret,
        name="flash_attention_dkv",
    )
    return out["dk"], out["dv"]


def dq(q, k, v, do, lse, delta, q_seg, kv_seg, table, *, static, blocks):
    """dq for padded inputs; `table` is the `masking.block_table` of query over key blocks."""
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
    outputs = Operands().add("dq", q_spec, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return _operands.call(
        functools.partial(_dq_kernel, static=static, block_q=bq, block_k=bk),
        inputs, outputs,
        grid=(t_pad // bq, heads, batch),
        num_warps=blocks.num_warps, num_stages=blocks.num_stages,
        interpret=static.interpret,
        name="flash_attention_dq",
    )["dq"]


def _inputs(table_spec, table, q_spec, kv_spec, rows_spec, q, k, v, do, lse, delta,
            q_seg_spec, q_seg, kv_seg_spec, kv_seg):
    """The named inputs of a backward kernel: q and dO share `q_spec`, k and v `kv_spec`, lse
    and delta `rows_spec`; the segment ids (or None) their own."""
    return (Operands().add("table", table_spec, table)
            .add("q", q_spec, q).add("k", kv_spec, k).add("v", kv_spec, v).add("do", q_spec, do)
            .add("lse", rows_spec, lse).add("delta", rows_spec, delta)
            .add("q_seg", q_seg_spec, q_seg).add("kv_seg", kv_seg_spec, kv_seg))
