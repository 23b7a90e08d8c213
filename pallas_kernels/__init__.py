"""FlashAttention and Mamba2 (SSD) kernels in Pallas (Triton lowering) for JAX, NVIDIA and AMD."""

from pallas_kernels import _compat
from pallas_kernels.attention.api import dot_product_attention
from pallas_kernels.mamba2.api import mamba_chunk_scan_combined, selective_state_update

_compat.silence_triton_deprecation()

__all__ = [
    "dot_product_attention",
    "mamba_chunk_scan_combined",
    "selective_state_update",
]
__version__ = "0.1.0"
