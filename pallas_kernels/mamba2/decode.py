"""One decode step of the SSD recurrence (mamba_ssm's `selective_state_update`): the op, its
VJP and its kernel.

One program per (head, batch row) reads its (P, N) state once and writes the new state and y:

    h <- exp(dt' A) h + dt' x B^T ;   y = h C + D x ;   y *= silu(z)

The step is bandwidth-bound (the state is read and written once); dt' and the decay come from
XLA. Its gradient is the jnp reference's: one step is cheap.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _device, _dispatch, _operands, _sharding
from pallas_kernels._operands import Operands
from pallas_kernels.mamba2 import checks, reference, semantics


def selective_state_update(
    state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
    dt_limit=semantics.DEFAULT_DT_LIMIT, *, implementation=None, interpret=None,
):
    """One decode step (mamba_ssm's `selective_state_update`), functional and differentiable.

    h' = exp(dt' A) h + dt' x B^T; y = h' C + D x; y *= silu(z), with dt' = clamp(softplus?(dt
    + dt_bias), *dt_limit) as in `mamba_chunk_scan_combined` (mamba_ssm's step has no dt_limit;
    the default clamp to (0, inf) makes stepping equal the scan). Stepping it over a sequence
    gives the outputs and final state of `mamba_chunk_scan_combined`.

    Args:
      state: (b, H, P, N); x: (b, H, P); dt: (b, H); A: (H,), <= 0; B, C: (b, G, N) with
      H % G == 0; D: (H,) or (H, P); z: (b, H, P); dt_bias: (H,).
      dt_softplus, dt_limit, implementation, interpret: as for `mamba_chunk_scan_combined`.

    Returns:
      (y (b, H, P) in x's dtype, new_state (b, H, P, N) float32).
    """
    checks.check_step(state, x, dt, A, B, C, D, z, dt_bias)
    dt_softplus = _dispatch.check_bool("dt_softplus", dt_softplus)
    dt_limit = checks.check_dt_limit(dt_limit)
    implementation, interpret = _dispatch.choose(implementation, interpret)
    if implementation == "xla":
        return reference.selective_state_update(
            state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
            dt_limit=dt_limit,
        )
    return _pallas_step(dt_softplus, dt_limit, interpret, state, x, dt, A, B, C, D, z, dt_bias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _pallas_step(dt_softplus, dt_limit, interpret, state, x, dt, A, B, C, D, z, dt_bias):
    b, h, p, n = state.shape
    p_pad, n_pad = _device.pow2_at_least(p), _device.pow2_at_least(n)
    pad = _device.pad_end
    dt_step = semantics.step_sizes(dt, dt_bias, dt_softplus, dt_limit, jnp.float32)
    decay = jnp.exp(dt_step * semantics.decay_rates(A.astype(jnp.float32)))
    if D is not None:
        D = pad(semantics.skip_weights(D, h, p), (None, p_pad))
    y, new_state = _state_update(
        pad(state.astype(jnp.float32), (None, None, p_pad, n_pad)),
        jnp.stack([dt_step, decay], axis=-1),
        pad(x, (None, None, p_pad)),
        pad(B, (None, None, n_pad)),
        pad(C, (None, None, n_pad)),
        D,
        None if z is None else pad(z, (None, None, p_pad)),
        interpret=interpret,
    )
    return y[:, :, :p], new_state[:, :, :p, :n]


def _pallas_step_fwd(dt_softplus, dt_limit, interpret, *args):
    return _pallas_step(dt_softplus, dt_limit, interpret, *args), args


def _pallas_step_bwd(dt_softplus, dt_limit, interpret, args, cotangents):
    # One step is cheap: differentiate the jnp reference (same function) instead of a kernel.
    step = functools.partial(reference.selective_state_update, dt_softplus=dt_softplus,
                             dt_limit=dt_limit)
    return tuple(map(_sharding.cotangent_like, jax.vjp(step, *args)[1](cotangents), args))


_pallas_step.defvjp(_pallas_step_fwd, _pallas_step_bwd)


def _state_update_kernel(refs):
    dt, decay = refs.step[0], refs.step[1]
    x = refs.x[...].astype(jnp.float32)
    b = refs.b[...].astype(jnp.float32)
    c = refs.c[...].astype(jnp.float32)
    state = decay * refs.state[...] + (dt * x)[:, None] * b[None, :]
    refs.new_state[...] = state
    y = jnp.sum(state * c[None, :], axis=1)
    if refs.d is not None:
        y += refs.d[...] * x
    if refs.z is not None:
        z = refs.z[...].astype(jnp.float32)
        y *= z * jax.nn.sigmoid(z)
    refs.y[...] = y.astype(refs.y.dtype)


def _state_update(state, step, x, b, c, d, z, *, interpret, num_warps=4):
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
    inputs = (Operands()
              .add("state", state_spec, state)
              .add("step", pl.BlockSpec((None, None, 2), lambda h, i: (i, h, 0)), step)
              .add("x", vector, x).add("b", group, b).add("c", group, c)
              .add("d", pl.BlockSpec((None, p_pad), lambda h, i: (h, 0)), d)
              .add("z", vector, z))
    outputs = (Operands().add("y", vector, jax.ShapeDtypeStruct(x.shape, x.dtype))
               .add("new_state", state_spec, jax.ShapeDtypeStruct(state.shape, jnp.float32)))
    out = _operands.call(
        _state_update_kernel, inputs, outputs,
        grid=(heads, batch),
        num_warps=num_warps, num_stages=1,
        interpret=interpret,
        name="ssd_state_update",
    )
    return out["y"], out["new_state"]
