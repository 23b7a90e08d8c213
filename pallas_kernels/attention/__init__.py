"""FlashAttention: `api.dot_product_attention`, its reference and kernels."""
