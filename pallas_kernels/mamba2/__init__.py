"""Mamba2 SSD: mamba_chunk_scan_combined and selective_state_update, references and kernels."""
