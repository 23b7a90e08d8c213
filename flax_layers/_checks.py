"""Argument checks shared by the Flax layers: each raises a TypeError (wrong kind) or a
ValueError (wrong value) naming the argument, before any array is built."""

import math
import numbers
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import IMPLEMENTATIONS
from pallas_kernels.arguments import known_value


def check_sizes(**sizes):
    """Each size must be an integer >= 1."""
    for name, size in sizes.items():
        if not isinstance(size, numbers.Integral) or isinstance(size, bool | np.bool_):
            raise TypeError(f"{name} must be an int, got {size!r}")
        if size < 1:
            raise ValueError(f"{name} must be a positive int, got {size}")


def check_flags(**flags):
    """Each flag must be a Python or numpy bool."""
    for name, flag in flags.items():
        if not isinstance(flag, bool | np.bool_):
            raise TypeError(f"{name} must be a bool, got {flag!r}")


def check_dtypes(**dtypes):
    """Each dtype must be None or a floating dtype (jnp.bfloat16, "float32", ...)."""
    for name, dtype in dtypes.items():
        try:
            floating = dtype is None or jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
        except TypeError:
            floating = False
        if not floating:
            raise TypeError(f"{name} must be a floating dtype or None, got {dtype!r}")


def check_state_dtype(name, dtype):
    """A recurrent state's dtype: float32, bfloat16, float16 or float64 (the update's math runs
    in float32 or float64 whatever it is; the state is rounded to it after each step)."""
    try:
        valid = dtype is not None and jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16,
                                                           jnp.float16, jnp.float64)
    except TypeError:
        valid = False
    if not valid:
        raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {dtype!r}")
    return jnp.dtype(dtype)


def check_implementation(implementation, *, name="implementation", attention=False):
    """`implementation` must be one of the kernels' implementations or None (for attention
    also "cudnn", jax.nn's cuDNN attention)."""
    allowed = (*IMPLEMENTATIONS, "cudnn") if attention else IMPLEMENTATIONS
    if implementation not in (None, *allowed):
        raise ValueError(f"{name} must be one of {allowed} or None, got {implementation!r}")


def check_positive_numbers(**numbers_or_none):
    """Each must be None or a finite real number > 0."""
    for name, value in numbers_or_none.items():
        if value is None:
            continue
        if not isinstance(value, numbers.Real) or isinstance(value, bool | np.bool_):
            raise TypeError(f"{name} must be a number or None, got {value!r}")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0 or None, got {value}")


def check_callables(**functions):
    """Each must be None or callable (an initializer)."""
    for name, function in functions.items():
        if function is not None and not callable(function):
            raise TypeError(f"{name} must be callable (an initializer), got {function!r}")


def check_mappings(**mappings):
    """Each must be a mapping (parameter metadata)."""
    for name, mapping in mappings.items():
        if not isinstance(mapping, Mapping):
            raise TypeError(f"{name} must be a mapping, got {mapping!r}")


def check_precision(precision):
    """`precision` must be what `jax.lax.dot_general` takes: None, a `jax.lax.Precision` or its
    name, a pair of them, or a dot algorithm (checked by tracing a dot with it)."""
    one = jax.ShapeDtypeStruct((1, 1), jnp.float32)
    try:
        jax.eval_shape(lambda a, b: jnp.matmul(a, b, precision=precision), one, one)
    except (TypeError, ValueError) as error:
        raise ValueError(f"precision must be None, a jax.lax.Precision (or its name), a pair "
                         f"of them or a dot algorithm, got {precision!r}") from error


def check_tokens(name, tokens, vocab_size):
    """tokens must be a (B, T) integer array with B, T >= 1 and, where their values are known
    (eagerly), ids in [0, vocab_size)."""
    if not (hasattr(tokens, "dtype") and jnp.issubdtype(tokens.dtype, jnp.integer)):
        raise TypeError(f"{name} must be an integer array, got "
                        f"{getattr(tokens, 'dtype', type(tokens).__name__)}")
    if tokens.ndim != 2 or 0 in tokens.shape:
        raise ValueError(f"{name} must be a (batch, length) array with at least one token per "
                         f"row, got shape {tokens.shape}")
    ids = known_value(tokens)
    if ids is not None:
        outside = ids[(ids < 0) | (ids >= vocab_size)]
        if outside.size:
            raise ValueError(f"{name} must lie in [0, {vocab_size}) (the vocabulary), got "
                             f"{outside[0]}")


def check_lengths(lengths, batch, t, *, name="lengths", minimum=0):
    """(B,) integers in [minimum, t] (values checked where known, eagerly) as int32."""
    if not (hasattr(lengths, "dtype") and jnp.issubdtype(lengths.dtype, jnp.integer)):
        raise TypeError(f"{name} must be an integer array, got "
                        f"{getattr(lengths, 'dtype', type(lengths).__name__)}")
    if lengths.shape != (batch,):
        raise ValueError(f"{name} must have shape ({batch},), got {lengths.shape}")
    known = known_value(lengths)
    if known is not None and ((known < minimum) | (known > t)).any():
        raise ValueError(f"{name} must lie in [{minimum}, {t}], got {known.tolist()}")
    return jnp.asarray(lengths, jnp.int32)
