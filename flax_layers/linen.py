"""Linen versions of the layers, through `flax.nnx.bridge.to_linen`.

Each function takes the NNX class's arguments (without `rngs`) and returns a Linen module for
`init`/`apply`; decode caches live in the "cache" collection (`mutable=["cache"]`).
"""

from typing import Any

from flax import linen
from flax.nnx import bridge

from flax_layers import attention, hybrid, mamba2


def FlashMultiHeadAttention(  # noqa: N802 (a module factory)
    *args: Any, **kwargs: Any
) -> linen.Module:
    return bridge.to_linen(attention.FlashMultiHeadAttention, *args, **kwargs)


def Mamba2(*args: Any, **kwargs: Any) -> linen.Module:  # noqa: N802
    return bridge.to_linen(mamba2.Mamba2, *args, **kwargs)


def HybridLM(config: hybrid.HybridLMConfig, **kwargs: Any) -> linen.Module:  # noqa: N802
    return bridge.to_linen(hybrid.HybridLM, config, **kwargs)
