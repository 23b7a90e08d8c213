"""`rms_norm_gated`: RMSNorm over groups of channels with an optional SiLU gate, as mamba_ssm's
`rmsnorm_fn` (Mamba2's `RMSNormGated`), differentiable, with Pallas kernels for both passes.

A call flows: argument checks (`checks`, before anything is traced) -> implementation choice
("xla" runs `reference.py`) -> on a mesh, the kernels per shard of the batch and sequence ->
rows flattened (a free reshape) -> `forward.normalise` under a `jax.custom_vjp` whose backward
is `backward.gradients`. XLA would otherwise run the norm as several passes over float32
copies of the activations (the forward's gated input and statistics, the backward's row and
column reductions): the kernels read each input once per pass and write only the outputs.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jax.typing import ArrayLike

from pallas_kernels import _device, _dispatch, _sharding
from pallas_kernels.norm import backward, checks, forward, reference, tuning


def rms_norm_gated(
    x: ArrayLike,
    weight: ArrayLike,
    z: ArrayLike | None = None,
    *,
    eps: float = 1e-6,
    group_size: int | None = None,
    norm_before_gate: bool = True,
    z_column_offset: int | None = None,
    sharding=None,
    implementation: str | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """RMSNorm of x over groups of channels, scaled by weight, with an optional SiLU gate.

    With z: norm(x) * weight * silu(z) when `norm_before_gate` (mamba_ssm's default), else
    norm(x * silu(z)) * weight (Mamba2's mixer); without z: norm(x) * weight. norm(v) = v /
    sqrt(mean(v**2) + eps), the mean over each group of `group_size` consecutive channels.
    The math runs in float32 (float64 for float64 inputs on the reference).

    Args:
      x: (..., D), bfloat16, float16, float32 or float64; on a mesh, (B, T, D) sharded over
        its batch and sequence (a sharded D raises a ValueError).
      weight: (D,).
      z: the gate, x's shape, or None.
      eps: added to the mean square, > 0.
      group_size: channels per group, dividing D; None: D (one group).
      norm_before_gate: where the gate applies (see above).
      z_column_offset: None, or z is (..., D_z) wider than x and its D channels start at this
        column (a packed projection such as Mamba2's in_proj output): the kernels read them in
        place where the offset is a multiple of `group_size`, else z's columns are sliced out
        first. z's gradient is zero outside them.
      sharding: as for `mamba_chunk_scan_combined` (a NamedSharding or PartitionSpec of x,
        which must then be (B, T, D)); None reads a (B, T, D) x's own on meshes with Explicit
        axes.
      implementation: "pallas" (the kernels), "xla" (the reference) or None (the kernels on
        a GPU, the reference elsewhere). Groups whose size is not a power of two (read padded,
        the kernels were slower than XLA: 5120 channels 0.76x on the H200), wider than 8192
        channels (`tuning.MAX_GROUP`), and float64 run the reference.
      interpret: run the kernels in interpret mode; None: when not on a GPU.

    Returns:
      (..., D) in x's dtype. Gradients flow to x, weight and z (the kernels' backward when
      the kernels ran the forward).
    """
    checks.check_arrays(x, weight, z, z_column_offset)
    channels = x.shape[-1]
    group_size = checks.check_group_size(group_size, channels)
    # The kernels read z's channels in place from a whole group's offset; else they are sliced.
    in_place = z_column_offset is not None and z_column_offset % group_size == 0
    if z_column_offset is not None and not in_place:
        z = z[..., z_column_offset:z_column_offset + channels]
    eps = _dispatch.check_positive("eps", eps, default=1e-6)
    norm_before_gate = _dispatch.check_bool("norm_before_gate", norm_before_gate)
    implementation, interpret = _dispatch.choose(implementation, interpret)
    options = dict(eps=eps, group_size=group_size, norm_before_gate=norm_before_gate)
    if implementation == "xla" or not kernels_apply(x.dtype, group_size):
        if in_place:
            z = z[..., z_column_offset:z_column_offset + channels]
        return reference.rms_norm_gated(x, weight, z, **options)

    def local(x, weight, z):
        rows = x.size // channels
        static = kernel_static(rows, z is not None, z_column_offset // group_size
                               if in_place else 0, interpret=interpret, **options)
        flat = None if z is None else z.reshape(rows, z.shape[-1])
        return _norm(static, x.reshape(rows, channels), weight, flat).reshape(x.shape)

    if sharding is not None and x.ndim != 3:
        raise ValueError(f"sharding: x must be (B, T, D) on a mesh, got {x.shape}")
    placement = None
    if x.ndim == 3:
        placement = _sharding.find("x", x, sharding, feature_dims=(2,))
    if placement is None:
        return local(x, weight, z)
    tokens = PartitionSpec(placement.batch, placement.sequence, None)
    return _sharding.run(placement, local, (x, weight, z), (tokens, PartitionSpec(None), tokens),
                         tokens)


def kernels_apply(dtype, group_size):
    """Whether the kernels normalise groups of `group_size` channels of `dtype` (else the
    reference does)."""
    return (dtype != jnp.float64 and group_size <= tuning.MAX_GROUP
            and _device.pow2_at_least(group_size, minimum=1) == group_size)


def kernel_static(rows, gated, z_offset, *, eps, group_size, norm_before_gate, interpret):
    """The kernels' `forward.Static` for `rows` rows (z read from group `z_offset`)."""
    return forward.Static(
        group_size=group_size, eps=eps, gated=gated, norm_before_gate=norm_before_gate,
        tiles=tuning.tiles(_device.target()[0], rows, group_size), interpret=interpret,
        z_offset=z_offset)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _norm(static, x, weight, z):
    return forward.normalise(x, weight, z, static=static)


def _norm_fwd(static, x, weight, z):
    return _norm(static, x, weight, z), (x, weight, z)


def _norm_bwd(static, residuals, dout):
    x, weight, z = residuals
    dx, dz, dweight = backward.gradients(x, weight, z, dout, static=static)
    if dz is not None and dz.shape != z.shape:  # z wider than x (read in place): zeros outside
        start = static.z_offset * static.group_size
        dz = jnp.pad(dz, ((0, 0), (start, z.shape[1] - start - dz.shape[1])))
    grads = (dx, dweight.astype(weight.dtype), dz)
    return tuple(map(_sharding.cotangent_like, grads, residuals))


_norm.defvjp(_norm_fwd, _norm_bwd)
