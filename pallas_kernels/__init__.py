"""FlashAttention and Mamba2 (SSD) kernels in Pallas (Triton lowering) for JAX, NVIDIA and AMD."""

from pallas_kernels import _compat
from pallas_kernels._dispatch import IMPLEMENTATIONS
from pallas_kernels._sharding import unzigzag, zigzag
from pallas_kernels.attention.api import dot_product_attention
from pallas_kernels.attention.tuning import AttentionBlocks, KernelBlocks
from pallas_kernels.conv.api import causal_conv1d, causal_conv1d_update
from pallas_kernels.kv_cache.api import attention_with_kv_cache, update_kv_cache
from pallas_kernels.mamba2.api import mamba_chunk_scan_combined
from pallas_kernels.mamba2.decode import selective_state_update
from pallas_kernels.norm.api import rms_norm_gated

_compat.silence_triton_deprecation()

__all__ = [
    "IMPLEMENTATIONS",
    "AttentionBlocks",
    "KernelBlocks",
    "attention_with_kv_cache",
    "causal_conv1d",
    "causal_conv1d_update",
    "dot_product_attention",
    "mamba_chunk_scan_combined",
    "rms_norm_gated",
    "selective_state_update",
    "unzigzag",
    "update_kv_cache",
    "zigzag",
]
__version__ = "0.2.0"
