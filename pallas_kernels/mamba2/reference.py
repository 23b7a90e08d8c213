"""Pure-jnp references for Mamba2's state-space duality (SSD) layer.

Three functions share the meaning of mamba_ssm's kernels, for batch row b, head h and its group
g = h // (H // G), with dt', A and the sequences defined in `semantics` (shared with the kernels):

    a_t   = dt'_t * A_h                        (<= 0: dt' >= 0 and A <= 0)
    h_t   = exp(a_t) h_{t-1} + dt'_t * outer(x_t, B_t)        state (P, N)
    y_t   = h_t C_t + D x_t,  then  y_t *= silu(z_t)  if z is given

- `ssd_recurrence` steps through the tokens one by one (`lax.scan` over time).
- `mamba_chunk_scan_combined` is the chunked SSD algorithm the kernels implement, in plain jnp;
  its memory is O(T * chunk_size), never T x T.
- `selective_state_update` is one decode step.

All math runs in float32 whatever the input dtype (float64 when jax x64 is on and the inputs are
float64); only ever exp() of non-positive arguments is taken. Outputs come back in x's dtype,
states in the compute dtype (the decode step's new state in the state's dtype).

`seq_idx` (b, T) integers pack several sequences into a row: wherever seq_idx[b, t] !=
seq_idx[b, t-1] the state is reset to zero before step t (an id that recurs later starts a new
sequence). `initial_states` is the state before t = 0, so it feeds the first sequence of each
row only. Values of one sequence never reach another through the state: resets select zero,
they do not multiply by it, so a NaN in one sequence's state stays there.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.mamba2 import semantics

_einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


def _at_most_zero(v):
    """v where v <= 0, else 0 (a log decay the recurrence clamps). A select, not a minimum,
    so that the gradient at v == 0 (A == 0) passes whole, as the recurrence's does; a minimum
    would halve it at the tie."""
    return jnp.where(v > 0, 0.0, v)


def _sums_restarting(values, starts):
    """Inclusive sums of values (b, nc, Q, ...) along axis 2 that restart wherever `starts`
    (broadcastable, bool) is true: selected, never subtracted, so a NaN stays in its run."""

    def combine(left, right):
        (sum_left, start_left), (sum_right, start_right) = left, right
        return jnp.where(start_right, sum_right, sum_left + sum_right), start_left | start_right

    starts = jnp.broadcast_to(starts, values.shape)
    return jax.lax.associative_scan(combine, (values, starts), axis=2)[0]


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
    state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
    dt_limit=semantics.DEFAULT_DT_LIMIT, state_batch_indices=None,
):
    """One decode step of the SSD recurrence (functional).

    Args:
      state: (b, H, P, N) the state after the previous token, or with `state_batch_indices` a
        cache of slots (num_slots, H, P, N).
      x: (b, H, P).
      dt: (b, H) raw step sizes (`semantics.step_sizes`).
      A: (H,), non-positive.
      B, C: (b, G, N) with H % G == 0.
      D: (H,) or (H, P), optional skip connection.
      z: (b, H, P), optional gate: y *= silu(z).
      dt_bias: (H,), optional.
      dt_softplus, dt_limit: see `semantics.step_sizes`.
      state_batch_indices: (b,) integers, optional: row i gathers slot state_batch_indices[i],
        steps it and scatters it back; a row whose index is outside [0, num_slots) is padding
        (y 0, no slot written). Rows must name distinct slots.

    Returns:
      (y, new_state): y (b, H, P) in x's dtype, new_state in state's shape and dtype (the
      math in the compute dtype).
    """
    if state_batch_indices is None:
        y, new_state = _step(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit)
        return y, new_state.astype(state.dtype)
    slots = state.shape[0]
    valid = (state_batch_indices >= 0) & (state_batch_indices < slots)
    y, stepped = _step(state[jnp.where(valid, state_batch_indices, 0)], x, dt, A, B, C, D, z,
                       dt_bias, dt_softplus, dt_limit)
    y = jnp.where(valid[:, None, None], y, jnp.zeros_like(y))
    # Padding rows scatter out of bounds, which "drop" leaves out.
    new_state = state.at[jnp.where(valid, state_batch_indices, slots)].set(
        stepped.astype(state.dtype), mode="drop")
    return y, new_state


def _step(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit):
    """`selective_state_update` of one state per row: (y in x's dtype, new state (b, H, P, N)
    in the compute dtype)."""
    heads, groups = x.shape[1], B.shape[1]
    dtype = semantics.compute_dtype(state, x, dt, A, B, C, D, z, dt_bias)
    dt = semantics.step_sizes(dt, dt_bias, dt_softplus, dt_limit, dtype)  # (b, H)
    B = jnp.repeat(B.astype(dtype), heads // groups, axis=1)  # (b, H, N)
    C = jnp.repeat(C.astype(dtype), heads // groups, axis=1)
    decay = jnp.exp(dt * semantics.decay_rates(A.astype(dtype)))  # (b, H)
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
    dt_limit=semantics.DEFAULT_DT_LIMIT,
    return_final_states=False,
):
    """The SSD scan token by token (`lax.scan` over time): the ground truth.

    Same signature and meaning as `mamba_chunk_scan_combined`; `chunk_size` is accepted for that
    and ignored. Each step is `selective_state_update` on the already preprocessed dt', after
    setting the state to zero where seq_idx changes.

    Returns:
      y (b, T, H, P) in x's dtype, and with `return_final_states` also the state after the last
      token, (b, H, P, N) float32.
    """
    del chunk_size
    batch, _, heads, head_dim = x.shape
    dtype = semantics.compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_states)
    dt = semantics.step_sizes(dt, dt_bias, dt_softplus, dt_limit, dtype)
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
    dt_limit=semantics.DEFAULT_DT_LIMIT,
    return_final_states=False,
    cu_seqlens=None,
    return_varlen_states=False,
):
    """The chunked SSD algorithm (mamba_ssm's `mamba_chunk_scan_combined`) in plain jnp.

    The sequence is split into chunks of Q = `chunk_size` tokens (T is zero-padded to a multiple
    of Q: padded tokens have x = B = C = 0 and dt' = 0, so they leave the state unchanged, and
    their outputs are sliced off). Within chunk c, with s_l the inclusive cumsum of a over the
    tokens of l's sequence in the chunk and e = Q - 1 its last row:

      y_l  = sum_{s <= l, same(l, s)} (C_l . B_s) exp(min(s_l - s_s, 0)) dt'_s x_s   (diagonal)
           + [seq_l == seq_prev] exp(s_l) C_l H_{c-1}                               (carried-in)
      S_c  = sum_{s, same(e, s)} exp(min(s_e - s_s, 0)) dt'_s outer(x_s, B_s)      (chunk state)
      H_c  = S_c + [seq_e == seq_prev] exp(s_e) H_{c-1}                             (lax.scan)

    where same(l, s) says that tokens l and s are in one sequence (`semantics.sequence_runs`),
    seq_prev is the sequence of the token before the chunk (token 0's for the first chunk) and
    H_{-1} = initial_states. H_c is the recurrence's state at the end of chunk c, so H_{nc-1}
    is the final state. Every [...] and same(...) selects rather than multiplies, so a value
    of one sequence never reaches another through the decays or the states.

    Args:
      x: (b, T, H, P).
      dt: (b, T, H) raw step sizes (`semantics.step_sizes`).
      A: (H,), non-positive (`semantics.decay_rates`).
      B, C: (b, T, G, N) with H % G == 0.
      chunk_size: Q, a Python int.
      D: (H,) or (H, P), optional skip connection.
      z: (b, T, H, P), optional gate: y *= silu(z).
      dt_bias: (H,), optional.
      initial_states: (b, H, P, N), optional state before t = 0 (zero if absent).
      seq_idx: (b, T) integers, optional sequence ids (see the module docstring).
      dt_softplus, dt_limit: see `semantics.step_sizes`.
      return_final_states: also return the state after the last token.
      cu_seqlens: (num_seqs + 1,) integers, optional, with b = 1: sequence i is tokens
        cu_seqlens[i] to cu_seqlens[i + 1] - 1 (rising from 0 to T). Without seq_idx it
        defines the sequences (seq_idx[t] = the sequence holding token t); with it, both must
        mark the same sequences.
      return_varlen_states: also return the state after each sequence's last token,
        (num_seqs, H, P, N): sequence i's final state as if it ran alone, from
        `initial_states` for the sequence holding token 0 (as y's first sequence) and from zero
        for the others; zero for an empty sequence.

    Returns:
      y (b, T, H, P) in x's dtype, then with `return_final_states` the final state
      (b, H, P, N), then with `return_varlen_states` the sequences' final states, both in the
      compute dtype.

    The state after sequence i, ending at row l of chunk c, is the chunk's carried-in and
    diagonal terms with the state in place of C_l:

      V_i = sum_{s <= l, s in i} exp(s_l - s_s) dt'_s outer(x_s, B_s) + [i live at c's start]
            exp(s_l) H_{c-1}.
    """
    batch, seq_len, heads, head_dim = x.shape
    groups, state_dim = B.shape[2], B.shape[3]
    per_group = heads // groups
    dtype = semantics.compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_states)
    num_chunks = -(-seq_len // chunk_size)
    pad = num_chunks * chunk_size - seq_len
    if seq_idx is None and cu_seqlens is not None:
        seq_idx = jnp.searchsorted(cu_seqlens[1:], jnp.arange(seq_len), side="right")[None]
    if seq_idx is None:
        runs = jnp.zeros((batch, seq_len), jnp.int32)
    else:
        runs = semantics.sequence_runs(seq_idx)

    def chunked(v, mode="constant"):
        """(b, T, ...) -> (b, nc, Q, ...), zero-padded (or edge-padded) along time."""
        v = jnp.pad(v, ((0, 0), (0, pad)) + ((0, 0),) * (v.ndim - 2), mode=mode)
        return v.reshape(batch, num_chunks, chunk_size, *v.shape[2:])

    def per_token(mask):
        """A (b, nc, Q) mask broadcast against (b, nc, Q, G, R, ...) arrays."""
        return mask[..., None, None]

    dt = semantics.step_sizes(dt, dt_bias, dt_softplus, dt_limit, dtype)
    dt = chunked(dt).reshape(batch, num_chunks, chunk_size, groups, per_group)
    x_c = chunked(x.astype(dtype)).reshape(*dt.shape, head_dim)  # (b, nc, Q, G, R, P)
    B_c = chunked(B.astype(dtype))  # (b, nc, Q, G, N)
    C_c = chunked(C.astype(dtype))
    seq = chunked(runs, mode="edge")  # (b, nc, Q)
    seq_end = seq[:, :, -1]  # (b, nc)
    seq_prev = jnp.concatenate([runs[:, :1], seq_end[:, :-1]], axis=1)  # (b, nc)
    in_last = seq == seq_end[..., None]  # (b, nc, Q): token in the chunk's last sequence
    continues = seq == seq_prev[..., None]  # token continues the sequence live at the start

    # In-chunk inclusive cumsums of a over each token's own sequence (l, s: rows, columns).
    # Every mask selects the factors of a product as well as the product, so that autodiff,
    # too, never multiplies a masked value (a NaN of another sequence, say) by zero.
    a = dt * semantics.decay_rates(A.astype(dtype)).reshape(groups, per_group)  # (b,nc,Q,G,R)
    starts = jnp.concatenate([jnp.ones_like(seq[..., :1], bool), seq[..., 1:] != seq[..., :-1]],
                             axis=-1)  # (b, nc, Q): a sequence starts (or the chunk does)
    cum = _sums_restarting(a, per_token(starts))
    cum_end = cum[:, :, -1]  # (b, nc, G, R)
    causal = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    visible = causal & (seq[:, :, :, None] == seq[:, :, None, :])  # (b, nc, Q, Q)
    pairs = visible[..., None, None]  # against (b, nc, Q, Q, G, R)

    # Diagonal blocks: L[l, s] = exp(min(s_l - s_s, 0)) for s <= l within one sequence.
    decay = jnp.exp(_at_most_zero(
        jnp.where(pairs, cum[:, :, :, None] - cum[:, :, None, :], 0.0)))
    cb = _einsum("bclgn,bcsgn->bclsg", C_c, B_c)[..., None]
    scores = (jnp.where(pairs, cb, 0.0) * jnp.where(pairs, decay, 0.0)
              * jnp.where(pairs, dt[:, :, None], 0.0))  # (b, nc, Q, Q, G, R)
    y = _einsum("bclsgr,bcsgrp->bclgrp", scores, x_c)

    # Chunk states from the tokens of the chunk's last sequence, then the states passed on.
    last = per_token(in_last)
    to_end = jnp.exp(_at_most_zero(jnp.where(last, cum_end[:, :, None] - cum, 0.0)))
    to_end = jnp.where(last, to_end, 0.0) * jnp.where(last, dt, 0.0)
    x_end = jnp.where(last[..., None], x_c, 0.0)
    B_end = jnp.where(in_last[..., None, None], B_c, 0.0)
    chunk_states = _einsum("bcsgr,bcsgrp,bcsgn->bcgrpn", to_end, x_end, B_end)
    carries = (seq_end == seq_prev)[..., None, None]  # (b, nc, 1, 1): no sequence starts inside
    carry = jnp.where(carries, jnp.exp(_at_most_zero(jnp.where(carries, cum_end, 0.0))), 0.0)
    if initial_states is None:
        state = jnp.zeros((batch, groups, per_group, head_dim, state_dim), dtype)
    else:
        state = initial_states.astype(dtype).reshape(batch, groups, per_group, head_dim, state_dim)

    def pass_state(state, chunk):
        chunk_state, carry_c, carries_c = chunk
        kept = jnp.where(carries_c[..., None, None], state, 0.0)
        return chunk_state + carry_c[..., None, None] * kept, state

    final_states, states_in = jax.lax.scan(
        pass_state, state,
        tuple(jnp.moveaxis(v, 1, 0) for v in (chunk_states, carry, carries)),
    )
    states_in = jnp.moveaxis(states_in, 0, 1)  # (b, nc, G, R, P, N): state before each chunk

    # Carried-in contribution to the rows that continue the sequence live at the chunk start.
    first = per_token(continues)
    from_start = jnp.exp(_at_most_zero(jnp.where(first, cum, 0.0)))
    from_start = jnp.where(first, from_start, 0.0)
    C_first = jnp.where(continues[..., None, None], C_c, 0.0)
    carried = _einsum("bclgn,bcgrpn->bclgrp", C_first, states_in) * from_start[..., None]
    y = y + jnp.where(first[..., None], carried, 0.0)

    y = y.reshape(batch, num_chunks * chunk_size, heads, head_dim)[:, :seq_len]
    y = _skip_and_gate(y, x, D, z, dtype).astype(x.dtype)
    outputs = (y,)
    if return_final_states:
        outputs += (final_states.reshape(batch, heads, head_dim, state_dim),)
    if return_varlen_states:
        outputs += (_sequence_states(cu_seqlens, states_in[0], cum[0], dt[0], x_c[0], B_c[0]),)
    return outputs if len(outputs) > 1 else y


def _sequence_states(cu_seqlens, states_in, cum, dt, x, B):
    """The state after each sequence's last token (`mamba_chunk_scan_combined`'s V_i) from the
    chunked quantities of one row: states_in (nc, G, R, P, N), the states entering the chunks;
    cum and dt (nc, Q, G, R); x (nc, Q, G, R, P); B (nc, Q, G, N). Returns (S, H, P, N)."""
    num_chunks, chunk_size = cum.shape[:2]
    start, end = cu_seqlens[:-1], cu_seqlens[1:]
    last = end - 1
    chunk = jnp.clip(last // chunk_size, 0, num_chunks - 1)  # (S,): the chunk of the last token
    row = jnp.clip(last - chunk * chunk_size, 0, chunk_size - 1)
    tokens = chunk[:, None] * chunk_size + jnp.arange(chunk_size)  # (S, Q)
    mine = ((tokens >= start[:, None]) & (tokens <= last[:, None]))[..., None, None]
    cum, dt = cum[chunk], dt[chunk]  # (S, Q, G, R)
    cum_last = jnp.take_along_axis(cum, row[:, None, None, None], axis=1)  # (S, 1, G, R)
    weight = jnp.exp(_at_most_zero(jnp.where(mine, cum_last - cum, 0.0)))
    weight = jnp.where(mine, weight, 0.0) * jnp.where(mine, dt, 0.0)
    x_mine = jnp.where(mine[..., None], x[chunk], 0.0)
    B_mine = jnp.where(mine[..., 0, None], B[chunk], 0.0)
    states = _einsum("sqgr,sqgrp,sqgn->sgrpn", weight, x_mine, B_mine)
    # The state entering the chunk is the sequence's if it started before the chunk, or if it
    # holds token 0 (initial_states); never for an empty sequence.
    live = ((end > start) & ((start < chunk * chunk_size) | (start == 0)))[:, None, None]
    carry = jnp.where(live, jnp.exp(_at_most_zero(jnp.where(live, cum_last[:, 0], 0.0))), 0.0)
    carried = carry[..., None, None] * jnp.where(live[..., None, None], states_in[chunk], 0.0)
    states = states + carried
    return states.reshape(states.shape[0], -1, *states.shape[-2:])
