"""Causal depthwise 1-d convolution with an optional SiLU (Mamba2's conv over x, B and C):
`api.causal_conv1d`, its reference and its forward and backward kernels."""
