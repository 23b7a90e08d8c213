"""Flax NNX layers on the pallas_kernels kernels."""

from flax_layers._sharding import LOGICAL_AXIS_RULES, gather_parameters, parameter_shardings
from flax_layers.attention import FlashMultiHeadAttention, flash_attention_fn
from flax_layers.hybrid import HybridLM, HybridLMConfig
from flax_layers.mamba2 import Mamba2
from flax_layers.mamba2_lm import Mamba2LM, Mamba2LMConfig
from flax_layers.zamba2 import Zamba2Config, Zamba2LM

__all__ = [
    "FlashMultiHeadAttention",
    "HybridLM",
    "HybridLMConfig",
    "LOGICAL_AXIS_RULES",
    "Mamba2",
    "Mamba2LM",
    "Mamba2LMConfig",
    "Zamba2Config",
    "Zamba2LM",
    "flash_attention_fn",
    "gather_parameters",
    "parameter_shardings",
]
