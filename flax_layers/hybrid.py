"""A Zamba2-style hybrid language model: Mamba2 blocks and one shared attention + MLP block."""

import dataclasses
from typing import Any, Self

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from flax_layers._checks import check_dtypes, check_flags, check_implementation, check_sizes
from flax_layers._sharding import (
    check_whole_parameters,
    logical,
    reorder_sequence,
    token_features,
)
from flax_layers.attention import FlashMultiHeadAttention, KVCacheSlot, check_heads
from flax_layers.generation import CausalLM
from flax_layers.mamba2 import Mamba2, mixer_shape, pre_norm_residual
from pallas_kernels import arguments


@dataclasses.dataclass(frozen=True)
class HybridLMConfig:
    """Sizes of a HybridLM. `shared_every` Mamba2 blocks are followed by the shared block.

    Every field is checked on construction (and by `dataclasses.replace`): a ValueError or
    TypeError naming it for a size that is not a positive int, `shared_every` not dividing
    `num_layers`, what `FlashMultiHeadAttention` and `Mamba2` would reject (`num_kv_heads`
    not dividing `num_heads`, an odd `attn_head_dim` with `rope_theta`, `expand * d_model`
    not divisible by `ssm_head_dim`, heads not divisible by `ngroups`, `chunk_size` not a power
    of two, ...), a `dtype` that is not a floating dtype or None, an unknown `implementation`,
    `attention_implementation`, `context_parallelism` or `sequence_order`.

    `implementation` picks the kernels or the jnp references for every op (but one decoded
    token's conv, always the jnp expression: `Mamba2`);
    `attention_implementation` (default: the same) may pick "cudnn" for the shared block's
    attention (jax.nn's cuDNN attention; decoding runs the kernels). With `remat` each block's
    activations are recomputed in the backward (jax.checkpoint per Mamba2 block and per use of
    the shared block): less memory for a second forward.

    On a mesh with Explicit axes (`jax.make_mesh`) the model follows its tokens' sharding:
    batch (data parallelism) and sequence (context parallelism) axes shard every activation,
    the kernels run per shard and the Mamba2 conv takes its history from the shard before. With
    `sequence_order="zigzag"` the tokens (and segment ids) come in `pallas_kernels.zigzag`
    order, which balances causal attention; the Mamba2 blocks run on contiguous shards between
    two reorders per use of the shared block, and the logits come out in the tokens' order.
    Parameters are where the caller puts them (`parameter_shardings` shards them over fsdp and
    tensor; `gather_parameters` gathers fsdp before the forward). Over a tensor axis the logits
    come out sharded over the vocabulary.
    """

    vocab_size: int = 256
    d_model: int = 64
    num_layers: int = 4  # Mamba2 blocks
    shared_every: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    attn_head_dim: int = 32
    mlp_hidden: int = 256
    d_state: int = 16
    ssm_head_dim: int = 16  # Mamba2 head dim (mamba_ssm's headdim)
    ngroups: int = 1
    expand: int = 2
    d_conv: int = 4
    chunk_size: int = 64
    rope_theta: float | None = 10000.0
    dtype: DTypeLike | None = None
    implementation: str | None = None
    attention_implementation: str | None = None  # None: `implementation`; or "cudnn"
    remat: bool = False  # recompute each block's activations in the backward
    context_parallelism: str = "all_gather"  # attention's, where the sequence is sharded
    sequence_order: str = "contiguous"  # or "zigzag": the tokens' order on the devices

    def __post_init__(self):
        check_sizes(vocab_size=self.vocab_size, num_layers=self.num_layers,
                    shared_every=self.shared_every, attn_head_dim=self.attn_head_dim,
                    ssm_head_dim=self.ssm_head_dim, mlp_hidden=self.mlp_hidden)
        if self.num_layers % self.shared_every:
            raise ValueError(f"num_layers ({self.num_layers}) must be a multiple of "
                             f"shared_every ({self.shared_every})")
        check_heads(self.num_heads, self.num_kv_heads, self.num_heads * self.attn_head_dim,
                    self.rope_theta)
        mixer_shape(self.d_model, self.d_state, self.d_conv, self.expand, self.ssm_head_dim,
                    self.ngroups, self.chunk_size)
        check_dtypes(dtype=self.dtype)
        check_implementation(self.implementation)
        check_implementation(self.attention_implementation, name="attention_implementation",
                             attention=True)
        check_flags(remat=self.remat)
        arguments.check_context_parallelism(self.context_parallelism)
        arguments.check_sequence_order(self.sequence_order)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> Self:
        """"tiny" (trains on a CPU in minutes), "small", or "zamba2-1.2b" (Zamba2-1.2B's sizes
        in this Zamba2-style model: d_model 2048, Mamba2 blocks with state 64, a shared 32-head
        block every 6; 36 blocks, as a shared block every 6 cannot divide Zamba2-1.2B's 38).
        `flax_layers.Zamba2Config.preset("zamba2-1.2b")` is the published architecture itself
        (38 layers, state 128, adapters, its hybrid layer pattern), for `Zamba2LM`."""
        presets = {
            "tiny": {},
            "small": dict(d_model=512, num_layers=12, shared_every=4, num_heads=8,
                          num_kv_heads=2, attn_head_dim=64, mlp_hidden=2048, d_state=64,
                          ssm_head_dim=64,
                          chunk_size=128),
            "zamba2-1.2b": dict(vocab_size=32000, d_model=2048, num_layers=36, shared_every=6,
                                num_heads=32, num_kv_heads=32, attn_head_dim=128, mlp_hidden=8192,
                                d_state=64, ssm_head_dim=64, chunk_size=256),
        }
        if name not in presets:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(presets)}")
        return cls(**{**presets[name], **overrides})


def _rms_norm(features, config, rngs):
    return nnx.RMSNorm(features, dtype=config.dtype, scale_metadata=logical("embed"), rngs=rngs)


class _MambaBlock(nnx.Module):
    def __init__(self, config, rngs):
        self.norm = _rms_norm(config.d_model, config, rngs)
        self.mixer = Mamba2(
            config.d_model, d_state=config.d_state, d_conv=config.d_conv, expand=config.expand,
            headdim=config.ssm_head_dim, ngroups=config.ngroups, chunk_size=config.chunk_size,
            dtype=config.dtype, implementation=config.implementation, rngs=rngs,
        )


class _SharedBlock(nnx.Module):
    """Attention over [hidden, embeddings] (as Zamba2) then an MLP, each with a residual."""

    def __init__(self, config, rngs):
        d = config.d_model
        self.attn_norm = _rms_norm(2 * d, config, rngs)
        self.attention = FlashMultiHeadAttention(
            config.num_heads, 2 * d, config.num_heads * config.attn_head_dim, d,
            num_kv_heads=config.num_kv_heads, is_causal=True, rope_theta=config.rope_theta,
            use_bias=False, dtype=config.dtype,
            implementation=config.attention_implementation or config.implementation,
            context_parallelism=config.context_parallelism,
            sequence_order=config.sequence_order, rngs=rngs,
        )
        self.mlp_norm = _rms_norm(d, config, rngs)
        self.up = nnx.Linear(d, config.mlp_hidden, dtype=config.dtype, rngs=rngs,
                             kernel_metadata=logical("embed", "mlp"), bias_metadata=logical("mlp"))
        self.down = nnx.Linear(config.mlp_hidden, d, dtype=config.dtype, rngs=rngs,
                               kernel_metadata=logical("mlp", "embed"),
                               bias_metadata=logical("embed"))

    def __call__(self, h, embeddings, segment_ids, cache, lengths=None, fresh=False):
        x = self.attn_norm(jnp.concatenate([h, embeddings], axis=-1))
        if cache is None:
            h = h + self.attention(x, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                                   decode=False)
        else:
            out, cache = self.attention.attend_cached(x, cache, new_lengths=lengths, fresh=fresh)
            h = h + out
        hidden = jax.nn.gelu(self.up(self.mlp_norm(h)))
        return h + self.down(hidden, out_sharding=token_features(h)), cache


class HybridLM(CausalLM):
    """Token embedding -> Mamba2 blocks (pre-norm residual), with one shared attention + MLP
    block (shared weights) after every `shared_every` of them -> RMSNorm -> tied LM head.

    `__call__(tokens (B, T) int, *, segment_ids=None, decode=False)` returns logits (B, T, V)
    float32. Token ids must lie in [0, vocab_size): eagerly an id outside is a ValueError;
    inside jit, ids outside [0, vocab) give NaN logits at their positions (the tokens after
    them see id 0 there).

    A call without `decode` never touches the caches. With `decode=True` (after `init_cache`)
    the tokens (no segment ids) continue each row's cached sequence; `lengths` (B,) says how
    many of each row's tokens are real (a ragged prompt, padded at the end; default all). A
    batch other than the caches', more tokens than they hold, or (eagerly) tokens past their
    capacity are a ValueError, raised before any cache changes. Inside jit the fill is not
    known: a row that does not fit keeps its KV caches and gets NaN logits, and so does every
    later call for it (its Mamba2 states then hold no meaningful values) until `init_cache`.
    `generate` sizes its caches so that this never happens.
    """

    def __init__(self, config: HybridLMConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, HybridLMConfig):
            raise TypeError(f"config must be a HybridLMConfig, got {type(config).__name__}")
        self.config = config
        self.embed = nnx.Embed(
            config.vocab_size, config.d_model, dtype=config.dtype,
            embedding_init=nnx.initializers.normal(0.02),
            embedding_metadata=logical("vocab", "embed"), rngs=rngs,
        )
        self.blocks = nnx.List([_MambaBlock(config, rngs) for _ in range(config.num_layers)])
        self.shared = _SharedBlock(config, rngs)
        self.final_norm = _rms_norm(config.d_model, config, rngs)
        self.kv_caches = nnx.data(None)

    def init_cache(self, batch_size: int, max_length: int, *, dtype: DTypeLike | None = None,
                   kv_dtype: DTypeLike | None = None, page_size: int | None = None,
                   ssm_dtype: DTypeLike = jnp.float32) -> None:
        """Empty decode caches for `batch_size` rows of up to `max_length` tokens: per Mamba2
        block a conv state (in `dtype`, default the model's) and an SSM state (`ssm_dtype`,
        float32 by default; see `Mamba2.init_cache`); per use
        of the shared block a KV cache of `kv_dtype` (default `dtype`; int8, float8_e4m3fn or
        float8_e4m3fnuz store 8-bit entries with a scale per token and head), dense or in pages
        of `page_size` tokens (`flax_layers.attention.empty_kv_cache`)."""
        check_sizes(batch_size=batch_size, max_length=max_length)
        dtype = jnp.dtype(dtype or self.config.dtype or jnp.float32)
        kv_dtype = jnp.dtype(kv_dtype or dtype)
        for block in self.blocks:
            block.mixer.init_cache(batch_size, dtype, ssm_dtype)
        uses = self.config.num_layers // self.config.shared_every
        self.kv_caches = nnx.List([
            KVCacheSlot(self.shared.attention.empty_cache(batch_size, max_length, kv_dtype,
                                                          page_size))
            for _ in range(uses)
        ])

    def __call__(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                 decode: bool = False, lengths: jax.Array | None = None) -> jax.Array:
        return self._forward(tokens, segment_ids, decode, lengths, fresh=False)

    def _forward(self, tokens, segment_ids, decode, lengths, fresh, logits_at=None):
        """`__call__`; with `fresh` (the caches were just initialised: a prefill) the shared
        block's attention runs the FlashAttention kernel over the prompt itself; with
        `logits_at` (B,) only the logits at those positions, (B, 1, V) (a prefill needs the
        last prompt token's: the (B, T, V) logits of a long prompt are large)."""
        lengths, in_vocab = self._inputs(tokens, segment_ids, decode, lengths)
        embeddings = self.embed(jnp.where(in_vocab, tokens, 0),
                                out_sharding=token_features(tokens))
        # The Mamba2 blocks run on contiguous sequence shards, the shared block in the tokens'
        # order (zig-zag balances causal attention); `h` is reordered only where they change.
        order = self.config.sequence_order
        seq_idx = None if segment_ids is None else reorder_sequence(segment_ids, order,
                                                                    "contiguous")
        h, h_order = embeddings, order
        mamba_block, shared_block = pre_norm_residual, _shared_block
        if self.config.remat and not decode:
            mamba_block, shared_block = nnx.remat(mamba_block), nnx.remat(shared_block)
        for i, block in enumerate(self.blocks):
            h, h_order = reorder_sequence(h, h_order, "contiguous"), "contiguous"
            if decode:
                h = h + block.mixer(block.norm(h), decode=True, lengths=lengths)
            else:
                h = mamba_block(block, h, None, seq_idx)  # positional: nnx.remat's
            if (i + 1) % self.config.shared_every == 0:
                use = (i + 1) // self.config.shared_every - 1
                h, h_order = reorder_sequence(h, h_order, order), order
                if decode:
                    h, cache = self.shared(h, embeddings, None, self.kv_caches[use].get(),
                                           lengths, fresh)
                    self.kv_caches[use].set(cache)
                else:
                    h = shared_block(self.shared, h, embeddings, segment_ids)
        h = reorder_sequence(h, h_order, order)
        return self._logits(h, in_vocab, logits_at, self.final_norm, self.embed.attend)

    def _check_decode(self, batch, new):
        """A ValueError, before any cache changes, unless `new` tokens of `batch` rows fit
        every cache (see `KVCache.check_fits`) and the parameters are whole (the decode path
        does not run tensor-parallel)."""
        if self.kv_caches is None:
            raise ValueError("decode=True needs init_cache(batch_size, max_length) first")
        check_whole_parameters(self)
        for block in self.blocks:
            block.mixer.check_cache(batch)
        for slot in self.kv_caches:
            slot.get().check_fits(batch, new)


@jax.named_scope("shared_block")
def _shared_block(shared, h, embeddings, segment_ids):
    """The shared block's forward (`HybridLMConfig.remat` recomputes it)."""
    return shared(h, embeddings, segment_ids, None)[0]
