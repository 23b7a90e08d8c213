"""A Zamba2-style hybrid language model: Mamba2 blocks and one shared attention + MLP block."""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from flax_layers._sharding import logical
from flax_layers.attention import FlashMultiHeadAttention, KVCache
from flax_layers.mamba2 import Mamba2


@dataclasses.dataclass(frozen=True)
class HybridLMConfig:
    """Sizes of a HybridLM. `shared_every` Mamba2 blocks are followed by the shared block."""

    vocab_size: int = 256
    d_model: int = 64
    num_layers: int = 4  # Mamba2 blocks
    shared_every: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    mlp_hidden: int = 256
    d_state: int = 16
    headdim: int = 16  # Mamba2 head dim
    ngroups: int = 1
    expand: int = 2
    d_conv: int = 4
    chunk_size: int = 64
    rope_theta: float = 10000.0
    dtype: object = None
    implementation: str | None = None

    @classmethod
    def preset(cls, name, **overrides):
        """"tiny" (trains on a CPU in minutes), "small", or "zamba2-1.2b" (Zamba2-1.2B's shape:
        d_model 2048, 38 Mamba2 blocks with state 64, a shared 32-head block every 6)."""
        presets = {
            "tiny": {},
            "small": dict(d_model=512, num_layers=12, shared_every=4, num_heads=8,
                          num_kv_heads=2, head_dim=64, mlp_hidden=2048, d_state=64, headdim=64,
                          chunk_size=128),
            "zamba2-1.2b": dict(vocab_size=32000, d_model=2048, num_layers=38, shared_every=6,
                                num_heads=32, num_kv_heads=32, head_dim=128, mlp_hidden=8192,
                                d_state=64, headdim=64, chunk_size=256),
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
            headdim=config.headdim, ngroups=config.ngroups, chunk_size=config.chunk_size,
            dtype=config.dtype, implementation=config.implementation, rngs=rngs,
        )


class _SharedBlock(nnx.Module):
    """Attention over [hidden, embeddings] (as Zamba2) then an MLP, each with a residual."""

    def __init__(self, config, rngs):
        d = config.d_model
        self.attn_norm = _rms_norm(2 * d, config, rngs)
        self.attention = FlashMultiHeadAttention(
            config.num_heads, 2 * d, config.num_heads * config.head_dim, d,
            num_kv_heads=config.num_kv_heads, is_causal=True, rope_theta=config.rope_theta,
            dtype=config.dtype, implementation=config.implementation, rngs=rngs,
        )
        self.mlp_norm = _rms_norm(d, config, rngs)
        self.up = nnx.Linear(d, config.mlp_hidden, dtype=config.dtype, rngs=rngs,
                             kernel_metadata=logical("embed", "mlp"), bias_metadata=logical("mlp"))
        self.down = nnx.Linear(config.mlp_hidden, d, dtype=config.dtype, rngs=rngs,
                               kernel_metadata=logical("mlp", "embed"),
                               bias_metadata=logical("embed"))

    def __call__(self, h, embeddings, segment_ids, cache):
        x = self.attn_norm(jnp.concatenate([h, embeddings], axis=-1))
        if cache is None:
            h = h + self.attention(x, q_segment_ids=segment_ids, kv_segment_ids=segment_ids)
        else:
            out, cache = self.attention.attend_cached(x, cache)
            h = h + out
        return h + self.down(jax.nn.gelu(self.up(self.mlp_norm(h)))), cache


class _CacheSlot(nnx.Module):
    """A KVCache held as nnx.Cache variables (one per use of the shared block)."""

    def __init__(self, cache):
        self.keys, self.values, self.index = (nnx.Cache(x) for x in cache)

    def get(self):
        return KVCache(self.keys[...], self.values[...], self.index[...])

    def set(self, cache):
        self.keys[...], self.values[...], self.index[...] = cache


class HybridLM(nnx.Module):
    """Token embedding -> Mamba2 blocks (pre-norm residual), with one shared attention + MLP
    block (shared weights) after every `shared_every` of them -> RMSNorm -> tied LM head.

    `__call__(tokens (B, T) int, *, segment_ids=None, decode=False)` returns logits (B, T, V).
    With `decode=True` (after `init_cache`) the tokens continue the cached sequence.
    """

    def __init__(self, config, *, rngs):
        if config.num_layers % config.shared_every:
            raise ValueError(f"num_layers ({config.num_layers}) must be a multiple of "
                             f"shared_every ({config.shared_every})")
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

    def init_cache(self, batch_size, max_length):
        """Empty decode caches: conv/SSM states per Mamba2 block, a KV cache per shared use."""
        for block in self.blocks:
            block.mixer.init_cache(batch_size)
        uses = self.config.num_layers // self.config.shared_every
        self.kv_caches = nnx.List([
            _CacheSlot(self.shared.attention.empty_cache(batch_size, max_length))
            for _ in range(uses)
        ])

    def __call__(self, tokens, *, segment_ids=None, decode=False):
        if decode and self.kv_caches is None:
            raise ValueError("decode=True needs init_cache(batch_size, max_length) first")
        embeddings = self.embed(tokens)
        h = embeddings
        for i, block in enumerate(self.blocks):
            h = h + block.mixer(block.norm(h), seq_idx=segment_ids, decode=decode)
            if (i + 1) % self.config.shared_every == 0:
                use = (i + 1) // self.config.shared_every - 1
                cache = self.kv_caches[use].get() if decode else None
                h, cache = self.shared(h, embeddings, segment_ids, cache)
                if decode:
                    self.kv_caches[use].set(cache)
        return self.embed.attend(self.final_norm(h)).astype(jnp.float32)

    def generate(self, prompt_tokens, max_new_tokens, *, temperature=1.0, rng):
        """Samples `max_new_tokens` after `prompt_tokens` (B, T) through the decode caches.

        temperature 0 takes the most likely token. Returns (B, max_new_tokens) int32.
        """
        batch, t = prompt_tokens.shape
        self.init_cache(batch, t + max_new_tokens)
        logits = self(prompt_tokens, decode=True)[:, -1]
        step = nnx.jit(lambda model, token: model(token[:, None], decode=True)[:, 0])
        new_tokens = []
        for key in jax.random.split(rng, max_new_tokens):
            if temperature == 0:
                token = jnp.argmax(logits, axis=-1)
            else:
                token = jax.random.categorical(key, logits / temperature, axis=-1)
            new_tokens.append(token.astype(jnp.int32))
            logits = step(self, new_tokens[-1])
        return jnp.stack(new_tokens, axis=1)
