"""`mamba_chunk_scan_combined`: Mamba2's SSD with mamba_ssm's names, shapes and meaning.

A call flows: argument checks (`checks`, before anything is traced) -> implementation choice
("xla" runs the chunked jnp reference, "pallas" the kernels) -> on a mesh, per shard
(`_sharding`; a sharded sequence through `context`) -> the tuned blocks fitted to the
call (`tuning`), the cut of the scan kernels' walks (`schedule.plan`) and padding in XLA ->
`_ssd`, a `jax.custom_vjp` over the kernels: its forward runs the dt preprocessing kernel
(softplus, bias, clamp, in-chunk log2 cumsum: `preprocess`) and the forward scan (`forward`),
and saves x, dt, dt', s, A, B, C, D, z, h0 and the pre-gate output; its backward
(`backward.gradients`) recomputes the chunk states and differentiates the gate, D, A and the dt
preprocessing. The backward is itself differentiable: its derivatives (second order) are those
of the reference's backward (`_kernel_gradients`). The decode step is `decode`.

Packed prefill (`cu_seqlens`, batch 1): the sequences' final states come from the forward
kernel run once more to emit the state entering each chunk (`forward(emit="states")`), plus, per
sequence, its last chunk's tokens up to its end, in jnp (`_sequence_states`). Their gradients
are the reference's (`_reference_sequence_states`).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike

from pallas_kernels import _derivatives, _device, _dispatch, _sharding
from pallas_kernels.mamba2 import (
    backward,
    checks,
    common,
    context,
    forward,
    preprocess,
    reference,
    schedule,
    semantics,
    tuning,
)


def mamba_chunk_scan_combined(
    x: ArrayLike,
    dt: ArrayLike,
    A: ArrayLike,
    B: ArrayLike,
    C: ArrayLike,
    chunk_size: int,
    D: ArrayLike | None = None,
    z: ArrayLike | None = None,
    dt_bias: ArrayLike | None = None,
    initial_states: ArrayLike | None = None,
    seq_idx: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = semantics.DEFAULT_DT_LIMIT,
    return_final_states: bool = False,
    return_varlen_states: bool = False,
    *,
    implementation: str | None = None,
    interpret: bool | None = None,
    sharding: NamedSharding | P | None = None,
) -> jax.Array | tuple[jax.Array, ...]:
    """Mamba2's chunked selective scan (SSD), differentiable in every array argument.

    Token by token, for batch row b, head h and its group g = h // (H // G):
    dt' = clamp(softplus(dt + dt_bias), *dt_limit) (softplus only with `dt_softplus`, identity
    above 20; the clamp always applies, (0, inf) by default, and has zero gradient where
    active); h_t = exp(dt'_t A_h) h_{t-1} + dt'_t x_t B_t^T; y_t = h_t C_t + D x_t; y_t *=
    silu(z_t). The state resets to zero wherever `seq_idx` changes from one token to the next;
    `initial_states` feed the first sequence of each row. `semantics` defines each of these.

    The arguments up to `return_varlen_states` are mamba_ssm's, in its order (a positional
    call means the same); the rest are keyword-only.

    Args:
      x: (b, T, H, P); dt: (b, T, H); A: (H,), <= 0 (a ValueError where its value is known;
        under jit a positive entry acts as 0); B, C: (b, T, G, N) with H % G == 0.
      chunk_size: a power of two (mamba_ssm uses 64-256). The SSD result does not depend on it;
        the kernels use min(chunk_size, the tuned tile).
      D: (H,) or (H, P); z: (b, T, H, P); dt_bias: (H,); initial_states: (b, H, P, N);
      seq_idx: (b, T) integers of any width; a new sequence starts wherever the id changes.
      cu_seqlens: (num_seqs + 1,) integers (mamba_ssm's packed prefill): x holds the sequences
        packed in one row, (1, T_total, ...), sequence i being tokens cu_seqlens[i] to
        cu_seqlens[i + 1] - 1; cu_seqlens rises from 0 to T_total (checked where its value is
        known). Without seq_idx it defines the sequences (seq_idx[t] = the sequence holding
        token t, which mamba_ssm leaves to the caller); with seq_idx, both must mark the same
        sequences (checked where both values are known). Empty sequences are allowed.
      dt_softplus: a bool. dt_limit: (low, high) with 0 <= low <= high, low finite.
      return_final_states: also return the state after the last token, (b, H, P, N) float32
        (float64 for float64 inputs under x64, on both paths).
      return_varlen_states: also return each sequence's final state, (num_seqs, H, P, N)
        float32 (float64 as above): what running the sequence alone with return_final_states
        gives, from `initial_states` for the sequence holding token 0 (the one they feed in y)
        and from zero for the others; zero for an empty sequence. mamba_ssm means the same,
        but drops initial_states when the first sequence ends inside the first chunk. Needs
        cu_seqlens; not on a mesh (`sharding`). Differentiable (mamba_ssm's is not): on the
        Pallas path the kernels give the values and the reference's VJP their gradients.
      implementation: "pallas", "xla" (chunked jnp reference) or None (pallas on GPU, else xla).
      interpret: run the Pallas kernels in interpret mode; None: when not on a GPU.
      sharding: how x is sharded on a mesh, a `jax.sharding.NamedSharding` or a
        `PartitionSpec` (on the mesh of `jax.set_mesh`), for classic meshes; on meshes with
        Explicit axes (`jax.make_mesh`) x's own sharding is used. Batch and heads may be
        sharded (dt, A, D, dt_bias, initial_states follow the heads; B and C's groups too,
        unless G is 1); the kernels then run per shard under `jax.shard_map`. A sharded
        sequence (contiguous pieces; dt, B, C, z and seq_idx sharded as x) is context
        parallelism: the devices pass states along (`context`), gathering only state-sized
        arrays; final_states are then the same on every device of the sequence axis.

    Returns:
      y (b, T, H, P) in x's dtype; with `return_final_states` or `return_varlen_states` a
      tuple as mamba_ssm's: y, then final_states, then varlen_states, each where asked for.

    Second-order derivatives (grad of grad, `jax.hessian`) work on both paths; on the Pallas
    path the first derivatives come from the kernels and the second from the reference.
    """
    checks.check_scan(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx)
    dt_softplus = _dispatch.check_bool("dt_softplus", dt_softplus)
    return_final_states = _dispatch.check_bool("return_final_states", return_final_states)
    return_varlen_states = _dispatch.check_bool("return_varlen_states", return_varlen_states)
    checks.check_varlen(x, seq_idx, cu_seqlens, return_varlen_states)
    dt_limit = checks.check_dt_limit(dt_limit)
    implementation, interpret = _dispatch.choose(implementation, interpret)
    placement = _sharding.find("x", x, sharding, feature_dims=(3,))
    if return_varlen_states and placement is not None:
        raise NotImplementedError(
            "return_varlen_states: the sequences' final states are not computed on a mesh; "
            "call without sharding (cu_seqlens packs one row)")
    if cu_seqlens is not None and seq_idx is None:
        seq_idx = jnp.searchsorted(cu_seqlens[1:], jnp.arange(x.shape[1]), side="right")[None]
    sequences = cu_seqlens if return_varlen_states else None

    def compute(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, sequences=None,
                sequence_axis=None):
        """(y, final) of checked arrays (a shard's, on a mesh), and the sequences' final states
        where `sequences` (cu_seqlens) is given; with `sequence_axis` (mesh axis name,
        devices), the kernels' context parallelism (`context.kernel_state_passing`)."""
        if implementation == "xla":
            return reference.mamba_chunk_scan_combined(
                x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                initial_states=initial_states, seq_idx=seq_idx, dt_softplus=dt_softplus,
                dt_limit=dt_limit, return_final_states=True, cu_seqlens=sequences,
                return_varlen_states=sequences is not None,
            )
        dtype = semantics.compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_states)
        outputs = _pallas_ssd(x, dt, semantics.decay_rates(A), B, C, chunk_size, D, z,
                              dt_bias, initial_states, seq_idx, dt_softplus, dt_limit,
                              interpret, sequences, sequence_axis)
        return (outputs[0], *(v.astype(dtype) for v in outputs[1:]))

    arrays = (x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx)
    if placement is None:
        y, final, *varlen = compute(*arrays, sequences)
    else:
        varlen = []
        local = compute
        if placement.sequence is not None:
            placement.check_sequence("x", x.shape[1], "contiguous")
            axis = (placement.sequence, placement.size(placement.sequence))
            if implementation == "xla" or axis[1] == 1:
                local = functools.partial(context.state_passing, compute, *axis,
                                          dt_softplus=dt_softplus, dt_limit=dt_limit)
            else:
                local = functools.partial(compute, sequence_axis=axis)
        y, final = _sharding.run(placement, local, arrays, *_specs(placement, x, B, D))
    outputs = (y, *([final] if return_final_states else []), *varlen)
    return outputs if len(outputs) > 1 else y


def _specs(placement, x, B, D):
    """(in_specs, out_specs) of `compute` under `placement`, after checking that the batch,
    the heads and B's groups divide over their mesh axes."""
    rows, sequence, heads = placement.batch, placement.sequence, placement.heads
    placement.check_divides("x", "the batch", x.shape[0], rows)
    placement.check_divides("x", "the heads", x.shape[2], heads)
    groups = B.shape[2]
    if groups > 1:  # each shard's heads must find their groups in its shard of B and C
        placement.check_divides("B", "the groups", groups, heads)
    tokens = P(rows, sequence, heads, None)
    grouped = P(rows, sequence, heads if groups > 1 else None, None)
    states = P(rows, heads, None, None)
    skip = None if D is None else P(heads) if D.ndim == 1 else P(heads, None)
    in_specs = (tokens, P(rows, sequence, heads), P(heads), grouped, grouped, skip, tokens,
                P(heads), states, P(rows, sequence))
    return in_specs, (tokens, states)


# ---------------------------------------------------------------------------------------------
# The Pallas path.


@dataclasses.dataclass(frozen=True)
class _Config:
    """What the kernels know of a call besides its arrays (hashable: keys custom_vjp and jit)."""

    static: common.Static
    blocks: tuning.SSDBlocks  # fitted to the call
    plan: schedule.Plan


def _pallas_ssd(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                dt_softplus, dt_limit, interpret, cu_seqlens=None, sequence_axis=None):
    """Pads to whole chunks and power-of-two P and N, runs `_ssd` (with `sequence_axis`, a
    (mesh axis name, devices) pair: `context.kernel_state_passing`), slices back: (y, final),
    and the sequences' final states (`_sequence_states`) where `cu_seqlens` is given."""
    b, t, h, p = x.shape
    n = B.shape[-1]
    p_pad, n_pad = _device.pow2_at_least(p), _device.pow2_at_least(n)
    device_kind = _device.target()[0]
    blocks = tuning.blocks_for(device_kind, n_pad).fit(chunk_size, p_pad, h // B.shape[2])
    t_pad = _device.cdiv(t, blocks.block_t) * blocks.block_t
    config = _Config(
        static=common.Static(
            has_seq_idx=seq_idx is not None,
            has_d=D is not None,
            has_z=z is not None,
            has_initial_states=initial_states is not None,
            seq_len=t,
            dt_softplus=dt_softplus,
            dt_limit=dt_limit,
            interpret=interpret,
        ),
        blocks=blocks,
        plan=schedule.plan(blocks, batch=b, heads=h, p_pad=p_pad,
                           num_chunks=t_pad // blocks.block_t,
                           multiprocessors=_device.multiprocessors(device_kind)),
    )
    pad = _device.pad_end
    x = pad(x, (None, t_pad, None, p_pad))
    dt = pad(dt, (None, t_pad, None))
    A = A.astype(jnp.float32)
    B = pad(B, (None, t_pad, None, n_pad))
    C = pad(C.astype(B.dtype), (None, t_pad, None, n_pad))
    h0 = None if initial_states is None else pad(
        initial_states.astype(jnp.float32), (None, None, p_pad, n_pad))
    seq = None if seq_idx is None else pad(semantics.sequence_runs(seq_idx), (None, t_pad),
                                           "edge")
    arrays = (x, dt, dt_bias, A, B, C,
              None if D is None else pad(semantics.skip_weights(D, h, p), (None, p_pad)),
              None if z is None else pad(z.astype(x.dtype), (None, t_pad, None, p_pad)),
              h0, seq)
    if sequence_axis is None:
        y, final = _ssd(config, *arrays)
    else:
        y, final = context.kernel_state_passing(config, *sequence_axis, *arrays,
                                                context.shard_edges(seq_idx, b))
    if cu_seqlens is None:
        return y[:, :t, :, :p], final[:, :, :p, :n]
    varlen = _sequence_states(config, x, dt, dt_bias, A, B, C, h0, seq, cu_seqlens)
    return y[:, :t, :, :p], final[:, :, :p, :n], varlen[:, :, :p, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ssd(config, x, dt, dt_bias, A, B, C, D, z, h0, seq):
    """(y, final) of padded inputs; dt (b, Tp, H) raw. See `forward.forward`."""
    return _forward(config, False, x, dt, dt_bias, A, B, C, D, z, h0, seq)[0]


def _ssd_fwd(config, x, dt, dt_bias, A, B, C, D, z, h0, seq):
    return _forward(config, True, x, dt, dt_bias, A, B, C, D, z, h0, seq)


# Second order (`_derivatives`): the forward rule and the backward keep their kernel values and
# take the tangents of the reference (`_reference_ssd`). Residuals that the kernels compute from
# the inputs (dt', s, y_pre, the saved entries) get zero tangents, and zero partials in the
# backward's rule: the reference recomputes them from the inputs, so every total derivative is
# still exact. The forward's rule is written out here, for those residuals.


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _forward(config, save_entries, x, dt, dt_bias, A, B, C, D, z, h0, seq):
    """((y, final), residuals) from the kernels; the forward saves the states its programs
    start from for the backward only when it is differentiated (`save_entries`)."""
    static, blocks = config.static, config.blocks
    dt_step, s = preprocess.preprocess(dt, dt_bias, A, seq, static=static,
                                       block_t=blocks.block_t)
    y, y_pre, final, entries = forward.forward(x, dt_step, s, B, C, seq, D, z, h0,
                                               static=static, blocks=blocks, plan=config.plan,
                                               save_entries=save_entries)
    return (y, final), (x, dt, dt_bias, dt_step, s, A, B, C, D, z, h0, seq, y_pre, entries)


@_forward.defjvp
def _forward_jvp(config, save_entries, primals, tangents):
    outputs, residuals = _forward(config, save_entries, *primals)
    _, output_tangents = jax.jvp(functools.partial(_reference_ssd, config), primals, tangents)
    dx, ddt, ddt_bias, dA, dB, dC, dD, dz, dh0, dseq = tangents
    _, _, _, dt_step, s, *_, y_pre, entries = residuals
    computed = [None if v is None else jnp.zeros_like(v) for v in (dt_step, s, y_pre, entries)]
    residual_tangents = (dx, ddt, ddt_bias, computed[0], computed[1], dA, dB, dC, dD, dz, dh0,
                         dseq, computed[2], computed[3])
    return (outputs, residuals), (output_tangents, residual_tangents)


def _reference_ssd(config, x, dt, dt_bias, A, B, C, D, z, h0, seq):
    """What `_ssd` computes, by the chunked reference on the real tokens of the padded
    arguments (padding tokens give zero outputs)."""
    static = config.static
    t = static.seq_len
    y, final = reference.mamba_chunk_scan_combined(
        x[:, :t], dt[:, :t], A, B[:, :t], C[:, :t], config.blocks.block_t, D=D,
        z=None if z is None else z[:, :t], dt_bias=dt_bias, initial_states=h0,
        seq_idx=None if seq is None else seq[:, :t], dt_softplus=static.dt_softplus,
        dt_limit=static.dt_limit, return_final_states=True,
    )
    return _device.pad_end(y, x.shape), final.astype(jnp.float32)


def _ssd_bwd(config, residuals, cotangents):
    primals = residuals[:3] + residuals[5:12]  # x, dt, dt_bias, A, B, C, D, z, h0, seq
    return tuple(map(_sharding.cotangent_like, _kernel_gradients(config, residuals, cotangents),
                     primals))


def _backward_kernels(config, residuals, cotangents):
    """The gradients of `_ssd`'s array arguments, from the backward kernels."""
    return (*backward.gradients(residuals, *cotangents, static=config.static,
                                blocks=config.blocks, plan=config.plan), None)


def _reference_gradients(config, residuals, cotangents):
    """`_backward_kernels` by differentiating `_reference_ssd`."""
    x, dt, dt_bias, _, _, A, B, C, D, z, h0, seq, _, _ = residuals
    _, vjp = jax.vjp(functools.partial(_reference_ssd, config, seq=seq),
                     x, dt, dt_bias, A, B, C, D, z, h0)
    return (*vjp(cotangents), None)


_kernel_gradients = _derivatives.reference_tangents(_backward_kernels, _reference_gradients)


_ssd.defvjp(_ssd_fwd, _ssd_bwd)


# ---------------------------------------------------------------------------------------------
# Packed prefill: the sequences' final states.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sequence_states(config, x, dt, dt_bias, A, B, C, h0, seq, cu_seqlens):
    """The state after each sequence's last token, (S, H, Pp, Np) float32, of the padded inputs
    of `_ssd` (batch 1) and cu_seqlens (S + 1,).

    Sequence i ends at row l of chunk c (chunks of Q = block_t tokens). The scan kernel emits
    the state entering every chunk, H_c (in x's dtype, as for the backward); in jnp, with s the
    preprocessing's in-chunk log2 cumsum (restarting where a sequence starts):

      V_i = sum_{j <= l in i} exp2(s_l - s_j) dt'_j outer(x_j, B_j) + [i live at c's start]
            exp2(s_l) H_c,

    a sequence being live at a chunk's start if it started before it, or holds token 0 (H_0 =
    h0). Every mask selects, so no other sequence's values reach a product.
    """
    static, blocks, q = config.static, config.blocks, config.blocks.block_t
    dt_step, s = preprocess.preprocess(dt, dt_bias, A, seq, static=static, block_t=q)
    entering, _ = forward.forward(x, dt_step, s, B, C, seq, None, None, h0, static=static,
                                  blocks=blocks, plan=config.plan, emit="states")
    heads, groups = x.shape[2], B.shape[2]
    start, end = cu_seqlens[:-1], cu_seqlens[1:]
    last = end - 1
    chunk = jnp.clip(last // q, 0, entering.shape[1] - 1)  # (S,): the chunk of the last token
    tokens = chunk[:, None] * q + jnp.arange(q)  # (S, Q)
    mine = (tokens >= start[:, None]) & (tokens <= last[:, None])
    s_last = s[0][:, jnp.clip(last, 0)].T  # (S, H)
    s_tok, dt_tok = (jnp.moveaxis(v[0][:, tokens], 0, -1) for v in (s, dt_step))  # (S, Q, H)
    weight = jnp.where(mine[..., None],
                       jnp.exp2(jnp.minimum(s_last[:, None] - s_tok, 0.0)) * dt_tok, 0.0)
    x_mine = jnp.where(mine[..., None, None], x[0][tokens], 0).astype(jnp.float32)
    B_mine = jnp.where(mine[..., None, None], B[0][tokens], 0).astype(jnp.float32)
    num = weight.shape[0]
    states = jnp.einsum(
        "sqgr,sqgrp,sqgn->sgrpn", weight.reshape(num, q, groups, heads // groups),
        x_mine.reshape(num, q, groups, heads // groups, -1), B_mine,
        precision=jax.lax.Precision.HIGHEST).reshape(num, heads, *entering.shape[-2:])
    live = ((end > start) & ((start < chunk * q) | (start == 0)))[:, None, None, None]
    carried = jnp.exp2(jnp.minimum(s_last, 0.0))[..., None, None] * entering[0, chunk]
    return states + jnp.where(live, carried, 0.0)


def _sequence_states_fwd(config, *args):
    return _sequence_states(config, *args), args


def _sequence_states_bwd(config, args, cotangent):
    *arrays, seq, cu_seqlens = args  # x, dt, dt_bias, A, B, C, h0
    _, vjp = jax.vjp(functools.partial(_reference_sequence_states, config, seq=seq,
                                       cu_seqlens=cu_seqlens), *arrays)
    return (*map(_sharding.cotangent_like, vjp(cotangent), arrays), None, None)


def _reference_sequence_states(config, x, dt, dt_bias, A, B, C, h0, *, seq, cu_seqlens):
    """What `_sequence_states` computes, by the chunked reference on the real tokens."""
    static = config.static
    t = static.seq_len
    *_, states = reference.mamba_chunk_scan_combined(
        x[:, :t], dt[:, :t], A, B[:, :t], C[:, :t], config.blocks.block_t, dt_bias=dt_bias,
        initial_states=h0, seq_idx=seq[:, :t], dt_softplus=static.dt_softplus,
        dt_limit=static.dt_limit, cu_seqlens=cu_seqlens, return_varlen_states=True,
    )
    return states.astype(jnp.float32)


_sequence_states.defvjp(_sequence_states_fwd, _sequence_states_bwd)
