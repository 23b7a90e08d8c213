"""The scan kernels' per-token inputs, from the raw dt, in one kernel (Pallas, Triton lowering).

    dt' = preprocess_dt(dt + dt_bias)        (softplus, clip: `reference.preprocess_dt`)
    s   = in-chunk inclusive cumsum of dt' * A * log2(e)       (`common.chunk_log2_decays`)

both transposed to (B, H, Tp), head-major, as the scan kernels read them. In XLA this took a
softplus-and-transpose fusion, three cumsum fusions and a scaling of A in front of the forward
scan (benchmarks/NOTES.md, ninth round); here it is one pass over dt. The cumsum is a float32
matmul with a 0/1 lower-triangular matrix (exact float32 products, summed in order), not a
Triton scan: scans are wrong on gfx942 (ROCm/triton#947).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.mamba2 import reference

_BLOCK_H = 16  # heads per program: the matmul's smallest width


def _preprocess_kernel(dt_ref, *refs, seq_len, has_bias, dt_softplus, dt_limit):
    bias_ref = refs[0] if has_bias else None
    a_ref, step_ref, s_ref = refs[-3:]
    q = step_ref.shape[-1]
    tokens = pl.program_id(1) * q + jnp.arange(q, dtype=jnp.int32)
    step = reference.preprocess_dt(
        dt_ref[...], None if bias_ref is None else bias_ref[...], dt_softplus, dt_limit
    ).astype(jnp.float32)  # (Q, heads block)
    step = jnp.where(tokens[:, None] < seq_len, step, 0.0)  # padding tokens take no step
    log2_decays = step * (a_ref[...].astype(jnp.float32) * math.log2(math.e))[None, :]
    row = jnp.arange(q, dtype=jnp.int32)[:, None]
    lower = (jnp.arange(q, dtype=jnp.int32)[None, :] <= row).astype(jnp.float32)
    s = jnp.dot(lower, log2_decays, precision=jax.lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32)
    step_ref[...] = step.T
    s_ref[...] = s.T


def preprocess(dt, dt_bias, A, *, static):
    """(dt', s) of the scan kernels: both (B, H, Tp) float32, zero at padding tokens.

    dt (B, Tp, H) raw step sizes (any float dtype) padded to whole chunks of `static.block_t`,
    of which the first `static.seq_len` are real; dt_bias (H,) or None; A (H,).
    `static.dt_softplus` and `static.dt_limit` as in `reference.preprocess_dt`; s as in
    `common.chunk_log2_decays`.
    """
    batch, t_pad, heads = dt.shape
    q = static.block_t
    h_pad = -(-heads // _BLOCK_H) * _BLOCK_H
    if h_pad != heads:  # the kernel's blocks cover whole arrays; the extra heads are dropped
        dt, dt_bias, A = (
            None if v is None else jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, h_pad - heads)])
            for v in (dt, dt_bias, A)
        )
    per_heads = pl.BlockSpec((_BLOCK_H,), lambda i, c, j: (j,))
    in_specs = [pl.BlockSpec((None, q, _BLOCK_H), lambda i, c, j: (i, c, j))]
    args = [dt]
    if dt_bias is not None:
        in_specs.append(per_heads)
        args.append(dt_bias)
    out = pl.BlockSpec((None, _BLOCK_H, q), lambda i, c, j: (i, j, c))
    shape = jax.ShapeDtypeStruct((batch, h_pad, t_pad), jnp.float32)
    step, s = pl.pallas_call(
        functools.partial(
            _preprocess_kernel, seq_len=static.seq_len, has_bias=dt_bias is not None,
            dt_softplus=static.dt_softplus, dt_limit=static.dt_limit,
        ),
        grid=(batch, t_pad // q, h_pad // _BLOCK_H),
        in_specs=in_specs + [per_heads],
        out_specs=[out, out],
        out_shape=[shape, shape],
        compiler_params=_compat.triton_params(4, 1),
        interpret=static.interpret,
        name="ssd_preprocess",
    )(*args, A)
    return step[:, :heads], s[:, :heads]
