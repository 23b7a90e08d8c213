"""Sampling from the language models in one compiled call: a prefill of the prompts, then a
`lax.while_loop` that decodes and samples a token per row per step (`CausalLM.generate`)."""

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike, DTypeLike

from flax_layers._checks import check_lengths, check_sizes, check_state_dtype, check_tokens
from flax_layers._sharding import check_whole_parameters, row_placement


class CausalLM(nnx.Module):
    """A language model that `generate` samples from. A subclass has a `config` with
    `vocab_size` and `dtype` (the compute dtype, or None), and provides
    `init_cache(batch, max_length, *, kv_dtype=None, page_size=None, ssm_dtype=float32)`
    (empty decode caches),
    `_check_decode(batch, new)` (a ValueError unless the caches take `new` tokens a row)
    and `_forward(tokens, segment_ids, decode, lengths, fresh, logits_at=None)` (logits
    float32; with `fresh` the caches were just initialised, with `logits_at` (B,) only the
    logits at those positions, (B, 1, V)), which `_inputs` and `_logits` begin and end."""

    def _inputs(self, tokens, segment_ids, decode, lengths):
        """`_forward`'s checks: (lengths as int32 or None, in_vocab (B, T) bool)."""
        check_tokens("tokens", tokens, self.config.vocab_size)
        if decode:
            if segment_ids is not None:
                raise ValueError("decode=True continues one sequence per row: it takes no "
                                 "segment_ids")
            self._check_decode(*tokens.shape)
        if lengths is not None:
            if not decode:
                raise ValueError("lengths is for decode=True (a forward takes segment_ids)")
            lengths = check_lengths(lengths, *tokens.shape)
        return lengths, (tokens >= 0) & (tokens < self.config.vocab_size)

    @jax.named_scope("lm_head")
    def _logits(self, h, in_vocab, logits_at, norm, head):
        """float32 logits of the final hidden states h (B, T, D) through `norm` and `head`: NaN
        at tokens outside the vocabulary, only at `logits_at` (B,) where given."""
        h = jnp.where(in_vocab[..., None], h, jnp.nan)  # fused into the final norm
        if logits_at is not None:
            h = jnp.take_along_axis(h, logits_at[:, None, None], axis=1)
        return head(norm(h)).astype(jnp.float32)

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
        prefill_tokens: int | None = None,
        ssm_dtype: DTypeLike = jnp.float32,
    ) -> jax.Array:
        """Samples up to `max_new_tokens` after each row's prompt, in one compiled call: the
        prompts run through the model once (the prefill: FlashAttention and the chunked SSD,
        writing the KV caches, conv and SSM states), then a `lax.while_loop` decodes a token per
        row per step through the cached attention kernel and `selective_state_update`,
        sampling inside the loop (greedy with `temperature=0`). The caches live inside the call
        (sized prompt + new tokens) and are updated in place; the model itself is not changed.

        On a mesh with Explicit axes (`jax.set_mesh`), a prompt whose rows are split over
        devices generates data-parallel: each device prefills and decodes its own rows with
        the whole parameters (tensor-sharded ones are a ValueError: gather them first), and
        the tokens come back split as the rows. Each row draws its sampling noise from its
        index in the batch, so its tokens do not depend on the split. Devices along mesh axes
        the rows are not split over repeat the work: split the rows over every axis to use
        every device. Place the parameters replicated on the mesh once (`flax_layers.
        gather_parameters(state, axes=None)`, or `jax.device_put(state, NamedSharding(mesh,
        P()))`): parameters left on one device are moved at every call.

        Args:
          prompt_tokens: (B, T) integers in [0, vocab_size), T >= 1; only its rows may be
            split over devices.
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
          ssm_dtype: the Mamba2 states' storage (see `init_cache`): float32, or bfloat16 to
            read and write half the bytes a step (the states rounded after each token).
          prefill_tokens: None or an int >= 1: the prefill runs the prompts in groups of rows
            holding at most this many prompt tokens (at least one row), one group after the
            other. Its activations grow with it; the caches do not. Default PREFILL_TOKENS (8192).

        Returns:
          (B, max_new_tokens) int32. Each argument is checked first (TypeError or ValueError
          naming it); with max_new_tokens 0 nothing else happens.
        """
        _check_generate(prompt_tokens, max_new_tokens, temperature, rng, self.config.vocab_size,
                        prefill_tokens)
        ssm_dtype = check_state_dtype("ssm_dtype", ssm_dtype)
        batch, t = prompt_tokens.shape
        sampling = _check_sampling(top_k, top_p, stop_tokens, self.config.vocab_size)
        lengths = (jnp.full((batch,), t, jnp.int32) if prompt_lengths is None
                   else check_lengths(prompt_lengths, batch, t, name="prompt_lengths",
                                       minimum=1))
        placement = row_placement("prompt_tokens", prompt_tokens)
        if placement is not None:
            check_whole_parameters(self)
        if max_new_tokens == 0:
            return jnp.zeros_like(jnp.asarray(prompt_tokens)[:, :0], jnp.int32)  # split as the rows
        graphdef, state = nnx.split(self)
        group = PREFILL_TOKENS if prefill_tokens is None else prefill_tokens
        rows = batch if placement is None else batch // _devices(*placement)
        options = dict(max_new_tokens=max_new_tokens, greedy=temperature == 0, top_k=top_k,
                       nucleus=top_p is not None,
                       kv_dtype=None if kv_dtype is None else jnp.dtype(kv_dtype).name,
                       page_size=page_size, ssm_dtype=ssm_dtype.name,
                       prefill_rows=_prefill_rows(rows, t, group),
                       compute_dtype=None if self.config.dtype is None
                       else jnp.dtype(self.config.dtype).name)
        args = (state, prompt_tokens, lengths, rng, jnp.float32(temperature),
                jnp.float32(1.0 if top_p is None else top_p),
                jnp.asarray(sampling.stop_tokens, jnp.int32))
        if placement is None:
            return _generate(graphdef, *args, **options)
        return _generate_rows(graphdef, *args, mesh=placement[0], row_axes=placement[1],
                              **options)


def _devices(mesh, axes):
    return math.prod(mesh.shape[a] for a in axes)


# `generate`'s default prefill group, in prompt tokens: a prefill's activations grow with the
# tokens of a group, the caches only with the rows. At the zamba2-like 1.1B shape, B 64 x 7680
# prompt tokens at once asked XLA for 322 GiB; with bf16 KV caches, groups of 32768 tokens fit
# a 141 GB GPU by arithmetic, groups of 8192 an 80 GB one (measured; prefill 6% slower than
# with 32768 on an H100).
PREFILL_TOKENS = 8192


def _prefill_rows(batch, t, tokens):
    """Rows per prefill group: the largest divisor of `batch` whose rows hold at most `tokens`
    tokens (at least one row)."""
    return max((r for r in range(1, batch + 1) if batch % r == 0 and r * t <= tokens),
               default=1)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=(
    "max_new_tokens", "greedy", "top_k", "nucleus", "kv_dtype", "page_size", "ssm_dtype",
    "prefill_rows", "compute_dtype", "row_axes"))
def _generate(graphdef, state, prompt, lengths, rng, temperature, top_p, stop_tokens, *,
              max_new_tokens, greedy, top_k, nucleus, kv_dtype, page_size, ssm_dtype,
              prefill_rows, compute_dtype, row_axes=None):
    """`CausalLM.generate`: the prefill (in groups of `prefill_rows` rows, `_prefill`) and its
    token, then the decode loop (a `lax.while_loop` whose carry holds the caches, so XLA
    updates them in place), each step a forward of the last token and a sample. Inside
    `_generate_rows`' shard_map over `row_axes` the rows are one device's."""
    state = _weights_in(state, compute_dtype)
    model = nnx.merge(graphdef, state)
    batch, t = prompt.shape
    cache_options = dict(max_length=t + max_new_tokens - 1, kv_dtype=kv_dtype,
                         page_size=page_size, ssm_dtype=ssm_dtype)
    model.init_cache(batch, **cache_options)
    if prefill_rows == batch:
        logits = model._forward(prompt, None, True, lengths, fresh=True, logits_at=lengths - 1)
    else:
        logits, caches = _prefill(graphdef, state, prompt, lengths, prefill_rows, cache_options)
        nnx.update(model, _merge_groups(nnx.state(model, nnx.Cache), caches))
    step_graph, caches, rest = nnx.split(model, nnx.Cache, ...)
    keys = jax.random.split(rng, max_new_tokens)
    # Each row's noise comes from its index in the whole batch: its tokens do not depend on
    # how the rows are split over devices.
    first_row = 0 if row_axes is None else jax.lax.axis_index(row_axes) * batch

    def sample(logits, key):
        if greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logits = logits - jnp.max(logits, axis=-1, keepdims=True)  # no overflow at small T
        return sample_token(logits / temperature, key, top_k=top_k,
                            top_p=top_p if nucleus else None, first_row=first_row)

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


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=(
    "mesh", "row_axes", "max_new_tokens", "greedy", "top_k", "nucleus", "kv_dtype",
    "page_size", "ssm_dtype", "prefill_rows", "compute_dtype"))
def _generate_rows(graphdef, state, prompt, lengths, rng, temperature, top_p, stop_tokens, *,
                   mesh, row_axes, **options):
    """`_generate` with the rows split over the devices of `mesh` along `row_axes` (data
    parallel: each device prefills and decodes its own rows, with the whole parameters and
    its rows' caches); the tokens come back split as the prompt's rows."""
    rows, whole = jax.sharding.PartitionSpec(row_axes), jax.sharding.PartitionSpec()
    in_specs = (whole, rows, rows, whole, whole, whole, whole)
    args = [jax.tree.map(lambda x, spec=spec: jax.sharding.reshard(
                x, jax.sharding.NamedSharding(mesh, spec)), arg)
            for arg, spec in zip((state, prompt, lengths, rng, temperature, top_p, stop_tokens),
                                 in_specs, strict=True)]
    body = functools.partial(_generate, graphdef, row_axes=row_axes, **options)
    # check_vma=False: the decode loop's carry starts replicated (the step counter) and comes
    # back varying over the row axes, which a checked while_loop rejects.
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=rows,
                         check_vma=False)(*args)


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
                 top_p: float | jax.Array | None = None,
                 first_row: int | jax.Array = 0) -> jax.Array:
    """A token per row (B,) int32 from logits (B, V) (already divided by the temperature),
    among the `top_k` most likely (with every token tied with the k-th) and, with `top_p`, the
    smallest set of most likely tokens whose probabilities reach top_p (the most likely always
    stays). The draw is the Gumbel-max trick, row i's noise from `key` folded with its index
    in the whole batch, first_row + i: a row's token does not depend on how a batch is split
    (`logits` may be the rows first_row, first_row + 1, ... of a larger batch)."""
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
    row_keys = jax.vmap(jax.random.fold_in, (None, 0))(
        key, first_row + jnp.arange(logits.shape[0], dtype=jnp.int32))
    noise = jax.vmap(lambda k: jax.random.gumbel(k, logits.shape[-1:], logits.dtype))(row_keys)
    return jnp.argmax(logits + noise, axis=-1).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# Argument checks of `generate`: TypeError or ValueError naming the argument.


def _check_generate(prompt_tokens, max_new_tokens, temperature, rng, vocab_size,
                    prefill_tokens):
    """`generate`'s arguments, as its docstring gives them."""
    check_tokens("prompt_tokens", prompt_tokens, vocab_size)
    if not isinstance(max_new_tokens, numbers.Integral) or isinstance(max_new_tokens,
                                                                      bool | np.bool_):
        raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if prefill_tokens is not None:
        check_sizes(prefill_tokens=prefill_tokens)
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
