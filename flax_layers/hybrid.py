"""A Zamba2-style hybrid language model: Mamba2 blocks and one shared attention + MLP block."""

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence
from typing import Any, Self

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike, DTypeLike

from flax_layers._checks import check_dtypes, check_implementation, check_sizes
from flax_layers._sharding import (
    logical,
    reorder_sequence,
    sharded_parameters,
    token_features,
)
from flax_layers.attention import FlashMultiHeadAttention, KVCacheSlot, check_heads
from flax_layers.mamba2 import Mamba2, mixer_shape
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
    `context_parallelism` or `sequence_order`.

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
        arguments.check_context_parallelism(self.context_parallelism)
        arguments.check_sequence_order(self.sequence_order)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> Self:
        """"tiny" (trains on a CPU in minutes), "small", or "zamba2-1.2b" (Zamba2-1.2B's sizes:
        d_model 2048, Mamba2 blocks with state 64, a shared 32-head block every 6). Zamba2-1.2B
        has 38 Mamba2 blocks, which a shared block every 6 cannot divide; the preset keeps 36
        (6 uses of the shared block). Its exact layer pattern is not modelled yet."""
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
            use_bias=False, dtype=config.dtype, implementation=config.implementation,
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


class HybridLM(nnx.Module):
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
                   kv_dtype: DTypeLike | None = None, page_size: int | None = None) -> None:
        """Empty decode caches for `batch_size` rows of up to `max_length` tokens: per Mamba2
        block a conv state (in `dtype`, default the model's) and an SSM state (float32); per use
        of the shared block a KV cache of `kv_dtype` (default `dtype`; int8, float8_e4m3fn or
        float8_e4m3fnuz store 8-bit entries with a scale per token and head), dense or in pages
        of `page_size` tokens (`flax_layers.attention.empty_kv_cache`)."""
        check_sizes(batch_size=batch_size, max_length=max_length)
        dtype = jnp.dtype(dtype or self.config.dtype or jnp.float32)
        kv_dtype = jnp.dtype(kv_dtype or dtype)
        for block in self.blocks:
            block.mixer.init_cache(batch_size, dtype)
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
        _check_tokens("tokens", tokens, self.config.vocab_size)
        if decode:
            self._check_decode(*tokens.shape, segment_ids)
        if lengths is not None:
            if not decode:
                raise ValueError("lengths is for decode=True (a forward takes segment_ids)")
            lengths = _check_lengths(lengths, *tokens.shape)
        in_vocab = (tokens >= 0) & (tokens < self.config.vocab_size)  # (B, T)
        embeddings = self.embed(jnp.where(in_vocab, tokens, 0),
                                out_sharding=token_features(tokens))
        # The Mamba2 blocks run on contiguous sequence shards, the shared block in the tokens'
        # order (zig-zag balances causal attention); `h` is reordered only where they change.
        order = self.config.sequence_order
        seq_idx = None if segment_ids is None else reorder_sequence(segment_ids, order,
                                                                    "contiguous")
        h, h_order = embeddings, order
        for i, block in enumerate(self.blocks):
            h, h_order = reorder_sequence(h, h_order, "contiguous"), "contiguous"
            h = h + block.mixer(block.norm(h), seq_idx=seq_idx, decode=decode, lengths=lengths)
            if (i + 1) % self.config.shared_every == 0:
                use = (i + 1) // self.config.shared_every - 1
                cache = self.kv_caches[use].get() if decode else None
                h, h_order = reorder_sequence(h, h_order, order), order
                h, cache = self.shared(h, embeddings, segment_ids, cache, lengths, fresh)
                if decode:
                    self.kv_caches[use].set(cache)
        h = reorder_sequence(h, h_order, order)
        h = jnp.where(in_vocab[..., None], h, jnp.nan)  # fused into the final norm
        if logits_at is not None:
            h = jnp.take_along_axis(h, logits_at[:, None, None], axis=1)
        return self.embed.attend(self.final_norm(h)).astype(jnp.float32)

    def _check_decode(self, batch, new, segment_ids):
        """A ValueError, before any cache changes, unless `new` tokens of `batch` rows (without
        segment ids) fit every cache (see `KVCache.check_fits`) and the parameters are whole
        (the decode path does not run tensor-parallel)."""
        if self.kv_caches is None:
            raise ValueError("decode=True needs init_cache(batch_size, max_length) first")
        sharded = sharded_parameters(self)
        if sharded:
            raise ValueError(f"decode=True needs whole parameters; {sharded[0]} (and "
                             f"{len(sharded) - 1} more) are sharded: merge the model from "
                             "flax_layers.gather_parameters(state, axes=None)")
        if segment_ids is not None:
            raise ValueError("decode=True continues one sequence per row: it takes no "
                             "segment_ids")
        for block in self.blocks:
            block.mixer.check_cache(batch)
        for slot in self.kv_caches:
            slot.get().check_fits(batch, new)

    def generate(
        self,
        prompt_tokens: jax.Array,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        rng: jax.Array,
        prompt_lengths: jax.Array | None = None,
        stop_tokens: Sequence[int] | ArrayLike | None = None,
        kv_dtype: DTypeLike | None = None,
        page_size: int | None = None,
    ) -> jax.Array:
        """Samples up to `max_new_tokens` after each row's prompt, in one compiled call: the
        prompts run through the model once (the prefill: FlashAttention and the chunked SSD,
        writing the KV caches, conv and SSM states), then a `lax.while_loop` decodes a token per
        row per step through the cached attention kernel and `selective_state_update`,
        sampling inside the loop. The caches live inside the call (sized prompt + new tokens)
        and are updated in place; the model itself is not changed.

        Args:
          prompt_tokens: (B, T) integers in [0, vocab_size), T >= 1.
          max_new_tokens: an int >= 0.
          temperature: a finite number >= 0; 0 takes the most likely token.
          top_k: None or an int >= 1: sample among the k most likely tokens (and those tied
            with the k-th).
          top_p: None or a number in (0, 1]: sample among the most likely tokens whose
            probabilities sum to at least p (nucleus sampling).
          rng: a PRNG key (`jax.random.key` or a legacy uint32 (2,) key).
          prompt_lengths: (B,) integers in [1, T]: each row's prompt is its first
            prompt_lengths[b] tokens (the rest is padding). Default: all T.
          stop_tokens: None or a sequence of token ids: a row that samples one stops; its later
            positions repeat that token. The loop ends when every row has stopped.
          kv_dtype, page_size: the KV caches' storage (see `init_cache`).

        Returns:
          (B, max_new_tokens) int32. Each argument is checked first (TypeError or ValueError
          naming it); with max_new_tokens 0 nothing else happens.
        """
        _check_generate(prompt_tokens, max_new_tokens, temperature, rng, self.config.vocab_size)
        batch, t = prompt_tokens.shape
        sampling = _check_sampling(top_k, top_p, stop_tokens, self.config.vocab_size)
        lengths = (jnp.full((batch,), t, jnp.int32) if prompt_lengths is None
                   else _check_lengths(prompt_lengths, batch, t, name="prompt_lengths",
                                       minimum=1))
        if max_new_tokens == 0:
            return jnp.zeros((batch, 0), jnp.int32)
        graphdef, state = nnx.split(self)
        return _generate(graphdef, state, prompt_tokens, lengths, rng, jnp.float32(temperature),
                         jnp.float32(1.0 if top_p is None else top_p),
                         jnp.asarray(sampling.stop_tokens, jnp.int32),
                         max_new_tokens=max_new_tokens, greedy=temperature == 0,
                         top_k=top_k, nucleus=top_p is not None,
                         kv_dtype=None if kv_dtype is None else jnp.dtype(kv_dtype).name,
                         page_size=page_size, prefill_rows=_prefill_rows(batch, t))


# A prefill runs its prompts in groups of rows of at most this many tokens, one group after
# the other: its activations grow with the tokens (at the zamba2-like 1.1B shape, B 64 x 7680
# prompt tokens at once asked XLA for 322 GiB), the caches only with the rows.
PREFILL_TOKENS = 32768


def _prefill_rows(batch, t):
    """Rows per prefill group: the largest divisor of `batch` whose rows hold at most
    PREFILL_TOKENS tokens (at least one row)."""
    return max((r for r in range(1, batch + 1) if batch % r == 0 and r * t <= PREFILL_TOKENS),
               default=1)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=(
    "max_new_tokens", "greedy", "top_k", "nucleus", "kv_dtype", "page_size", "prefill_rows"))
def _generate(graphdef, state, prompt, lengths, rng, temperature, top_p, stop_tokens, *,
              max_new_tokens, greedy, top_k, nucleus, kv_dtype, page_size, prefill_rows):
    """`HybridLM.generate`: the prefill (in groups of `prefill_rows` rows, `_prefill`) and its
    token, then the decode loop (a `lax.while_loop` whose carry holds the caches, so XLA
    updates them in place), each step a forward of the last token and a sample."""
    state = _weights_in(state, nnx.merge(graphdef, state).config.dtype)
    model = nnx.merge(graphdef, state)
    batch, t = prompt.shape
    cache_options = dict(max_length=t + max_new_tokens - 1, kv_dtype=kv_dtype,
                         page_size=page_size)
    model.init_cache(batch, **cache_options)
    if prefill_rows == batch:
        logits = model._forward(prompt, None, True, lengths, fresh=True, logits_at=lengths - 1)
    else:
        logits, caches = _prefill(graphdef, state, prompt, lengths, prefill_rows, cache_options)
        nnx.update(model, _merge_groups(nnx.state(model, nnx.Cache), caches))
    step_graph, caches, rest = nnx.split(model, nnx.Cache, ...)
    keys = jax.random.split(rng, max_new_tokens)

    def sample(logits, key):
        if greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logits = logits - jnp.max(logits, axis=-1, keepdims=True)  # no overflow at small T
        return sample_token(logits / temperature, key, top_k=top_k,
                            top_p=top_p if nucleus else None)

    def stops(token):
        return jnp.any(token[:, None] == stop_tokens[None, :], axis=1)

    first = sample(logits[:, 0], keys[0])
    # Initial values derived from the prompt carry its sharding (a batch-sharded mesh).
    tokens = jnp.repeat(jnp.zeros_like(prompt[:, :1]), max_new_tokens, axis=1).at[:, 0].set(first)

    def unfinished(carry):
        i, _, _, done, _ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def step(carry):
        i, caches, tokens, done, last = carry
        decoder = nnx.merge(step_graph, caches, rest)
        logits = decoder(last[:, None], decode=True)[:, 0]
        token = jnp.where(done, last, sample(logits, keys[i]))
        return (i + 1, nnx.state(decoder, nnx.Cache), tokens.at[:, i].set(token),
                done | stops(token), token)

    start = (jnp.int32(1), caches, tokens, stops(first), first)
    i, _, tokens, _, last = jax.lax.while_loop(unfinished, step, start)
    # Every row stopped before the end: the positions not reached repeat its last token.
    return jnp.where(jnp.arange(max_new_tokens) < i, tokens, last[:, None])


def _weights_in(state, dtype):
    """`state` with its matmul weights (the Linear kernels and the embedding table) cast to
    the compute `dtype` (None: as they are) once, as every layer casts them at each use (the
    same values). Inside the decode loop XLA on GPU does not hoist those casts: at the 1.1B
    shape each step converted 6 GB of float32 weights (4.2 ms of a 4.2 ms step on an H100)."""
    if dtype is None:
        return state

    def cast(path, leaf):
        names = [key.key for key in path if isinstance(key, jax.tree_util.DictKey)]
        if names and names[-1] in ("kernel", "embedding") and jnp.issubdtype(leaf.dtype,
                                                                               jnp.floating):
            return leaf.astype(dtype)
        return leaf

    return jax.tree_util.tree_map_with_path(cast, state)


def _prefill(graphdef, state, prompt, lengths, rows, cache_options):
    """The prefill of `rows` rows at a time (`lax.map`: one group after the other): the logits
    at each row's last prompt token (B, 1, V) and the caches, each leaf stacked over the
    groups (groups, ...) as a group's model holds it."""

    def group(arrays):
        prompt, lengths = arrays
        model = nnx.merge(graphdef, state)
        model.init_cache(rows, **cache_options)
        logits = model._forward(prompt, None, True, lengths, fresh=True, logits_at=lengths - 1)
        return logits, nnx.state(model, nnx.Cache)

    groups = prompt.shape[0] // rows
    logits, caches = jax.lax.map(group, (prompt.reshape(groups, rows, -1),
                                         lengths.reshape(groups, rows)))
    return logits.reshape(-1, *logits.shape[2:]), caches


def _merge_groups(full, grouped):
    """The whole batch's caches from `_prefill`'s groups: each leaf's groups laid end to end
    along its first axis (rows, or pages: each row owns a run of pages in row order), so
    `full` (the whole batch's empty caches) gives the shapes; the paged caches' block tables
    stay `full`'s."""
    def merge(path, whole, groups):
        if "block_table" in jax.tree_util.keystr(path):
            return whole
        return groups.reshape(whole.shape)

    return jax.tree_util.tree_map_with_path(merge, full, grouped)


def sample_token(logits: jax.Array, key: jax.Array, *, top_k: int | None = None,
                 top_p: float | jax.Array | None = None) -> jax.Array:
    """A token per row (B,) int32 from logits (B, V) (already divided by the temperature),
    among the `top_k` most likely (with every token tied with the k-th) and, with `top_p`, the
    smallest set of most likely tokens whose probabilities reach top_p (the most likely always
    stays)."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    if top_p is not None:
        order = jnp.argsort(-logits, axis=-1)
        ordered = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
        kept = jnp.where(before < top_p, ordered, -jnp.inf)
        logits = jnp.full_like(logits, -jnp.inf).at[
            jnp.arange(logits.shape[0])[:, None], order].set(kept)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# Argument checks (the config's are in `HybridLMConfig.__post_init__`, with the layers'
# shared ones): TypeError or ValueError naming the argument.


def _check_tokens(name, tokens, vocab_size):
    """tokens must be a (B, T) integer array with B, T >= 1 and, where their values are known
    (eagerly), ids in [0, vocab_size)."""
    if not (hasattr(tokens, "dtype") and jnp.issubdtype(tokens.dtype, jnp.integer)):
        raise TypeError(f"{name} must be an integer array, got "
                        f"{getattr(tokens, 'dtype', type(tokens).__name__)}")
    if tokens.ndim != 2 or 0 in tokens.shape:
        raise ValueError(f"{name} must be a (batch, length) array with at least one token per "
                         f"row, got shape {tokens.shape}")
    ids = arguments.known_value(tokens)
    if ids is not None:
        outside = ids[(ids < 0) | (ids >= vocab_size)]
        if outside.size:
            raise ValueError(f"{name} must lie in [0, {vocab_size}) (the vocabulary), got "
                             f"{outside[0]}")


def _check_generate(prompt_tokens, max_new_tokens, temperature, rng, vocab_size):
    """`generate`'s arguments, as its docstring gives them."""
    _check_tokens("prompt_tokens", prompt_tokens, vocab_size)
    if not isinstance(max_new_tokens, numbers.Integral) or isinstance(max_new_tokens,
                                                                      bool | np.bool_):
        raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not isinstance(temperature, numbers.Real) or isinstance(temperature, bool | np.bool_):
        raise TypeError(f"temperature must be a number, got {temperature!r}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if not _is_key(rng):
        raise TypeError(f"rng must be a PRNG key (jax.random.key(seed)), got {rng!r}")


def _is_key(rng):
    """A typed PRNG key of shape (), or a legacy uint32 (2,) key."""
    if not isinstance(rng, jax.Array):
        return False
    if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return rng.shape == ()
    return rng.dtype == jnp.uint32 and rng.shape == (2,)


def _check_lengths(lengths, batch, t, *, name="lengths", minimum=0):
    """(B,) integers in [minimum, t] (values checked where known, eagerly) as int32."""
    if not (hasattr(lengths, "dtype") and jnp.issubdtype(lengths.dtype, jnp.integer)):
        raise TypeError(f"{name} must be an integer array, got "
                        f"{getattr(lengths, 'dtype', type(lengths).__name__)}")
    if lengths.shape != (batch,):
        raise ValueError(f"{name} must have shape ({batch},), got {lengths.shape}")
    known = arguments.known_value(lengths)
    if known is not None and ((known < minimum) | (known > t)).any():
        raise ValueError(f"{name} must lie in [{minimum}, {t}], got {known.tolist()}")
    return jnp.asarray(lengths, jnp.int32)


@dataclasses.dataclass(frozen=True)
class _Sampling:
    stop_tokens: tuple


def _check_sampling(top_k, top_p, stop_tokens, vocab_size):
    """`generate`'s top_k (None or an int >= 1), top_p (None or a number in (0, 1]) and
    stop_tokens (None or token ids in [0, vocab_size))."""
    if top_k is not None and (not isinstance(top_k, numbers.Integral)
                              or isinstance(top_k, bool | np.bool_) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and (not isinstance(top_p, numbers.Real)
                              or isinstance(top_p, bool | np.bool_) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or a number in (0, 1], got {top_p!r}")
    stops = () if stop_tokens is None else tuple(int(x) for x in np.asarray(stop_tokens).ravel())
    outside = [x for x in stops if not 0 <= x < vocab_size]
    if outside:
        raise ValueError(f"stop_tokens must lie in [0, {vocab_size}), got {outside[0]}")
    return _Sampling(stops)
