"""Every call whose spelling differs between the jax versions we support (>=0.11.2, <0.13).

Pallas-Triton is deprecated upstream since jax 0.11 but is the only Pallas path on ROCm. Kernel
bodies use only idioms that are identical in 0.11.2 and 0.12 (ref indexing, `jnp.dot` with
`preferred_element_type`, `lax.fori_loop`); what is version-specific lives here.
"""

import warnings

import jax
import jaxlib
import numpy as np
from jax.experimental.pallas import triton as plt

TRITON_DEPRECATION = "The Pallas Triton backend is deprecated"


def silence_triton_deprecation():
    """Filters the Pallas-Triton DeprecationWarning, which fires each time a kernel is lowered.

    Lowering happens when the user's jit lowers, outside any context manager of ours, so the
    filter is process-wide; it matches only that message.
    """
    warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)


def jaxlib_at_least(major, minor):
    """Whether the installed jaxlib is `major.minor` or newer. jaxlib carries the Triton compiler
    that turns a kernel's IR into machine code, so a tile's speed can change with it (tuning
    tables key on this where a measurement showed it)."""
    return tuple(int(part) for part in jaxlib.__version__.split(".")[:2]) >= (major, minor)


def triton_params(num_warps, num_stages):
    """Compiler parameters that select the Triton lowering (Mosaic GPU is the default elsewhere)."""
    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def abstract_gpu_mesh(device_kind, platform, shape=(1,), names=("x",), axis_types=None):
    """An abstract mesh of GPUs that are not attached, for ahead-of-time lowering: one device
    by default, else `shape` with axis `names` (and `axis_types`, jax's default if None)."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform=platform)
    kw = {} if axis_types is None else dict(axis_types=tuple(axis_types))
    return jax.sharding.AbstractMesh(tuple(shape), tuple(names), abstract_device=device, **kw)


def abstract_device():
    """The abstract device of `jax.sharding.use_abstract_mesh` around the code traced now
    (ahead-of-time lowering for a GPU that is not attached), or None."""
    return getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)


def concrete_value(x):
    """x as a numpy array when its value is known now (not a tracer), else None.

    Argument checks that need values (signs, ranges) run where this is not None: eagerly, or on
    constants under jit.
    """
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None
