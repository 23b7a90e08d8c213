"""The gated RMSNorm backward kernel (Pallas, Triton lowering).

One program per (run of `backward_blocks` row tiles, group). For each tile it re-reads x (and
z) with the output's gradient, recomputes the row's 1/rms, writes dx (and dz), and adds the
tile's weight gradient to a float32 sum it keeps in registers; each program writes that sum as
one partial row, and XLA adds the partials in a fixed order, so the gradients are
deterministic. With v the normalised input (x, or x * silu(z) when the gate comes first),
r = 1/rms(v), v^ = v r and g the gradient reaching v^ * weight:

    dweight = sum over rows of g * v^
    dv = r (g weight - v^ mean(g weight v^))          (the mean over the group)
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _device, _operands
from pallas_kernels._operands import Operands
from pallas_kernels.norm.forward import gate_and_slope, inverse_rms


def _backward_kernel(refs, *, static):
    program = pl.program_id(0)
    row_blocks = refs.x.shape[0] // static.tiles.block_rows
    first = program * static.tiles.backward_blocks
    last = jnp.minimum(first + static.tiles.backward_blocks, row_blocks)
    weight = refs.weight[...].astype(jnp.float32)

    def tile(j, weight_grad):
        rows = _device.block_slice(j, static.tiles.block_rows)
        x = refs.x[rows, :].astype(jnp.float32)
        grad = refs.dout[rows, :].astype(jnp.float32)
        gate = slope = None
        if static.gated:
            gate, slope = gate_and_slope(refs.z[rows, :].astype(jnp.float32))
        gate_first = gate is not None and not static.norm_before_gate
        v = x * gate if gate_first else x
        r = inverse_rms(v, static)[:, None]
        normalised = v * r
        if gate is not None and static.norm_before_gate:
            refs.dz[rows, :] = (grad * normalised * weight[None, :] * slope).astype(
                refs.dz.dtype)
            grad = grad * gate
        weight_grad += jnp.sum(grad * normalised, axis=0)
        scaled = grad * weight[None, :]
        mean = jnp.sum(scaled * normalised, axis=1) / static.group_size
        dv = r * (scaled - normalised * mean[:, None])
        if gate_first:
            refs.dz[rows, :] = (dv * x * slope).astype(refs.dz.dtype)
            dv = dv * gate
        refs.dx[rows, :] = dv.astype(refs.dx.dtype)
        return weight_grad

    refs.dweight[...] = jax.lax.fori_loop(
        first, last, tile, jnp.zeros((static.group_size,), jnp.float32))


def gradients(x, weight, z, dout, *, static, dz_in_place=False):
    """(dx, dz (M, D) or None, dweight) of `forward.normalise` at x (M, D), weight (D,), z (M,
    D_z) (x's channels from group `z_offset`) or None, given dout (M, D); dweight float32.
    `dz_in_place`: dz is (M, D_z) instead, written only in x's channels (the others are left
    unwritten, for a caller that writes them: the Mamba2 mixer's packed gradient)."""
    rows, channels = x.shape
    groups = channels // static.group_size
    programs = _device.cdiv(rows // static.tiles.block_rows, static.tiles.backward_blocks)
    # Each program walks whole columns of row tiles: its blocks span every row.
    column = pl.BlockSpec((rows, static.group_size), lambda p, g: (0, g))
    z_column = pl.BlockSpec((rows, static.group_size), lambda p, g: (0, g + static.z_offset))
    inputs = (Operands()
              .add("x", column, x)
              .add("z", z_column, z)
              .add("dout", column, dout)
              .add("weight", pl.BlockSpec((static.group_size,), lambda p, g: (g,)), weight))
    dz = None if z is None else (jax.ShapeDtypeStruct(z.shape, z.dtype) if dz_in_place
                                 else jax.ShapeDtypeStruct(x.shape, z.dtype))
    outputs = (Operands()
               .add("dx", column, jax.ShapeDtypeStruct(x.shape, x.dtype))
               .add("dz", z_column if dz_in_place else column, dz)
               .add("dweight", pl.BlockSpec((None, static.group_size), lambda p, g: (p, g)),
                    jax.ShapeDtypeStruct((programs, channels), jnp.float32)))
    result = _operands.call(
        functools.partial(_backward_kernel, static=static), inputs, outputs,
        grid=(programs, groups), num_warps=static.tiles.backward_warps,
        num_stages=static.tiles.backward_stages,
        interpret=static.interpret, name="rms_norm_gated_backward", windows=("z", "dz"))
    return result["dx"], result.get("dz"), jnp.sum(result["dweight"], axis=0)
