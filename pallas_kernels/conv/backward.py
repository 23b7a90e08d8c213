"""The causal conv backward: a Pallas kernel (Triton lowering) for the pre-activation's gradient
and the weight's and bias's, then dx from it in XLA.

With u the pre-activation and du = dout * silu'(u) (dout without the SiLU):

    dweight[k] = sum over t of du[t] * x[t - (W - 1 - k)],   dbias = sum over t of du[t]
    dx[t] = sum over j of weight[W - 1 - j] * du[t + j]

One program per (batch row, tile of tokens, block of channels), as the forward: it gathers its
rows' taps (kept for the weight's gradient), recomputes u, writes du in x's dtype (entries outside
x load as zeros) and its (W, block_c) part of dweight and its part of dbias in
float32; XLA adds the tiles' parts in a fixed order (deterministic). dx is one XLA fusion of W
shifted reads of du. A single kernel computing dx too would need du W - 1 rows past its tile,
so each program would recompute u W times from W x W gathers: measured slower than XLA's
conv (NOTES).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import _device, _operands
from pallas_kernels._operands import Operands
from pallas_kernels.conv.forward import (
    Tile,
    by_reach,
    load_tile,
    operands,
    pre_activation,
    sigmoid,
    store_tile,
    taps,
)


def _pre_activation_grad_kernel(refs, *, static):
    tiles = static.backward_tiles
    tile = Tile.of_program(tiles.block_t, tiles.block_c, refs.x.shape[0], static)

    def body(reaches_back):
        row_taps = list(taps(refs, tile, static, reaches_back))  # kept for the weight's gradient
        grad = load_tile(refs.dout, tile)  # zeros outside x: nothing outside is summed
        if static.silu:
            u = pre_activation(refs, tile, row_taps)
            s = sigmoid(u)
            grad = grad * (s * (1.0 + u * (1.0 - s)))
        store_tile(refs.du, grad, tile)
        for k, tap in enumerate(row_taps):
            plt.store(refs.dweight.at[jnp.int32(k), :], jnp.sum(grad * tap, axis=0),
                      mask=tile.col_ok)
        if refs.dbias is not None:
            plt.store(refs.dbias, jnp.sum(grad, axis=0), mask=tile.col_ok)

    by_reach(body, tiles.block_t, static)


def gradients(x, weight, bias, history, dout, *, static):
    """(dx in x's dtype, dweight (W, C) float32, dbias (C,) float32 or None) of
    `forward.convolve`, given dout (B, T, C)."""
    tiles = static.backward_tiles
    b, t, c = x.shape
    width = static.width
    t_blocks, c_blocks = _device.cdiv(t, tiles.block_t), _device.cdiv(c, tiles.block_c)
    tile = pl.BlockSpec((None, tiles.block_t, tiles.block_c), lambda b, t, c: (b, t, c))
    inputs = operands(x, weight, bias, history, tiles).add("dout", tile, dout)
    outputs = (Operands()
               .add("du", tile, jax.ShapeDtypeStruct(x.shape, x.dtype))
               .add("dweight", pl.BlockSpec((None, None, width, tiles.block_c),
                                            lambda b, t, c: (b, t, 0, c)),
                    jax.ShapeDtypeStruct((b, t_blocks, width, c), jnp.float32))
               .add("dbias", pl.BlockSpec((None, None, tiles.block_c),
                                          lambda b, t, c: (b, t, c)),
                    None if bias is None else jax.ShapeDtypeStruct((b, t_blocks, c),
                                                                   jnp.float32)))
    result = _operands.call(
        functools.partial(_pre_activation_grad_kernel, static=static), inputs, outputs,
        grid=(b, t_blocks, c_blocks), num_warps=tiles.num_warps, num_stages=1,
        interpret=static.interpret, name="causal_conv1d_backward", masks_edges=True)
    du = jnp.pad(result["du"], ((0, 0), (0, width - 1), (0, 0)))
    dx = sum(weight[width - 1 - j].astype(jnp.float32) * du[:, j:j + t].astype(jnp.float32)
             for j in range(width))
    dbias = result.get("dbias")
    return (dx.astype(x.dtype), jnp.sum(result["dweight"], axis=(0, 1)),
            None if dbias is None else jnp.sum(dbias, axis=(0, 1)))
