"""Argument checks shared by the Flax layers: each raises a TypeError (wrong kind) or a
ValueError (wrong value) naming the argument, before any array is built."""

import numbers

import jax.numpy as jnp
import numpy as np

from pallas_kernels import IMPLEMENTATIONS


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


def check_implementation(implementation):
    """`implementation` must be one of the kernels' implementations or None."""
    if implementation not in (None, *IMPLEMENTATIONS):
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
