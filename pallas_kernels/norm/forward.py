"""The gated RMSNorm forward kernel (Pallas, Triton lowering).

One program per (tile of `block_rows` rows, group): it reads the tile's x (and z) once, whole
groups (a power of two of channels: `api` sends other sizes to the reference), and writes the
normalised output in x's dtype. Nothing else is kept for the backward, which recomputes the row
statistics from the same reads (`backward.py`). z may be wider than x (a packed projection, read
in place): its channels start at a multiple of the group size, `z_offset` groups in.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _operands
from pallas_kernels._operands import Operands


@dataclasses.dataclass(frozen=True)
class Static:
    """What the kernels know of a call besides its arrays (hashable: keys custom_vjp)."""

    group_size: int
    eps: float
    gated: bool  # z is given
    norm_before_gate: bool
    tiles: object  # tuning.NormTiles
    interpret: bool
    z_offset: int = 0  # z's first channel, in groups


def gate_and_slope(z):
    """silu(z) and its derivative, float32."""
    sigmoid = 1.0 / (1.0 + jnp.exp(-z))
    return z * sigmoid, sigmoid * (1.0 + z * (1.0 - sigmoid))


def inverse_rms(v, static):
    """1 / sqrt(mean(v**2 over the group) + eps) per row of v (rows, group_size)."""
    return jax.lax.rsqrt(jnp.sum(v * v, axis=1) / static.group_size + static.eps)


def _forward_kernel(refs, *, static):
    x = refs.x[...].astype(jnp.float32)
    weight = refs.weight[...].astype(jnp.float32)
    gate = None
    if static.gated:
        gate, _ = gate_and_slope(refs.z[...].astype(jnp.float32))
    v = x * gate if gate is not None and not static.norm_before_gate else x
    out = v * inverse_rms(v, static)[:, None] * weight[None, :]
    if gate is not None and static.norm_before_gate:
        out = out * gate
    refs.out[...] = out.astype(refs.out.dtype)


def normalise(x, weight, z, *, static):
    """The normalised rows: x (M, D) with M % block_rows == 0, weight (D,), z (M, D_z) (x's
    channels from group `z_offset`) or None; returns (M, D) in x's dtype."""
    rows, channels = x.shape
    groups = channels // static.group_size
    tile = pl.BlockSpec((static.tiles.block_rows, static.group_size), lambda i, g: (i, g))
    z_tile = pl.BlockSpec((static.tiles.block_rows, static.group_size),
                          lambda i, g: (i, g + static.z_offset))
    inputs = (Operands()
              .add("x", tile, x)
              .add("z", z_tile, z)
              .add("weight", pl.BlockSpec((static.group_size,), lambda i, g: (g,)), weight))
    outputs = Operands().add("out", tile, jax.ShapeDtypeStruct(x.shape, x.dtype))
    return _operands.call(
        functools.partial(_forward_kernel, static=static), inputs, outputs,
        grid=(rows // static.tiles.block_rows, groups), num_warps=static.tiles.num_warps,
        num_stages=1, interpret=static.interpret, name="rms_norm_gated_forward",
        windows=("z",))["out"]
