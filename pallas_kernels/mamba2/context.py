"""Context parallelism for the SSD: the sequence sharded contiguously over a mesh axis of n
devices (device i holds the i-th n-th of every row).

The scan is linear in the state it starts from. Each device runs the op on its shard from a
zero state, which gives its output y0 and final state F, and forms, per head, the decay m of
a state carried through the whole shard (0 when a sequence starts inside it). The devices
all-gather (F, m) and the sequence ids at the shard edges, state-sized, and each chains them
in the same order: the state entering shard i is

    h_0 = initial_states,  h_{i+1} = [seq continues across the edge] (F_i + m_i h_i).

A state h entering a shard adds, for every token t before the shard's first sequence change,

    y_t += exp(sum_{s <= t} dt'_s A) (C_t . h) * silu(z_t)

to the output (the gate is a product, so it applies to the sum), and m h to the final state.
That correction is one state-sized einsum per token, so the kernels run once, not twice. Every
gradient is autodiff's: the kernels' own (through F's cotangent), the einsum's and the
gather's transpose, a state-sized reduce-scatter.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.mamba2 import semantics


def state_passing(compute, axis_name, parts, x, dt, A, B, C, D, z, dt_bias, initial_states,
                  seq_idx, *, dt_softplus, dt_limit):
    """(y (b, Tl, H, P), final (b, H, P, N)) of one device's shards (Tl = T / parts tokens of
    x, dt, B, C, z and seq_idx) along mesh axis `axis_name`; `final` is the state after the
    whole sequence's last token, the same on every device.

    `compute(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx)` is the op on local
    arrays, returning (y, final state). With one device along the axis it is all there is.
    """
    if parts == 1:
        return compute(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx)
    dtype = semantics.compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_states)
    batch, _, heads, head_dim = x.shape
    groups, state_dim = B.shape[2], B.shape[3]
    y0, final0 = compute(x, dt, A, B, C, D, z, dt_bias, None, seq_idx)

    log_decay = jnp.cumsum(
        semantics.step_sizes(dt, dt_bias, dt_softplus, dt_limit, dtype)
        * semantics.decay_rates(A).astype(dtype), axis=1)  # (b, Tl, H)
    if seq_idx is None:
        carried = jnp.ones(x.shape[:2], bool)
        edges = jnp.zeros((batch, 2), jnp.int32)
    else:  # tokens before the shard's first sequence change
        carried = semantics.sequence_runs(seq_idx) == 0
        edges = jnp.stack([seq_idx[:, 0], seq_idx[:, -1]], axis=1)
    decay = jnp.where(carried[:, :, None], jnp.exp(log_decay), 0.0)  # (b, Tl, H)

    gather = jax.tree.map(lambda a: jax.lax.all_gather(a, axis_name),
                          (final0, decay[:, -1], edges))
    finals, through, edges = gather  # (n, b, H, P, N), (n, b, H), (n, b, 2)
    state = (jnp.zeros((batch, heads, head_dim, state_dim), dtype) if initial_states is None
             else initial_states.astype(dtype))
    entering = []
    for i in range(parts):
        entering.append(state)
        state = finals[i] + through[i][:, :, None, None] * state
        if i + 1 < parts:
            continues = edges[i, :, 1] == edges[i + 1, :, 0]
            state = jnp.where(continues[:, None, None, None], state, 0.0)
    entering = jnp.stack(entering)[jax.lax.axis_index(axis_name)]  # (b, H, P, N)

    per_group = heads // groups  # C . h in C's dtype, accumulated in float32, as the kernels do
    carried_out = jnp.einsum(
        "btgn,bgkpn->btgkp", C,
        entering.reshape(batch, groups, per_group, head_dim, state_dim).astype(C.dtype),
        precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
    ).astype(dtype).reshape(x.shape) * decay[..., None]
    if z is not None:
        carried_out = carried_out * jax.nn.silu(z.astype(dtype))
    return (y0.astype(dtype) + carried_out).astype(x.dtype), state
