"""Mamba2 mixer (mamba_ssm's `Mamba2` block) as a Flax NNX module, with decode caches."""

import math

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from flax_layers._sharding import logical, logical_param
from pallas_kernels.mamba2 import reference


def _torch_linear_init(fan_in):
    """PyTorch's default Linear/Conv init: uniform(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def _param(rngs, init, shape, dtype, names):
    return logical_param(init(rngs.params(), shape, dtype), *names)


class Mamba2(nnx.Module):
    """Mamba2 mixer: in_proj -> causal depthwise conv (SiLU) -> SSD -> gated RMSNorm -> out_proj.

    Same parameters, initialisation and meaning as mamba_ssm's `Mamba2` (without its optional
    gated-MLP part): in_proj output ordered [z, x, B, C, dt]; a width-`d_conv` causal conv over
    x, B and C; A = -exp(A_log); dt_bias at the inverse softplus of a log-uniform dt in
    [dt_min, dt_max] (floored at dt_init_floor); the SSD kernel with dt_softplus; a gated
    RMSNorm over groups of d_inner / ngroups channels (y * silu(z) then the norm, or the reverse
    with `norm_before_gate`); out_proj.

    `__call__(u (B, T, d_model), *, seq_idx=None, decode=False)` returns (B, T, d_model). With a
    cache (`init_cache`), a forward call leaves the conv and SSM states of its last tokens in it,
    and `decode=True` consumes one or more new tokens step by step from there.
    """

    def __init__(
        self,
        d_model,
        *,
        d_state=128,
        d_conv=4,
        expand=2,
        headdim=64,
        ngroups=1,
        chunk_size=256,
        A_init_range=(1, 16),
        dt_min=0.001,
        dt_max=0.1,
        dt_init_floor=1e-4,
        dt_limit=(0.0, float("inf")),
        D_has_hdim=False,
        rmsnorm=True,
        norm_before_gate=False,
        conv_bias=True,
        bias=False,
        dtype=None,
        param_dtype=jnp.float32,
        implementation=None,
        rngs,
    ):
        d_inner = expand * d_model
        if d_inner % headdim:
            raise ValueError(f"d_inner = expand * d_model ({d_inner}) must be divisible by "
                             f"headdim ({headdim})")
        nheads = d_inner // headdim
        if nheads % ngroups:
            raise ValueError(f"heads ({nheads}) must be divisible by ngroups ({ngroups})")
        if not 0 < dt_min <= dt_max:
            raise ValueError(f"need 0 < dt_min <= dt_max, got {dt_min}, {dt_max}")
        if A_init_range[0] <= 0 or A_init_range[0] > A_init_range[1]:
            raise ValueError(f"A_init_range must be 0 < low <= high, got {A_init_range}")
        self.d_model, self.d_inner, self.d_state, self.d_conv = d_model, d_inner, d_state, d_conv
        self.headdim, self.nheads, self.ngroups = headdim, nheads, ngroups
        self.chunk_size, self.dt_limit, self.rmsnorm = chunk_size, tuple(dt_limit), rmsnorm
        self.D_has_hdim = D_has_hdim
        self.norm_before_gate, self.dtype, self.implementation = (
            norm_before_gate, dtype, implementation)
        self.conv_dim = d_inner + 2 * ngroups * d_state
        d_in_proj = 2 * d_inner + 2 * ngroups * d_state + nheads

        self.in_proj = nnx.Linear(
            d_model, d_in_proj, use_bias=bias, dtype=dtype, param_dtype=param_dtype,
            kernel_init=_torch_linear_init(d_model), bias_init=_torch_linear_init(d_model),
            kernel_metadata=logical("embed", "inner"), bias_metadata=logical("inner"), rngs=rngs,
        )
        self.conv_weight = _param(rngs, _torch_linear_init(d_conv), (d_conv, self.conv_dim),
                                  param_dtype, ("conv_width", "inner"))
        self.conv_bias = (
            _param(rngs, _torch_linear_init(d_conv), (self.conv_dim,), param_dtype, ("inner",))
            if conv_bias else None
        )
        key_dt, key_a = jax.random.split(rngs.params())
        log_dt = jax.random.uniform(key_dt, (nheads,), jnp.float32, math.log(dt_min),
                                    math.log(dt_max))
        dt = jnp.maximum(jnp.exp(log_dt), dt_init_floor)
        self.dt_bias = logical_param(dt + jnp.log(-jnp.expm1(-dt)), "heads")
        a = jax.random.uniform(key_a, (nheads,), jnp.float32, *A_init_range)
        self.A_log = logical_param(jnp.log(a), "heads")
        self.D = logical_param(jnp.ones((d_inner,) if D_has_hdim else (nheads,), jnp.float32),
                               "inner" if D_has_hdim else "heads")
        self.norm_weight = (
            logical_param(jnp.ones((d_inner,), param_dtype), "inner") if rmsnorm else None
        )
        self.out_proj = nnx.Linear(
            d_inner, d_model, use_bias=bias, dtype=dtype, param_dtype=param_dtype,
            kernel_init=_torch_linear_init(d_inner), bias_init=_torch_linear_init(d_inner),
            kernel_metadata=logical("inner", "embed"), bias_metadata=logical("embed"), rngs=rngs,
        )
        self.conv_state = nnx.data(None)
        self.ssm_state = nnx.data(None)

    def init_cache(self, batch_size, dtype=jnp.float32):
        """Zero conv state (B, d_conv - 1, conv_dim) and SSM state (B, H, P, N) float32."""
        self.conv_state = nnx.Cache(jnp.zeros((batch_size, self.d_conv - 1, self.conv_dim),
                                              dtype))
        self.ssm_state = nnx.Cache(jnp.zeros(
            (batch_size, self.nheads, self.headdim, self.d_state), jnp.float32))

    # -----------------------------------------------------------------------------------------

    def _split(self, zxbcdt):
        d, gn = self.d_inner, self.ngroups * self.d_state
        return zxbcdt[..., :d], zxbcdt[..., d:2 * d + 2 * gn], zxbcdt[..., 2 * d + 2 * gn:]

    def _conv(self, xbc, history, seq_idx=None):
        """Causal depthwise conv + SiLU over (B, T, C) with `history` (B, d_conv - 1, C)."""
        padded = jnp.concatenate([history.astype(xbc.dtype), xbc], axis=1)
        t = xbc.shape[1]
        weight = self.conv_weight[...].astype(jnp.float32)
        out = jnp.zeros(xbc.shape, jnp.float32)
        for k in range(self.d_conv):  # tap k looks d_conv - 1 - k tokens back
            tap = padded[:, k:k + t].astype(jnp.float32) * weight[k]
            lag = self.d_conv - 1 - k
            if seq_idx is not None and lag:
                same = seq_idx == jnp.pad(seq_idx, ((0, 0), (lag, 0)), mode="edge")[:, :t]
                tap = jnp.where(same[..., None], tap, 0.0)
            out += tap
        if self.conv_bias is not None:
            out += self.conv_bias[...].astype(jnp.float32)
        return jax.nn.silu(out).astype(xbc.dtype)

    def _heads(self, x, b, c):
        lead = x.shape[:-1]
        return (x.reshape(*lead, self.nheads, self.headdim),
                b.reshape(*lead, self.ngroups, self.d_state),
                c.reshape(*lead, self.ngroups, self.d_state))

    def _ssd_inputs(self, xbc):
        d, gn = self.d_inner, self.ngroups * self.d_state
        return self._heads(xbc[..., :d], xbc[..., d:d + gn], xbc[..., d + gn:])

    def _d(self):
        """D as the SSD takes it: (H,) or, with D_has_hdim, (H, P)."""
        d = self.D[...]
        return d.reshape(self.nheads, self.headdim) if self.D_has_hdim else d

    def _norm_and_project(self, y, z):
        """Gated grouped RMSNorm (without rmsnorm the SSD already applied the gate), out_proj.

        y, z (..., d_inner).
        """
        y = y.astype(jnp.float32)
        gate = jax.nn.silu(z.astype(jnp.float32))
        if self.rmsnorm:
            if not self.norm_before_gate:
                y = y * gate
            groups = y.reshape(*y.shape[:-1], self.ngroups, -1)
            groups = groups * jax.lax.rsqrt(jnp.mean(groups**2, axis=-1, keepdims=True) + 1e-5)
            y = groups.reshape(y.shape) * self.norm_weight[...].astype(jnp.float32)
            if self.norm_before_gate:
                y = y * gate
        dtype = self.dtype or self.out_proj.kernel[...].dtype
        return self.out_proj(y.astype(dtype))

    def __call__(self, u, *, seq_idx=None, decode=False):
        zxbcdt = self.in_proj(u)
        z, xbc, dt = self._split(zxbcdt)
        if decode:
            return self._decode(z, xbc, dt)
        batch, t = u.shape[:2]
        history = jnp.zeros((batch, self.d_conv - 1, self.conv_dim), xbc.dtype)
        x, b, c = self._ssd_inputs(self._conv(xbc, history, seq_idx))
        A = -jnp.exp(self.A_log[...])
        y, final = pallas_kernels.mamba_chunk_scan_combined(
            x, dt, A, b, c, self.chunk_size, D=self._d(),
            z=None if self.rmsnorm else z.reshape(x.shape), dt_bias=self.dt_bias[...],
            seq_idx=seq_idx, dt_softplus=True, dt_limit=self.dt_limit,
            return_final_states=True, implementation=self.implementation,
        )
        if self.ssm_state is not None:  # leave the states where decoding continues
            padded = jnp.concatenate([history, xbc], axis=1)
            tail = padded[:, padded.shape[1] - (self.d_conv - 1):]  # empty when d_conv == 1
            self.conv_state[...] = tail.astype(self.conv_state.dtype)
            self.ssm_state[...] = final
        return self._norm_and_project(y.reshape(batch, t, self.d_inner), z)

    def _decode(self, z, xbc, dt):
        """Steps the new tokens through the conv state and `selective_state_update`."""
        if self.ssm_state is None:
            raise ValueError("decode=True needs init_cache(batch_size) first")
        A = -jnp.exp(self.A_log[...])
        dt = reference.preprocess_dt(dt, self.dt_bias[...], True, self.dt_limit)

        def step(carry, inputs):
            conv_state, ssm_state = carry
            xbc_t, dt_t, z_t = inputs  # (B, C), (B, H), (B, d_inner)
            window = jnp.concatenate([conv_state, xbc_t[:, None].astype(conv_state.dtype)], 1)
            conv_out = self._conv(xbc_t[:, None], conv_state)[:, 0]
            x, b, c = self._ssd_inputs(conv_out)
            y, ssm_state = pallas_kernels.selective_state_update(
                ssm_state, x, dt_t, A, b, c, D=self._d(),
                z=None if self.rmsnorm else z_t.reshape(x.shape),
                implementation=self.implementation,
            )
            return (window[:, 1:], ssm_state), y.reshape(y.shape[0], self.d_inner)

        (conv_state, ssm_state), ys = jax.lax.scan(
            step, (self.conv_state[...], self.ssm_state[...]),
            (jnp.swapaxes(xbc, 0, 1), jnp.swapaxes(dt, 0, 1), jnp.swapaxes(z, 0, 1)),
        )
        self.conv_state[...] = conv_state
        self.ssm_state[...] = ssm_state
        return self._norm_and_project(jnp.swapaxes(ys, 0, 1), z)
