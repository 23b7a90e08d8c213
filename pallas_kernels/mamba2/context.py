"""Context parallelism for the SSD: the sequence sharded contiguously over a mesh axis of n
devices (device i holds the i-th n-th of every row).

The scan is linear in the state it starts from. With F the final state of a shard entered with
zero and m, per head, the decay of a state carried through the whole shard (0 when a sequence
starts inside it), the devices all-gather (F, m) and the sequence ids at the shard edges,
state-sized, and each chains them in the same order (`enter`): the state entering shard i is

    h_0 = initial_states,  h_{i+1} = [seq continues across the edge] (F_i + m_i h_i),

with m_i h_i taken as 0, by a select, where a sequence starts inside shard i: a NaN or inf of
one packed sequence never reaches another's (0 * NaN would).

Two ways to use it:

* `kernel_state_passing` (the kernels): a states-only walk gives F, then the scan runs once from
  h_i. Its backward is linear in the same way: a walk of the state gradients from the output's
  cotangent alone gives g_i, the gradient of the state entering shard i; gathered with m, they
  chain backwards into d_i, the gradient of the state leaving shard i, and the backward runs
  once from it. Two extra walks of one matmul a chunk, each only the parts that reach the
  state it gives (the forward's last, the backward's first); no (b, T, ...) work in XLA.
* `state_passing` (any op returning (y, final), the reference): the op runs from zero, and a
  state h entering a shard adds, for every token t before the shard's first sequence change,
  y_t += exp(sum_{s <= t} dt'_s A) (C_t . h) * silu(z_t), and m h to the final state; autodiff
  gives every gradient. One einsum per token and its gradients in XLA: on an H200 they cost as
  much as the kernels (benchmarks/NOTES.md).
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _derivatives, _device
from pallas_kernels.mamba2 import backward, forward, preprocess, reference, semantics


def state_passing(compute, axis_name, parts, x, dt, A, B, C, D, z, dt_bias, initial_states,
                  seq_idx, *, dt_softplus, dt_limit, edges=None):
    """(y (b, Tl, H, P), final (b, H, P, N)) of one device's shards (Tl = T / parts tokens of
    x, dt, B, C, z and seq_idx) along mesh axis `axis_name`; `final` is the state after the
    whole sequence's last token, the same on every device.

    `compute(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx)` is the op on local
    arrays, returning (y, final state). With one device along the axis it is all there is.
    `edges`: the shard's first and last sequence ids (default `shard_edges(seq_idx)`), where
    seq_idx holds run numbers instead.
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
    # tokens before the shard's first sequence change
    carried = (jnp.ones(x.shape[:2], bool) if seq_idx is None
               else semantics.sequence_runs(seq_idx) == 0)
    decay = jnp.where(carried[:, :, None], jnp.exp(log_decay), 0.0)  # (b, Tl, H)

    state = (jnp.zeros((batch, heads, head_dim, state_dim), dtype) if initial_states is None
             else initial_states)
    if edges is None:
        edges = shard_edges(seq_idx, batch)
    entering, state = enter(axis_name, parts, final0, decay[:, -1], edges, state)

    # C . h in C's dtype, accumulated in float32 (as the kernels do) or float64. Only the tokens
    # before the shard's first sequence change see h: a select on both sides of the product, so
    # that neither the output nor autodiff multiplies another sequence's NaN by zero.
    per_group = heads // groups
    token_carried = carried[:, :, None, None]
    carried_out = jnp.einsum(
        "btgn,bgkpn->btgkp", jnp.where(token_carried, C, 0),
        entering.reshape(batch, groups, per_group, head_dim, state_dim).astype(C.dtype),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.promote_types(jnp.float32, C.dtype),
    ).astype(dtype).reshape(x.shape) * decay[..., None]
    carried_out = jnp.where(token_carried, carried_out, 0.0)
    if z is not None:
        carried_out = carried_out * jax.nn.silu(z.astype(dtype))
    return (y0.astype(dtype) + carried_out).astype(x.dtype), state


def shard_edges(seq_idx, batch):
    """(b, 3) in the ids' integer dtype (compared at their own width): the sequence ids of a
    shard's first and last tokens, and 1 where the shard holds one sequence (no sequence starts
    inside it), 0 otherwise. Without seq_idx, (0, 0, 1): one sequence."""
    if seq_idx is None:
        return jnp.tile(jnp.array([0, 0, 1], jnp.int32), (batch, 1))
    whole = jnp.all(seq_idx == seq_idx[:, :1], axis=1).astype(seq_idx.dtype)
    return jnp.stack([seq_idx[:, 0], seq_idx[:, -1], whole], axis=1)


def enter(axis_name, parts, final0, through, edges, initial_states):
    """(the state entering this device's shard, the state after the sequence's last token, the
    same on every device), chained from every shard's (final0 (b, H, P, N): its final state
    entered with zero; through (b, H): m; edges (b, 3): `shard_edges`) and `initial_states`
    (b, H, P, N), in their dtype."""
    finals, through, edges = jax.tree.map(lambda a: jax.lax.all_gather(a, axis_name),
                                          (final0, through, edges))  # (n, b, ...)
    state = initial_states.astype(final0.dtype)
    entering = []
    for i in range(parts):
        entering.append(state)
        # A sequence starting inside the shard drops the state entering it (selected, so that
        # neither a NaN in it nor its gradient meets a zero factor).
        kept = jnp.where((edges[i, :, 2] == 1)[:, None, None, None], state, 0.0)
        state = finals[i] + through[i][:, :, None, None] * kept
        if i + 1 < parts:
            continues = edges[i, :, 1] == edges[i + 1, :, 0]
            state = jnp.where(continues[:, None, None, None], state, 0.0)
    return jnp.stack(entering)[jax.lax.axis_index(axis_name)], state


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def kernel_state_passing(config, axis_name, parts, x, dt, dt_bias, A, B, C, D, z, h0, seq,
                         edges):
    """(y, final) of one device's shard of the padded SSD inputs of `api._ssd` (A the decay
    rates, seq the sequence runs or None), the sequence over mesh axis `axis_name` of `parts`
    devices; edges (b, 3): the shard's sequence ids at its ends (`shard_edges`).
    `final` is the state after the sequence's last token, the same on every device. See the
    module docstring; second-order derivatives come from `reference_passing`, as `api._ssd`'s
    from its reference."""
    arrays = (x, dt, dt_bias, A, B, C, D, z, h0, seq, edges)
    return _passing_forward(config, axis_name, parts, False, arrays)[0]


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2, 3))
def _passing_forward(config, axis_name, parts, save_entries, arrays):
    """((y, final), (arrays, computed)) from the kernels: `computed` holds what the backward
    reuses, the preprocessed steps, the pre-gate output, the forward's saved entries, and the
    chain's inputs and the state entering the shard."""
    x, dt, dt_bias, A, B, C, D, z, h0, seq, edges = arrays
    static, blocks, plan = config.static, config.blocks, config.plan
    dt_step, s = preprocess.preprocess(dt, dt_bias, A, seq, static=static,
                                       block_t=blocks.block_t)
    final0 = forward.forward(x, dt_step, s, B, C, seq, None, None, None, static=static,
                             blocks=blocks, plan=plan, emit="final")
    through = _through(dt_step, A, seq)
    entering, final = enter(axis_name, parts, final0, through, edges, _start(h0, final0))
    y, y_pre, _, entries = forward.forward(x, dt_step, s, B, C, seq, D, z, entering,
                                           static=static, blocks=blocks, plan=plan,
                                           save_entries=save_entries)
    return (y, final), (arrays, (dt_step, s, y_pre, entries, final0, through, entering))


@_passing_forward.defjvp
def _passing_forward_jvp(config, axis_name, parts, save_entries, primals, tangents):
    # As `api._forward`'s rule: the outputs' tangents from the reference, zero tangents for the
    # computed residuals (the reference backward recomputes them from `arrays`).
    outputs, (arrays, computed) = _passing_forward(config, axis_name, parts, save_entries,
                                                   *primals)
    _, output_tangents = jax.jvp(
        lambda arrays: reference_passing(config, axis_name, parts, *arrays), primals, tangents)
    zeros = jax.tree.map(jnp.zeros_like, computed)
    return (outputs, (arrays, computed)), (output_tangents, (tangents[0], zeros))


def _start(h0, final0):
    """The state entering the sequence: h0, or zeros like a final state."""
    return jnp.zeros_like(final0) if h0 is None else h0


def _through(dt_step, A, seq):
    """m (b, H) float32: the decay of a state carried through the whole shard, 0 where a
    sequence starts inside it (seq: the sequence runs, 0 before the first change)."""
    decay = jnp.exp(jnp.sum(dt_step, axis=2) * A[None, :])
    return decay if seq is None else jnp.where(seq[:, -1:] == 0, decay, 0.0)


def _passing_fwd(config, axis_name, parts, *arrays):
    return _passing_forward(config, axis_name, parts, True, arrays)


def _passing_bwd(config, axis_name, parts, residuals, cotangents):
    arrays, computed = residuals
    return _passing_gradients((config, axis_name, parts), arrays, computed, cotangents)


def _kernel_passing_gradients(static_args, arrays, computed, cotangents):
    """The gradients of `kernel_state_passing`'s arrays from the kernels (None for seq and
    edges): the gradient of the state entering the shard from dy alone (g, a walk of first
    parts), the chain's transpose (d, the gradient of the state leaving the shard), then the
    backward from dy and d."""
    config, axis_name, parts = static_args
    static, blocks, plan = config.static, config.blocks, config.plan
    x, dt, dt_bias, A, B, C, D, z, h0, seq, edges = arrays
    dt_step, s, y_pre, entries, final0, through, entering = computed
    dy, dfinal = cotangents
    dy_pre, _ = backward.gate_gradients(dy, z, y_pre, x.dtype)  # CSE'd with the backward's
    entering_gradient = backward.initial_state_gradient(dy_pre, dt_step, s, C, seq,
                                                        static=static, blocks=blocks, plan=plan)
    _, chain_vjp = jax.vjp(lambda final0, start: enter(axis_name, parts, final0, through,
                                                       edges, start),
                           final0, _start(h0, final0))
    leaving, dstart = chain_vjp((entering_gradient, dfinal.astype(final0.dtype)))
    residuals = (x, dt, dt_bias, dt_step, s, A, B, C, D, z, entering, seq, y_pre, entries)
    grads = backward.gradients(residuals, dy, leaving, static=static, blocks=blocks, plan=plan)
    return (*grads[:-1], None if h0 is None else dstart, None, None)


def _reference_passing_gradients(static_args, arrays, computed, cotangents):
    """`_kernel_passing_gradients` by differentiating `reference_passing`."""
    *differentiable, seq, edges = arrays
    _, vjp = jax.vjp(lambda *a: reference_passing(*static_args, *a, seq, edges),
                     *differentiable)
    return (*vjp(cotangents), None, None)


_passing_gradients = _derivatives.reference_tangents(_kernel_passing_gradients,
                                                     _reference_passing_gradients)


def reference_passing(config, axis_name, parts, x, dt, dt_bias, A, B, C, D, z, h0, seq, edges):
    """What `kernel_state_passing` computes, by `state_passing` over the chunked reference on
    the real tokens of the padded arguments (padding tokens give zero outputs)."""
    static = config.static
    t = static.seq_len

    def compute(x, dt, A, B, C, D, z, dt_bias, h0, seq_idx):
        return reference.mamba_chunk_scan_combined(
            x, dt, A, B, C, config.blocks.block_t, D=D, z=z, dt_bias=dt_bias,
            initial_states=h0, seq_idx=seq_idx, dt_softplus=static.dt_softplus,
            dt_limit=static.dt_limit, return_final_states=True)

    y, final = state_passing(
        compute, axis_name, parts, x[:, :t], dt[:, :t], A, B[:, :t], C[:, :t], D,
        None if z is None else z[:, :t], dt_bias, h0, None if seq is None else seq[:, :t],
        dt_softplus=static.dt_softplus, dt_limit=static.dt_limit, edges=edges)
    return _device.pad_end(y, x.shape), final.astype(jnp.float32)


kernel_state_passing.defvjp(_passing_fwd, _passing_bwd)
