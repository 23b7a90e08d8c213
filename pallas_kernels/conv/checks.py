"""Argument checks of `causal_conv1d`: a TypeError or ValueError naming the argument, before
anything is traced."""

import numbers

import jax.numpy as jnp

from pallas_kernels import _dispatch

ACTIVATIONS = ("silu", None)


def check_arrays(x, weight, bias, initial_states, seq_idx, initial_seq_idx, column_offset=None):
    """x (B, T, C), or (B, T, C_x) with the C channels from `column_offset`; weight (W, C);
    bias (C,); initial_states (B, W - 1, C); seq_idx (B, T) and initial_seq_idx (B, W - 1)
    integers (initial_seq_idx only with seq_idx)."""
    _dispatch.check_floats({"x": x, "weight": weight, "bias": bias,
                            "initial_states": initial_states}, _dispatch.FLOATS,
                           "bfloat16, float16, float32 or float64")
    if x.ndim != 3:
        raise ValueError(f"x must be (B, T, C), got {x.shape}")
    b, t, c = x.shape
    if weight.ndim != 2 or weight.shape[0] < 1:
        raise ValueError(f"weight must be (W, C), got {weight.shape}")
    if column_offset is None:
        if weight.shape[1] != c:
            raise ValueError(f"weight must be (W, C) with C = {c}, got {weight.shape}")
    else:
        if not isinstance(column_offset, numbers.Integral) or isinstance(column_offset, bool):
            raise TypeError(f"column_offset must be an int or None, got {column_offset!r}")
        if not 0 <= column_offset <= c - weight.shape[1]:
            raise ValueError(f"column_offset must leave weight's C = {weight.shape[1]} channels "
                             f"inside x's {c}, got {column_offset}")
        c = weight.shape[1]
    width = weight.shape[0]
    if bias is not None and bias.shape != (c,):
        raise ValueError(f"bias must be (C,) = ({c},), got {bias.shape}")
    if initial_states is not None and initial_states.shape != (b, width - 1, c):
        raise ValueError(f"initial_states must be (B, W - 1, C) = {(b, width - 1, c)}, got "
                         f"{initial_states.shape}")
    for name, ids, shape in (("seq_idx", seq_idx, (b, t)),
                             ("initial_seq_idx", initial_seq_idx, (b, width - 1))):
        if ids is None:
            continue
        if not hasattr(ids, "dtype") or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got {getattr(ids, 'dtype', ids)}")
        if ids.shape != shape:
            raise ValueError(f"{name} must be {shape}, got {ids.shape}")
    if initial_seq_idx is not None and seq_idx is None:
        raise ValueError("initial_seq_idx needs seq_idx")


def check_update(x, conv_state, weight, bias, column_offset):
    """`causal_conv1d_update`'s arrays: x (B, C), or (B, C_x) with the C channels from
    `column_offset`; conv_state (B, W - 1, C) with W >= 2; weight (W, C); bias (C,)."""
    _dispatch.check_floats({"x": x, "conv_state": conv_state}, _dispatch.FLOATS,
                           "bfloat16, float16, float32 or float64")
    if conv_state is None:
        raise TypeError("conv_state must be an array (B, W - 1, C), got None")
    if x.ndim != 2:
        raise ValueError(f"x must be (B, C) (one token per row), got {x.shape}")
    check_arrays(x[:, None], weight, bias, None, None, None, column_offset)
    width, c = weight.shape
    if width < 2:
        raise ValueError(f"weight must be (W, C) with W >= 2 (a conv state of W - 1 >= 1 rows), "
                         f"got {weight.shape}")
    if conv_state.shape != (x.shape[0], width - 1, c):
        raise ValueError(f"conv_state must be (B, W - 1, C) = {(x.shape[0], width - 1, c)}, "
                         f"got {conv_state.shape}")


def check_split(split, channels):
    """None, or an int in (0, C): the output in two arrays, channels [0, split) and the rest."""
    if split is None:
        return None
    if not isinstance(split, numbers.Integral) or isinstance(split, bool):
        raise TypeError(f"split must be an int or None, got {split!r}")
    if not 0 < split < channels:
        raise ValueError(f"split must be in (0, C) = (0, {channels}), got {split}")
    return int(split)


def check_activation(activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return activation
