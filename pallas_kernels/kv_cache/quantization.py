"""How a KV cache stores its keys and values: float caches as they are, 8-bit caches with a
float32 scale per token and KV head (the dequantised value is stored * scale).

| cache dtype | holds | scales | largest stored value |
|---|---|---|---|
| bfloat16, float16, float32 | the values | none | - |
| int8 | round(value / scale) | required | 127 |
| float8_e4m3fn (NVIDIA) | value / scale | optional (1) | 448 |
| uint8 | the bits of AMD's float8_e4m3fnuz, value / scale | optional (1) | 240 |

Pallas-Triton cannot cast float8_e4m3fnuz, so such caches are kept as uint8 and the kernel
decodes the bits (`decode_e4m3fnuz`); a float8_e4m3fnuz array passed in is viewed as uint8.
"""

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Format:
    """A cache dtype's storage: `largest` stored magnitude (None for float caches) and whether
    scales are "forbidden", "required" or "optional"."""

    name: str
    largest: float | None
    scales: str

    @property
    def quantised(self):
        return self.largest is not None


FLOAT = Format("float", None, "forbidden")
INT8 = Format("int8", 127.0, "required")
E4M3FN = Format("float8_e4m3fn", 448.0, "optional")
E4M3FNUZ_BITS = Format("uint8 (float8_e4m3fnuz bits)", 240.0, "optional")

_FORMATS = {
    jnp.dtype(jnp.bfloat16): FLOAT, jnp.dtype(jnp.float16): FLOAT, jnp.dtype(jnp.float32): FLOAT,
    jnp.dtype(jnp.int8): INT8, jnp.dtype(jnp.float8_e4m3fn): E4M3FN,
    jnp.dtype(jnp.uint8): E4M3FNUZ_BITS, jnp.dtype(jnp.float8_e4m3fnuz): E4M3FNUZ_BITS,
}
DTYPES = ", ".join(str(d) for d in _FORMATS)


def format_of(name, dtype):
    """The Format of a cache dtype; a TypeError naming the argument for any other dtype."""
    fmt = _FORMATS.get(jnp.dtype(dtype))
    if fmt is None:
        raise TypeError(f"{name} must be one of {DTYPES}, got {jnp.dtype(dtype)}")
    return fmt


def as_stored(cache):
    """The cache as the kernels read it: a float8_e4m3fnuz cache viewed as its uint8 bits."""
    if cache.dtype == jnp.float8_e4m3fnuz:
        return jax.lax.bitcast_convert_type(cache, jnp.uint8)
    return cache


def decode_e4m3fnuz(bits):
    """float8_e4m3fnuz values (bias 8, no infinities, 0x80 NaN) from their uint8 bits, as
    float32, by integer arithmetic (works in a Triton kernel)."""
    b = bits.astype(jnp.int32)
    sign, exponent, mantissa = b >> 7, (b >> 3) & 15, b & 7
    normal = jax.lax.bitcast_convert_type(
        (sign << 31) | ((exponent + 119) << 23) | (mantissa << 20), jnp.float32)
    subnormal = jnp.where(sign == 1, -1.0, 1.0) * mantissa.astype(jnp.float32) * 2.0**-10
    value = jnp.where(exponent == 0, subnormal, normal)
    return jnp.where(b == 128, jnp.nan, value)


def decode(stored, fmt, dtype):
    """A block of stored cache entries as `dtype` (exact: every 8-bit value is a bf16 value)."""
    if fmt is E4M3FNUZ_BITS:
        return decode_e4m3fnuz(stored).astype(dtype)
    if fmt is E4M3FN:
        return stored.astype(jnp.float32).astype(dtype)
    return stored.astype(dtype)


def encode(values, dtype, scaled):
    """(stored entries, scales) of float `values` (..., H) for a cache of `dtype`: scales
    (...,) float32 = absmax / largest when `scaled` (else None, scale 1), the entries rounded
    (int8) or cast (float8) after division and clipped to the largest magnitude."""
    fmt = format_of("cache", dtype)
    values = values.astype(jnp.float32)
    if not fmt.quantised:
        return values.astype(dtype), None
    scales = None
    if scaled:
        scales = jnp.max(jnp.abs(values), axis=-1) / fmt.largest
        values = values / jnp.where(scales > 0, scales, 1.0)[..., None]
    values = jnp.clip(values, -fmt.largest, fmt.largest)
    if fmt is INT8:
        return jnp.round(values).astype(jnp.int8), scales
    if fmt is E4M3FN:
        return values.astype(jnp.float8_e4m3fn), scales
    return jax.lax.bitcast_convert_type(values.astype(jnp.float8_e4m3fnuz), jnp.uint8), scales
