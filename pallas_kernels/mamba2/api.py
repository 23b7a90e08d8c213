"""`mamba_chunk_scan_combined`: Mamba2's SSD with mamba_ssm's names, shapes and meaning.

A call flows: argument checks (before anything is traced) -> implementation choice ("xla" runs
the chunked jnp reference, "pallas" the kernels) -> padding in XLA -> `_ssd`, a
`jax.custom_vjp` over the kernels: its forward runs the dt preprocessing kernel (softplus, bias,
clamp, in-chunk log2 cumsum: `preprocess`) and the forward scan, and saves x, dt, dt', s, A, B, C,
D, z, h0 and the pre-gate output; its backward recomputes the chunk states and differentiates the
dt preprocessing through `semantics.step_sizes`. The backward is itself differentiable: its
derivatives (second order) are those of the reference's backward (`_kernel_gradients`).
"""

import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _compat, _derivatives
from pallas_kernels.attention.tuning import pow2_at_least
from pallas_kernels.mamba2 import (
    backward,
    common,
    forward,
    preprocess,
    reference,
    semantics,
    state_update,
    tuning,
)

IMPLEMENTATIONS = ("pallas", "xla")
_FLOATS = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)


def mamba_chunk_scan_combined(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    seq_idx=None,
    dt_softplus=False,
    dt_limit=semantics.DEFAULT_DT_LIMIT,
    return_final_states=False,
    *,
    implementation=None,
    interpret=None,
):
    """Mamba2's chunked selective scan (SSD), differentiable in every array argument.

    Token by token, for batch row b, head h and its group g = h // (H // G):
    dt' = clamp(softplus(dt + dt_bias), *dt_limit) (softplus only with `dt_softplus`, identity
    above 20; the clamp always applies, (0, inf) by default, and has zero gradient where
    active); h_t = exp(dt'_t A_h) h_{t-1} + dt'_t x_t B_t^T; y_t = h_t C_t + D x_t; y_t *=
    silu(z_t). The state resets to zero wherever `seq_idx` changes from one token to the next;
    `initial_states` feed the first sequence of each row. `semantics` defines each of these.

    Args:
      x: (b, T, H, P); dt: (b, T, H); A: (H,), <= 0 (a ValueError where its value is known;
        under jit a positive entry acts as 0); B, C: (b, T, G, N) with H % G == 0.
      chunk_size: a power of two (mamba_ssm uses 64-256). The SSD result does not depend on it;
        the kernels use min(chunk_size, the tuned tile).
      D: (H,) or (H, P); z: (b, T, H, P); dt_bias: (H,); initial_states: (b, H, P, N);
      seq_idx: (b, T) integers of any width; a new sequence starts wherever the id changes.
      dt_softplus: a bool. dt_limit: (low, high) with 0 <= low <= high, low finite.
      return_final_states: also return the state after the last token, (b, H, P, N) float32
        (float64 for float64 inputs under x64, on both paths).
      implementation: "pallas", "xla" (chunked jnp reference) or None (pallas on GPU, else xla).
      interpret: run the Pallas kernels in interpret mode; None: when not on a GPU.

    Returns:
      y (b, T, H, P) in x's dtype, or (y, final_states) with `return_final_states`.

    Second-order derivatives (grad of grad, `jax.hessian`) work on both paths; on the Pallas
    path the first derivatives come from the kernels and the second from the reference.
    """
    _check(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx)
    dt_softplus = _check_bool("dt_softplus", dt_softplus)
    return_final_states = _check_bool("return_final_states", return_final_states)
    dt_limit = check_dt_limit(dt_limit)
    implementation, interpret = _choose(implementation, interpret)
    if implementation == "xla":
        return reference.mamba_chunk_scan_combined(
            x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
            initial_states=initial_states, seq_idx=seq_idx, dt_softplus=dt_softplus,
            dt_limit=dt_limit, return_final_states=return_final_states,
        )
    y, final = _pallas_ssd(x, dt, semantics.decay_rates(A), B, C, chunk_size, D, z, dt_bias,
                           initial_states, seq_idx, dt_softplus, dt_limit, interpret)
    final = final.astype(semantics.compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_states))
    return (y, final) if return_final_states else y


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
    _check_step(state, x, dt, A, B, C, D, z, dt_bias)
    dt_softplus = _check_bool("dt_softplus", dt_softplus)
    dt_limit = check_dt_limit(dt_limit)
    implementation, interpret = _choose(implementation, interpret)
    if implementation == "xla":
        return reference.selective_state_update(
            state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
            dt_limit=dt_limit,
        )
    return _pallas_step(dt_softplus, dt_limit, interpret, state, x, dt, A, B, C, D, z, dt_bias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _pallas_step(dt_softplus, dt_limit, interpret, state, x, dt, A, B, C, D, z, dt_bias):
    b, h, p, n = state.shape
    p_pad, n_pad = pow2_at_least(p), pow2_at_least(n)
    dt_step = semantics.step_sizes(dt, dt_bias, dt_softplus, dt_limit, jnp.float32)
    decay = jnp.exp(dt_step * semantics.decay_rates(A.astype(jnp.float32)))
    if D is not None:
        D = jnp.broadcast_to(D.astype(jnp.float32)[:, None] if D.ndim == 1 else D, (h, p))
        D = _pad(D.astype(jnp.float32), (None, p_pad))
    y, new_state = state_update.state_update(
        _pad(state.astype(jnp.float32), (None, None, p_pad, n_pad)),
        jnp.stack([dt_step, decay], axis=-1),
        _pad(x, (None, None, p_pad)),
        _pad(B, (None, None, n_pad)),
        _pad(C, (None, None, n_pad)),
        D,
        None if z is None else _pad(z, (None, None, p_pad)),
        interpret=interpret,
    )
    return y[:, :, :p], new_state[:, :, :p, :n]


def _pallas_step_fwd(dt_softplus, dt_limit, interpret, *args):
    return _pallas_step(dt_softplus, dt_limit, interpret, *args), args


def _pallas_step_bwd(dt_softplus, dt_limit, interpret, args, cotangents):
    # One step is cheap: differentiate the jnp reference (same function) instead of a kernel.
    step = functools.partial(reference.selective_state_update, dt_softplus=dt_softplus,
                             dt_limit=dt_limit)
    return jax.vjp(step, *args)[1](cotangents)


_pallas_step.defvjp(_pallas_step_fwd, _pallas_step_bwd)


def _choose(implementation, interpret):
    if implementation not in (None, *IMPLEMENTATIONS):
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}"
        )
    if interpret is not None:
        interpret = _check_bool("interpret", interpret)
    on_gpu = _compat.targets_gpu()
    if implementation is None:
        implementation = "pallas" if on_gpu else "xla"
    return implementation, (not on_gpu) if interpret is None else interpret


# ---------------------------------------------------------------------------------------------
# Argument checks: each raises ValueError/TypeError naming the argument, before any tracing.


def _shape_error(name, want, got):
    return ValueError(f"{name} must have shape {want}, got {got}")


def _check_bool(name, value):
    """value as a Python bool; a TypeError unless it is a Python or numpy bool."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def check_dt_limit(dt_limit):
    """dt_limit as a (low, high) tuple of floats with 0 <= low <= high, low finite (high may be
    inf), else a ValueError. Shared with the Flax Mamba2 layer."""
    if (
        not isinstance(dt_limit, tuple | list) or len(dt_limit) != 2
        or not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in dt_limit)
    ):
        raise ValueError(f"dt_limit must be a (low, high) pair of numbers, got {dt_limit!r}")
    low, high = (float(v) for v in dt_limit)
    if not (math.isfinite(low) and 0.0 <= low <= high):  # NaN fails every comparison
        raise ValueError(
            f"dt_limit must have 0 <= low <= high with a finite low (high may be inf), got "
            f"{dt_limit!r}"
        )
    return low, high


def _check_decay_rates(A):
    """A ValueError if A's value is known and any entry is positive or NaN."""
    value = _compat.concrete_value(A)
    if value is not None and not np.all(value <= 0):
        bad = value[~(value <= 0)]
        raise ValueError(f"A must be <= 0 (a decay rate), got entries {bad[:4].tolist()}")


def _check_floats(arrays):
    for name, value in arrays.items():
        if value is None:
            continue
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(value)}")
        if value.dtype not in _FLOATS:
            raise TypeError(f"{name} must be a float array, got {value.dtype}")


def _check(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx):
    _check_floats(dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                       initial_states=initial_states))
    if x.ndim != 4:
        raise ValueError(f"x must be rank 4 (b, T, H, P), got {x.shape}")
    b, t, h, p = x.shape
    if 0 in x.shape:
        raise ValueError(f"x must not be empty, got {x.shape}")
    if dt.shape != (b, t, h):
        raise _shape_error("dt", (b, t, h), dt.shape)
    if A.shape != (h,):
        raise _shape_error("A", (h,), A.shape)
    if B.ndim != 4 or B.shape[:2] != (b, t):
        raise ValueError(f"B must have shape (b, T, G, N) = ({b}, {t}, G, N), got {B.shape}")
    g, n = B.shape[2:]
    if g == 0 or h % g:
        raise ValueError(f"heads ({h}) must be a multiple of B's groups ({g})")
    if n == 0:
        raise ValueError(f"B's state size N must not be 0, got {B.shape}")
    if C.shape != B.shape:
        raise _shape_error("C", B.shape, C.shape)
    if (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1
            or chunk_size & (chunk_size - 1)):
        raise ValueError(f"chunk_size must be a positive power of two, got {chunk_size!r}")
    if D is not None and D.shape not in ((h,), (h, p)):
        raise ValueError(f"D must have shape ({h},) or ({h}, {p}), got {D.shape}")
    if z is not None and z.shape != x.shape:
        raise _shape_error("z", x.shape, z.shape)
    if dt_bias is not None and dt_bias.shape != (h,):
        raise _shape_error("dt_bias", (h,), dt_bias.shape)
    if initial_states is not None and initial_states.shape != (b, h, p, n):
        raise _shape_error("initial_states", (b, h, p, n), initial_states.shape)
    if seq_idx is not None:
        if not hasattr(seq_idx, "dtype") or not jnp.issubdtype(seq_idx.dtype, jnp.integer):
            got = getattr(seq_idx, "dtype", type(seq_idx))
            raise TypeError(f"seq_idx must be an integer array, got {got}")
        if seq_idx.shape != (b, t):
            raise _shape_error("seq_idx", (b, t), seq_idx.shape)
    if n > 256 or p > 256:
        raise ValueError(f"state size N and head dim P must be at most 256, got N={n}, P={p}")
    _check_decay_rates(A)


def _check_step(state, x, dt, A, B, C, D, z, dt_bias):
    arrays = dict(state=state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias)
    _check_floats(arrays)
    if x.ndim != 3:
        raise ValueError(f"x must be rank 3 (b, H, P), got {x.shape}")
    b, h, p = x.shape
    if B.ndim != 3 or B.shape[0] != b:
        raise ValueError(f"B must have shape (b, G, N) = ({b}, G, N), got {B.shape}")
    g, n = B.shape[1:]
    if g == 0 or h % g:
        raise ValueError(f"heads ({h}) must be a multiple of B's groups ({g})")
    want = dict(state=(b, h, p, n), dt=(b, h), A=(h,), C=B.shape, z=x.shape, dt_bias=(h,))
    for name, shape in want.items():
        if arrays[name] is not None and arrays[name].shape != shape:
            raise _shape_error(name, shape, arrays[name].shape)
    if D is not None and D.shape not in ((h,), (h, p)):
        raise ValueError(f"D must have shape ({h},) or ({h}, {p}), got {D.shape}")
    _check_decay_rates(A)


# ---------------------------------------------------------------------------------------------
# The Pallas path.


def _pad(x, sizes, mode="constant"):
    """Pads each axis of x at the end up to `sizes` (None keeps an axis)."""
    widths = [
        (0, 0 if size is None else size - dim) for dim, size in zip(x.shape, sizes, strict=True)
    ]
    return x if not any(w for _, w in widths) else jnp.pad(x, widths, mode=mode)


def _pallas_ssd(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                dt_softplus, dt_limit, interpret):
    """Pads to whole chunks and power-of-two P and N, runs `_ssd`, slices back."""
    b, t, h, p = x.shape
    n = B.shape[-1]
    p_pad, n_pad = pow2_at_least(p), pow2_at_least(n)
    device_kind = _compat.target_device()[0]
    blocks = tuning.blocks_for(device_kind, n_pad)
    block_t = max(16, min(chunk_size, blocks.block_t))
    t_pad = math.ceil(t / block_t) * block_t
    static = common.Static.from_blocks(
        blocks,
        block_t=block_t,
        p_pad=p_pad,
        batch=b,
        heads=h,
        heads_per_group=h // B.shape[2],
        num_chunks=t_pad // block_t,
        multiprocessors=tuning.multiprocessors(device_kind, _compat.target_multiprocessors()),
        interpret=interpret,
        has_seq_idx=seq_idx is not None,
        has_d=D is not None,
        has_z=z is not None,
        has_initial_states=initial_states is not None,
        seq_len=t,
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
    )
    if D is not None:
        D = jnp.broadcast_to(D.astype(jnp.float32)[:, None] if D.ndim == 1 else D, (h, p))
        D = _pad(D.astype(jnp.float32), (None, p_pad))
    y, final = _ssd(
        static,
        _pad(x, (None, t_pad, None, p_pad)),
        _pad(dt, (None, t_pad, None)),
        dt_bias,
        A.astype(jnp.float32),
        _pad(B, (None, t_pad, None, n_pad)),
        _pad(C.astype(B.dtype), (None, t_pad, None, n_pad)),
        D,
        None if z is None else _pad(z.astype(x.dtype), (None, t_pad, None, p_pad)),
        None if initial_states is None else _pad(
            initial_states.astype(jnp.float32), (None, None, p_pad, n_pad)
        ),
        None if seq_idx is None else _pad(semantics.sequence_runs(seq_idx), (None, t_pad), "edge"),
    )
    return y[:, :t, :, :p], final[:, :, :p, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ssd(static, x, dt, dt_bias, A, B, C, D, z, h0, seq):
    """(y, final) of padded inputs; dt (b, Tp, H) raw. See `forward.forward`."""
    return _forward(static, False, x, dt, dt_bias, A, B, C, D, z, h0, seq)[0]


def _ssd_fwd(static, x, dt, dt_bias, A, B, C, D, z, h0, seq):
    return _forward(static, True, x, dt, dt_bias, A, B, C, D, z, h0, seq)


# Second order (`_derivatives`): the forward rule and the backward keep their kernel values and
# take the tangents of the reference (`_reference_ssd`). Residuals that the kernels compute from
# the inputs (dt', s, y_pre, the saved entries) get zero tangents, and zero partials in the
# backward's rule: the reference recomputes them from the inputs, so every total derivative is
# still exact. The forward's rule is written out here, for those residuals.


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _forward(static, save_entries, x, dt, dt_bias, A, B, C, D, z, h0, seq):
    """((y, final), residuals) from the kernels; the forward saves the states its programs
    start from for the backward only when it is differentiated (`save_entries`)."""
    dt_step, s = preprocess.preprocess(dt, dt_bias, A, seq, static=static)
    y, y_pre, final, entries = forward.forward(x, dt_step, s, B, C, seq, D, z, h0,
                                               static=static, save_entries=save_entries)
    return (y, final), (x, dt, dt_bias, dt_step, s, A, B, C, D, z, h0, seq, y_pre, entries)


@_forward.defjvp
def _forward_jvp(static, save_entries, primals, tangents):
    outputs, residuals = _forward(static, save_entries, *primals)
    _, output_tangents = jax.jvp(functools.partial(_reference_ssd, static), primals, tangents)
    dx, ddt, ddt_bias, dA, dB, dC, dD, dz, dh0, dseq = tangents
    _, _, _, dt_step, s, *_, y_pre, entries = residuals
    computed = [None if v is None else jnp.zeros_like(v) for v in (dt_step, s, y_pre, entries)]
    residual_tangents = (dx, ddt, ddt_bias, computed[0], computed[1], dA, dB, dC, dD, dz, dh0,
                         dseq, computed[2], computed[3])
    return (outputs, residuals), (output_tangents, residual_tangents)


def _reference_ssd(static, x, dt, dt_bias, A, B, C, D, z, h0, seq):
    """What `_ssd` computes, by the chunked reference on the real tokens of the padded
    arguments (padding tokens give zero outputs)."""
    t = static.seq_len
    y, final = reference.mamba_chunk_scan_combined(
        x[:, :t], dt[:, :t], A, B[:, :t], C[:, :t], static.block_t, D=D,
        z=None if z is None else z[:, :t], dt_bias=dt_bias, initial_states=h0,
        seq_idx=None if seq is None else seq[:, :t], dt_softplus=static.dt_softplus,
        dt_limit=static.dt_limit, return_final_states=True,
    )
    return _pad(y, x.shape), final.astype(jnp.float32)


def _ssd_bwd(static, residuals, cotangents):
    return _kernel_gradients(static, residuals, cotangents)


def _backward_kernels(static, residuals, cotangents):
    """The gradients of `_ssd`'s array arguments, from the backward kernels."""
    x, dt, dt_bias, dt_step, s, A, B, C, D, z, h0, seq, y_pre, entries = residuals
    dy, dfinal = cotangents
    dz = None
    if z is not None:
        zf = z.astype(jnp.float32)
        sig = jax.nn.sigmoid(zf)
        dz = (dy.astype(jnp.float32) * y_pre.astype(jnp.float32) * sig * (1 + zf * (1 - sig)))
        dz = dz.astype(z.dtype)
        dy = dy.astype(jnp.float32) * zf * sig
    dy = dy.astype(x.dtype)
    states, gstates, dh0 = backward.states_and_gradients(
        x, dy, dt_step, s, B, C, seq, h0, dfinal.astype(jnp.float32), entries, static=static)
    static = static.for_backward()
    dx, ddt_x, dlog_decay, dB, dC = backward.chunk_gradients(
        x, dy, dt_step, s, B, C, seq, D, states, gstates, static=static
    )
    ddt_step = dlog_decay * A[None, :, None] + ddt_x
    dA = jnp.sum(dlog_decay * dt_step, axis=(0, 2))
    ddt, ddt_bias = _preprocess_vjp(static, dt, dt_bias, ddt_step)
    dD = None
    if D is not None:
        dD = jnp.sum(dy.astype(jnp.float32) * x.astype(jnp.float32), axis=(0, 1))
    return dx, ddt, ddt_bias, dA, dB, dC, dD, dz, None if h0 is None else dh0, None


def _reference_gradients(static, residuals, cotangents):
    """`_backward_kernels` by differentiating `_reference_ssd`."""
    x, dt, dt_bias, _, _, A, B, C, D, z, h0, seq, _, _ = residuals
    _, vjp = jax.vjp(functools.partial(_reference_ssd, static, seq=seq),
                     x, dt, dt_bias, A, B, C, D, z, h0)
    return (*vjp(cotangents), None)


_kernel_gradients = _derivatives.reference_tangents(_backward_kernels, _reference_gradients)


def _preprocess_vjp(static, dt, dt_bias, ddt_step):
    """Gradients of the raw dt (b, Tp, H) and dt_bias (or None) from that of dt' (b, H, Tp),
    through `semantics.step_sizes` (what `preprocess.preprocess` computes in the kernel)."""
    real = jnp.arange(dt.shape[1]) < static.seq_len  # padding tokens have no step
    ddt_step = jnp.where(real[None, :, None], jnp.swapaxes(ddt_step, 1, 2), 0.0)

    def step_sizes(dt, dt_bias):
        return semantics.step_sizes(dt, dt_bias, static.dt_softplus, static.dt_limit,
                                    jnp.float32)

    step, vjp = jax.vjp(step_sizes, dt, dt_bias)
    return vjp(ddt_step.astype(step.dtype))


_ssd.defvjp(_ssd_fwd, _ssd_bwd)
