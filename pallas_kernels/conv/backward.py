"""The causal conv backward: a Pallas kernel (Triton lowering) for the pre-activation's gradient
and the weight's and bias's, then dx from it in XLA.

With u the pre-activation and du = dout * silu'(u) (dout without the SiLU):

    dweight[k] = sum over t of du[t] * x[t - (W - 1 - k)],   dbias = sum over t of du[t]
    dx[t] = sum over j of weight[W - 1 - j] * du[t + j]

One program per (batch row, span of `steps` tiles of `block_t` tokens, block of channels). It
walks its span a tile at a time: gathers the tile's taps, recomputes u, writes du in x's dtype
(entries outside x load as zeros) and adds du * tap and du to (block_t, block_c) float32 sums
in registers; after the walk it sums those over the rows once, its (W, block_c) part of dweight
and its part of dbias (summing every 64-row tile's rows took 200 shuffles and 49 barriers in
its sm_90a code). XLA adds the spans' parts in a fixed order (deterministic). dx is one XLA
fusion of W shifted reads of du. A single kernel computing dx too would need du W - 1 rows past
its tile, so each program would recompute u W times from W x W gathers: measured slower than
XLA's conv (NOTES).
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
    add_parts,
    by_part,
    by_reach,
    in_first_part,
    load_tile,
    operands,
    pre_activation,
    sigmoid,
    store_tile,
    taps,
)


def _pre_activation_grad_kernel(refs, *, static):
    tiles = static.backward_tiles
    length, width = refs.x.shape[0], static.width
    start = pl.program_id(1) * tiles.block_t * tiles.steps
    first = Tile.of_program(tiles.block_t, tiles.block_c, length, static, first_row=start)
    in_first = in_first_part(static, tiles.block_c)

    def step(i, sums):
        first_row = start + i * tiles.block_t
        tile = first.moved(first_row, length)
        # This step's rows of the program's span of dout and du.
        rows = pl.ds(pl.multiple_of(i * tiles.block_t, tiles.block_t), tiles.block_t)

        def body(reaches_back, sums):
            row_taps = list(taps(refs, tile, static, reaches_back))
            grad = by_part(refs, "dout", in_first,  # zeros outside x: nothing outside summed
                           lambda dout: load_tile(dout.at[rows, :], tile))
            if static.silu:
                u = pre_activation(refs, tile, row_taps)
                s = sigmoid(u)
                grad = grad * (s * (1.0 + u * (1.0 - s)))
            store_tile(refs.du.at[rows, :], grad, tile)
            weight_sums = (total + grad * tap
                           for total, tap in zip(sums[:width], row_taps, strict=True))
            return (*weight_sums, sums[width] + grad)

        return by_reach(body, first_row, static, sums)

    zeros = jnp.zeros((tiles.block_t, tiles.block_c), jnp.float32)
    sums = jax.lax.fori_loop(0, tiles.steps, step, (zeros,) * (width + 1))
    for k in range(width):
        plt.store(refs.dweight.at[jnp.int32(k), :], jnp.sum(sums[k], axis=0), mask=first.col_ok)
    if refs.dbias is not None:
        plt.store(refs.dbias, jnp.sum(sums[width], axis=0), mask=first.col_ok)


def gradients(x, weight, bias, history, dout, *, static):
    """(dx (B, T, C) in x's dtype, dweight (W, C) float32, dbias (C,) float32 or None) of
    `forward.convolve`, given dout (B, T, C), or its two parts with a split. dx is the
    gradient of x's conv channels."""
    tiles = static.backward_tiles
    b, t = x.shape[:2]
    c, width = static.channels, static.width
    t_blocks = _device.cdiv(t, tiles.block_t * tiles.steps)
    c_blocks = _device.cdiv(c, tiles.block_c)
    span = tiles.block_t * tiles.steps
    inputs = add_parts(operands(x, weight, bias, history, tiles, static), "dout", span, tiles,
                       static, dout if static.split is not None else (dout,))
    outputs = (Operands()
               .add("du", pl.BlockSpec((None, span, tiles.block_c), lambda b, t, c: (b, t, c)),
                    jax.ShapeDtypeStruct((b, t, c), x.dtype))
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
