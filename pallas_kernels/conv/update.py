"""The causal conv's decode step kernel (Pallas, Triton lowering): one new token per row through
the conv and its SiLU, the conv state (the W - 1 inputs before the token) updated in place.

One program per (batch row, block of `block_c` channels) loads the token's channels (read in
place from a wider packed array at `column_offset`, a multiple of the block), the state's
W - 1 rows one at a time, the weight and the bias, and writes the output, then the state
shifted by one row with the token last over the state's own buffer (the new state aliases the
old one: under jit with it donated no copy is made). Each channel belongs to one program, so
no program reads what another writes.

The state is rounded to x's dtype for the sum, as `causal_conv1d` rounds its initial states;
the shifted rows are stored as they were read. Edge blocks (C not a multiple of the block)
load and store through masks (jax 0.11's Pallas-Triton masks no overhanging block).
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import _operands
from pallas_kernels._operands import Operands
from pallas_kernels.conv.forward import sigmoid


@dataclasses.dataclass(frozen=True)
class Static:
    """What the kernel knows of a call besides its arrays."""

    width: int  # W, taps (at least 2: the state has W - 1 rows)
    channels: int  # C
    silu: bool
    column_offset: int  # x's first conv channel, a multiple of tiles.block_c
    tiles: object  # tuning.ConvTiles (block_c, num_warps)
    interpret: bool


def _kernel(refs, *, static):
    block_c = static.tiles.block_c
    cols = pl.program_id(1) * block_c + jax.lax.broadcasted_iota(jnp.int32, (block_c,), 0)
    col_ok = None if static.channels % block_c == 0 else cols < static.channels
    other = None if col_ok is None else 0

    def load(ref):
        return plt.load(ref, mask=col_ok, other=other)

    def store(ref, value):
        plt.store(ref, value.astype(ref.dtype), mask=col_ok)

    token = load(refs.x)
    history = [load(refs.state.at[jnp.int32(r), :]) for r in range(static.width - 1)]
    total = None
    for k, tap in enumerate([*(row.astype(token.dtype) for row in history), token]):
        term = load(refs.weight.at[jnp.int32(k), :]).astype(jnp.float32) * tap.astype(
            jnp.float32)
        total = term if total is None else total + term
    if refs.bias is not None:
        total = total + load(refs.bias).astype(jnp.float32)
    if static.silu:
        total = total * sigmoid(total)
    store(refs.out, total)
    for r, row in enumerate([*history[1:], token]):
        store(refs.new_state.at[jnp.int32(r), :], row)


def update(x, state, weight, bias, *, static):
    """The kernel: x (B, C_x) holding the token's C channels from `static.column_offset`, state
    (B, W - 1, C) in any float dtype, weight (W, C), bias (C,) or None. Returns (out (B, C) in
    x's dtype, the new state: the state's buffer, updated in place)."""
    block_c = static.tiles.block_c
    batch = x.shape[0]
    offset = static.column_offset // block_c
    blocks = pl.cdiv(static.channels, block_c)
    row = pl.BlockSpec((None, block_c), lambda b, c: (b, c))
    state_spec = pl.BlockSpec((None, state.shape[1], block_c), lambda b, c: (b, 0, c))
    inputs = (Operands()
              .add("x", pl.BlockSpec((None, block_c), lambda b, c: (b, c + offset)), x)
              .add("state", state_spec, state)
              .add("weight", pl.BlockSpec((weight.shape[0], block_c), lambda b, c: (0, c)),
                   weight)
              .add("bias", pl.BlockSpec((block_c,), lambda b, c: (c,)), bias))
    outputs = (Operands()
               .add("out", row, jax.ShapeDtypeStruct((batch, static.channels), x.dtype))
               .add("new_state", state_spec, jax.ShapeDtypeStruct(state.shape, state.dtype)))
    out = _operands.call(
        lambda refs: _kernel(refs, static=static), inputs, outputs,
        grid=(batch, blocks), num_warps=static.tiles.num_warps, num_stages=1,
        interpret=static.interpret, name="causal_conv1d_update",
        aliases={"state": "new_state"}, masks_edges=static.channels % block_c != 0,
        windows=("x",))
    return out["out"], out["new_state"]
