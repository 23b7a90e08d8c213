"""Mamba2 mixer (mamba_ssm's `Mamba2` block) as a Flax NNX module, with decode caches."""

import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

import pallas_kernels
from flax_layers._checks import (
    check_dtypes,
    check_flags,
    check_implementation,
    check_sizes,
    check_state_dtype,
)
from flax_layers._sharding import (
    causal_halo,
    features_sharded,
    heads_sharded,
    logical,
    logical_param,
    token_features,
)
from pallas_kernels import _dispatch, arguments
from pallas_kernels.mamba2 import mixer, semantics


def _uniform(bound):
    """An initialiser uniform in [-bound, bound)."""

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def _torch_linear_init(fan_in):
    """PyTorch's default Linear/Conv init: uniform(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    return _uniform(1.0 / math.sqrt(fan_in))


def _param(rngs, init, shape, dtype, names):
    return logical_param(init(rngs.params(), shape, dtype), *names)


class Mamba2(nnx.Module):
    """Mamba2 mixer: in_proj -> causal depthwise conv (SiLU) -> SSD -> gated RMSNorm -> out_proj.

    Same parameters, initialisation and meaning as mamba_ssm's `Mamba2`: in_proj's output
    ordered [z0, x0, z, x, B, C, dt]; a width-`d_conv` causal conv over x, B and C (weights
    uniform in +-conv_init where given, else PyTorch's default); A = -exp(A_log); dt_bias at the
    inverse softplus of a log-uniform dt in [dt_min, dt_max] (floored at dt_init_floor); the SSD
    kernel with dt_softplus on x, of d_ssm channels (default d_inner = expand * d_model); a
    gated RMSNorm (epsilon `norm_eps`) over groups of d_ssm / ngroups channels (y * silu(z)
    then the norm, or the reverse with `norm_before_gate`); where d_ssm < d_inner, the other
    d_mlp = d_inner - d_ssm channels are a gated MLP, silu(z0) * x0, put before y; out_proj.
    `layer_idx` only names the layer (mamba_ssm keys its inference caches by it).

    Every argument is checked at construction (ValueError or TypeError naming it).

    `__call__(u (B, T, d_model), *, seq_idx=None, decode=None, lengths=None)` returns (B, T,
    d_model). A forward (`decode` False) never touches the caches. With `decode=True` (after
    `init_cache`) the tokens continue the cached conv and SSM states, which the call advances:
    one token through the conv and `selective_state_update` (with the kernels and the gated
    norm: `causal_conv1d_update` and the step's kernel, reading in_proj's output in place and
    updating both states over their buffers; elsewhere the conv as the jnp expression, one XLA
    fusion), several (a prefill) through the chunked scan from the cached states, which gives
    the same result. A whole sequence decoded from an
    empty cache gives the forward's outputs. `lengths` (B,) (decode only) says how many of each
    row's T tokens are real (a ragged prompt, padded at the end): the states advance over those
    only. `decode=None` takes the layer's `decode` (the constructor's, or `nnx.view`'s).
    """

    def __init__(
        self,
        d_model: int,
        *,
        d_state: int = 128,
        d_conv: int = 4,
        conv_init: float | None = None,
        expand: int = 2,
        headdim: int = 64,
        d_ssm: int | None = None,
        ngroups: int = 1,
        A_init_range: tuple[float, float] = (1, 16),
        D_has_hdim: bool = False,
        rmsnorm: bool = True,
        norm_before_gate: bool = False,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        dt_limit: tuple[float, float] = (0.0, float("inf")),
        bias: bool = False,
        conv_bias: bool = True,
        chunk_size: int = 256,
        norm_eps: float = 1e-5,
        layer_idx: int | None = None,
        decode: bool = False,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        implementation: str | None = None,
        rngs: nnx.Rngs,
    ):
        d_inner, d_ssm, nheads = mixer_shape(d_model, d_state, d_conv, expand, headdim, ngroups,
                                             chunk_size, d_ssm)
        _check_initialisation(A_init_range, dt_min, dt_max, dt_init_floor, conv_init)
        _check_layer_idx(layer_idx)
        if not (_finite(norm_eps) and norm_eps > 0):
            raise ValueError(f"norm_eps must be a finite number > 0, got {norm_eps!r}")
        dt_limit = arguments.check_dt_limit(dt_limit)
        check_flags(D_has_hdim=D_has_hdim, rmsnorm=rmsnorm, norm_before_gate=norm_before_gate,
                    conv_bias=conv_bias, bias=bias, decode=decode)
        check_dtypes(dtype=dtype, param_dtype=param_dtype)
        check_implementation(implementation)
        self.d_model, self.d_inner, self.d_state, self.d_conv = d_model, d_inner, d_state, d_conv
        self.d_ssm, self.d_mlp = d_ssm, d_inner - d_ssm
        self.headdim, self.nheads, self.ngroups = headdim, nheads, ngroups
        self.chunk_size = int(chunk_size)  # the kernel takes a Python int, not a numpy one
        self.dt_limit, self.rmsnorm, self.norm_eps = dt_limit, rmsnorm, float(norm_eps)
        self.D_has_hdim, self.layer_idx, self.decode = D_has_hdim, layer_idx, decode
        self.norm_before_gate, self.dtype, self.implementation = (
            norm_before_gate, dtype, implementation)
        self.conv_dim = d_ssm + 2 * ngroups * d_state
        d_in_proj = 2 * d_inner + 2 * ngroups * d_state + nheads

        self.in_proj = nnx.Linear(
            d_model, d_in_proj, use_bias=bias, dtype=dtype, param_dtype=param_dtype,
            kernel_init=_torch_linear_init(d_model), bias_init=_torch_linear_init(d_model),
            kernel_metadata=logical("embed", "inner"), bias_metadata=logical("inner"), rngs=rngs,
        )
        conv_weight_init = (_torch_linear_init(d_conv) if conv_init is None
                            else _uniform(conv_init))
        self.conv_weight = _param(rngs, conv_weight_init, (d_conv, self.conv_dim), param_dtype,
                                  ("conv_width", "inner"))
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
        self.D = logical_param(jnp.ones((d_ssm,) if D_has_hdim else (nheads,), jnp.float32),
                               "inner" if D_has_hdim else "heads")
        self.norm_weight = (
            logical_param(jnp.ones((d_ssm,), param_dtype), "inner") if rmsnorm else None
        )
        self.out_proj = nnx.Linear(
            d_inner, d_model, use_bias=bias, dtype=dtype, param_dtype=param_dtype,
            kernel_init=_torch_linear_init(d_inner), bias_init=_torch_linear_init(d_inner),
            kernel_metadata=logical("inner", "embed"), bias_metadata=logical("embed"), rngs=rngs,
        )
        self.conv_state = nnx.data(None)
        self.ssm_state = nnx.data(None)

    def init_cache(self, batch_size: int, dtype: DTypeLike = jnp.float32,
                   ssm_dtype: DTypeLike = jnp.float32) -> None:
        """Zero conv state (B, d_conv - 1, conv_dim) in `dtype` and SSM state (B, H, P, N) in
        `ssm_dtype`: float32 by default; bfloat16 (mamba_ssm's and transformers' choice for a
        bf16 model) halves the bytes a decode step reads and writes, the state rounded to bf16
        after each step (the update's math runs in float32 either way)."""
        check_sizes(batch_size=batch_size)
        ssm_dtype = check_state_dtype("ssm_dtype", ssm_dtype)
        self.conv_state = nnx.Cache(jnp.zeros((batch_size, self.d_conv - 1, self.conv_dim),
                                              dtype))
        self.ssm_state = nnx.Cache(jnp.zeros(
            (batch_size, self.nheads, self.headdim, self.d_state), ssm_dtype))

    def set_view(self, decode: bool | None = None, batch_size: int | None = None) -> None:
        """For `nnx.view(model, decode=..., batch_size=...)`: `decode` becomes the default of
        `__call__`'s; `batch_size` allocates empty caches (`init_cache`)."""
        if decode is not None:
            check_flags(decode=decode)
            self.decode = decode
        if batch_size is not None:
            self.init_cache(batch_size)

    def check_cache(self, batch):
        """A ValueError unless the decode caches exist and hold `batch` rows."""
        if self.ssm_state is None:
            raise ValueError("decode=True needs init_cache(batch_size) first")
        if batch != self.ssm_state.shape[0]:
            raise ValueError(f"batch {batch} does not match the Mamba2 cache's batch "
                             f"{self.ssm_state.shape[0]}")

    # -----------------------------------------------------------------------------------------

    def _split(self, zxbcdt):
        """in_proj's output (..., d_in_proj) as mamba_ssm orders it: the gated MLP's [z0, x0]
        (..., 2 d_mlp), z (..., d_ssm), xBC (..., conv_dim) and dt (..., H)."""
        mlp, d = 2 * self.d_mlp, self.d_ssm
        xbc_end = mlp + d + self.conv_dim
        return (zxbcdt[..., :mlp], zxbcdt[..., mlp:mlp + d], zxbcdt[..., mlp + d:xbc_end],
                zxbcdt[..., xbc_end:])

    @jax.named_scope("conv")
    def _conv(self, xbc, history, seq_idx=None, packed=None):
        """Causal depthwise conv + SiLU over xbc (B, T, C) with `history` (B, d_conv - 1, C),
        as (x (B, T, d_ssm), [B, C] (B, T, 2 G N)). `packed`: in_proj's output, whose xBC
        columns the kernels read in place, writing x and [B, C] as two arrays (no copies; a
        call without a mesh or sequence ids). On a mesh with Explicit axes it runs per shard;
        a sharded sequence takes each shard's history (and its sequence ids) from the shard
        before it (`_sharding.causal_halo`)."""
        weights = (self.conv_weight[...], None if self.conv_bias is None else self.conv_bias[...])
        if packed is not None and seq_idx is None and token_features(xbc) is None:
            return pallas_kernels.causal_conv1d(
                packed, *weights, initial_states=history, column_offset=2 * self.d_mlp + self.d_ssm,
                split=self.d_ssm, implementation=self.implementation)
        conv = functools.partial(_causal_conv, self.implementation)
        if token_features(xbc) is not None:
            out = causal_halo(conv, xbc, history, seq_idx, *weights)
        else:
            out = conv(xbc, history, seq_idx, None, *weights)
        return out[..., :self.d_ssm], out[..., self.d_ssm:]

    @jax.named_scope("conv")
    def _conv_token(self, xbc, history):
        """One token's conv + SiLU, xbc (B, 1, C) after `history`, as (x (B, d_ssm), [B, C]
        (B, 2 G N)): the jnp expression (one XLA fusion), not the kernel, whose launch and
        padded history cost more than the few bytes a token reads."""
        weights = (self.conv_weight[...], None if self.conv_bias is None else self.conv_bias[...])
        out = _causal_conv("xla", xbc, history, None, None, *weights)[:, 0]
        return out[..., :self.d_ssm], out[..., self.d_ssm:]

    def _heads(self, x, b, c):
        lead = x.shape[:-1]
        return (x.reshape(*lead, self.nheads, self.headdim),
                b.reshape(*lead, self.ngroups, self.d_state),
                c.reshape(*lead, self.ngroups, self.d_state))

    def _ssd_inputs(self, x, bc):
        """The SSD's x (..., H, P), B and C (..., G, N) from the conv's two parts."""
        gn = self.ngroups * self.d_state
        return self._heads(x, bc[..., :gn], bc[..., gn:])

    def _d(self):
        """D as the SSD takes it: (H,) or, with D_has_hdim, (H, P)."""
        d = self.D[...]
        return d.reshape(self.nheads, self.headdim) if self.D_has_hdim else d

    @jax.named_scope("norm_and_out_proj")
    def _norm_and_project(self, y, z, mlp, packed):
        """Gated grouped RMSNorm (without rmsnorm the SSD already applied the gate), the gated
        MLP's silu(z0) * x0 before it where d_mlp > 0, out_proj.

        y, z (..., d_ssm); mlp [z0, x0] (..., 2 d_mlp); packed: in_proj's output, from which
        the norm kernels read z in place.
        """
        if self.rmsnorm:  # y split over heads runs the reference (the kernels read whole groups)
            y = pallas_kernels.rms_norm_gated(
                y, self.norm_weight[...], packed, eps=self.norm_eps,
                group_size=self.d_ssm // self.ngroups, norm_before_gate=self.norm_before_gate,
                z_column_offset=2 * self.d_mlp,
                implementation="xla" if features_sharded(y) else self.implementation)
        return self._project(y, z, mlp)

    def _project(self, y, z, mlp):
        """out_proj of the normalised y (..., d_ssm), after the gated MLP's silu(z0) * x0 where
        d_mlp > 0."""
        y = y.astype(jnp.float32)
        if self.d_mlp:
            z0, x0 = jnp.split(mlp.astype(jnp.float32), 2, axis=-1)
            features = token_features(z)
            if features is not None:  # y may be sharded over heads; the MLP's part is whole
                y = jax.sharding.reshard(y, features)
            y = jnp.concatenate([jax.nn.silu(z0) * x0, y], axis=-1)
        dtype = self.dtype or self.out_proj.kernel[...].dtype
        return self.out_proj(y.astype(dtype), out_sharding=token_features(z))

    def __call__(self, u: jax.Array, *, seq_idx: jax.Array | None = None,
                 decode: bool | None = None, lengths: jax.Array | None = None) -> jax.Array:
        decode = self.decode if decode is None else decode
        if decode:
            if seq_idx is not None:
                raise ValueError("decode=True continues one sequence per row: it takes no seq_idx")
            self.check_cache(u.shape[0])
        elif lengths is not None:
            raise ValueError("lengths is for decode=True (a forward takes seq_idx)")
        with jax.named_scope("in_proj"):
            zxbcdt = self.in_proj(u)
            mlp, z, xbc, dt = self._split(zxbcdt)
        if decode:
            states = (self.conv_state[...], self.ssm_state[...])
            if u.shape[1] == 1:
                y, new_states = self._step(zxbcdt, z, xbc, dt, *states)
                if lengths is not None:  # a row without a real token keeps its states
                    new_states = [jnp.where((lengths > 0).reshape(-1, *[1] * (new.ndim - 1)),
                                            new, old) for new, old in zip(new_states, states,
                                                                          strict=True)]
            else:
                y, new_states = self._prefill(z, xbc, dt, *states, lengths)
            self.conv_state[...], self.ssm_state[...] = new_states
        else:
            y = self._fused_mixer(zxbcdt, seq_idx)
            if y is not None:
                return self._project(y, z, mlp)
            history = jnp.zeros((u.shape[0], self.d_conv - 1, self.conv_dim), xbc.dtype)
            y, _ = self._scan(z, xbc, dt, history, None, seq_idx, caches=False, packed=zxbcdt)
        return self._norm_and_project(y, z, mlp, zxbcdt)

    @jax.named_scope("conv_ssd_norm")
    def _fused_mixer(self, zxbcdt, seq_idx):
        """The gated norm's output (B, T, d_ssm) of in_proj's output, as `_scan` and the norm
        compute it, by one op whose backward writes in_proj's gradient in place
        (`mixer.split_conv_scan_norm`); None where that op does not apply: it runs the kernels,
        off meshes, with the gated norm, no gated MLP and no sequence ids."""
        implementation, interpret = _dispatch.choose(self.implementation, None)
        shape = self._mixer_shape()
        if not (implementation == "pallas" and self.rmsnorm and not self.d_mlp
                and seq_idx is None and token_features(zxbcdt) is None
                and mixer.applies(zxbcdt, shape)):
            return None
        return mixer.split_conv_scan_norm(
            zxbcdt, self.conv_weight[...],
            None if self.conv_bias is None else self.conv_bias[...], self.dt_bias[...],
            -jnp.exp(self.A_log[...]), self._d(), self.norm_weight[...],
            shape=shape, chunk_size=self.chunk_size, dt_limit=self.dt_limit,
            norm_eps=self.norm_eps, norm_before_gate=self.norm_before_gate,
            interpret=interpret)

    def _mixer_shape(self):
        return mixer.MixerShape(d_ssm=self.d_ssm, ngroups=self.ngroups, d_state=self.d_state,
                                nheads=self.nheads, norm_group_size=self.d_ssm // self.ngroups)

    def _scan(self, z, xbc, dt, history, initial_states, seq_idx=None, *, caches=True,
              step_sizes=False, packed=None):
        """The chunked scan over (B, T, ...) from conv `history` (B, d_conv - 1, C) and
        `initial_states` (B, H, P, N) or None. `dt` is in_proj's (B, T, H), or with
        `step_sizes` the step sizes themselves (the bias, softplus and limits applied).
        `packed`: in_proj's output, for the conv to read xbc in place (`_conv`). Returns (y
        (B, T, d_ssm), (conv history, SSM state) after the last token, in the dtypes of
        `history` and `initial_states`), None for the latter unless `caches`."""
        x, b, c = self._ssd_inputs(*self._conv(xbc, history, seq_idx, packed))
        if not caches:  # training: over a tensor axis the scan runs per head shard (decoding
            x, dt = heads_sharded(x), heads_sharded(dt)  # takes whole parameters)
        with jax.named_scope("ssd"):
            y, final = pallas_kernels.mamba_chunk_scan_combined(
                x, dt, -jnp.exp(self.A_log[...]), b, c, self.chunk_size, D=self._d(),
                z=None if self.rmsnorm else z.reshape(x.shape),
                dt_bias=None if step_sizes else self.dt_bias[...], initial_states=initial_states,
                seq_idx=seq_idx, dt_softplus=not step_sizes,
                dt_limit=(0.0, float("inf")) if step_sizes else self.dt_limit,
                return_final_states=True, implementation=self.implementation,
            )
        y = y.reshape(*xbc.shape[:2], self.d_ssm)
        if not caches:
            return y, None
        return y, (_conv_history(history, xbc), final.astype(initial_states.dtype))

    def _prefill(self, z, xbc, dt, conv_state, ssm_state, lengths):
        """Several tokens (B, T, ...) through the chunked scan from the cached states; with
        `lengths` (B,) only each row's first lengths[b] count: the padding after them gets a
        step size of 0 (decay 1, no input), so the final SSM state is the one after the last
        real token, and the conv history ends there too (the step sizes are computed here,
        as the scan would, so that a dt_limit above 0 does not lift the padding's)."""
        if lengths is None:
            return self._scan(z, xbc, dt, conv_state, ssm_state)
        real = jnp.arange(xbc.shape[1]) < lengths[:, None]  # (B, T)
        steps = semantics.step_sizes(dt, self.dt_bias[...], True, self.dt_limit, jnp.float32)
        steps = jnp.where(real[..., None], steps, 0.0)
        y, (_, ssm_state) = self._scan(z, xbc, steps, conv_state, ssm_state, step_sizes=True)
        inputs = jnp.concatenate([conv_state, xbc.astype(conv_state.dtype)], axis=1)
        last = lengths[:, None] + jnp.arange(self.d_conv - 1)  # the history after the row's end
        return y, (jnp.take_along_axis(inputs, last[..., None], axis=1), ssm_state)

    def _step(self, zxbcdt, z, xbc, dt, conv_state, ssm_state):
        """One token (B, 1, ...) through the conv state and `selective_state_update` (in_proj's
        output zxbcdt and its parts z, xbc, dt). Returns (y (B, 1, d_ssm), (conv state, SSM
        state) after it)."""
        fused = self._fused_step(zxbcdt, conv_state, ssm_state)
        if fused is not None:
            y, conv_state, ssm_state = fused
            return y.reshape(xbc.shape[0], 1, self.d_ssm), (conv_state, ssm_state)
        x, b, c = self._ssd_inputs(*self._conv_token(xbc, conv_state))
        y, ssm_state = pallas_kernels.selective_state_update(
            ssm_state, x, dt[:, 0], -jnp.exp(self.A_log[...]), b, c, D=self._d(),
            z=None if self.rmsnorm else z[:, 0].reshape(x.shape), dt_bias=self.dt_bias[...],
            dt_softplus=True, dt_limit=self.dt_limit, implementation=self.implementation,
        )
        return y.reshape(xbc.shape[0], 1, self.d_ssm), (_conv_history(conv_state, xbc),
                                                          ssm_state)

    @jax.named_scope("conv_ssd_step")
    def _fused_step(self, zxbcdt, conv_state, ssm_state):
        """(y (B, H, P), conv state, SSM state) after one token, zxbcdt (B, 1, d_in_proj), by
        `mixer.split_conv_step`'s two kernels, which read in_proj's output in place and update
        both states over their buffers; None where that does not apply: it runs the kernels,
        off meshes, with the gated norm (which applies z)."""
        implementation, interpret = _dispatch.choose(self.implementation, None)
        shape = self._mixer_shape()
        if not (implementation == "pallas" and self.rmsnorm and token_features(zxbcdt) is None
                and mixer.step_applies(shape, self.d_conv)):
            return None
        return mixer.split_conv_step(
            zxbcdt[:, 0], conv_state, ssm_state, self.conv_weight[...],
            None if self.conv_bias is None else self.conv_bias[...], self.dt_bias[...],
            self.A_log[...], self._d(), shape=shape, column_offset=2 * self.d_mlp,
            dt_limit=self.dt_limit, interpret=interpret)


@jax.named_scope("mamba2_block")  # (profiles name the ops of a step by these scopes)
def pre_norm_residual(block, h, x=None, seq_idx=None):
    """h + block.mixer(block.norm(x)) (x default h): the forward of a pre-norm residual Mamba2
    block (a module with `norm` and a `Mamba2` `mixer`), the unit a model's `remat`
    recomputes in the backward."""
    return h + block.mixer(block.norm(h if x is None else x), seq_idx=seq_idx, decode=False)


def _causal_conv(implementation, xbc, history, seq_idx, history_ids, weight, bias):
    """SiLU(causal depthwise conv) of xbc (B, T, C) after `history` (B, K - 1, C), with
    weight (K, C) and bias (C,) or None (`pallas_kernels.causal_conv1d`); taps that reach back
    into another sequence (by `seq_idx` (B, T), with `history_ids` (B, K - 1) for the history,
    None: the first token's) contribute nothing."""
    return pallas_kernels.causal_conv1d(
        xbc, weight, bias, initial_states=history, seq_idx=seq_idx,
        initial_seq_idx=history_ids, implementation=implementation)


def _conv_history(history, xbc):
    """The last d_conv - 1 conv inputs after `history` (B, d_conv - 1, C) and the new xbc
    (B, T, C), in the history's dtype (empty when d_conv == 1)."""
    padded = jnp.concatenate([history, xbc.astype(history.dtype)], axis=1)
    return padded[:, xbc.shape[1]:]


# ---------------------------------------------------------------------------------------------
# Argument checks (the generic ones are in `_checks`): TypeError or ValueError
# naming the argument, before any array is built.


def mixer_shape(d_model: int, d_state: int, d_conv: int, expand: int, headdim: int,
                ngroups: int, chunk_size: int, d_ssm: int | None = None) -> tuple[int, int, int]:
    """(d_inner, d_ssm, heads) of a Mamba2 mixer, after checking its sizes: each a positive int,
    d_inner = expand * d_model, d_ssm (default d_inner) at most d_inner and divisible by
    headdim, heads = d_ssm / headdim by ngroups, chunk_size a power of two. Shared with
    `HybridLMConfig`."""
    check_sizes(d_model=d_model, d_state=d_state, d_conv=d_conv, expand=expand,
                headdim=headdim, ngroups=ngroups, chunk_size=chunk_size)
    d_inner = expand * d_model
    if d_ssm is None:
        if d_inner % headdim:
            raise ValueError(f"d_inner = expand * d_model ({d_inner}) must be divisible by "
                             f"headdim ({headdim})")
        d_ssm = d_inner
    else:
        check_sizes(d_ssm=d_ssm)
        if d_ssm > d_inner:
            raise ValueError(f"d_ssm ({d_ssm}) must be at most d_inner = expand * d_model "
                             f"({d_inner})")
        if d_ssm % headdim:
            raise ValueError(f"d_ssm ({d_ssm}) must be divisible by headdim ({headdim})")
    nheads = d_ssm // headdim
    if nheads % ngroups:
        raise ValueError(f"heads ({nheads}) must be divisible by ngroups ({ngroups})")
    if chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a positive power of two, got {chunk_size}")
    return d_inner, d_ssm, nheads


def _finite(*values):
    return all(isinstance(v, numbers.Real) and not isinstance(v, bool | np.bool_)
               and math.isfinite(v) for v in values)


def _check_initialisation(A_init_range, dt_min, dt_max, dt_init_floor, conv_init):
    """A_init_range a pair 0 < low <= high, 0 < dt_min <= dt_max, dt_init_floor >= 0 and
    conv_init None or > 0, all finite numbers."""
    if not (isinstance(A_init_range, tuple | list) and len(A_init_range) == 2
            and _finite(*A_init_range) and 0 < A_init_range[0] <= A_init_range[1]):
        raise ValueError(f"A_init_range must be a pair of finite numbers 0 < low <= high, got "
                         f"{A_init_range!r}")
    if not (_finite(dt_min, dt_max) and 0 < dt_min <= dt_max):
        raise ValueError(f"need finite 0 < dt_min <= dt_max, got {dt_min!r}, {dt_max!r}")
    if not (_finite(dt_init_floor) and dt_init_floor >= 0):
        raise ValueError(f"dt_init_floor must be a finite number >= 0, got {dt_init_floor!r}")
    if conv_init is not None and not (_finite(conv_init) and conv_init > 0):
        raise ValueError(f"conv_init must be None or a finite number > 0, got {conv_init!r}")


def _check_layer_idx(layer_idx):
    """layer_idx must be None or an int >= 0."""
    if layer_idx is None:
        return
    if not isinstance(layer_idx, numbers.Integral) or isinstance(layer_idx, bool | np.bool_):
        raise TypeError(f"layer_idx must be an int or None, got {layer_idx!r}")
    if layer_idx < 0:
        raise ValueError(f"layer_idx must be >= 0, got {layer_idx}")
