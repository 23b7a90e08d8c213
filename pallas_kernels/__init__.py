"""FlashAttention and Mamba2 (SSD) kernels in Pallas (Triton lowering) for JAX on NVIDIA and AMD."""

from pallas_kernels import _compat
from pallas_kernels.attention.api import dot_product_attention

_compat.silence_triton_deprecation()

__all__ = ["dot_product_attention"]
__version__ = "0.1.0"
