"""One decode step of the SSD recurrence as a Pallas kernel (mamba_ssm's selective_state_update).

One program per (head, batch row) reads its (P, N) state once and writes the new state and y:

    h <- exp(dt' A) h + dt' x B^T ;   y = h C + D x ;   y *= silu(z)

The step is bandwidth-bound (the state is read and written once); dt' and the decay come from XLA.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat


def _state_update_kernel(state_ref, step_ref, x_ref, b_ref, c_ref, *refs, has_d, has_z):
    refs = list(refs)
    d_ref = refs.pop(0) if has_d else None
    z_ref = refs.pop(0) if has_z else None
    y_ref, new_state_ref = refs
    dt, decay = step_ref[0], step_ref[1]
    x = x_ref[...].astype(jnp.float32)
    b = b_ref[...].astype(jnp.float32)
    c = c_ref[...].astype(jnp.float32)
    state = decay * state_ref[...] + (dt * x)[:, None] * b[None, :]
    new_state_ref[...] = state
    y = jnp.sum(state * c[None, :], axis=1)
    if d_ref is not None:
        y += d_ref[...] * x
    if z_ref is not None:
        z = z_ref[...].astype(jnp.float32)
        y *= z * jax.nn.sigmoid(z)
    y_ref[...] = y.astype(y_ref.dtype)


def state_update(state, step, x, b, c, d, z, *, interpret, num_warps=4):
    """The kernel on padded inputs.

    state (B, H, Pp, Np) float32; step (B, H, 2) float32 holding (dt', exp(dt' A)); x, z
    (B, H, Pp); b, c (B, G, Np); d (H, Pp) float32 or None. Returns y (B, H, Pp) in x's dtype and
    the new state (B, H, Pp, Np) float32.
    """
    batch, heads, p_pad, n_pad = state.shape
    hpg = heads // b.shape[1]
    vector = pl.BlockSpec((None, None, p_pad), lambda h, i: (i, h, 0))
    group = pl.BlockSpec((None, None, n_pad), lambda h, i: (i, h // hpg, 0))
    state_spec = pl.BlockSpec((None, None, p_pad, n_pad), lambda h, i: (i, h, 0, 0))
    in_specs = [state_spec, pl.BlockSpec((None, None, 2), lambda h, i: (i, h, 0)), vector,
                group, group]
    args = [state, step, x, b, c]
    if d is not None:
        in_specs.append(pl.BlockSpec((None, p_pad), lambda h, i: (h, 0)))
        args.append(d)
    if z is not None:
        in_specs.append(vector)
        args.append(z)
    return pl.pallas_call(
        functools.partial(_state_update_kernel, has_d=d is not None, has_z=z is not None),
        grid=(heads, batch),
        in_specs=in_specs,
        out_specs=[vector, state_spec],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                   jax.ShapeDtypeStruct(state.shape, jnp.float32)],
        compiler_params=_compat.triton_params(num_warps, 1),
        interpret=interpret,
        name="ssd_state_update",
    )(*args)
