"""Zamba2 as transformers defines it (`Zamba2ForCausalLM`), with checkpoint loading and export."""

import dataclasses
import functools
import json
import numbers
import os
from collections.abc import Mapping
from typing import Any, Self

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from flax_layers import _checkpoint_io as io
from flax_layers._checks import (
    check_dtypes,
    check_flags,
    check_implementation,
    check_positive_numbers,
    check_sizes,
)
from flax_layers._sharding import logical, token_features
from flax_layers.attention import FlashMultiHeadAttention, KVCacheSlot, check_heads
from flax_layers.generation import CausalLM
from flax_layers.mamba2 import Mamba2, mixer_shape, pre_norm_residual

_ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
}


@dataclasses.dataclass(frozen=True)
class Zamba2Config:
    """Sizes of a Zamba2LM, as transformers' `Zamba2Config` names them (in brackets where the
    name here differs).

    `num_layers` Mamba2 layers; before each layer of `hybrid_layers` (`hybrid_layer_ids`) one
    of `num_mem_blocks` shared transformer blocks runs (in turn: A B A B ...). The attention
    has `num_heads` heads of head dim 2 d_model / num_heads over [hidden, embeddings] (2
    d_model features) and scales its logits by (head_dim / 2)^-0.5; rotary embeddings where
    `rope_theta` is set (`use_mem_rope`); `attention_adapters`
    (`use_shared_attention_adapter`) adds a rank-`adapter_rank` adapter per use to q, k and v,
    and the gated MLP (`intermediate_size` = `mlp_hidden`) always has one. The Mamba2 layers
    have `mamba_heads` heads (`n_mamba_heads`), `d_state`, `ngroups`, `expand`, `d_conv`,
    `chunk_size`, step sizes clamped at `dt_min` (`time_step_min`) and a gated RMSNorm with
    epsilon 1e-5. `remat` recomputes each layer in the backward. Every field is checked on
    construction (ValueError or TypeError naming it).
    `source` keeps the config.json it was read from (JSON text) for the export.
    """

    vocab_size: int = 256
    d_model: int = 64
    num_layers: int = 4
    hybrid_layers: tuple[int, ...] = (1, 3)
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    ngroups: int = 1
    mamba_heads: int = 8
    chunk_size: int = 64
    dt_min: float = 0.001
    num_heads: int = 4
    num_kv_heads: int = 4
    mlp_hidden: int = 256
    hidden_act: str = "gelu"
    num_mem_blocks: int = 1
    attention_adapters: bool = False
    adapter_rank: int = 8
    rope_theta: float | None = None
    norm_eps: float = 1e-5
    bias: bool = False  # transformers' add_bias_linear
    tie_embeddings: bool = True
    remat: bool = False  # recompute each layer (and each use of a shared block) in the backward
    dtype: DTypeLike | None = None
    implementation: str | None = None
    source: str | None = None

    def __post_init__(self):
        check_sizes(vocab_size=self.vocab_size, num_layers=self.num_layers,
                    mamba_heads=self.mamba_heads, mlp_hidden=self.mlp_hidden,
                    num_mem_blocks=self.num_mem_blocks, adapter_rank=self.adapter_rank)
        object.__setattr__(self, "hybrid_layers", tuple(self.hybrid_layers))
        if (not all(isinstance(i, numbers.Integral) and not isinstance(i, bool | np.bool_)
                    and 0 <= i < self.num_layers for i in self.hybrid_layers)
                or list(self.hybrid_layers) != sorted(set(self.hybrid_layers))):
            raise ValueError(f"hybrid_layers must be increasing layer indices in [0, "
                             f"{self.num_layers}), got {self.hybrid_layers}")
        if (self.expand * self.d_model) % self.mamba_heads:
            raise ValueError(f"expand * d_model ({self.expand * self.d_model}) must be divisible "
                             f"by mamba_heads ({self.mamba_heads})")
        mixer_shape(self.d_model, self.d_state, self.d_conv, self.expand, self.mamba_headdim,
                    self.ngroups, self.chunk_size)
        check_heads(self.num_heads, self.num_kv_heads, 2 * self.d_model, self.rope_theta)
        if self.attention_adapters and self.num_kv_heads != self.num_heads:
            raise ValueError("attention_adapters add 2 d_model features to k and v: they need "
                             f"num_kv_heads == num_heads, got {self.num_kv_heads} and "
                             f"{self.num_heads}")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {sorted(_ACTIVATIONS)}, got "
                             f"{self.hidden_act!r}")
        for name in ("dt_min", "norm_eps"):
            if getattr(self, name) is None:
                raise TypeError(f"{name} must be a number, got None")
        check_positive_numbers(dt_min=self.dt_min, norm_eps=self.norm_eps)
        check_flags(attention_adapters=self.attention_adapters, bias=self.bias,
                    tie_embeddings=self.tie_embeddings, remat=self.remat)
        if not self.tie_embeddings and len(self.hybrid_layers) > self.num_mem_blocks:
            raise ValueError(
                "tie_embeddings=False with more hybrid layers than num_mem_blocks: transformers "
                "then unties the shared blocks as well (each hybrid layer its own), which this "
                "model does not build")
        check_dtypes(dtype=self.dtype)
        check_implementation(self.implementation)

    @property
    def mamba_headdim(self) -> int:
        return self.expand * self.d_model // self.mamba_heads

    @property
    def head_dim(self) -> int:
        return 2 * self.d_model // self.num_heads

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> Self:
        """"zamba2-1.2b": Zyphra's Zamba2-1.2B (38 Mamba2 layers of d_model 2048, state 128,
        64 heads; one shared block of 32 heads before layers 5, 11, ..., 35, with adapters of
        rank 128 and rotary embeddings; vocabulary 32000), random weights."""
        presets = {
            "zamba2-1.2b": dict(
                vocab_size=32000, d_model=2048, num_layers=38,
                hybrid_layers=(5, 11, 17, 23, 29, 35), d_state=128, mamba_heads=64,
                chunk_size=256, num_heads=32, num_kv_heads=32, mlp_hidden=8192,
                num_mem_blocks=1, attention_adapters=True, adapter_rank=128,
                rope_theta=10000.0),
        }
        if name not in presets:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(presets)}")
        return cls(**{**presets[name], **overrides})

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], **overrides: Any) -> Self:
        """From transformers' Zamba2Config dict (config.json); `overrides` replace fields."""
        if config.get("model_type", "zamba2") != "zamba2":
            raise ValueError(f"a Zamba2LM loads model_type 'zamba2', got "
                             f"{config.get('model_type')!r}")
        if config.get("use_long_context", False):
            raise ValueError("use_long_context (rescaled rotary embeddings) is not supported")
        d_model, layers = config.get("hidden_size", 2560), config.get("num_hidden_layers", 54)
        types, hybrid = config.get("layers_block_type"), config.get("hybrid_layer_ids")
        if types is not None:  # what transformers builds the layers from
            from_types = [i for i, kind in enumerate(types) if kind == "hybrid"]
            if hybrid is not None and list(hybrid) != from_types:
                raise ValueError(f"hybrid_layer_ids {list(hybrid)} disagrees with "
                                 f"layers_block_type's hybrid layers {from_types}")
            hybrid = from_types
        elif hybrid is None:
            raise ValueError("the config names no hybrid layers (layers_block_type or "
                             "hybrid_layer_ids)")
        rope = config.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope['rope_type']!r} is not supported")
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        heads = config.get("num_attention_heads", 32)
        fields = dict(
            vocab_size=config.get("vocab_size", 32000), d_model=d_model, num_layers=layers,
            hybrid_layers=tuple(hybrid), d_state=config.get("mamba_d_state", 64),
            d_conv=config.get("mamba_d_conv", 4), expand=config.get("mamba_expand", 2),
            ngroups=config.get("mamba_ngroups", 1), mamba_heads=config.get("n_mamba_heads", 8),
            chunk_size=config.get("chunk_size", 256),
            dt_min=float(config.get("time_step_min", 0.001)), num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            mlp_hidden=config.get("intermediate_size") or 4 * d_model,
            hidden_act=config.get("hidden_act", "gelu"),
            num_mem_blocks=config.get("num_mem_blocks", 1),
            attention_adapters=config.get("use_shared_attention_adapter", False),
            adapter_rank=config.get("adapter_rank", 128),
            rope_theta=float(theta) if config.get("use_mem_rope", False) else None,
            norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            bias=config.get("add_bias_linear", False),
            tie_embeddings=config.get("tie_word_embeddings", True),
            source=json.dumps(dict(config), sort_keys=True),
        )
        return cls(**{**fields, **overrides})

    def to_transformers(self, dtype: DTypeLike = jnp.float32) -> dict[str, Any]:
        """transformers' Zamba2Config dict (config.json), over the source's other fields."""
        source = json.loads(self.source) if self.source else {}
        source.pop("torch_dtype", None)  # `dtype` below replaces it
        types = ["hybrid" if i in self.hybrid_layers else "mamba" for i in range(self.num_layers)]
        if "layers_block_type" in source:  # as the source spelled the Mamba2 layers
            mamba_name = next((t for t in source["layers_block_type"] if t != "hybrid"), "mamba")
            types = [t if t == "hybrid" else mamba_name for t in types]
        rope = dict(source.get("rope_parameters") or {"rope_type": "default"})
        rope["rope_theta"] = self.rope_theta if self.rope_theta is not None else rope.get(
            "rope_theta", 10000.0)
        return {**source, **dict(
            architectures=["Zamba2ForCausalLM"], model_type="zamba2",
            vocab_size=self.vocab_size, hidden_size=self.d_model,
            num_hidden_layers=self.num_layers, layers_block_type=types,
            hybrid_layer_ids=list(self.hybrid_layers), mamba_d_state=self.d_state,
            mamba_d_conv=self.d_conv, mamba_expand=self.expand, mamba_ngroups=self.ngroups,
            n_mamba_heads=self.mamba_heads, mamba_headdim=self.mamba_headdim,
            chunk_size=self.chunk_size, time_step_min=self.dt_min,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            attention_head_dim=self.head_dim, attention_hidden_size=2 * self.d_model,
            intermediate_size=self.mlp_hidden, hidden_act=self.hidden_act,
            num_mem_blocks=self.num_mem_blocks,
            use_shared_attention_adapter=self.attention_adapters,
            adapter_rank=self.adapter_rank, use_mem_rope=self.rope_theta is not None,
            rope_parameters=rope, rms_norm_eps=self.norm_eps, add_bias_linear=self.bias,
            tie_word_embeddings=self.tie_embeddings, use_conv_bias=True,
            dtype=jnp.dtype(dtype).name,
        )}


def _rms_norm(features, config, param_dtype, rngs):
    return nnx.RMSNorm(features, epsilon=config.norm_eps, dtype=config.dtype,
                       param_dtype=param_dtype, scale_metadata=logical("embed"), rngs=rngs)


def _linear(features_in, features_out, config, param_dtype, rngs, *, bias=False,
            names=("embed", "mlp")):
    return nnx.Linear(features_in, features_out, use_bias=bias, dtype=config.dtype,
                      param_dtype=param_dtype, kernel_metadata=logical(*names),
                      bias_metadata=logical(names[1]), rngs=rngs)


class _LowRank(nnx.Module):
    """x -> up(down(x)), rank `rank`, no biases (Zamba2's adapters)."""

    def __init__(self, features_in, rank, features_out, config, param_dtype, rngs):
        self.down = _linear(features_in, rank, config, param_dtype, rngs, names=("embed", None))
        self.up = _linear(rank, features_out, config, param_dtype, rngs, names=(None, "mlp"))

    def __call__(self, x):
        return self.up(self.down(x))


class _Adapters(nnx.Module):
    """One use's adapters of a shared block: q, k, v (where configured) and the MLP's."""

    def __init__(self, config, param_dtype, rngs):
        d, rank = config.d_model, config.adapter_rank
        self.qkv = nnx.List([_LowRank(2 * d, rank, 2 * d, config, param_dtype, rngs)
                             for _ in range(3)]) if config.attention_adapters else None
        self.mlp = _LowRank(d, rank, 2 * config.mlp_hidden, config, param_dtype, rngs)


class _SharedBlock(nnx.Module):
    """transformers' Zamba2AttentionDecoderLayer: RMSNorm([hidden, embeddings]) -> attention
    -> RMSNorm -> gated MLP, without residuals; `adapters` holds one _Adapters per use."""

    def __init__(self, config, uses, param_dtype, rngs):
        d = config.d_model
        self.input_layernorm = _rms_norm(2 * d, config, param_dtype, rngs)
        self.attention = FlashMultiHeadAttention(
            config.num_heads, 2 * d, 2 * d, d, num_kv_heads=config.num_kv_heads,
            is_causal=True, rope_theta=config.rope_theta, scale=(config.head_dim / 2) ** -0.5,
            use_bias=False, dtype=config.dtype, param_dtype=param_dtype,
            implementation=config.implementation, rngs=rngs)
        self.pre_ff_layernorm = _rms_norm(d, config, param_dtype, rngs)
        self.gate_up = _linear(d, 2 * config.mlp_hidden, config, param_dtype, rngs,
                               bias=config.bias)
        self.down = _linear(config.mlp_hidden, d, config, param_dtype, rngs, bias=config.bias,
                            names=("mlp", "embed"))
        self.adapters = nnx.List([_Adapters(config, param_dtype, rngs) for _ in range(uses)])

    def __call__(self, h, embeddings, use, segment_ids, cache, lengths, fresh, activation):
        x = self.input_layernorm(jnp.concatenate([h, embeddings], axis=-1))
        adapters = self.adapters[use]
        extra = None if adapters.qkv is None else tuple(a(x) for a in adapters.qkv)
        if cache is None:
            out = self.attention(x, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                                 decode=False, adapter_outputs=extra)
        else:
            out, cache = self.attention.attend_cached(x, cache, new_lengths=lengths, fresh=fresh,
                                                      adapter_outputs=extra)
        y = self.pre_ff_layernorm(out)
        gate_up = self.gate_up(y) + adapters.mlp(y)
        # Slices, not jnp.split: their gradients are pads that XLA adds in the fusion writing
        # d(gate_up); split's is a concatenate, a copy of the whole (B, T, 2F) array on its own.
        half = gate_up.shape[-1] // 2
        hidden = activation(gate_up[..., :half]) * gate_up[..., half:]
        return self.down(hidden, out_sharding=token_features(h)), cache


class _MambaLayer(nnx.Module):
    def __init__(self, config, index, param_dtype, rngs):
        self.norm = _rms_norm(config.d_model, config, param_dtype, rngs)
        self.mixer = Mamba2(
            config.d_model, d_state=config.d_state, d_conv=config.d_conv, expand=config.expand,
            headdim=config.mamba_headdim, ngroups=config.ngroups, chunk_size=config.chunk_size,
            dt_limit=(config.dt_min, float("inf")), bias=config.bias, layer_idx=index,
            dtype=config.dtype, param_dtype=param_dtype, implementation=config.implementation,
            rngs=rngs)


class Zamba2LM(CausalLM):
    """Zamba2 (transformers' `Zamba2ForCausalLM`): embedding -> Mamba2 layers, before each
    hybrid layer a shared transformer block (of `num_mem_blocks`, in turn) over [hidden,
    embeddings] whose output, through that layer's own linear, is added to the Mamba2 layer's
    input (not to its residual) -> RMSNorm -> LM head (tied to the embedding by default).

    `__call__(tokens (B, T) int, *, segment_ids=None, decode=False, lengths=None)` returns
    logits (B, T, V) float32. With `decode=True` (after `init_cache`) the tokens continue
    each row's cached sequence (KV caches per hybrid layer, conv and SSM states per Mamba2
    layer). `generate` samples in one compiled call. `from_pretrained` loads transformers'
    checkpoints; `state_dict` and `save_pretrained` export them.

    Where transformers differs: its one-token decode step does not clamp the step sizes at
    `dt_min` (its forward does); here decoding clamps as the forward does, so that a decoded
    sequence gives the forward's outputs. They agree wherever softplus(dt) >= dt_min.
    """

    def __init__(self, config: Zamba2Config, *, param_dtype: DTypeLike = jnp.float32,
                 rngs: nnx.Rngs):
        if not isinstance(config, Zamba2Config):
            raise TypeError(f"config must be a Zamba2Config, got {type(config).__name__}")
        self.config = config
        d, uses = config.d_model, len(config.hybrid_layers)
        self.embed = nnx.Embed(config.vocab_size, d, dtype=config.dtype, param_dtype=param_dtype,
                               embedding_metadata=logical("vocab", "embed"), rngs=rngs)
        self.layers = nnx.List([_MambaLayer(config, i, param_dtype, rngs)
                                for i in range(config.num_layers)])
        blocks = min(config.num_mem_blocks, uses)
        self.shared = nnx.List([
            _SharedBlock(config, len(range(b, uses, config.num_mem_blocks)), param_dtype, rngs)
            for b in range(blocks)])
        self.linears = nnx.List([_linear(d, d, config, param_dtype, rngs,
                                         names=("embed", None)) for _ in range(uses)])
        self.final_norm = _rms_norm(d, config, param_dtype, rngs)
        self.lm_head = None if config.tie_embeddings else _linear(
            d, config.vocab_size, config, param_dtype, rngs, names=("embed", "vocab"))
        self.kv_caches = nnx.data(None)

    def init_cache(self, batch_size: int, max_length: int, *, dtype: DTypeLike | None = None,
                   kv_dtype: DTypeLike | None = None, page_size: int | None = None,
                   ssm_dtype: DTypeLike = jnp.float32) -> None:
        """Empty decode caches for `batch_size` rows of up to `max_length` tokens (see
        `HybridLM.init_cache`: conv states in `dtype`, SSM states in `ssm_dtype`, a KV cache of
        `kv_dtype`, dense or paged, per hybrid layer)."""
        check_sizes(batch_size=batch_size, max_length=max_length)
        dtype = jnp.dtype(dtype or self.config.dtype or jnp.float32)
        kv_dtype = jnp.dtype(kv_dtype or dtype)
        for layer in self.layers:
            layer.mixer.init_cache(batch_size, dtype, ssm_dtype)
        self.kv_caches = nnx.List([
            KVCacheSlot(self.shared[use % len(self.shared)].attention.empty_cache(
                batch_size, max_length, kv_dtype, page_size))
            for use in range(len(self.config.hybrid_layers))])

    def __call__(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                 decode: bool = False, lengths: jax.Array | None = None) -> jax.Array:
        return self._forward(tokens, segment_ids, decode, lengths, fresh=False)

    def _forward(self, tokens, segment_ids, decode, lengths, fresh, logits_at=None):
        lengths, in_vocab = self._inputs(tokens, segment_ids, decode, lengths)
        embeddings = self.embed(jnp.where(in_vocab, tokens, 0),
                                out_sharding=token_features(tokens))
        activation = _ACTIVATIONS[self.config.hidden_act]
        h = embeddings
        remat = nnx.remat if self.config.remat and not decode else lambda f: f
        for i, layer in enumerate(self.layers):
            x = h
            if i in self.config.hybrid_layers:
                use = self.config.hybrid_layers.index(i)
                block, k = self.shared[use % len(self.shared)], use // len(self.shared)
                if decode:
                    out, cache = block(h, embeddings, k, None, self.kv_caches[use].get(),
                                       lengths, fresh, activation)
                    self.kv_caches[use].set(cache)
                    x = h + self.linears[use](out)
                else:
                    shared_use = functools.partial(_shared_use, k, activation)  # positional:
                    x = remat(shared_use)(block, self.linears[use], h, embeddings,  # nnx.remat's
                                          segment_ids)
            if decode:
                h = h + layer.mixer(layer.norm(x), decode=True, lengths=lengths)
            else:
                h = remat(pre_norm_residual)(layer, h, x, segment_ids)
        return self._logits(h, in_vocab, logits_at, self.final_norm,
                            self.embed.attend if self.lm_head is None else self.lm_head)

    def _check_decode(self, batch, new):
        if self.kv_caches is None:
            raise ValueError("decode=True needs init_cache(batch_size, max_length) first")
        for layer in self.layers:
            layer.mixer.check_cache(batch)
        for slot in self.kv_caches:
            slot.get().check_fits(batch, new)

    # -----------------------------------------------------------------------------------------
    # Checkpoints, in transformers' names: model.embed_tokens, model.layers.{i}.mamba (or
    # .mamba_decoder.mamba for a hybrid layer, with its .linear), each shared block under the
    # first hybrid layer that uses it (model.layers.{i}.shared_transformer), its adapters
    # indexed by the hybrid layers' order.

    def _block_prefix(self, use):
        """Where the shared block of the `use`-th hybrid layer is saved."""
        layer = self.config.hybrid_layers[use % len(self.shared)]
        return f"model.layers.{layer}.shared_transformer"

    def _tensors(self):
        """(checkpoint name, module, kind) of every parameter (`io.load_tensors`)."""
        yield "model.embed_tokens", self.embed, "embedding"
        for i, layer in enumerate(self.layers):
            prefix = (f"model.layers.{i}.mamba_decoder" if i in self.config.hybrid_layers
                      else f"model.layers.{i}")
            yield f"{prefix}.input_layernorm", layer.norm, "norm"
            yield f"{prefix}.mamba", layer.mixer, "mixer"
        for use, i in enumerate(self.config.hybrid_layers):
            yield f"model.layers.{i}.linear", self.linears[use], "linear"
        for b, block in enumerate(self.shared):
            prefix = self._block_prefix(b)
            yield f"{prefix}.input_layernorm", block.input_layernorm, "norm"
            yield f"{prefix}.pre_ff_layernorm", block.pre_ff_layernorm, "norm"
            attention = block.attention
            for name, projection in zip("qkv", (attention.query, attention.key,
                                                attention.value), strict=True):
                yield f"{prefix}.self_attn.{name}_proj", projection, "linear"
            yield f"{prefix}.self_attn.o_proj", attention.out, "linear_heads_in"
            yield f"{prefix}.feed_forward.gate_up_proj", block.gate_up, "linear"
            yield f"{prefix}.feed_forward.down_proj", block.down, "linear"
            for k, adapters in enumerate(block.adapters):
                use = b + k * len(self.shared)
                lists = [("feed_forward.gate_up_proj", adapters.mlp)]
                if adapters.qkv is not None:
                    lists += [(f"self_attn.linear_{name}", adapter)
                              for name, adapter in zip("qkv", adapters.qkv, strict=True)]
                for name, adapter in lists:
                    yield f"{prefix}.{name}_adapter_list.{use}.0", adapter.down, "linear"
                    yield f"{prefix}.{name}_adapter_list.{use}.1", adapter.up, "linear"
        yield "model.final_layernorm", self.final_norm, "norm"
        if self.lm_head is not None:
            yield "lm_head", self.lm_head, "linear"

    @classmethod
    def from_pretrained(cls, source: str | os.PathLike | Mapping[str, Any], *,
                        config: Zamba2Config | None = None,
                        param_dtype: DTypeLike = jnp.float32, **overrides: Any) -> Self:
        """A Zamba2LM with the weights of a transformers checkpoint (a directory with
        config.json and safetensors, a single file, or a state dict; see
        `Mamba2LM.from_pretrained`). Copies of a shared block saved under its later hybrid
        layers (tied weights) must equal the first."""
        return io.from_pretrained(cls, Zamba2Config, source, config, param_dtype, overrides)

    def _load(self, reader):
        io.load_tensors(reader, self._tensors())
        for use, i in enumerate(self.config.hybrid_layers[len(self.shared):],
                                start=len(self.shared)):
            copy, original = f"model.layers.{i}.shared_transformer.", self._block_prefix(use)
            for name in [n for n in reader.tensors if n.startswith(copy)]:
                reader.tied(name, original + "." + name[len(copy):])
        if self.lm_head is None:
            reader.tied("lm_head.weight", "model.embed_tokens.weight")

    def state_dict(self, *, dtype: DTypeLike | None = None) -> dict[str, Any]:
        """The parameters as numpy arrays in transformers' layout and names (what its
        `save_pretrained` writes: each shared block once), in `dtype` (default: the dtype the
        source checkpoint recorded, else float32)."""
        return io.export_tensors(self._tensors(),
                                 jnp.dtype(dtype or io.source_dtype(self.config)))

    def save_pretrained(self, directory: str | os.PathLike, *,
                        dtype: DTypeLike | None = None) -> str:
        """Writes config.json (transformers' Zamba2Config) and model.safetensors into
        `directory`, which transformers' `Zamba2ForCausalLM.from_pretrained` reads."""
        return io.save_pretrained(self, directory, dtype)


def _shared_use(use, activation, block, linear, h, embeddings, segment_ids):
    """A hybrid layer's input: h + linear(the shared block's output) (`remat` recomputes it)."""
    out, _ = block(h, embeddings, use, segment_ids, None, None, False, activation)
    return h + linear(out)
