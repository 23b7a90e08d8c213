"""One decode step of the SSD recurrence (mamba_ssm's `selective_state_update`): the op, its
VJP and its kernel.

One program per (head, batch row) reads its (P, N) state once and writes the new state and y:

    h <- exp(dt' A) h + dt' x B^T ;   y = h C + D x ;   y *= silu(z)

The step is bandwidth-bound (the state is read and written once); dt' and the decay come from
XLA, or, in `packed_step` (the Mamba2 layer's decode step), from the kernel itself, which then
reads x, B, C and the raw dt where they lie in the conv's and in_proj's outputs. The kernel
updates the state in place: its new-state output aliases the state input, so under `jax.jit`
with the state donated no copy of it is made. With `state_batch_indices` the state is a cache
of slots and each program loads its row's slot id from an input and indexes the cache with it
(Pallas-Triton has no scalar prefetch for the BlockSpecs to read it); slots that no row names
are never read or written. Its gradient is the jnp reference's: one step is cheap.
"""

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class PackedColumns:
    """Where one token's operands lie for `packed_step`: x, B, C in the conv's output
    [x (H P), B (G N), C (G N)], the raw dt in in_proj's output from `dt_column`."""

    heads: int
    head_dim: int  # P
    ngroups: int
    d_state: int  # N
    dt_column: int

    def applies(self):
        """Whether the kernel reads the operands in place: whole blocks of P and N columns."""
        return (_device.pow2_at_least(self.head_dim) == self.head_dim
                and _device.pow2_at_least(self.d_state) == self.d_state
                and (self.heads * self.head_dim) % self.d_state == 0)


def packed_step(state, xbc, zxbcdt, A_log, dt_bias, D, *, columns, dt_limit, interpret):
    """`selective_state_update` (dt_softplus, no z) of one token per row read where it lies:
    x, B and C from the conv's output xbc (b, H P + 2 G N), the raw dt from in_proj's output
    zxbcdt (b, d_in_proj) at `columns.dt_column`; the kernel computes the step size and the
    decay itself, with A = -exp(A_log) (mamba_ssm's parameter), so no XLA op runs around it.
    state (b, H, P, N), any float dtype, updated in place; A_log, dt_bias (H,); D (H,), (H, P)
    or None. Returns (y (b, H, P) in xbc's dtype, the new state). The caller checks
    `columns.applies()`; gradients are the reference's."""
    return _packed_step((columns, tuple(dt_limit), interpret), state, xbc, zxbcdt, A_log,
                        dt_bias, D)


def _unpacked(columns, xbc, zxbcdt):
    """(x (b, H, P), B, C (b, G, N), dt (b, H)) sliced out of the packed arrays."""
    b, hp, gn = xbc.shape[0], columns.heads * columns.head_dim, columns.ngroups * columns.d_state
    groups = (b, columns.ngroups, columns.d_state)
    return (xbc[:, :hp].reshape(b, columns.heads, columns.head_dim),
            xbc[:, hp:hp + gn].reshape(groups), xbc[:, hp + gn:hp + 2 * gn].reshape(groups),
            zxbcdt[:, columns.dt_column:columns.dt_column + columns.heads])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _packed_step(static, state, xbc, zxbcdt, A_log, dt_bias, D):
    columns, dt_limit, interpret = static
    heads, p, n = columns.heads, columns.head_dim, columns.d_state
    hpg = heads // columns.ngroups
    b_block = heads * p // n
    c_block = b_block + columns.ngroups
    if D is not None:
        D = D.astype(jnp.float32)
        D = D.reshape(heads, 1) if D.ndim == 1 else D
    token = [("x", pl.BlockSpec((None, p), lambda h, i: (i, h)), xbc),
             ("b", pl.BlockSpec((None, n), lambda h, i: (i, b_block + h // hpg)), xbc),
             ("c", pl.BlockSpec((None, n), lambda h, i: (i, c_block + h // hpg)), xbc),
             ("dt", pl.BlockSpec((None, 1), lambda h, i: (i, columns.dt_column + h)), zxbcdt),
             ("dt_bias", pl.BlockSpec((1,), lambda h, i: (h,)), dt_bias),
             ("a_log", pl.BlockSpec((1,), lambda h, i: (h,)), A_log)]
    return _call(state, token, D, None, None,
                 jax.ShapeDtypeStruct((xbc.shape[0], heads, p), xbc.dtype),
                 functools.partial(_state_update_kernel, dt_limit=dt_limit),
                 interpret=interpret, num_warps=4, windows=("x", "b", "c"))


def _packed_step_fwd(static, *args):
    return _packed_step(static, *args), args


def _packed_step_bwd(static, args, cotangents):
    columns, dt_limit, _ = static

    def step(state, xbc, zxbcdt, A_log, dt_bias, D):
        x, b, c, dt = _unpacked(columns, xbc, zxbcdt)
        return reference.selective_state_update(state, x, dt, -jnp.exp(A_log), b, c, D=D,
                                                dt_bias=dt_bias, dt_softplus=True,
                                                dt_limit=dt_limit)

    grads = jax.vjp(step, *args)[1](cotangents)
    return tuple(map(_sharding.cotangent_like, grads, args))


_packed_step.defvjp(_packed_step_fwd, _packed_step_bwd)


def _state_update_kernel(refs, *, dt_limit=None):
    if refs.step is not None:
        dt, decay = refs.step[0], refs.step[1]
    else:  # one raw dt: softplus(dt + dt_bias) clamped, as `semantics.step_sizes`
        dt = semantics.step_sizes(refs.dt[0].astype(jnp.float32), refs.dt_bias[0], True,
                                  dt_limit, jnp.float32)
        decay = jnp.exp(-dt * jnp.exp(refs.a_log[0].astype(jnp.float32)))  # A = -exp(A_log)
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
    heads, p_pad = x.shape[1:]
    n_pad = state.shape[-1]
    hpg = heads // b.shape[1]
    vector = pl.BlockSpec((None, None, p_pad), lambda h, i: (i, h, 0))
    group = pl.BlockSpec((None, None, n_pad), lambda h, i: (i, h // hpg, 0))
    token = [("step", pl.BlockSpec((None, None, 2), lambda h, i: (i, h, 0)), step),
             ("x", vector, x), ("b", group, b), ("c", group, c)]
    return _call(state, token, d, z, slots,
                 jax.ShapeDtypeStruct(x.shape, x.dtype), _state_update_kernel,
                 interpret=interpret, num_warps=num_warps)


def _call(state, token, d, z, slots, y_struct, kernel, *, interpret, num_warps, windows=()):
    """The state-update kernel over grid (H, B) with the state, `token` (its (name, BlockSpec,
    array) operands, x's blocks (P,)), D, z (B, H, P) or None and the slots; y (B, H, P) as
    `y_struct`."""
    batch, heads, p_pad = y_struct.shape
    n_pad = state.shape[-1]
    vector = pl.BlockSpec((None, None, p_pad), lambda h, i: (i, h, 0))
    if slots is None:
        state_spec = pl.BlockSpec((None, None, p_pad, n_pad), lambda h, i: (i, h, 0, 0))
    else:  # every slot of head h; the kernel picks the row's
        state_spec = pl.BlockSpec((state.shape[0], None, p_pad, n_pad), lambda h, i: (0, h, 0, 0))
    inputs = Operands().add("state", state_spec, state)
    for operand in token:
        inputs.add(*operand)
    inputs = (inputs.add("d", None if d is None else pl.BlockSpec((None, d.shape[1]),
                                                                   lambda h, i: (h, 0)), d)
              .add("z", vector, z)
              .add("slot", pl.BlockSpec((None,), lambda h, i: (i,)), slots))
    outputs = (Operands()
               .add("y", vector, y_struct)
               .add("new_state", state_spec, jax.ShapeDtypeStruct(state.shape, state.dtype)))
    out = _operands.call(
        kernel, inputs, outputs,
        grid=(heads, batch),
        num_warps=num_warps, num_stages=1,
        interpret=interpret,
        name="ssd_state_update",
        aliases={"state": "new_state"},
        windows=windows,
    )
    return out["y"], out["new_state"]
