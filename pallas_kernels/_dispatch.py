"""Which implementation runs a call, and the argument checks every op shares.

Each check raises a TypeError (wrong kind) or ValueError (wrong value) naming the argument,
before anything is traced.
"""

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _device

IMPLEMENTATIONS = ("pallas", "xla")


def choose(implementation, interpret):
    """(implementation, interpret) of a call: "pallas" (the kernels) or "xla" (the pure-jnp
    reference), None meaning the kernels on a GPU and the reference elsewhere; `interpret`
    (run the kernels in interpret mode) None meaning when not on a GPU."""
    if implementation not in (None, *IMPLEMENTATIONS):
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}"
        )
    if interpret is not None:
        interpret = check_bool("interpret", interpret)
    on_gpu = _device.on_gpu()
    if implementation is None:
        implementation = "pallas" if on_gpu else "xla"
    return implementation, (not on_gpu) if interpret is None else interpret


def check_bool(name, value):
    """value as a Python bool; a TypeError unless it is a Python or numpy bool."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def check_positive(name, value, *, default):
    """A finite number > 0 (a Python number or a concrete one-element array) as a float (`default`
    for None); TypeError for a non-number, a bool or a traced value, ValueError for zero, a
    negative, NaN or an infinity."""
    if value is None:
        return default
    if hasattr(value, "shape") and hasattr(value, "dtype") and math.prod(value.shape) == 1:
        if not jnp.issubdtype(value.dtype, jnp.number) or jnp.issubdtype(value.dtype,
                                                                          jnp.complexfloating):
            raise TypeError(f"{name} must be a real number, got an array of {value.dtype}")
        try:
            value = value.item()
        except jax.errors.ConcretizationTypeError:
            raise TypeError(
                f"{name} must be known when the call is traced (a Python number or a concrete "
                f"array), got a traced value; pass it as a static argument") from None
    if not isinstance(value, numbers.Real) or isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a Python number, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_floats(arrays, dtypes, names):
    """Each array of `arrays` (name -> array or None) must be an array of one of `dtypes`,
    which the TypeError calls `names` ("bfloat16, float16 or float32")."""
    for name, value in arrays.items():
        if value is None:
            continue
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(value)}")
        if value.dtype not in dtypes:
            raise TypeError(f"{name} must be {names}, got {value.dtype}")


HALF_AND_SINGLE = (jnp.bfloat16, jnp.float16, jnp.float32)
FLOATS = (*HALF_AND_SINGLE, jnp.float64)
