"""`split_conv_scan_norm`: Mamba2's mixer from in_proj's packed output to the gated norm's
output, one `jax.custom_vjp` over the conv, SSD and norm kernels (mamba_ssm's
`mamba_split_conv1d_scan_combined` without the projection).

Run as three differentiable ops, each reading its columns of the packed (B, T, d_in_proj)
array in place, the backward would return three cotangents of the whole array, each zero
outside its own columns, and XLA would add them in one pass that reads every part again and
writes the whole gradient (0.32 ms a layer at the zamba2-like shape on an H100, more than the
conv backward's kernel). Here the backward assembles that gradient where it lies: the norm's
backward kernel writes dz into its columns of a new (B, T, d_in_proj) array (`dz_in_place`),
and the conv's dx and the SSD's ddt are written into theirs by dynamic-update-slices, which
XLA runs in place (0.16 ms a layer; `benchmarks/REPORT.md`, "d(zxbcdt) where it lies").

Forward: the conv kernels read xBC's columns in place and write x and [B, C] apart
(`conv.forward.convolve`), the SSD (`mamba_chunk_scan_combined`, its own custom_vjp, whose
pullback the backward calls) reads dt's columns sliced (B, T, H), the norm kernels read z's
columns in place. First derivatives only, as the conv's and the norm's.

`split_conv_step` is the decode counterpart for one token: the conv update and the SSM state
update, each kernel reading its operands in place and writing its state over its buffer.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.conv import api as conv_api
from pallas_kernels.conv import backward as conv_backward
from pallas_kernels.conv import forward as conv_forward
from pallas_kernels.mamba2 import api as ssd_api
from pallas_kernels.mamba2 import decode
from pallas_kernels.norm import api as norm_api
from pallas_kernels.norm import backward as norm_backward
from pallas_kernels.norm import forward as norm_forward


@dataclasses.dataclass(frozen=True)
class MixerShape:
    """The packed projection's parts: [z (d_ssm), xBC (d_ssm + 2 G N), dt (H)], and the norm's
    groups."""

    d_ssm: int
    ngroups: int  # G
    d_state: int  # N
    nheads: int  # H; the head dim is d_ssm // H
    norm_group_size: int

    @property
    def conv_dim(self):
        return self.d_ssm + 2 * self.ngroups * self.d_state

    @property
    def width(self):
        """d_in_proj."""
        return self.d_ssm + self.conv_dim + self.nheads


def step_applies(shape, width):
    """Whether `split_conv_step`'s kernels take a mixer of this shape: a conv of width >= 2
    (a state to update), x, B and C in whole blocks of the state-update kernel."""
    return width >= 2 and _columns(shape, 0).applies()


def split_conv_step(zxbcdt, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D,
                    *, shape, column_offset, dt_limit, interpret):
    """One token of the mixer in decode, from in_proj's output zxbcdt (B, d_in_proj) whose
    [z, xBC, dt] start at `column_offset` (after a gated MLP's columns): the causal conv + SiLU
    of xBC after conv_state (B, W - 1, conv_dim) and the SSM step of its x, B, C from
    ssm_state (B, H, P, N) with dt (softplus of dt + dt_bias, clamped to `dt_limit`), A =
    -exp(A_log) (H,) (taken as mamba_ssm's parameter, so that no XLA op computes A each step)
    and D (H,) or (H, P), without the gate (the norm applies it). Two kernels and no XLA op
    between them: the conv's reads xBC in place and writes the conv state over its buffer
    (`causal_conv1d_update`), the step's reads x, B, C from the conv's output and dt from
    zxbcdt in place and writes the SSM state over its buffer (`decode.packed_step`).

    Returns (y (B, H, P) in zxbcdt's dtype, the new conv state, the new SSM state), the
    states in their dtypes. The caller checks `step_applies`; differentiable (the
    references' gradients)."""
    xbc, conv_state = conv_api.causal_conv1d_update(
        zxbcdt, conv_state, conv_weight, conv_bias, column_offset=column_offset + shape.d_ssm,
        implementation="pallas", interpret=interpret)
    y, ssm_state = decode.packed_step(ssm_state, xbc, zxbcdt, A_log, dt_bias, D,
                                      columns=_columns(shape, column_offset),
                                      dt_limit=dt_limit, interpret=interpret)
    return y, conv_state, ssm_state


def _columns(shape, column_offset):
    return decode.PackedColumns(
        heads=shape.nheads, head_dim=shape.d_ssm // shape.nheads, ngroups=shape.ngroups,
        d_state=shape.d_state, dt_column=column_offset + shape.d_ssm + shape.conv_dim)


def applies(zxbcdt, shape):
    """Whether `split_conv_scan_norm`'s kernels take this (B, T, d_in_proj) array: the conv's
    in-place columns and split on its channel blocks, the norm's groups in its kernels. (The
    caller runs it off meshes: the kernels take whole arrays.)"""
    return (zxbcdt.ndim == 3 and zxbcdt.shape[-1] == shape.width
            and shape.d_ssm % conv_api.CHANNEL_BLOCK == 0
            and norm_api.kernels_apply(zxbcdt.dtype, shape.norm_group_size))


@dataclasses.dataclass(frozen=True)
class _Static:
    shape: MixerShape
    chunk_size: int
    dt_limit: tuple[float, float]
    norm_eps: float
    norm_before_gate: bool
    interpret: bool


def split_conv_scan_norm(zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight, *, shape,
                         chunk_size, dt_limit, norm_eps, norm_before_gate, interpret):
    """The mixer's gated-norm output (B, T, d_ssm) in zxbcdt's dtype: the causal conv + SiLU of
    xBC (weight (W, conv_dim), bias (conv_dim,) or None, zero history), the SSD of its x, B, C
    with dt (softplus of dt + dt_bias, clamped to `dt_limit`), A (H,), D (H,) or (H, P) and no
    initial state, then `rms_norm_gated` with z (norm_weight (d_ssm,), groups of
    `shape.norm_group_size`). The caller checks `applies` first."""
    static = _Static(shape, chunk_size, tuple(dt_limit), norm_eps, norm_before_gate, interpret)
    return _mixer(static, zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight)


def _statics(static, zxbcdt, conv_weight):
    shape = static.shape
    conv = conv_api.kernel_static(
        conv_weight.shape[0], shape.conv_dim, silu=True, initial_states=False,
        interpret=static.interpret, column_offset=shape.d_ssm, split=shape.d_ssm)
    rows = zxbcdt.shape[0] * zxbcdt.shape[1]
    norm = norm_api.kernel_static(
        rows, True, 0, eps=static.norm_eps, group_size=shape.norm_group_size,
        norm_before_gate=static.norm_before_gate, interpret=static.interpret)
    return conv, norm


def _history(zxbcdt, conv, shape):
    """The conv's zero history, (B, history_rows, conv_dim)."""
    return jnp.zeros((zxbcdt.shape[0], conv.history_rows, shape.conv_dim), zxbcdt.dtype)


def _scan(static, x, bc, dt, dt_bias, A, D):
    """The SSD of the conv's outputs x (B, T, d_ssm) and [B, C] (B, T, 2 G N): y (B, T, H, P)."""
    shape = static.shape
    b, t = x.shape[:2]
    gn = shape.ngroups * shape.d_state
    return ssd_api.mamba_chunk_scan_combined(
        x.reshape(b, t, shape.nheads, shape.d_ssm // shape.nheads), dt, A,
        bc[..., :gn].reshape(b, t, shape.ngroups, shape.d_state),
        bc[..., gn:].reshape(b, t, shape.ngroups, shape.d_state), static.chunk_size, D=D,
        dt_bias=dt_bias, dt_softplus=True, dt_limit=static.dt_limit, implementation="pallas",
        interpret=static.interpret)


def _forward(static, zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight, *,
             differentiated):
    """(out, residuals); the SSD's pullback in them only where `differentiated`."""
    shape = static.shape
    conv, norm = _statics(static, zxbcdt, conv_weight)
    x, bc = conv_forward.convolve(zxbcdt, conv_weight, conv_bias,
                                  _history(zxbcdt, conv, shape), static=conv)
    dt = zxbcdt[..., shape.d_ssm + shape.conv_dim:]
    scan = functools.partial(_scan, static)
    if differentiated:
        y, scan_pullback = jax.vjp(scan, x, bc, dt, dt_bias, A, D)
    else:
        y, scan_pullback = scan(x, bc, dt, dt_bias, A, D), None
    b, t = zxbcdt.shape[:2]
    y = y.reshape(b * t, shape.d_ssm)
    packed = zxbcdt.reshape(b * t, shape.width)
    out = norm_forward.normalise(y, norm_weight, packed, static=norm).reshape(b, t, shape.d_ssm)
    return out, (zxbcdt, conv_weight, conv_bias, norm_weight, y, scan_pullback)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mixer(static, zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight):
    return _forward(static, zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight,
                    differentiated=False)[0]


def _mixer_fwd(static, *arrays):
    return _forward(static, *arrays, differentiated=True)


def _mixer_bwd(static, residuals, dout):
    zxbcdt, conv_weight, conv_bias, norm_weight, y, scan_pullback = residuals
    shape = static.shape
    conv, norm = _statics(static, zxbcdt, conv_weight)
    b, t = zxbcdt.shape[:2]
    packed = zxbcdt.reshape(b * t, shape.width)
    # dz lands in its columns of the new (B T, d_in_proj) array; the rest is written below.
    dy, dpacked, dnorm_weight = norm_backward.gradients(
        y, norm_weight, packed, dout.reshape(b * t, shape.d_ssm), static=norm, dz_in_place=True)
    dx, dbc, ddt, ddt_bias, dA, dD = scan_pullback(dy.reshape(b, t, shape.nheads, -1))
    dxbc, dconv_weight, dconv_bias = conv_backward.gradients(
        zxbcdt, conv_weight, conv_bias, _history(zxbcdt, conv, shape), (dx, dbc), static=conv)
    dpacked = dpacked.reshape(b, t, shape.width)
    for update, column in ((dxbc, shape.d_ssm), (ddt, shape.d_ssm + shape.conv_dim)):
        dpacked = jax.lax.dynamic_update_slice(
            dpacked, _typed_as(update.astype(zxbcdt.dtype), dpacked), (0, 0, column))
    return (dpacked, dconv_weight.astype(conv_weight.dtype),
            None if conv_bias is None else dconv_bias.astype(conv_bias.dtype),
            ddt_bias, dA, dD, dnorm_weight.astype(norm_weight.dtype))


def _typed_as(update, operand):
    """`update` with `operand`'s sharding type, as dynamic_update_slice asks (a kernel's output
    takes the context's mesh, an XLA slice of an input the input's)."""
    sharding = jax.typeof(operand).sharding
    return update if jax.typeof(update).sharding == sharding else jax.sharding.reshard(
        update, sharding)


_mixer.defvjp(_mixer_fwd, _mixer_bwd)
