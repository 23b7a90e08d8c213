"""Decoding over a KV cache: `api.attention_with_kv_cache` (split-K) and `api.update_kv_cache`,
their reference and kernel."""
