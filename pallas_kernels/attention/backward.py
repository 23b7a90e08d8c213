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

from pallas_kernels import _compat
from pallas_kernels.attention import common, masking


def _probabilities(scores, lse2, static):
    """exp2(logits - lse) for raw scores and base-2 lse broadcast to the scores' shape."""
    logits = common.base2_logits(scores, static)
    return logits, jnp.exp2(logits - lse2)


def _dkv_kernel(
    table_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, static, block_q, block_k,
):
    if static.has_segments:
        q_seg_ref, kv_seg_ref, dk_ref, dv_ref = refs
    else:
        (dk_ref, dv_ref), q_seg_ref, kv_seg_ref = refs, None, None
    k_block = pl.program_id(0)
    k = k_ref[...]
    v = v_ref[...]
    kv_seg = None if kv_seg_ref is None else kv_seg_ref[...]
    key_band = masking.transpose_band(static.band)

    def head(g, carry):
        def step(i, carry, masked):
            dk, dv = carry
            q = q_ref[common.ds(i, block_q), g, :]
            do = do_ref[common.ds(i, block_q), g, :]
            if masked and static.has_q_len:
                q, do = common.zero_past(table_ref, masking.COL_LEN, i * block_q, q, do)
            lse2 = lse_ref[g, common.ds(i, block_q)] * common.LOG2E
            delta = delta_ref[g, common.ds(i, block_q)]
            scores_t = jnp.dot(k, q.T, preferred_element_type=jnp.float32)  # (block_k, block_q)
            logits_t, probs_t = _probabilities(scores_t, lse2[None, :], static)
            if masked:
                q_seg = None if q_seg_ref is None else q_seg_ref[common.ds(i, block_q)]
                mask = common.block_mask(
                    table_ref, k_block * block_k, block_k, i * block_q, block_q, static,
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

        return common.visit_blocks(table_ref, step, carry, static)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, static.groups, head, (zeros, zeros))
    dk_ref[...] = (dk * static.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(
    table_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, static, block_q, block_k,
):
    if static.has_segments:
        q_seg_ref, kv_seg_ref, dq_ref = refs
    else:
        (dq_ref,), q_seg_ref, kv_seg_ref = refs, None, None
    q_block = pl.program_id(0)
    q = q_ref[...]
    do = do_ref[...]
    lse2 = lse_ref[...] * common.LOG2E
    delta = delta_ref[...]
    q_seg = None if q_seg_ref is None else q_seg_ref[...]

    def step(j, dq, masked):
        k = k_ref[common.ds(j, block_k), :]
        v = v_ref[common.ds(j, block_k), :]
        if masked and static.has_kv_len:  # (v's NaN dprobs are masked out of dlogits)
            (k,) = common.zero_past(table_ref, masking.COL_LEN, j * block_k, k)
        scores = jnp.dot(q, k.T, preferred_element_type=jnp.float32)
        logits, probs = _probabilities(scores, lse2[:, None], static)
        if masked:
            kv_seg = None if kv_seg_ref is None else kv_seg_ref[common.ds(j, block_k)]
            mask = common.block_mask(
                table_ref, q_block * block_q, block_q, j * block_k, block_k, static,
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

    dq = common.visit_blocks(table_ref, step, jnp.zeros(q.shape, jnp.float32), static)
    dq_ref[...] = (dq * static.scale).astype(dq_ref.dtype)


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
    in_specs = [
        pl.BlockSpec((None, None, table.shape[-1]), lambda j, h, b: (b, j, 0)),
        group_spec, kv_spec, kv_spec, group_spec, group_rows, group_rows,
    ]
    args = [table, q, k, v, do, lse, delta]
    if static.has_segments:
        in_specs += [
            pl.BlockSpec((None, t_pad), lambda j, h, b: (b, 0)),
            pl.BlockSpec((None, bk), lambda j, h, b: (b, j)),
        ]
        args += [q_seg, kv_seg]
    return pl.pallas_call(
        functools.partial(_dkv_kernel, static=static, block_q=bq, block_k=bk),
        grid=(s_pad // bk, kv_heads, batch),
        in_specs=in_specs,
        out_specs=[kv_spec, kv_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_compat.triton_params(blocks.num_warps, blocks.num_stages),
        interpret=static.interpret,
        name="flash_attention_dkv",
    )(*args)


def dq(q, k, v, do, lse, delta, q_seg, kv_seg, table, *, static, blocks):
    """dq for padded inputs; `table` is the `masking.block_table` of query over key blocks."""
    batch, t_pad, heads, d_pad = q.shape
    s_pad = k.shape[1]
    bq, bk, groups = blocks.block_q, blocks.block_k, static.groups
    q_spec = pl.BlockSpec((None, bq, None, d_pad), lambda i, h, b: (b, i, h, 0))
    rows_spec = pl.BlockSpec((None, None, bq), lambda i, h, b: (b, h, i))
    kv_spec = pl.BlockSpec((None, s_pad, None, d_pad), lambda i, h, b: (b, 0, h // groups, 0))
    in_specs = [
        pl.BlockSpec((None, None, table.shape[-1]), lambda i, h, b: (b, i, 0)),
        q_spec, kv_spec, kv_spec, q_spec, rows_spec, rows_spec,
    ]
    args = [table, q, k, v, do, lse, delta]
    if static.has_segments:
        in_specs += [
            pl.BlockSpec((None, bq), lambda i, h, b: (b, i)),
            pl.BlockSpec((None, s_pad), lambda i, h, b: (b, 0)),
        ]
        args += [q_seg, kv_seg]
    return pl.pallas_call(
        functools.partial(_dq_kernel, static=static, block_q=bq, block_k=bk),
        grid=(t_pad // bq, heads, batch),
        in_specs=in_specs,
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compat.triton_params(blocks.num_warps, blocks.num_stages),
        interpret=static.interpret,
        name="flash_attention_dq",
    )(*args)
