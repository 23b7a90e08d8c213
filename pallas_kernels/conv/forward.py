"""The causal conv forward kernel (Pallas, Triton lowering).

One program per (batch row, tile of `block_t` tokens, block of `block_c` channels). Tap k of
output token t reads input token t - (W - 1 - k): the program gathers those rows of x (a row
vector of indices, clamped to the sequence), and rows before the first token from the initial
states, which come padded at the front to a power of two of rows. The sum of the taps and the
bias goes through the SiLU in float32 and is stored in x's dtype; the tile's rows past T are
not written.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _device, _operands
from pallas_kernels._operands import Operands


@dataclasses.dataclass(frozen=True)
class Static:
    """What the kernels know of a call besides its arrays (hashable: keys custom_vjp)."""

    width: int  # W, taps
    history_rows: int  # the initial states' rows, padded at the front to a power of two
    silu: bool
    initial_states: bool  # given by the caller (else zeros, whose gradient is not needed)
    forward_tiles: object  # tuning.ConvTiles
    backward_tiles: object
    interpret: bool


def token_rows(refs, rows, static):
    """x's rows `rows` (block_t,) (the initial states' rows where negative) as float32
    (block_t, block_c)."""
    length = refs.x.shape[0]
    inside = refs.x[jnp.clip(rows, 0, length - 1), :]
    before = refs.history[jnp.clip(rows + static.history_rows, 0, static.history_rows - 1), :]
    return jnp.where((rows >= 0)[:, None], inside, before).astype(jnp.float32)


def pre_activation(refs, rows, static):
    """bias + sum over k of weight[k] * x[rows - (W - 1 - k)], float32 (block_t, block_c)."""
    total = None
    for k in range(static.width):
        tap = refs.weight[k, :].astype(jnp.float32)[None, :] * token_rows(
            refs, rows - (static.width - 1 - k), static)
        total = tap if total is None else total + tap
    if refs.bias is not None:
        total = total + refs.bias[...].astype(jnp.float32)[None, :]
    return total


def sigmoid(u):
    return 1.0 / (1.0 + jnp.exp(-u))


def _forward_kernel(refs, *, static):
    block_t = static.forward_tiles.block_t
    rows = pl.program_id(1) * block_t + jax.lax.broadcasted_iota(jnp.int32, (block_t,), 0)
    u = pre_activation(refs, rows, static)
    if static.silu:
        u = u * sigmoid(u)
    refs.out[...] = u.astype(refs.out.dtype)


def operands(x, weight, bias, history, tiles):
    """The inputs every conv kernel reads, by grid (b, t, c): x and the padded initial states
    whole along the tokens, weight (W, block_c), bias (block_c,)."""
    block_c = tiles.block_c
    return (Operands()
            .add("x", pl.BlockSpec((None, x.shape[1], block_c), lambda b, t, c: (b, 0, c)), x)
            .add("history", pl.BlockSpec((None, history.shape[1], block_c),
                                         lambda b, t, c: (b, 0, c)), history)
            .add("weight", pl.BlockSpec((weight.shape[0], block_c), lambda b, t, c: (0, c)),
                 weight)
            .add("bias", pl.BlockSpec((block_c,), lambda b, t, c: (c,)), bias))


def convolve(x, weight, bias, history, *, static):
    """The conv's output (B, T, C) in x's dtype: x (B, T, C), weight (W, C), bias (C,) or None,
    history (B, history_rows, C) (the initial states after zero rows)."""
    tiles = static.forward_tiles
    b, t, c = x.shape
    tile = pl.BlockSpec((None, tiles.block_t, tiles.block_c), lambda b, t, c: (b, t, c))
    outputs = Operands().add("out", tile, jax.ShapeDtypeStruct(x.shape, x.dtype))
    return _operands.call(
        functools.partial(_forward_kernel, static=static),
        operands(x, weight, bias, history, tiles), outputs,
        grid=(b, _device.cdiv(t, tiles.block_t), _device.cdiv(c, tiles.block_c)),
        num_warps=tiles.num_warps, num_stages=1, interpret=static.interpret,
        name="causal_conv1d_forward")["out"]
