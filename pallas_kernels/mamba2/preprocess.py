"""The scan kernels' per-token inputs, from the raw dt, in one kernel (Pallas, Triton lowering).

    dt' = clamp(softplus?(dt + dt_bias))        (`semantics.step_sizes`)
    s   = in-chunk inclusive cumsum of dt' * A * log2(e)       (`common.chunk_log2_decays`)

both transposed to (B, H, Tp), head-major, as the scan kernels read them. With `seq_idx` the
cumsum runs over each sequence's own tokens (it restarts where a sequence starts inside the
chunk): the kernels only use differences of s within one sequence, or s of the sequence live at
the chunk's start, so the decays are the same, and a non-finite dt of one sequence never
reaches another's.

In XLA this took a softplus-and-transpose fusion, three cumsum fusions and a scaling of A in
front of the forward scan (benchmarks/NOTES.md); here it is one pass over dt. The cumsum is a
float32 matmul with a 0/1 lower-triangular matrix (exact float32 products, summed in order), not
a Triton scan: scans are wrong on gfx942 (ROCm/triton#947).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _device, _operands
from pallas_kernels._operands import Operands
from pallas_kernels.mamba2 import semantics

_BLOCK_H = 16  # heads per program: the matmul's smallest width
_MOST_NEGATIVE = float(jnp.finfo(jnp.float32).min)


def _preprocess_kernel(refs, *, seq_len, dt_softplus, dt_limit):
    q = refs.step.shape[-1]
    tokens = pl.program_id(1) * q + jnp.arange(q, dtype=jnp.int32)
    step = semantics.step_sizes(
        refs.dt[...], None if refs.dt_bias is None else refs.dt_bias[...], dt_softplus,
        dt_limit, jnp.float32,
    )  # (Q, heads block)
    step = jnp.where(tokens[:, None] < seq_len, step, 0.0)  # padding tokens take no step
    log2_decays = step * (refs.A[...].astype(jnp.float32) * math.log2(math.e))[None, :]
    row = jnp.arange(q, dtype=jnp.int32)[:, None]
    summed = jnp.arange(q, dtype=jnp.int32)[None, :] <= row  # (Q, Q): s_l sums tokens j <= l
    if refs.seq is not None:  # of l's own sequence
        seq = refs.seq[...]
        summed &= seq[None, :] == seq[:, None]
    # The sums are a matmul with the 0/1 matrix (exact float32 products), so every value must
    # be finite: a NaN would reach every row through 0 x NaN. A NaN log decay (from a NaN dt')
    # counts as 0, as the scan kernels still see the NaN dt' itself, which makes the outputs and
    # states it reaches NaN; -inf (an infinite dt') as the most negative sum that stays finite.
    log2_decays = jnp.maximum(jnp.where(jnp.isnan(log2_decays), 0.0, log2_decays),
                              _MOST_NEGATIVE / q)
    s = jnp.dot(summed.astype(jnp.float32), log2_decays, precision=jax.lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32)
    refs.step[...] = step.T
    refs.s[...] = s.T


def preprocess(dt, dt_bias, A, seq, *, static, block_t):
    """(dt', s) of the scan kernels: both (B, H, Tp) float32, zero at padding tokens.

    dt (B, Tp, H) raw step sizes (any float dtype) padded to whole chunks of `block_t`, of which
    the first `static.seq_len` are real; dt_bias (H,) or None; A (H,), <= 0; seq (B, Tp) int32
    sequence runs (`semantics.sequence_runs`) or None. `static.dt_softplus` and
    `static.dt_limit` as in `semantics.step_sizes`; s as in `common.chunk_log2_decays`, summed
    over each token's own sequence, always finite (see the kernel).
    """
    batch, t_pad, heads = dt.shape
    q = block_t
    # The kernel's blocks cover whole arrays; the extra heads are dropped.
    h_pad = _device.cdiv(heads, _BLOCK_H) * _BLOCK_H
    dt = _device.pad_end(dt, (None, None, h_pad))
    dt_bias, A = (None if v is None else _device.pad_end(v, (h_pad,)) for v in (dt_bias, A))
    per_heads = pl.BlockSpec((_BLOCK_H,), lambda i, c, j: (j,))
    inputs = (Operands()
              .add("dt", pl.BlockSpec((None, q, _BLOCK_H), lambda i, c, j: (i, c, j)), dt)
              .add("dt_bias", per_heads, dt_bias)
              .add("seq", pl.BlockSpec((None, q), lambda i, c, j: (i, c)), seq)
              .add("A", per_heads, A))
    out = pl.BlockSpec((None, _BLOCK_H, q), lambda i, c, j: (i, j, c))
    shape = jax.ShapeDtypeStruct((batch, h_pad, t_pad), jnp.float32)
    outputs = Operands().add("step", out, shape).add("s", out, shape)
    result = _operands.call(
        functools.partial(_preprocess_kernel, seq_len=static.seq_len,
                          dt_softplus=static.dt_softplus, dt_limit=static.dt_limit),
        inputs, outputs,
        grid=(batch, t_pad // q, h_pad // _BLOCK_H),
        num_warps=4, num_stages=1,
        interpret=static.interpret,
        name="ssd_preprocess",
    )
    return result["step"][:, :heads], result["s"][:, :heads]
