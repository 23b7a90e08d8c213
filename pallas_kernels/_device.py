"""What the package knows about GPUs: the device that code traced now will run on, its family
and multiprocessor count, peak FLOP/s, and the shape rules of Triton kernels (power-of-two
arrays, whole blocks, aligned block slices).

The tuning tables (`attention/tuning.py`, `mamba2/tuning.py`) have one row list per `family`.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat

# device_kind substrings (lower case) of each family, most specific first.
_FAMILIES = (
    ("hopper", ("h100", "h200", "h800", "h20", "gh200")),
    ("ampere", ("a100", "a800", "a10", "a40", "l4", "l40", "rtx")),
    ("cdna", ("gfx942", "gfx90a", "mi300", "mi325", "mi250")),  # 64 KiB LDS, wavefront 64
)

# Multiprocessors (AMD: compute units) of a family's usual part, where the device does not say
# (ahead-of-time lowering for an abstract device made without a core count).
_MULTIPROCESSORS = {"hopper": 132, "ampere": 108, "cdna": 304, "fallback": 100}

# Vendor peak dense bf16 tensor FLOP/s (no sparsity), matched as substrings of the device
# kind, most specific first.
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),  # also GH200
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("MI300X", 1307e12),
    ("MI325X", 1307e12),
    ("MI250X", 383e12),
)


def target():
    """(device_kind, platform) that code traced now will run on.

    Inside `jax.sharding.use_abstract_mesh` with an abstract device (ahead-of-time lowering for a
    GPU that is not attached) that device; otherwise the first device of the default backend.
    Examples: ("NVIDIA H200", "cuda"), ("gfx942", "rocm"), ("cpu", "cpu").
    """
    abstract = _compat.abstract_device()
    if abstract is not None:
        return abstract.device_kind, abstract.platform
    device = jax.devices()[0]
    return device.device_kind, device.platform


def on_gpu():
    """Whether code traced now will run on a GPU (see `target`)."""
    return target()[1] in ("gpu", "cuda", "rocm")


def family(device_kind):
    """"hopper", "ampere", "cdna" or "fallback" for a jax device kind ("NVIDIA H200", ...)."""
    kind = device_kind.lower()
    for name, parts in _FAMILIES:
        if any(part in kind for part in parts):
            return name
    return "fallback"


def multiprocessors(device_kind):
    """Streaming multiprocessors (AMD: compute units) of the target device: its own count where
    it has one, else its family's usual count."""
    abstract = _compat.abstract_device()
    known = abstract.num_cores if abstract is not None else getattr(
        jax.devices()[0], "core_count", None)
    return known or _MULTIPROCESSORS[family(device_kind)]


def peak_flops(device_kind):
    """Peak dense bf16 FLOP/s of a known accelerator (`PEAK_BF16_FLOPS`), else None."""
    for name, flops in PEAK_BF16_FLOPS:
        if name.lower() in device_kind.lower():
            return flops
    return None


def pow2_at_least(n, minimum=16):
    """The smallest power of two >= n and >= minimum (Triton needs power-of-two arrays; its
    dot needs 16)."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def cdiv(n, d):
    """ceil(n / d) for positive d: Python ints, numpy or jnp integer arrays."""
    return -(-n // d)


def pad_end(x, sizes, mode="constant"):
    """x padded at the end of each axis up to `sizes` (None keeps an axis); x itself when no
    axis grows. `mode` as in jnp.pad ("constant": zeros, "edge": the last entry repeated)."""
    widths = [(0, 0 if size is None else size - dim)
              for dim, size in zip(x.shape, sizes, strict=True)]
    return x if not any(w for _, w in widths) else jnp.pad(x, widths, mode=mode)


def block_slice(index, size):
    """In a kernel: the slice of block `index` of an axis cut into blocks of `size`."""
    return pl.ds(pl.multiple_of(index * size, size), size)
