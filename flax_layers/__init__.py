"""Flax NNX layers on the pallas_kernels kernels."""

from flax_layers.attention import FlashMultiHeadAttention, flash_attention_fn

__all__ = ["FlashMultiHeadAttention", "flash_attention_fn"]
