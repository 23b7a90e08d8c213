"""`causal_conv1d`: causal depthwise convolution over tokens with an optional SiLU (the
`causal_conv1d_fn` of Dao-AILab's causal-conv1d, which Mamba2 runs over x, B and C), in jax's
(B, T, C) layout, differentiable, with Pallas kernels for both passes.

A call flows: argument checks (`checks`, before anything is traced) -> implementation choice
("xla" runs `reference.py`; so do sequence ids) -> on a mesh, the kernels per shard of the batch
-> the initial states padded at the front to a power of two of rows (a (B, W - 1, C) array) ->
`forward.convolve` under a `jax.custom_vjp` whose backward is `backward.gradients`, and the
initial states' gradient from the reference over the first W - 1 tokens (the only ones they
reach). XLA would otherwise keep a float32 copy of the pre-activation's gradient and read it
again in separate reductions for each tap's weight gradient.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jax.typing import ArrayLike

from pallas_kernels import _device, _dispatch, _sharding
from pallas_kernels.conv import backward, checks, forward, reference, tuning


def causal_conv1d(
    x: ArrayLike,
    weight: ArrayLike,
    bias: ArrayLike | None = None,
    *,
    initial_states: ArrayLike | None = None,
    seq_idx: ArrayLike | None = None,
    initial_seq_idx: ArrayLike | None = None,
    activation: str | None = "silu",
    sharding=None,
    implementation: str | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """out[b, t, c] = activation(bias[c] + sum over k of weight[k, c] * x[b, t - (W - 1 - k), c]).

    Args:
      x: (B, T, C), bfloat16, float16, float32 or float64.
      weight: (W, C): tap k looks W - 1 - k tokens back (tap W - 1 is the token itself).
      bias: (C,) or None.
      initial_states: (B, W - 1, C), the W - 1 tokens before the first (a decode cache's conv
        state); None: zeros.
      seq_idx: (B, T) integers, packed sequences: a tap whose token belongs to another
        sequence contributes nothing. Runs the reference.
      initial_seq_idx: (B, W - 1) the initial states' sequence ids; None: the first token's.
      activation: "silu" or None.
      sharding: a NamedSharding or PartitionSpec of x (as for `mamba_chunk_scan_combined`);
        None reads x's own on meshes with Explicit axes. The kernels run per shard of the
        batch; a sharded sequence is a ValueError (each shard would need the tokens before it:
        `flax_layers` passes them as initial states), as is a sharded C.
      implementation: "pallas" (the kernels), "xla" (the reference) or None (the kernels on a
        GPU, the reference elsewhere).
      interpret: run the kernels in interpret mode; None: when not on a GPU.

    Returns:
      (B, T, C) in x's dtype; the sum and the SiLU in float32. Gradients flow to x, weight,
      bias and initial_states.
    """
    checks.check_arrays(x, weight, bias, initial_states, seq_idx, initial_seq_idx)
    activation = checks.check_activation(activation)
    implementation, interpret = _dispatch.choose(implementation, interpret)
    b, t, c = x.shape
    width = weight.shape[0]
    given_states = initial_states is not None
    # The initial states are rounded to x's dtype on both paths (a float32 decode cache).
    initial_states = (initial_states.astype(x.dtype) if given_states
                      else jnp.zeros((b, width - 1, c), x.dtype))
    if seq_idx is not None and initial_seq_idx is None:
        initial_seq_idx = jnp.broadcast_to(seq_idx[:, :1], (b, width - 1))
    if implementation == "xla" or seq_idx is not None or x.dtype == jnp.float64:
        return reference.causal_conv1d(x, weight, bias, initial_states, seq_idx,
                                       initial_seq_idx, activation)
    static = forward.Static(
        width=width, channels=c, history_rows=_device.pow2_at_least(width - 1, minimum=1),
        silu=activation == "silu", initial_states=given_states,
        forward_tiles=tuning.FORWARD, backward_tiles=tuning.BACKWARD, interpret=interpret)
    placement = _sharding.find("x", x, sharding, feature_dims=(2,))
    if placement is None:
        return _conv(static, x, weight, bias, initial_states)
    if placement.sequence is not None:
        raise ValueError(f"x: its sequence is sharded over mesh axis {placement.sequence!r}; "
                         "causal_conv1d needs whole sequences (pass each shard the tokens "
                         "before it as initial_states, per shard)")
    rows = PartitionSpec(placement.batch, None, None)
    return _sharding.run(placement, functools.partial(_conv, static),
                         (x, weight, bias, initial_states),
                         (rows, PartitionSpec(None, None), PartitionSpec(None), rows), rows)


def _padded_history(initial_states, static):
    """(B, W - 1, C) -> (B, history_rows, C), zero rows first."""
    pad = static.history_rows - initial_states.shape[1]
    return jnp.pad(initial_states, ((0, 0), (pad, 0), (0, 0)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _conv(static, x, weight, bias, initial_states):
    return forward.convolve(x, weight, bias, _padded_history(initial_states, static),
                            static=static)


def _conv_fwd(static, x, weight, bias, initial_states):
    return _conv(static, x, weight, bias, initial_states), (x, weight, bias, initial_states)


def _conv_bwd(static, residuals, dout):
    x, weight, bias, initial_states = residuals
    dx, dweight, dbias = backward.gradients(
        x, weight, bias, _padded_history(initial_states, static), dout, static=static)
    # The initial states reach only the first W - 1 outputs: their gradient from the reference
    # (zeros the call made need none).
    reach = static.width - 1

    def head(states):
        return reference.causal_conv1d(x[:, :reach], weight, bias, states, None, None,
                                       "silu" if static.silu else None)

    if static.initial_states:
        (dstates,) = jax.vjp(head, initial_states)[1](dout[:, :reach])
    else:
        dstates = jnp.zeros_like(initial_states)
    grads = (dx, dweight.astype(weight.dtype), None if dbias is None else
             dbias.astype(bias.dtype), dstates)
    return tuple(map(_sharding.cotangent_like, grads, residuals))


_conv.defvjp(_conv_fwd, _conv_bwd)
