"""What the SSD's arguments mean, defined once for the kernels, the references and decoding.

Neither the kernels nor the references own these definitions; both read them from here, and the
tests check both against a token recurrence of their own.

* Step sizes (mamba_ssm's `_chunk_cumsum_fwd_kernel`): dt' = clamp(softplus?(dt + dt_bias),
  *dt_limit), the clamp always applied, (0, inf) by default, so dt' >= 0 (a negative raw dt
  without softplus becomes 0). softplus(u) = u above 20. The clamp has zero gradient where it
  is active and gradient one on and inside the limits.
* Decay rates: A <= 0 (the public functions reject A > 0 where its value is known). Under jit A
  is not known; a positive entry then acts as 0 (no decay), so every log decay dt' A is <= 0
  and the kernels only ever take exp of non-positive numbers.
* Sequences: `seq_idx` (b, T) marks packed sequences; the state resets wherever the id
  changes from one token to the next, so an id that recurs later in a row starts a new
  sequence. `sequence_runs` turns any ids into run numbers (0, 1, 2, ... per row,
  non-decreasing, int32), compared at the ids' own width (int64 ids under x64 are never cast
  before they are compared).
* Precision: the math runs in float32, float64 where a float input is float64 (only under
  x64): `compute_dtype`. Final states come back in it on every path.
"""

import jax.numpy as jnp

DEFAULT_DT_LIMIT = (0.0, float("inf"))
SOFTPLUS_THRESHOLD = 20.0  # softplus(u) = u above it, as in mamba_ssm


def compute_dtype(*arrays):
    """float32, or float64 when a floating input is float64 (only possible with x64 on)."""
    return jnp.result_type(jnp.float32, *(a for a in arrays if a is not None))


def step_sizes(dt, dt_bias=None, dt_softplus=False, dt_limit=DEFAULT_DT_LIMIT, dtype=None):
    """dt' = clamp(softplus?(dt + dt_bias), low, high), in `dtype` (default: dt's).

    dt (..., H) raw step sizes; dt_bias (H,) or None (broadcasts over the last axis);
    dt_limit a (low, high) pair of Python floats with 0 <= low <= high (high may be inf). Plain
    jnp, so it runs inside a Pallas kernel as well as in XLA. The softplus is written so that
    its gradient stays finite; the clamp's gradient is 1 on [low, high] and 0 outside it.
    """
    u = dt.astype(dtype or dt.dtype)
    if dt_bias is not None:
        u = u + dt_bias.astype(u.dtype)
    if dt_softplus:
        u = jnp.where(u > SOFTPLUS_THRESHOLD, u,
                      jnp.log1p(jnp.exp(jnp.minimum(u, SOFTPLUS_THRESHOLD))))
    low, high = dt_limit
    u = jnp.where(u < low, low, u)
    return jnp.where(u > high, high, u) if high != float("inf") else u


def decay_rates(A):
    """A as the recurrence uses it: positive entries act as 0 (see the module docstring)."""
    return jnp.where(A > 0, jnp.zeros_like(A), A)


def sequence_runs(seq_idx):
    """(b, T) int32 run numbers of `seq_idx` (b, T) integers: +1 wherever the id changes."""
    changes = (seq_idx[:, 1:] != seq_idx[:, :-1]).astype(jnp.int32)
    return jnp.pad(jnp.cumsum(changes, axis=1), ((0, 0), (1, 0)))


def skip_weights(D, heads, head_dim):
    """D (H,) or (H, P), the skip connection's weights y += D x, as (H, P) float32."""
    D = D.astype(jnp.float32)
    return jnp.broadcast_to(D[:, None] if D.ndim == 1 else D, (heads, head_dim))
