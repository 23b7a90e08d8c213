"""The pure-jnp causal depthwise convolution, written independently of the kernels: what
`causal_conv1d` computes, in float32 (float64 for float64 inputs), differentiated by JAX."""

import jax
import jax.numpy as jnp


def causal_conv1d(x, weight, bias, initial_states, seq_idx, initial_seq_idx, activation):
    """x (B, T, C); weight (W, C), tap k looking W - 1 - k tokens back; bias (C,) or None;
    initial_states (B, W - 1, C), the tokens before the first; seq_idx (B, T) or None and
    initial_seq_idx (B, W - 1): a tap from another sequence contributes nothing. Returns x's
    dtype: activation(sum of the taps + bias), activation "silu" or None."""
    width, t = weight.shape[0], x.shape[1]
    compute = jnp.promote_types(x.dtype, jnp.float32)
    padded = jnp.concatenate([initial_states.astype(x.dtype), x], axis=1)
    ids = None if seq_idx is None else jnp.concatenate([initial_seq_idx, seq_idx], axis=1)
    weight = weight.astype(compute)
    out = jnp.zeros(x.shape, compute)
    for k in range(width):
        tap = padded[:, k:k + t].astype(compute) * weight[k]
        if ids is not None and k < width - 1:
            tap = jnp.where((seq_idx == ids[:, k:k + t])[..., None], tap, 0.0)
        out += tap
    if bias is not None:
        out += bias.astype(compute)
    if activation == "silu":
        out = jax.nn.silu(out)
    return out.astype(x.dtype)


def causal_conv1d_update(x, conv_state, weight, bias, activation):
    """One token x (B, C) after `conv_state` (B, W - 1, C): (`causal_conv1d`'s output for it
    (B, C), the new state: the last W - 1 inputs in the state's dtype, the token last)."""
    out = causal_conv1d(x[:, None], weight, bias, conv_state, None, None, activation)[:, 0]
    inputs = jnp.concatenate([conv_state, x[:, None].astype(conv_state.dtype)], axis=1)
    return out, inputs[:, 1:]
