"""The pure-jnp gated RMSNorm, written independently of the kernels: what `rms_norm_gated`
computes, in float32 (float64 for float64 inputs), differentiated by JAX."""

import jax
import jax.numpy as jnp


def rms_norm_gated(x, weight, z=None, *, eps, group_size, norm_before_gate):
    """x (..., D), weight (D,), z like x or None; groups of `group_size` channels. Returns x's
    dtype: norm(x) * weight * silu(z) with `norm_before_gate`, else norm(x * silu(z)) *
    weight, where norm(v) = v / sqrt(mean(v**2 over its group) + eps)."""
    compute = jnp.promote_types(x.dtype, jnp.float32)
    v = x.astype(compute)
    gate = None if z is None else jax.nn.silu(z.astype(compute))
    if gate is not None and not norm_before_gate:
        v = v * gate
    # One group is not reshaped: x's channels may be split over a mesh axis (the mean then
    # reduces across the shards).
    groups = v if group_size == v.shape[-1] else v.reshape(*v.shape[:-1], -1, group_size)
    mean_square = jnp.mean(jnp.square(groups), axis=-1, keepdims=True)
    out = (groups * jax.lax.rsqrt(mean_square + eps)).reshape(v.shape) * weight.astype(compute)
    if gate is not None and norm_before_gate:
        out = out * gate
    return out.astype(x.dtype)
