"""The causal conv backward kernel (Pallas, Triton lowering).

One program per (batch row, tile of tokens, block of channels), as the forward. With u the
pre-activation and du = dout * silu'(u) (dout without the SiLU):

    dx[t] = sum over j of weight[W - 1 - j] * du[t + j]
    dweight[k] = sum over t of du[t] * x[t - (W - 1 - k)],   dbias = sum over t of du[t]

The program recomputes u at its rows shifted by j = 0 .. W - 1 from gathered rows of x (cache
hits: the tiles overlap by W - 1 rows), so nothing but x is kept from the forward. Rows at or
past T carry du = 0. Each tile writes its (W, block_c) part of dweight and its part of dbias
in float32; XLA adds the tiles' parts in a fixed order (deterministic).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _device, _operands
from pallas_kernels._operands import Operands
from pallas_kernels.conv.forward import operands, pre_activation, sigmoid, token_rows


def _backward_kernel(refs, *, static):
    block_t = static.backward_tiles.block_t
    length = refs.x.shape[0]
    rows = pl.program_id(1) * block_t + jax.lax.broadcasted_iota(jnp.int32, (block_t,), 0)
    dx = None
    for j in range(static.width):
        shifted = rows + j
        grad = refs.dout[jnp.minimum(shifted, length - 1), :].astype(jnp.float32)
        if static.silu:
            u = pre_activation(refs, shifted, static)
            s = sigmoid(u)
            grad = grad * (s * (1.0 + u * (1.0 - s)))
        grad = jnp.where((shifted < length)[:, None], grad, 0.0)
        term = refs.weight[static.width - 1 - j, :].astype(jnp.float32)[None, :] * grad
        dx = term if dx is None else dx + term
        if j == 0:  # this tile's own rows: its part of the weight's and the bias's gradients
            # The taps are gathered again (cache hits) rather than kept from pre_activation: W
            # more live tiles would not fit the registers.
            for k in range(static.width):
                tap = token_rows(refs, rows - (static.width - 1 - k), static)
                refs.dweight[k, :] = jnp.sum(grad * tap, axis=0)
            if refs.dbias is not None:
                refs.dbias[...] = jnp.sum(grad, axis=0)
    refs.dx[...] = dx.astype(refs.dx.dtype)


def gradients(x, weight, bias, history, dout, *, static):
    """(dx in x's dtype, dweight (W, C) float32, dbias (C,) float32 or None) of
    `forward.convolve`, given dout (B, T, C)."""
    tiles = static.backward_tiles
    b, t, c = x.shape
    t_blocks, c_blocks = _device.cdiv(t, tiles.block_t), _device.cdiv(c, tiles.block_c)
    inputs = operands(x, weight, bias, history, tiles).add(
        "dout", pl.BlockSpec((None, t, tiles.block_c), lambda b, t, c: (b, 0, c)), dout)
    tile = pl.BlockSpec((None, tiles.block_t, tiles.block_c), lambda b, t, c: (b, t, c))
    outputs = (Operands()
               .add("dx", tile, jax.ShapeDtypeStruct(x.shape, x.dtype))
               .add("dweight", pl.BlockSpec((None, None, static.width, tiles.block_c),
                                            lambda b, t, c: (b, t, 0, c)),
                    jax.ShapeDtypeStruct((b, t_blocks, static.width, c), jnp.float32))
               .add("dbias", pl.BlockSpec((None, None, tiles.block_c),
                                          lambda b, t, c: (b, t, c)),
                    None if bias is None else jax.ShapeDtypeStruct((b, t_blocks, c),
                                                                   jnp.float32)))
    result = _operands.call(
        functools.partial(_backward_kernel, static=static), inputs, outputs,
        grid=(b, t_blocks, c_blocks), num_warps=tiles.num_warps, num_stages=1,
        interpret=static.interpret, name="causal_conv1d_backward")
    dbias = result.get("dbias")
    return (result["dx"], jnp.sum(result["dweight"], axis=(0, 1)),
            None if dbias is None else jnp.sum(dbias, axis=(0, 1)))
