"""The SSD ops' argument checks: each raises a TypeError (wrong kind) or ValueError (wrong
value) naming the argument, before anything is traced. `check_dt_limit` is shared with the Flax
Mamba2 layer (through `pallas_kernels.arguments`)."""

import math
import numbers

import jax.numpy as jnp
import numpy as np

from pallas_kernels import _compat, _dispatch


def _shape_error(name, want, got):
    return ValueError(f"{name} must have shape {want}, got {got}")


def _check_integers(name, value):
    if not hasattr(value, "dtype") or not jnp.issubdtype(value.dtype, jnp.integer):
        got = getattr(value, "dtype", type(value))
        raise TypeError(f"{name} must be an integer array, got {got}")


def _check_floats(arrays):
    _dispatch.check_floats(arrays, _dispatch.FLOATS, "a float array")


def check_dt_limit(dt_limit):
    """dt_limit as a (low, high) tuple of floats with 0 <= low <= high, low finite (high may be
    inf), else a ValueError."""
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


def check_decay_rates(A):
    """A ValueError if A's value is known and any entry is positive or NaN."""
    value = _compat.concrete_value(A)
    if value is not None and not np.all(value <= 0):
        bad = value[~(value <= 0)]
        raise ValueError(f"A must be <= 0 (a decay rate), got entries {bad[:4].tolist()}")


def check_scan(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx):
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
        _check_integers("seq_idx", seq_idx)
        if seq_idx.shape != (b, t):
            raise _shape_error("seq_idx", (b, t), seq_idx.shape)
    if n > 256 or p > 256:
        raise ValueError(f"state size N and head dim P must be at most 256, got N={n}, P={p}")
    check_decay_rates(A)


def check_step(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices):
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
    rows = b
    if state_batch_indices is not None:
        _check_integers("state_batch_indices", state_batch_indices)
        if state_batch_indices.shape != (b,):
            raise _shape_error("state_batch_indices", (b,), state_batch_indices.shape)
        if state.ndim != 4 or state.shape[0] == 0:
            raise ValueError(f"state must be a cache of slots (num_slots, H, P, N) = (num_slots, "
                             f"{h}, {p}, {n}) with state_batch_indices, got {state.shape}")
        rows = state.shape[0]
    want = dict(state=(rows, h, p, n), dt=(b, h), A=(h,), C=B.shape, z=x.shape, dt_bias=(h,))
    for name, shape in want.items():
        if arrays[name] is not None and arrays[name].shape != shape:
            raise _shape_error(name, shape, arrays[name].shape)
    if D is not None and D.shape not in ((h,), (h, p)):
        raise ValueError(f"D must have shape ({h},) or ({h}, {p}), got {D.shape}")
    check_decay_rates(A)


def check_varlen(x, seq_idx, cu_seqlens, return_varlen_states):
    """cu_seqlens (num_seqs + 1,) integers for x (1, T, ...) packing the sequences, rising from
    0 to T where its value is known, marking seq_idx's sequences where both are known; needed
    by return_varlen_states."""
    if cu_seqlens is None:
        if return_varlen_states:
            raise ValueError("return_varlen_states needs cu_seqlens, the packed sequences' "
                             "bounds (num_seqs + 1,)")
        return
    _check_integers("cu_seqlens", cu_seqlens)
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must have shape (num_seqs + 1,) with num_seqs >= 1, got "
                         f"{cu_seqlens.shape}")
    if x.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs the sequences packed into one row, x (1, T_total, H, "
                         f"P), got x {x.shape}")
    bounds = _compat.concrete_value(cu_seqlens)
    if bounds is None:
        return
    t = x.shape[1]
    if bounds[0] != 0 or bounds[-1] != t or np.any(np.diff(bounds) < 0):
        raise ValueError(f"cu_seqlens must rise from 0 to T_total = {t} (never falling), got "
                         f"{bounds.tolist()}")
    ids = None if seq_idx is None else _compat.concrete_value(seq_idx)
    if ids is not None:
        sequence = np.searchsorted(bounds[1:], np.arange(t), side="right")
        if np.any((ids[0, 1:] != ids[0, :-1]) != (sequence[1:] != sequence[:-1])):
            raise ValueError("seq_idx and cu_seqlens must mark the same sequences (seq_idx "
                             "changes exactly where a sequence of cu_seqlens starts)")
