"""Argument checks of `rms_norm_gated`: a TypeError or ValueError naming the argument, before
anything is traced."""

import numbers

import numpy as np

from pallas_kernels import _dispatch


def check_arrays(x, weight, z, z_column_offset=None):
    """x (..., D) with at least one leading axis, weight (D,), z of x's shape (or wider, its D
    channels from `z_column_offset`) or None; float dtypes."""
    _dispatch.check_floats({"x": x, "weight": weight, "z": z}, _dispatch.FLOATS,
                           "bfloat16, float16, float32 or float64")
    if x.ndim < 2:
        raise ValueError(f"x must be (..., D) with at least one leading axis, got {x.shape}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight must be (D,) = {x.shape[-1:]}, got {weight.shape}")
    if z_column_offset is not None:
        if (not isinstance(z_column_offset, numbers.Integral)
                or isinstance(z_column_offset, bool | np.bool_)):
            raise TypeError(f"z_column_offset must be an int or None, got {z_column_offset!r}")
        if z is None or z.shape[:-1] != x.shape[:-1] or not (
                0 <= z_column_offset <= z.shape[-1] - x.shape[-1]):
            raise ValueError(f"z_column_offset: z must hold x's {x.shape[-1]} channels from "
                             f"column {z_column_offset} with x's leading axes {x.shape[:-1]}, "
                             f"got z {None if z is None else z.shape}")
    elif z is not None and z.shape != x.shape:
        raise ValueError(f"z must have x's shape {x.shape}, got {z.shape}")


def check_group_size(group_size, channels):
    """The group size as an int: `channels` for None, else a positive integer (Python or
    numpy) dividing it."""
    if group_size is None:
        return channels
    if (not isinstance(group_size, numbers.Integral) or isinstance(group_size, bool | np.bool_)
            or group_size <= 0):
        raise TypeError(f"group_size must be a positive int or None, got {group_size!r}")
    group_size = int(group_size)
    if channels % group_size:
        raise ValueError(f"group_size ({group_size}) must divide x's last axis ({channels})")
    return group_size
