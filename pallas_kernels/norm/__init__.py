"""RMSNorm with an optional SiLU gate (Mamba2's gated norm): `api.rms_norm_gated`, its
reference and its forward and backward kernels."""
