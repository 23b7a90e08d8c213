"""One decode step of the SSD recurrence (mamba_ssm's `selective_state_update`): the op, its
VJP and its kernel.

One program per (head, batch row) reads its (P, N) state once and writes the new state and y:

    h <- exp(dt' A) h + dt' x B^T ;   y = h C + D x ;   y *= silu(z)

The step is bandwidth-bound (the state is read and written once); dt' and the decay come from
XLA. The kernel updates the state in place: its new-state output aliases the state input, so
under `jax.jit` with the state donated no copy of it is made. With `state_batch_indices` the
state is a cache of slots and each program loads its row's slot id from an input and indexes
the cache with it (Pallas-Triton has no scalar prefetch for the BlockSpecs to read it); slots
that no row names are never read or written. Its gradient is the jnp reference's: one step is
cheap.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.typing import ArrayLike

from pallas_kernels import _device, _dispatch, _operands, _sharding
from pallas_kernels._operands import Operands
from pallas_kernels.mamba2 import checks, reference, semantics


def selective_state_update(
    state: ArrayLike,
    x: ArrayLike,
    dt: ArrayLike,
    A: ArrayLike,
    B: ArrayLike,
    C: ArrayLike,
    D: ArrayLike | None = None,
    z: ArrayLike | None = None,
    dt_bias: ArrayLike | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = semantics.DEFAULT_DT_LIMIT,
    *,
    state_batch_indices: ArrayLike | None = None,
    implementation: str | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One decode step (mamba_ssm's `selective_state_update`), functional and differentiable.

    h' = exp(dt' A) h + dt' x B^T; y = h' C + D x; y *= silu(z), with dt' = clamp(softplus?(dt
    + dt_bias), *dt_limit) as in `mamba_chunk_scan_combined` (mamba_ssm's step has no dt_limit;
    the default clamp to (0, inf) makes stepping equal the scan). Stepping it over a sequence
    gives the outputs and final state of `mamba_chunk_scan_combined`. The math runs in float32
    (float64 for float64 inputs under x64); the new state is stored in the state's dtype.

    The Pallas kernel writes the new state over the state's buffer: under `jax.jit(...,
    donate_argnums=...)` with the state donated, the step makes no copy of it (when P and N are
    powers of two, as Mamba2's 64 and 128; other sizes are padded, a copy).

    Args:
      state: (b, H, P, N), or with `state_batch_indices` a cache of slots (num_slots, H, P, N);
        any float dtype.
      x: (b, H, P); dt: (b, H); A: (H,), <= 0; B, C: (b, G, N) with H % G == 0; D: (H,) or
      (H, P); z: (b, H, P); dt_bias: (H,).
      dt_softplus, dt_limit, implementation, interpret: as for `mamba_chunk_scan_combined`.
      state_batch_indices: (b,) integers (mamba_ssm's serving argument): row i steps slot
        state_batch_indices[i] of the cache. A row whose index is outside [0, num_slots) is a
        padding row (vLLM's pad slot -1; mamba_ssm skips negative ones): its y is 0 and it
        touches no slot. The other slots keep their values bit for bit. Two rows must not name
        one slot. Gradients flow through it too (the reference's).

    Returns:
      (y (b, H, P) in x's dtype, new_state in state's shape and dtype: the whole cache with
      `state_batch_indices`).
    """
    checks.check_step(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices)
    dt_softplus = _dispatch.check_bool("dt_softplus", dt_softplus)
    dt_limit = checks.check_dt_limit(dt_limit)
    implementation, interpret = _dispatch.choose(implementation, interpret)
    if implementation == "xla":
        return reference.selective_state_update(
            state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
            dt_limit=dt_limit, state_batch_indices=state_batch_indices,
        )
    slots = None if state_batch_indices is None else state_batch_indices.astype(jnp.int32)
    return _pallas_step(dt_softplus, dt_limit, interpret, state, x, dt, A, B, C, D, z, dt_bias,
                        slots)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _pallas_step(dt_softplus, dt_limit, interpret, state, x, dt, A, B, C, D, z, dt_bias, slots):
    h, p, n = state.shape[1:]
    p_pad, n_pad = _device.pow2_at_least(p), _device.pow2_at_least(n)
    pad = _device.pad_end
    dt_step = semantics.step_sizes(dt, dt_bias, dt_softplus, dt_limit, jnp.float32)
    decay = jnp.exp(dt_step * semantics.decay_rates(A.astype(jnp.float32)))
    if D is not None:  # (H, 1) broadcasts over the head dim in the kernel: no (H, P) copy
        D = D.astype(jnp.float32)
        D = D.reshape(h, 1) if D.ndim == 1 else pad(D, (None, p_pad))
    y, new_state = _state_update(
        pad(state, (None, None, p_pad, n_pad)),  # itself for powers of two: updated in place
        jnp.stack([dt_step, decay], axis=-1),
        pad(x, (None, None, p_pad)),
        pad(B, (None, None, n_pad)),
        pad(C, (None, None, n_pad)),
        D,
        None if z is None else pad(z, (None, None, p_pad)),
        slots,
        interpret=interpret,
    )
    return y[:, :, :p], new_state[:, :, :p, :n]


def _pallas_step_fwd(dt_softplus, dt_limit, interpret, *args):
    return _pallas_step(dt_softplus, dt_limit, interpret, *args), args


def _pallas_step_bwd(dt_softplus, dt_limit, interpret, args, cotangents):
    # One step is cheap: differentiate the jnp reference (same function) instead of a kernel.
    *arrays, slots = args
    step = functools.partial(reference.selective_state_update, dt_softplus=dt_softplus,
                             dt_limit=dt_limit, state_batch_indices=slots)
    grads = jax.vjp(step, *arrays)[1](cotangents)
    return (*map(_sharding.cotangent_like, grads, arrays), None)


_pallas_step.defvjp(_pallas_step_fwd, _pallas_step_bwd)


def _state_update_kernel(refs):
    dt, decay = refs.step[0], refs.step[1]
    x = refs.x[...].astype(jnp.float32)
    b = refs.b[...].astype(jnp.float32)
    c = refs.c[...].astype(jnp.float32)
    if refs.slot is None:
        row = ...
    else:  # this head's slots: the row's (slot 0 is read, not written, for a padding row)
        slot = refs.slot[...]
        valid = (slot >= 0) & (slot < refs.state.shape[0])
        row = jnp.where(valid, slot, 0)
    state = decay * refs.state[row].astype(jnp.float32) + (dt * x)[:, None] * b[None, :]
    y = jnp.sum(state * c[None, :], axis=1)
    if refs.d is not None:
        y += refs.d[...] * x
    if refs.z is not None:
        z = refs.z[...].astype(jnp.float32)
        y *= z * jax.nn.sigmoid(z)
    if refs.slot is None:
        refs.new_state[...] = state.astype(refs.new_state.dtype)
    else:
        y = jnp.where(valid, y, 0.0)

        @pl.when(valid)
        def _():
            refs.new_state[row] = state.astype(refs.new_state.dtype)

    refs.y[...] = y.astype(refs.y.dtype)


def _state_update(state, step, x, b, c, d, z, slots, *, interpret, num_warps=4):
    """The kernel on padded inputs.

    state (B, H, Pp, Np), or with `slots` (S, H, Pp, Np), in any float dtype; step (B, H, 2)
    float32 holding (dt', exp(dt' A)); x, z (B, H, Pp); b, c (B, G, Np); d (H, Pp) or (H, 1)
    float32, or None; slots (B,) int32 or None. Returns y (B, H, Pp) in x's dtype and the new
    state, the state's buffer updated in place (same shape and dtype).
    """
    batch, heads, p_pad = x.shape
    n_pad = state.shape[-1]
    hpg = heads // b.shape[1]
    vector = pl.BlockSpec((None, None, p_pad), lambda h, i: (i, h, 0))
    group = pl.BlockSpec((None, None, n_pad), lambda h, i: (i, h // hpg, 0))
    if slots is None:
        state_spec = pl.BlockSpec((None, None, p_pad, n_pad), lambda h, i: (i, h, 0, 0))
    else:  # every slot of head h; the kernel picks the row's
        state_spec = pl.BlockSpec((state.shape[0], None, p_pad, n_pad), lambda h, i: (0, h, 0, 0))
    inputs = (Operands()
              .add("state", state_spec, state)
              .add("step", pl.BlockSpec((None, None, 2), lambda h, i: (i, h, 0)), step)
              .add("x", vector, x).add("b", group, b).add("c", group, c)
              .add("d", None if d is None else pl.BlockSpec((None, d.shape[1]),
                                                             lambda h, i: (h, 0)), d)
              .add("z", vector, z)
              .add("slot", pl.BlockSpec((None,), lambda h, i: (i,)), slots))
    outputs = (Operands().add("y", vector, jax.ShapeDtypeStruct(x.shape, x.dtype))
               .add("new_state", state_spec, jax.ShapeDtypeStruct(state.shape, state.dtype)))
    out = _operands.call(
        _state_update_kernel, inputs, outputs,
        grid=(heads, batch),
        num_warps=num_warps, num_stages=1,
        interpret=interpret,
        name="ssd_state_update",
        aliases={"state": "new_state"},
    )
    return out["y"], out["new_state"]
