"""FlashAttention forward kernel (Pallas, Triton lowering).

One program computes one block of queries of one head: it streams the key/value blocks that its
table row lists, keeps a running max and sum (online softmax, base 2) and writes the normalised
output and the natural-log log-sum-exp. Rows that see no key get output 0 and lse -inf.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _device, _operands
from pallas_kernels._operands import Operands
from pallas_kernels.attention import common, masking


def _forward_kernel(refs, *, static, block_q, block_k, num_q_blocks):
    q_block = num_q_blocks - 1 - pl.program_id(0)  # heaviest causal blocks first
    q = refs.q[...]
    q_seg = None if refs.q_seg is None else refs.q_seg[...]

    def step(j, carry, masked):
        acc, row_max, row_sum = carry
        k = refs.k[_device.block_slice(j, block_k), :]
        v = refs.v[_device.block_slice(j, block_k), :]
        if masked and static.has_kv_len:  # (k's NaN logits are masked out before the exp)
            (v,) = common.zero_past(refs.table, masking.COL_LEN, j * block_k, v)
        cols = _device.block_slice(j, block_k)
        logits = common.base2_logits(
            jnp.dot(q, k.T, preferred_element_type=jnp.float32), static
        ) + common.pair_logits(refs, slice(None), cols)
        if masked:
            kv_seg = None if refs.kv_seg is None else refs.kv_seg[cols]
            mask = common.block_mask(
                refs.table, q_block * block_q, block_q, j * block_k, block_k, static,
                static.band, q_seg, kv_seg,
            ) & common.pair_visible(refs, slice(None), cols)
            logits = jnp.where(mask, logits, -jnp.inf)
        new_max = jnp.maximum(row_max, jnp.max(logits, axis=1))
        rescale = jnp.exp2(row_max - new_max)
        probs = jnp.exp2(logits - new_max[:, None])
        row_sum = row_sum * rescale + jnp.sum(probs, axis=1)
        acc = acc * rescale[:, None] + jnp.dot(
            probs.astype(v.dtype), v, preferred_element_type=jnp.float32
        )
        return acc, new_max, row_sum

    # A finite start for the running max keeps exp2(-inf - start) = 0 for masked entries
    # instead of exp2(-inf + inf) = nan while a row has seen nothing yet.
    carry = (
        jnp.zeros(q.shape, jnp.float32),
        jnp.full((block_q,), jnp.finfo(jnp.float32).min, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    acc, row_max, row_sum = common.visit_blocks(refs.table, step, carry, static)
    empty = row_sum == 0.0
    safe_sum = jnp.where(empty, 1.0, row_sum)
    refs.out[...] = (acc / safe_sum[:, None]).astype(refs.out.dtype)
    refs.lse[...] = jnp.where(empty, -jnp.inf, (row_max + jnp.log2(safe_sum)) * common.LN2)


def forward(q, k, v, q_seg, kv_seg, table, *, static, blocks, mask=None, bias=None):
    """Runs the forward kernel on padded inputs.

    q (B, Tp, N, Dp), k/v (B, Sp, K, Dp) with Tp % block_q == 0, Sp % block_k == 0 and Dp a power
    of two; q_seg (B, Tp) / kv_seg (B, Sp) int32 or None; table (B, Tp // block_q, 8) from
    `masking.block_table`; `blocks` a `tuning.KernelBlocks`; mask (from `masking.pack_mask`:
    uint8 8 keys a byte, (B', N', T', Sp / 8), or int8 (B', N', T', S'), nonzero: visible) and
    bias (float, added to the logits after the soft cap, (B', N', T', S')), each dim 1 or full
    (Tp, Sp), or None. Returns out (B, Tp, N, Dp) in q's dtype and lse (B, N, Tp) float32.
    """
    block_q, block_k = blocks.block_q, blocks.block_k
    batch, t_pad, heads, d_pad = q.shape
    s_pad = k.shape[1]
    num_q_blocks = t_pad // block_q
    groups = static.groups

    def q_block(i):
        return num_q_blocks - 1 - i

    q_spec = pl.BlockSpec((None, block_q, None, d_pad), lambda i, h, b: (b, q_block(i), h, 0))
    kv_spec = pl.BlockSpec((None, s_pad, None, d_pad), lambda i, h, b: (b, 0, h // groups, 0))
    inputs = (Operands()
              .add("table", pl.BlockSpec((None, None, table.shape[-1]),
                                         lambda i, h, b: (b, q_block(i), 0)), table)
              .add("q", q_spec, q).add("k", kv_spec, k).add("v", kv_spec, v)
              .add("q_seg", pl.BlockSpec((None, block_q), lambda i, h, b: (b, q_block(i))), q_seg)
              .add("kv_seg", pl.BlockSpec((None, s_pad), lambda i, h, b: (b, 0)), kv_seg))
    common.add_pairs(inputs, mask, bias, heads=None, rows=block_q, cols=s_pad,
                     index=lambda i, h, b: (b, h, q_block(i), 0))
    outputs = (Operands().add("out", q_spec, jax.ShapeDtypeStruct(q.shape, q.dtype))
               .add("lse", pl.BlockSpec((None, None, block_q), lambda i, h, b: (b, h, q_block(i))),
                    jax.ShapeDtypeStruct((batch, heads, t_pad), jnp.float32)))
    kernel = functools.partial(
        _forward_kernel, static=static, block_q=block_q, block_k=block_k,
        num_q_blocks=num_q_blocks,
    )
    out = _operands.call(
        kernel, inputs, outputs,
        grid=common.shared_pairs_grid((num_q_blocks, heads, batch), inputs, outputs, mask,
                                      bias),
        num_warps=blocks.num_warps, num_stages=blocks.num_stages,
        interpret=static.interpret,
        name="flash_attention_forward",
    )
    return out["out"], out["lse"]
