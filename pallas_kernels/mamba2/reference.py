"""Pure-jnp references for Mamba2's state-space duality (SSD) layer.

Three functions share the meaning of mamba_ssm's kernels, for batch row b, head h and its group
g = h // (H // G):

    dt'_t = preprocess_dt(dt_t)                 (softplus, bias, clip; see `preprocess_dt`)
    a_t   = min(dt'_t * A_h, 0)                 (A <= 0 and dt' >= 0 in practice)
    h_t   = exp(a_t) h_{t-1} + dt'_t * outer(x_t, B_t)        state (P, N)
    y_t   = h_t C_t + D x_t,  then  y_t *= silu(z_t)  if z is given

- `ssd_recurrence` steps through the tokens one by one (`lax.scan` over time): the ground truth.
- `mamba_chunk_scan_combined` is the chunked SSD algorithm the kernels implement, in plain jnp;
  its memory is O(T * chunk_size), never T x T.
- `selective_state_update` is one decode step.

All math runs in float32 whatever the input dtype (float64 when jax x64 is on and the inputs are
float64); only ever exp() of non-positive arguments is taken. Outputs come back in x's dtype,
states in the compute dtype (float32).

`seq_idx` (b, T) int32 packs several sequences into a row: where seq_idx[b, t] != seq_idx[b, t-1]
the state is reset to zero before step t. `initial_states` is the state before t = 0, so it feeds
the first sequence of each row only. As in mamba_ssm, sequences are contiguous: an id that has
ended does not recur later in the row.
"""

import functools

import jax
import jax.numpy as jnp

_DEFAULT_DT_LIMIT = (0.0, float("inf"))

_einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


def _compute_dtype(*arrays):
    """float32, or float64 when a floating input is float64 (only possible with x64 on)."""
    return jnp.result_type(jnp.float32, *(a for a in arrays if a is not None))


def preprocess_dt(dt, dt_bias=None, dt_softplus=False, dt_limit=_DEFAULT_DT_LIMIT):
    """The step sizes dt' that the SSD recurrence uses, from the raw `dt`.

    u = dt + dt_bias (the bias is optional and broadcasts over the last axis, heads);
    dt' = softplus(u) if `dt_softplus` else u, with softplus(u) = u for u > 20 and log1p(exp(u))
    otherwise (written so that its gradient stays finite); then dt' = clip(dt', *dt_limit). As in
    mamba_ssm, the clip is skipped when `dt_limit` is the default (0, inf), so a raw negative dt
    without softplus passes through unchanged. The gradient is zero where the clip is active.

    Args:
      dt: (..., H) raw step sizes, any float dtype.
      dt_bias: (H,) or None.
      dt_softplus: apply softplus after the bias.
      dt_limit: (low, high) Python floats.

    Returns:
      dt' with dt's shape, float32 (float64 for float64 inputs under x64).
    """
    dtype = _compute_dtype(dt, dt_bias)
    u = dt.astype(dtype)
    if dt_bias is not None:
        u = u + dt_bias.astype(dtype)
    if dt_softplus:
        u = jnp.where(u > 20.0, u, jnp.log1p(jnp.exp(jnp.minimum(u, 20.0))))
    if tuple(dt_limit) != _DEFAULT_DT_LIMIT:
        u = jnp.clip(u, dt_limit[0], dt_limit[1])
    return u


def _skip_and_gate(y, x, D, z, dtype):
    """y + D * x, then * silu(z): y, x, z (..., H, P); D (H,) or (H, P); all in `dtype`."""
    if D is not None:
        D = D.astype(dtype)
        y = y + (D[:, None] if D.ndim == 1 else D) * x.astype(dtype)
    if z is not None:
        z = z.astype(dtype)
        y = y * z * jax.nn.sigmoid(z)
    return y


def selective_state_update(
    state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False
):
    """One decode step of the SSD recurrence (functional; mamba_ssm's has no dt_limit, nor this).

    Args:
      state: (b, H, P, N) the state after the previous token.
      x: (b, H, P).
      dt: (b, H) raw step sizes (see `preprocess_dt`).
      A: (H,), non-positive.
      B, C: (b, G, N) with H % G == 0.
      D: (H,) or (H, P), optional skip connection.
      z: (b, H, P), optional gate: y *= silu(z).
      dt_bias: (H,), optional.
      dt_softplus: apply softplus to dt + dt_bias.

    Returns:
      (y, new_state): y (b, H, P) in x's dtype, new_state (b, H, P, N) float32.
    """
    heads, groups = x.shape[1], B.shape[1]
    dtype = _compute_dtype(state, x, dt, A, B, C, D, z, dt_bias)
    dt = preprocess_dt(dt, dt_bias, dt_softplus).astype(dtype)  # (b, H)
    B = jnp.repeat(B.astype(dtype), heads // groups, axis=1)  # (b, H, N)
    C = jnp.repeat(C.astype(dtype), heads // groups, axis=1)
    decay = jnp.exp(jnp.minimum(dt * A.astype(dtype), 0.0))  # (b, H)
    update = (dt[..., None] * x.astype(dtype))[..., None] * B[:, :, None, :]  # (b, H, P, N)
    new_state = decay[..., None, None] * state.astype(dtype) + update
    y = _einsum("bhpn,bhn->bhp", new_state, C)
    return _skip_and_gate(y, x, D, z, dtype).astype(x.dtype), new_state


def ssd_recurrence(
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
    dt_limit=_DEFAULT_DT_LIMIT,
    return_final_states=False,
):
    """The SSD scan token by token (`lax.scan` over time): the ground truth.

    Same signature and meaning as `mamba_chunk_scan_combined`; `chunk_size` is accepted for that
    and ignored. Each step is `selective_state_update` on the already preprocessed dt', after
    zeroing the state where seq_idx changes.

    Returns:
      y (b, T, H, P) in x's dtype, and with `return_final_states` also the state after the last
      token, (b, H, P, N) float32.
    """
    del chunk_size
    batch, _, heads, head_dim = x.shape
    dtype = _compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_states)
    dt = preprocess_dt(dt, dt_bias, dt_softplus, dt_limit).astype(dtype)
    if initial_states is None:
        state = jnp.zeros((batch, heads, head_dim, B.shape[-1]), dtype)
    else:
        state = initial_states.astype(dtype)
    if seq_idx is None:
        reset = jnp.zeros(x.shape[:2], bool)
    else:
        reset = jnp.pad(seq_idx[:, 1:] != seq_idx[:, :-1], ((0, 0), (1, 0)))

    def step(state, token):
        x_t, dt_t, B_t, C_t, z_t, reset_t = token
        state = jnp.where(reset_t[:, None, None, None], 0.0, state)
        y_t, state = selective_state_update(state, x_t, dt_t, A, B_t, C_t, D=D, z=z_t)
        return state, y_t

    time_major = jax.tree.map(lambda v: jnp.moveaxis(v, 1, 0), (x, dt, B, C, z, reset))
    final_states, y = jax.lax.scan(step, state, time_major)
    y = jnp.moveaxis(y, 0, 1)
    return (y, final_states) if return_final_states else y


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
    dt_limit=_DEFAULT_DT_LIMIT,
    return_final_states=False,
):
    """The chunked SSD algorithm (mamba_ssm's `mamba_chunk_scan_combined`) in plain jnp.

    The sequence is split into chunks of Q = `chunk_size` tokens (T is zero-padded to a multiple
    of Q: padded tokens have x = B = C = 0 and dt' = 0, so they leave the state unchanged, and
    their outputs are sliced off). Within chunk c, with s_l the inclusive cumsum of a over the
    chunk and e = Q - 1 its last row:

      y_l  = sum_{s <= l, same(l, s)} (C_l . B_s) exp(min(s_l - s_s, 0)) dt'_s x_s   (diagonal)
           + [seq_l == seq_prev] exp(s_l) C_l H_{c-1}                               (carried-in)
      S_c  = sum_{s, same(e, s)} exp(min(s_e - s_s, 0)) dt'_s outer(x_s, B_s)      (chunk state)
      H_c  = S_c + [seq_e == seq_prev] exp(s_e) H_{c-1}                             (lax.scan)

    where same(l, s) = [seq_idx_l == seq_idx_s], seq_prev is seq_idx of the token before the chunk
    (seq_idx of token 0 for the first chunk) and H_{-1} = initial_states. H_c is the recurrence's
    state at the end of chunk c, so H_{nc-1} is the final state.

    Args:
      x: (b, T, H, P).
      dt: (b, T, H) raw step sizes (see `preprocess_dt`).
      A: (H,), non-positive.
      B, C: (b, T, G, N) with H % G == 0.
      chunk_size: Q, a Python int.
      D: (H,) or (H, P), optional skip connection.
      z: (b, T, H, P), optional gate: y *= silu(z).
      dt_bias: (H,), optional.
      initial_states: (b, H, P, N), optional state before t = 0 (zero if absent).
      seq_idx: (b, T) int32, optional sequence ids (see the module docstring).
      dt_softplus, dt_limit: see `preprocess_dt`.
      return_final_states: also return the state after the last token.

    Returns:
      y (b, T, H, P) in x's dtype, and with `return_final_states` also the final state
      (b, H, P, N) float32.
    """
    batch, seq_len, heads, head_dim = x.shape
    groups, state_dim = B.shape[2], B.shape[3]
    per_group = heads // groups
    dtype = _compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_states)
    num_chunks = -(-seq_len // chunk_size)
    pad = num_chunks * chunk_size - seq_len
    if seq_idx is None:
        seq_idx = jnp.zeros((batch, seq_len), jnp.int32)

    def chunked(v, mode="constant"):
        """(b, T, ...) -> (b, nc, Q, ...), zero-padded (or edge-padded) along time."""
        v = jnp.pad(v, ((0, 0), (0, pad)) + ((0, 0),) * (v.ndim - 2), mode=mode)
        return v.reshape(batch, num_chunks, chunk_size, *v.shape[2:])

    dt = preprocess_dt(dt, dt_bias, dt_softplus, dt_limit).astype(dtype)
    dt = chunked(dt).reshape(batch, num_chunks, chunk_size, groups, per_group)
    x_c = chunked(x.astype(dtype)).reshape(*dt.shape, head_dim)  # (b, nc, Q, G, R, P)
    B_c = chunked(B.astype(dtype))  # (b, nc, Q, G, N)
    C_c = chunked(C.astype(dtype))
    seq = chunked(seq_idx, mode="edge")  # (b, nc, Q)
    seq_end = seq[:, :, -1]  # (b, nc)
    seq_prev = jnp.concatenate([seq_idx[:, :1], seq_end[:, :-1]], axis=1)  # (b, nc)

    a = jnp.minimum(dt * A.astype(dtype).reshape(groups, per_group), 0.0)  # (b, nc, Q, G, R)
    cum = jnp.cumsum(a, axis=2)
    cum_end = cum[:, :, -1]  # (b, nc, G, R)

    # Diagonal blocks: L[l, s] = exp(min(s_l - s_s, 0)) for s <= l within one sequence.
    decay = jnp.exp(jnp.minimum(cum[:, :, :, None] - cum[:, :, None, :], 0.0))
    causal = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    visible = causal & (seq[:, :, :, None] == seq[:, :, None, :])  # (b, nc, Q, Q)
    decay = jnp.where(visible[..., None, None], decay, 0.0)  # (b, nc, Q, Q, G, R)
    scores = _einsum("bclgn,bcsgn->bclsg", C_c, B_c)[..., None] * decay * dt[:, :, None]
    y = _einsum("bclsgr,bcsgrp->bclgrp", scores, x_c)

    # Chunk states from the chunk's own tokens, then the states passed between chunks.
    to_end = jnp.exp(jnp.minimum(cum_end[:, :, None] - cum, 0.0)) * dt
    to_end = jnp.where((seq == seq_end[..., None])[..., None, None], to_end, 0.0)
    chunk_states = _einsum("bcsgr,bcsgrp,bcsgn->bcgrpn", to_end, x_c, B_c)
    carry = jnp.exp(jnp.minimum(cum_end, 0.0))  # (b, nc, G, R)
    carry = jnp.where((seq_end == seq_prev)[..., None, None], carry, 0.0)
    if initial_states is None:
        state = jnp.zeros((batch, groups, per_group, head_dim, state_dim), dtype)
    else:
        state = initial_states.astype(dtype).reshape(batch, groups, per_group, head_dim, state_dim)

    def pass_state(state, chunk):
        chunk_state, carry_c = chunk
        return chunk_state + carry_c[..., None, None] * state, state

    final_states, states_in = jax.lax.scan(
        pass_state, state, (jnp.moveaxis(chunk_states, 1, 0), jnp.moveaxis(carry, 1, 0))
    )
    states_in = jnp.moveaxis(states_in, 0, 1)  # (b, nc, G, R, P, N): state before each chunk

    # Carried-in contribution to each row.
    from_start = jnp.exp(jnp.minimum(cum, 0.0))
    from_start = jnp.where((seq == seq_prev[..., None])[..., None, None], from_start, 0.0)
    y = y + _einsum("bclgn,bcgrpn,bclgr->bclgrp", C_c, states_in, from_start)

    y = y.reshape(batch, num_chunks * chunk_size, heads, head_dim)[:, :seq_len]
    y = _skip_and_gate(y, x, D, z, dtype).astype(x.dtype)
    if not return_final_states:
        return y
    return y, final_states.reshape(batch, heads, head_dim, state_dim)
