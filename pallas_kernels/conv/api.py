"""`causal_conv1d`: causal depthwise convolution over tokens with an optional SiLU (the
`causal_conv1d_fn` of Dao-AILab's causal-conv1d, which Mamba2 runs over x, B and C), in jax's
(B, T, C) layout, differentiable, with Pallas kernels for both passes.

A call flows: argument checks (`checks`, before anything is traced) -> implementation choice
("xla" runs `reference.py`; so do sequence ids) -> a wider x's columns read in place by the
kernels (`column_offset` a multiple of their channel block) or sliced out, the output written
as two arrays (`split`) or sliced -> on a mesh, the kernels per shard of the batch
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
from pallas_kernels.conv import update as update_kernel


def causal_conv1d(
    x: ArrayLike,
    weight: ArrayLike,
    bias: ArrayLike | None = None,
    *,
    initial_states: ArrayLike | None = None,
    seq_idx: ArrayLike | None = None,
    initial_seq_idx: ArrayLike | None = None,
    activation: str | None = "silu",
    column_offset: int | None = None,
    split: int | None = None,
    sharding=None,
    implementation: str | None = None,
    interpret: bool | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
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
      column_offset: None, or x is (B, T, C_x) wider than the conv and its C channels start at
        this column (a packed projection such as Mamba2's in_proj output): the kernels read
        them in place, where the offset is a multiple of their channel block (128), else x's
        columns are sliced out first. x's gradient is zero outside them.
      split: None, or an int in (0, C): the output as two arrays, channels [0, split) and
        [split, C) (Mamba2's x and its B, C), each written by the kernels where split is a
        multiple of their channel block, else sliced from one.
      sharding: a NamedSharding or PartitionSpec of x (as for `mamba_chunk_scan_combined`);
        None reads x's own on meshes with Explicit axes. The kernels run per shard of the
        batch; a sharded sequence is a ValueError (each shard would need the tokens before it:
        `flax_layers` passes them as initial states), as is a sharded C.
      implementation: "pallas" (the kernels), "xla" (the reference) or None (the kernels on a
        GPU, the reference elsewhere).
      interpret: run the kernels in interpret mode; None: when not on a GPU.

    Returns:
      (B, T, C) in x's dtype, or its two parts with `split`; the sum and the SiLU in float32.
      Gradients flow to x, weight, bias and initial_states.
    """
    checks.check_arrays(x, weight, bias, initial_states, seq_idx, initial_seq_idx,
                        column_offset)
    width, c = weight.shape
    split = checks.check_split(split, c)
    activation = checks.check_activation(activation)
    implementation, interpret = _dispatch.choose(implementation, interpret)
    b, t = x.shape[:2]
    given_states = initial_states is not None
    # The initial states are rounded to x's dtype on both paths (a float32 decode cache).
    initial_states = (initial_states.astype(x.dtype) if given_states
                      else jnp.zeros((b, width - 1, c), x.dtype))
    if seq_idx is not None and initial_seq_idx is None:
        initial_seq_idx = jnp.broadcast_to(seq_idx[:, :1], (b, width - 1))
    if implementation == "xla" or seq_idx is not None or x.dtype == jnp.float64:
        if column_offset is not None:
            x = x[..., column_offset:column_offset + c]
        out = reference.causal_conv1d(x, weight, bias, initial_states, seq_idx,
                                      initial_seq_idx, activation)
        return _parts(out, split)
    placement = _sharding.find("x", x, sharding, feature_dims=(2,))
    in_place = (placement is None and column_offset is not None
                and column_offset % CHANNEL_BLOCK == 0)
    if column_offset is not None and not in_place:
        x = x[..., column_offset:column_offset + c]
    static = kernel_static(
        width, c, silu=activation == "silu", initial_states=given_states, interpret=interpret,
        column_offset=column_offset if in_place else 0,
        split=split if placement is None and split is not None and split % CHANNEL_BLOCK == 0
        else None)
    if placement is None:
        out = _conv(static, x, weight, bias, initial_states)
        return out if static.split is not None else _parts(out, split)
    if placement.sequence is not None:
        raise ValueError(f"x: its sequence is sharded over mesh axis {placement.sequence!r}; "
                         "causal_conv1d needs whole sequences (pass each shard the tokens "
                         "before it as initial_states, per shard)")
    rows = PartitionSpec(placement.batch, None, None)
    out = _sharding.run(placement, functools.partial(_conv, static),
                        (x, weight, bias, initial_states),
                        (rows, PartitionSpec(None, None), PartitionSpec(None), rows), rows)
    return _parts(out, split)


def causal_conv1d_update(
    x: ArrayLike,
    conv_state: ArrayLike,
    weight: ArrayLike,
    bias: ArrayLike | None = None,
    *,
    activation: str | None = "silu",
    column_offset: int | None = None,
    implementation: str | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One new token per row through the causal conv (causal-conv1d's `causal_conv1d_update`),
    functional: `causal_conv1d(x[:, None], weight, bias, initial_states=conv_state)[:, 0]` and
    the conv state after the token.

    The Pallas kernel writes the new state over the state's buffer: under `jax.jit(...,
    donate_argnums=...)` with the state donated (a decode loop's carry), no copy of it is made.

    Args:
      x: (B, C), one token per row; or (B, C_x) with the C channels from `column_offset` (a
        packed projection such as Mamba2's in_proj output), read in place by the kernel where
        the offset is a multiple of its channel block (256), else sliced out first.
      conv_state: (B, W - 1, C), the W - 1 inputs before the token, oldest first (as
        `causal_conv1d`'s initial_states; causal-conv1d's own layout is (B, C, W)); any float
        dtype. Rounded to x's dtype for the sum, as `causal_conv1d` rounds initial states.
      weight: (W, C) with W >= 2, tap W - 1 the token itself; bias: (C,) or None.
      activation: "silu" or None.
      implementation, interpret: as for `causal_conv1d`. On a mesh the kernel runs per shard
        of the batch; a sharded C is a ValueError.

    Returns:
      (out (B, C) in x's dtype, the new state (B, W - 1, C) in conv_state's dtype: its last
      W - 2 rows, then the token). Gradients flow to x, conv_state, weight and bias.
    """
    checks.check_update(x, conv_state, weight, bias, column_offset)
    activation = checks.check_activation(activation)
    implementation, interpret = _dispatch.choose(implementation, interpret)
    width, c = weight.shape
    if implementation == "xla" or x.dtype == jnp.float64:
        if column_offset is not None:
            x = x[:, column_offset:column_offset + c]
        return reference.causal_conv1d_update(x, conv_state, weight, bias, activation)
    placement = _sharding.find("x", x[:, None], None, feature_dims=(2,))
    tiles = tuning.UPDATE
    in_place = (placement is None and column_offset is not None
                and column_offset % tiles.block_c == 0)
    if column_offset is not None and not in_place:
        x = x[:, column_offset:column_offset + c]
    static = update_kernel.Static(width=width, channels=c, silu=activation == "silu",
                                  column_offset=column_offset if in_place else 0, tiles=tiles,
                                  interpret=interpret)
    if placement is None:
        return _update(static, x, conv_state, weight, bias)
    rows, states = PartitionSpec(placement.batch, None), PartitionSpec(placement.batch, None,
                                                                       None)
    return _sharding.run(placement, functools.partial(_update, static),
                         (x, conv_state, weight, bias),
                         (rows, states, PartitionSpec(None, None), PartitionSpec(None)),
                         (rows, states))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _update(static, x, conv_state, weight, bias):
    return update_kernel.update(x, conv_state, weight, bias, static=static)


def _update_fwd(static, x, conv_state, weight, bias):
    return _update(static, x, conv_state, weight, bias), (x, conv_state, weight, bias)


def _update_bwd(static, residuals, cotangents):
    # One token is cheap: differentiate the reference (x's columns read in place: zeros
    # outside them).
    x, conv_state, weight, bias = residuals
    offset, c = static.column_offset, static.channels

    def step(x, conv_state, weight, bias):
        return reference.causal_conv1d_update(x[:, offset:offset + c], conv_state, weight, bias,
                                              "silu" if static.silu else None)

    grads = jax.vjp(step, x, conv_state, weight, bias)[1](cotangents)
    return tuple(map(_sharding.cotangent_like, grads, residuals))


_update.defvjp(_update_fwd, _update_bwd)


# A program's channel block must lie inside the columns read and inside one output part: an
# in-place column offset and a split are multiples of this (powers of two).
CHANNEL_BLOCK = max(tuning.FORWARD.block_c, tuning.BACKWARD.block_c)


def kernel_static(width, channels, *, silu, initial_states, interpret, column_offset=0,
                  split=None):
    """The kernels' `forward.Static` for a (W, C) weight."""
    return forward.Static(
        width=width, channels=channels, history_rows=_device.pow2_at_least(width - 1, minimum=1),
        silu=silu, initial_states=initial_states, forward_tiles=tuning.FORWARD,
        backward_tiles=tuning.BACKWARD, interpret=interpret, column_offset=column_offset,
        split=split)


def padded_history(initial_states, static):
    """(B, W - 1, C) -> (B, history_rows, C), zero rows first."""
    pad = static.history_rows - initial_states.shape[1]
    return jnp.pad(initial_states, ((0, 0), (pad, 0), (0, 0)))


def _parts(out, split):
    """out (B, T, C) whole (split None), or its channels [0, split) and [split, C)."""
    return out if split is None else (out[..., :split], out[..., split:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _conv(static, x, weight, bias, initial_states):
    return forward.convolve(x, weight, bias, padded_history(initial_states, static),
                            static=static)


def _conv_fwd(static, x, weight, bias, initial_states):
    return _conv(static, x, weight, bias, initial_states), (x, weight, bias, initial_states)


def _conv_bwd(static, residuals, dout):
    x, weight, bias, initial_states = residuals
    dx, dweight, dbias = backward.gradients(
        x, weight, bias, padded_history(initial_states, static), dout, static=static)
    # x wider than the conv (read in place): zeros outside its channels.
    offset = static.column_offset
    dx = jnp.pad(dx, ((0, 0), (0, 0), (offset, x.shape[2] - offset - static.channels)))
    # The initial states reach only the first W - 1 outputs: their gradient from the reference
    # (zeros the call made need none).
    reach = static.width - 1

    def head(states):
        return reference.causal_conv1d(x[:, :reach, offset:offset + static.channels], weight,
                                       bias, states, None, None,
                                       "silu" if static.silu else None)

    if static.initial_states:
        dout_head = (dout if static.split is None
                     else jnp.concatenate(dout, axis=2))[:, :reach]
        (dstates,) = jax.vjp(head, initial_states)[1](dout_head)
    else:
        dstates = jnp.zeros_like(initial_states)
    grads = (dx, dweight.astype(weight.dtype), None if dbias is None else
             dbias.astype(bias.dtype), dstates)
    return tuple(map(_sharding.cotangent_like, grads, residuals))


_conv.defvjp(_conv_fwd, _conv_bwd)
