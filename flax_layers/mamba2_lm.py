"""Mamba2 language model (transformers' `Mamba2ForCausalLM`, mamba_ssm's `MambaLMHeadModel` with
Mamba2 layers) with checkpoint loading and export."""

import dataclasses
import json
import os
import warnings
from collections.abc import Mapping
from typing import Any, Self

import jax
import jax.numpy as jnp
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
from flax_layers.generation import CausalLM
from flax_layers.mamba2 import Mamba2, mixer_shape, pre_norm_residual
from pallas_kernels import arguments


@dataclasses.dataclass(frozen=True)
class Mamba2LMConfig:
    """Sizes of a Mamba2LM, with the names of mamba_ssm's `Mamba2` layer.

    `from_dict` reads transformers' `Mamba2Config` (config.json, model_type "mamba2") or
    mamba_ssm's config.json; `to_transformers` writes the former. `source` keeps the
    config.json the model was loaded from (JSON text), so an export keeps its other fields
    (token ids, ...). `remat` recomputes each block in the backward (less memory for a
    second forward). Every field is checked on construction (ValueError or TypeError naming
    it).
    """

    vocab_size: int = 256
    d_model: int = 64
    num_layers: int = 2
    d_state: int = 128
    headdim: int = 64
    ngroups: int = 1
    expand: int = 2
    d_conv: int = 4
    chunk_size: int = 256
    norm_eps: float = 1e-5  # the block norms' and the gated norm's
    bias: bool = False  # in_proj's and out_proj's
    conv_bias: bool = True
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    residual_in_fp32: bool = True
    tie_embeddings: bool = False
    remat: bool = False  # recompute each block in the backward
    dtype: DTypeLike | None = None
    implementation: str | None = None
    source: str | None = None

    def __post_init__(self):
        check_sizes(vocab_size=self.vocab_size, num_layers=self.num_layers)
        mixer_shape(self.d_model, self.d_state, self.d_conv, self.expand, self.headdim,
                    self.ngroups, self.chunk_size)
        check_flags(bias=self.bias, conv_bias=self.conv_bias,
                    residual_in_fp32=self.residual_in_fp32, tie_embeddings=self.tie_embeddings,
                    remat=self.remat)
        check_positive_numbers(norm_eps=self.norm_eps)
        if self.norm_eps is None:
            raise TypeError("norm_eps must be a number, got None")
        object.__setattr__(self, "dt_limit", arguments.check_dt_limit(tuple(self.dt_limit)))
        check_dtypes(dtype=self.dtype)
        check_implementation(self.implementation)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], **overrides: Any) -> Self:
        """From transformers' Mamba2Config dict (its defaults where a field is missing) or
        mamba_ssm's config.json dict; `overrides` (dtype, implementation, chunk_size, ...)
        replace fields. With n_groups > 1 a warning: transformers' own inference normalises
        the gated RMSNorm over all channels, this model (as mamba_ssm) per group."""
        if "ssm_cfg" in config or "n_layer" in config:
            return cls._from_mamba_ssm(config, **overrides)
        if config.get("model_type", "mamba2") != "mamba2":
            raise ValueError(f"a Mamba2LM loads model_type 'mamba2', got "
                             f"{config.get('model_type')!r}")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Mamba2 uses hidden_act 'silu', got {config['hidden_act']!r}")
        fields = dict(
            vocab_size=config.get("vocab_size", 32768), d_model=config.get("hidden_size", 4096),
            num_layers=config.get("num_hidden_layers", 64), d_state=config.get("state_size", 128),
            headdim=config.get("head_dim", 64), ngroups=config.get("n_groups", 8),
            expand=config.get("expand", 2), d_conv=config.get("conv_kernel", 4),
            chunk_size=config.get("chunk_size", 256),
            norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
            bias=config.get("use_bias", False), conv_bias=config.get("use_conv_bias", True),
            dt_limit=tuple(io.number(x) for x in config.get("time_step_limit",
                                                            (0.0, float("inf")))),
            residual_in_fp32=config.get("residual_in_fp32", True),
            tie_embeddings=config.get("tie_word_embeddings", False),
            source=json.dumps(dict(config), sort_keys=True),
        )
        heads = config.get("num_heads")
        if heads is not None and heads * fields["headdim"] != fields["expand"] * fields["d_model"]:
            raise ValueError(f"num_heads * head_dim ({heads} * {fields['headdim']}) must equal "
                             f"expand * hidden_size ({fields['expand']} * {fields['d_model']})")
        if fields["ngroups"] > 1:
            warnings.warn(
                f"n_groups={fields['ngroups']}: this Mamba2LM normalises the gated RMSNorm per "
                "group, as mamba_ssm's kernels (which trained the published models) do; "
                "transformers' inference normalises over all channels, so its logits differ",
                stacklevel=2)
        return cls(**{**fields, **overrides})

    @classmethod
    def _from_mamba_ssm(cls, config, **overrides):
        ssm = dict(config.get("ssm_cfg", {}))
        if ssm.get("layer", "Mamba1") != "Mamba2":  # mamba_ssm's default layer is Mamba1
            raise ValueError(f"a Mamba2LM loads Mamba2 layers, got ssm_cfg layer "
                             f"{ssm.get('layer', 'Mamba1 (the default)')!r}")
        if ssm.get("d_ssm") is not None:
            raise ValueError("ssm_cfg d_ssm (a gated MLP beside the SSM) is not supported")
        if config.get("d_intermediate", 0) or config.get("attn_layer_idx"):
            raise ValueError("mamba_ssm configs with MLP (d_intermediate) or attention layers "
                             "(attn_layer_idx) are not a Mamba2LM")
        if not config.get("rms_norm", True):
            raise ValueError("a Mamba2LM has RMSNorm (mamba_ssm's rms_norm=True)")
        for option, default in (("rmsnorm", True), ("norm_before_gate", False),
                                ("D_has_hdim", False)):
            if ssm.get(option, default) != default:
                raise ValueError(f"ssm_cfg {option}={ssm[option]!r} is not supported")
        multiple = config.get("pad_vocab_size_multiple", 8)  # mamba_ssm's default
        vocab = -(-config["vocab_size"] // multiple) * multiple
        fields = dict(
            vocab_size=vocab, d_model=config["d_model"], num_layers=config["n_layer"],
            d_state=ssm.get("d_state", 128), headdim=ssm.get("headdim", 64),
            ngroups=ssm.get("ngroups", 1), expand=ssm.get("expand", 2),
            d_conv=ssm.get("d_conv", 4), chunk_size=ssm.get("chunk_size", 256),
            bias=ssm.get("bias", False), conv_bias=ssm.get("conv_bias", True),
            dt_limit=tuple(float(x) for x in ssm.get("dt_limit", (0.0, float("inf")))),
            residual_in_fp32=config.get("residual_in_fp32", True),
            tie_embeddings=config.get("tie_embeddings", True),
            source=json.dumps(dict(config), sort_keys=True),
        )
        return cls(**{**fields, **overrides})

    def to_transformers(self, dtype: DTypeLike = jnp.float32) -> dict[str, Any]:
        """transformers' Mamba2Config dict (config.json) for these sizes, over the source's
        other fields where it was one."""
        source = json.loads(self.source) if self.source else {}
        if "ssm_cfg" in source or "n_layer" in source:
            source = {}
        source.pop("torch_dtype", None)  # `dtype` below replaces it
        return {**source, **dict(
            architectures=["Mamba2ForCausalLM"], model_type="mamba2",
            vocab_size=self.vocab_size, hidden_size=self.d_model,
            num_hidden_layers=self.num_layers, state_size=self.d_state, head_dim=self.headdim,
            num_heads=self.expand * self.d_model // self.headdim, n_groups=self.ngroups,
            expand=self.expand, conv_kernel=self.d_conv, chunk_size=self.chunk_size,
            layer_norm_epsilon=self.norm_eps, use_bias=self.bias,
            use_conv_bias=self.conv_bias, hidden_act="silu",
            time_step_limit=[io.json_number(x) for x in self.dt_limit],
            residual_in_fp32=self.residual_in_fp32, tie_word_embeddings=self.tie_embeddings,
            dtype=jnp.dtype(dtype).name,
        )}


class _Block(nnx.Module):
    def __init__(self, config, index, param_dtype, rngs):
        self.norm = nnx.RMSNorm(config.d_model, epsilon=config.norm_eps, dtype=config.dtype,
                                param_dtype=param_dtype, scale_metadata=logical("embed"),
                                rngs=rngs)
        self.mixer = Mamba2(
            config.d_model, d_state=config.d_state, d_conv=config.d_conv, expand=config.expand,
            headdim=config.headdim, ngroups=config.ngroups, chunk_size=config.chunk_size,
            norm_eps=config.norm_eps, dt_limit=config.dt_limit, bias=config.bias,
            conv_bias=config.conv_bias, layer_idx=index, dtype=config.dtype,
            param_dtype=param_dtype, implementation=config.implementation, rngs=rngs,
        )


class Mamba2LM(CausalLM):
    """Embedding -> Mamba2 blocks (pre-norm residual, the residual stream in float32 with
    `residual_in_fp32`) -> RMSNorm -> LM head (the embedding's transpose with
    `tie_embeddings`).

    `__call__(tokens (B, T) int, *, segment_ids=None, decode=False, lengths=None)` returns
    logits (B, T, V) float32; with `decode=True` (after `init_cache`) the tokens continue each
    row's cached conv and SSM states (`lengths` (B,): real tokens per row). `generate` samples
    in one compiled call. `from_pretrained` loads transformers' or mamba_ssm's checkpoints;
    `state_dict` and `save_pretrained` export them.

    Where the references differ:
    - transformers' inference (its fused kernel runs only in training) normalises the gated
      RMSNorm over all d_inner channels whatever n_groups; mamba_ssm's kernels, which trained
      the published models, and this model normalise each group. They agree at n_groups = 1.
    - A step size limit (`dt_limit`) clamps the decode step here as in the forward, so that
      decoding gives the forward's outputs; transformers' and mamba_ssm's one-token steps do
      not clamp. They agree where the limit does not bind (the default (0, inf) never does).
    """

    def __init__(self, config: Mamba2LMConfig, *, param_dtype: DTypeLike = jnp.float32,
                 rngs: nnx.Rngs):
        if not isinstance(config, Mamba2LMConfig):
            raise TypeError(f"config must be a Mamba2LMConfig, got {type(config).__name__}")
        self.config = config
        self.embed = nnx.Embed(config.vocab_size, config.d_model, dtype=config.dtype,
                               param_dtype=param_dtype,
                               embedding_metadata=logical("vocab", "embed"), rngs=rngs)
        self.blocks = nnx.List([_Block(config, i, param_dtype, rngs)
                                 for i in range(config.num_layers)])
        self.norm_f = nnx.RMSNorm(config.d_model, epsilon=config.norm_eps, dtype=config.dtype,
                                  param_dtype=param_dtype, scale_metadata=logical("embed"),
                                  rngs=rngs)
        self.lm_head = None if config.tie_embeddings else nnx.Linear(
            config.d_model, config.vocab_size, use_bias=False, dtype=config.dtype,
            param_dtype=param_dtype, kernel_metadata=logical("embed", "vocab"), rngs=rngs)

    def init_cache(self, batch_size: int, max_length: int | None = None, *,
                   dtype: DTypeLike | None = None, kv_dtype: DTypeLike | None = None,
                   page_size: int | None = None, ssm_dtype: DTypeLike = jnp.float32) -> None:
        """Empty decode caches for `batch_size` rows: per block a conv state (in `dtype`,
        default the model's) and an SSM state (`ssm_dtype`, float32 by default; see
        `Mamba2.init_cache`). A Mamba2LM holds no KV cache: its
        caches do not grow, and `max_length`, `kv_dtype` and `page_size` change nothing."""
        check_sizes(batch_size=batch_size)
        dtype = jnp.dtype(dtype or self.config.dtype or jnp.float32)
        for block in self.blocks:
            block.mixer.init_cache(batch_size, dtype, ssm_dtype)

    def __call__(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                 decode: bool = False, lengths: jax.Array | None = None) -> jax.Array:
        return self._forward(tokens, segment_ids, decode, lengths, fresh=False)

    def _forward(self, tokens, segment_ids, decode, lengths, fresh, logits_at=None):
        lengths, in_vocab = self._inputs(tokens, segment_ids, decode, lengths)
        h = self.embed(jnp.where(in_vocab, tokens, 0), out_sharding=token_features(tokens))
        if self.config.residual_in_fp32:
            h = h.astype(jnp.float32)
        block_forward = nnx.remat(pre_norm_residual) if self.config.remat else pre_norm_residual
        for block in self.blocks:
            if decode:
                h = h + block.mixer(block.norm(h), decode=True, lengths=lengths)
            else:
                h = block_forward(block, h, None, segment_ids)  # positional: nnx.remat's
        return self._logits(h, in_vocab, logits_at, self.norm_f,
                            self.embed.attend if self.lm_head is None else self.lm_head)

    def _check_decode(self, batch, new):
        for block in self.blocks:
            block.mixer.check_cache(batch)

    # -----------------------------------------------------------------------------------------
    # Checkpoints

    @classmethod
    def from_pretrained(cls, source: str | os.PathLike | Mapping[str, Any], *,
                        config: Mamba2LMConfig | None = None,
                        param_dtype: DTypeLike = jnp.float32, **overrides: Any) -> Self:
        """A Mamba2LM with the weights of a checkpoint: a directory with config.json and
        safetensors (or a torch state dict), a single file, or a state dict in memory, in
        transformers' names (`backbone.embeddings.weight`, `backbone.layers.{i}.mixer.*`,
        ...) or mamba_ssm's (`backbone.embedding.weight`, ...). `config` is needed where the
        source has no config.json; `overrides` (dtype, implementation, chunk_size, ...)
        replace its fields. Parameters are `param_dtype` (float32 by default, for training);
        every tensor must be used, with the shape the config gives it."""
        return io.from_pretrained(cls, Mamba2LMConfig, source, config, param_dtype, overrides)

    def _tensors(self, names="transformers"):
        """(checkpoint name, module, kind) of every parameter (`io.load_tensors`), in
        transformers' names or mamba_ssm's (the embedding's only differs)."""
        embedding = "embedding" if names == "mamba_ssm" else "embeddings"
        yield f"backbone.{embedding}", self.embed, "embedding"
        for i, block in enumerate(self.blocks):
            yield f"backbone.layers.{i}.norm", block.norm, "norm"
            yield f"backbone.layers.{i}.mixer", block.mixer, "mixer"
        yield "backbone.norm_f", self.norm_f, "norm"
        if self.lm_head is not None:
            yield "lm_head", self.lm_head, "linear"

    def _load(self, reader):
        names = "mamba_ssm" if "backbone.embedding.weight" in reader else "transformers"
        io.load_tensors(reader, self._tensors(names))
        if self.lm_head is None:
            embedding = "embedding" if names == "mamba_ssm" else "embeddings"
            reader.tied("lm_head.weight", f"backbone.{embedding}.weight")

    def state_dict(self, *, dtype: DTypeLike | None = None,
                   names: str = "transformers") -> dict[str, Any]:
        """The parameters as numpy arrays in transformers' layout and names (`names=
        "mamba_ssm"`: mamba_ssm's, with a tied LM head written under its own name too, as
        mamba_ssm's state dict holds it), in `dtype` (default: the dtype the source
        checkpoint recorded, else float32)."""
        if names not in ("transformers", "mamba_ssm"):
            raise ValueError(f"names must be 'transformers' or 'mamba_ssm', got {names!r}")
        out = io.export_tensors(self._tensors(names),
                                jnp.dtype(dtype or io.source_dtype(self.config)))
        if names == "mamba_ssm" and self.lm_head is None:
            out["lm_head.weight"] = out["backbone.embedding.weight"]
        return out

    def save_pretrained(self, directory: str | os.PathLike, *,
                        dtype: DTypeLike | None = None) -> str:
        """Writes config.json (transformers' Mamba2Config) and model.safetensors into
        `directory`, which transformers' `Mamba2ForCausalLM.from_pretrained` reads."""
        return io.save_pretrained(self, directory, dtype)
