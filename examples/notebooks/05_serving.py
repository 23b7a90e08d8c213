# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Serving: a paged KV cache, split-K decode attention, and generation in one call
#
# Decoding reads the whole KV cache once per token, so it is bound by memory bandwidth. This
# notebook
#
# 1. writes tokens into a **paged** KV cache (`update_kv_cache`) and attends over it with the
#    split-K kernel (`attention_with_kv_cache`), against the pure-jnp reference;
# 2. stores the cache in **int8** (one scale per token and head) and measures the logit error
#    that costs a small `HybridLM`;
# 3. **prefills** ragged prompts into the model's caches and checks the next step against the
#    plain forward;
# 4. runs `HybridLM.generate`: the prefill and the whole decode loop (sampling included) in one
#    compiled call;
# 5. times decoding on a GPU, when there is one.
#
# On a CPU the kernels run in Pallas interpret mode, so the shapes are small.

# %%
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

import pallas_kernels
from flax_layers import HybridLM, HybridLMConfig
from pallas_kernels.kv_cache import reference

on_gpu = jax.devices()[0].platform == "gpu"
print(jax.devices()[0].device_kind, "- kernels in interpret mode" if not on_gpu else "")

# %% [markdown]
# ## 1. A paged cache and the split-K kernel
#
# A paged cache is a pool of pages `(pages, page_size, K, H)`; each row's `block_table` lists
# its pages in order, so rows grow without moving memory and may share pages. Here 3 rows of
# up to 64 tokens take pages from a shuffled pool of 16. Each row gets a different number of
# tokens, written by `update_kv_cache` at each row's length.

# %%
batch, kv_heads, heads, head_dim, page = 3, 2, 8, 64, 16
keys = jax.random.split(jax.random.key(0), 4)
table = jax.random.permutation(keys[0], 16)[:12].reshape(batch, 4).astype(jnp.int32)
lengths = jnp.array([50, 7, 33], jnp.int32)
new_k, new_v = (jax.random.normal(k, (batch, 64, kv_heads, head_dim)) for k in keys[1:3])


def written(dtype):
    """The cache after writing each row's first `lengths` tokens, one at a time as decoding
    does (positions past a row's length stay zero)."""
    k_cache = v_cache = jnp.zeros((16, page, kv_heads, head_dim), dtype)
    scales = (jnp.zeros((16, kv_heads, page)),) * 2 if dtype == jnp.int8 else (None, None)
    write = jax.jit(pallas_kernels.update_kv_cache)
    for t in range(int(lengths.max())):
        step = jnp.minimum(lengths - t, 1)  # rows that are done write past their capacity
        at = jnp.where(step > 0, t, 64)
        k_cache, v_cache, *scales = write(k_cache, v_cache, new_k[:, t:t + 1],
                                          new_v[:, t:t + 1], at, block_table=table,
                                          k_scale=scales[0], v_scale=scales[1])
    return k_cache, v_cache, *scales


q = jax.random.normal(keys[3], (batch, 1, heads, head_dim))
caches = {dtype.__name__: written(dtype) for dtype in (jnp.float32, jnp.int8)}
for name, (k_cache, v_cache, k_scale, v_scale) in caches.items():
    args = dict(block_table=table, k_scale=k_scale, v_scale=v_scale)
    outs = [pallas_kernels.attention_with_kv_cache(q, k_cache, v_cache, lengths, num_splits=s,
                                                   implementation="pallas", **args)
            for s in (1, 4)]
    want = reference.attention_with_kv_cache(q, k_cache, v_cache, lengths, **args)
    errors = [float(jnp.max(jnp.abs(o - want))) for o in outs]
    print(f"{name:8s} cache: kernel vs reference, 1 split {errors[0]:.1e}, 4 splits "
          f"{errors[1]:.1e}")
    assert max(errors) < 1e-5

# %% [markdown]
# Four splits cut each row's keys into four pieces that run as separate programs and merge by
# their log-sum-exp: with few rows and a long cache that is what fills a GPU. The int8 cache
# holds a quarter of the float32 bytes; its output differs from float32 by the quantisation:

# %%
float_out, int8_out = (reference.attention_with_kv_cache(
    q, c[0], c[1], lengths, block_table=table, k_scale=c[2], v_scale=c[3])
    for c in caches.values())
gap = jnp.max(jnp.abs(int8_out - float_out)) / jnp.max(jnp.abs(float_out))
print(f"int8 vs float32 cache, relative error {float(gap):.1e}")

# %% [markdown]
# ## 2. What an 8-bit KV cache and bf16 SSM states cost a model
#
# A small `HybridLM` (random weights) decodes the same tokens over a float32 cache and over
# int8 and float8 caches, and once more with its Mamba2 states kept in bfloat16
# (`ssm_dtype`, as mamba_ssm keeps a bf16 model's: half the state bytes a step reads and
# writes); the plot shows the logit error per step. The model runs its default
# implementation: the kernels on a GPU, the jnp references (same caches) on a CPU.

# %%
config = HybridLMConfig.preset("tiny")
model = HybridLM(config, rngs=nnx.Rngs(0))
tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, config.vocab_size)
step = nnx.jit(lambda model, tokens, lengths=None: model(tokens, decode=True,
                                                           lengths=lengths))


def decode_logits(kv_dtype, ssm_dtype=jnp.float32):
    model.init_cache(2, 32, kv_dtype=kv_dtype, page_size=16, ssm_dtype=ssm_dtype)
    step(model, tokens[:, :8])  # the prompt
    return jnp.concatenate([step(model, tokens[:, t:t + 1]) for t in range(8, 16)], axis=1)


base = decode_logits(jnp.float32)
runs = {"int8 KV": dict(kv_dtype=jnp.int8), "float8_e4m3fn KV": dict(kv_dtype=jnp.float8_e4m3fn),
        "bfloat16 SSM states": dict(kv_dtype=jnp.float32, ssm_dtype=jnp.bfloat16)}
errors = {}
for name, options in runs.items():
    got = decode_logits(**options)
    errors[name] = np.asarray(jnp.max(jnp.abs(got - base), axis=(0, 2)) / jnp.max(jnp.abs(base)))
for name, error in errors.items():
    plt.plot(range(8, 16), error, marker="o", label=name)
plt.yscale("log")
plt.xlabel("decode step (position)")
plt.ylabel("max |logit error| / max |logit|")
plt.title("Smaller caches against float32")
plt.legend()
plt.show()
assert errors["int8 KV"].max() < 2e-2 and errors["bfloat16 SSM states"].max() < 2e-2

# %% [markdown]
# ## 3. Ragged prompts into the caches
#
# Prompts of different lengths share one batch, padded at the end; `lengths` says how many
# tokens of each row are real. The Mamba2 states advance over those only (the padding gets a
# step size of 0), the KV cache counts them per row, and the next token of each row continues
# its own prompt: the logits equal the plain forward's.

# %%
prompt_lengths = jnp.array([10, 4])
full = model(tokens)
model.init_cache(2, 32, page_size=16)
step(model, tokens[:, :10], lengths=prompt_lengths)
next_tokens = jnp.stack([tokens[0, 10], tokens[1, 4]])[:, None]
following = step(model, next_tokens)[:, 0]
for row, position in enumerate([10, 4]):
    gap = float(jnp.max(jnp.abs(following[row] - full[row, position])))
    print(f"row {row}: next-token logits vs forward at position {position}: {gap:.1e}")
    assert gap < 1e-3

# %% [markdown]
# ## 4. `generate`: prefill and decode loop in one compiled call
#
# The prefill runs FlashAttention and the chunked SSD over the prompts and fills the caches;
# a `lax.while_loop` then decodes one token per row per step, samples inside the loop
# (temperature, top-k, top-p) and stops each row at a stop token. The caches are the loop's
# carry, so XLA updates them in place.

# %%
prompt = jax.random.randint(jax.random.key(2), (2, 12), 0, config.vocab_size)
out = model.generate(prompt, 16, temperature=0.8, top_k=40, top_p=0.95, rng=jax.random.key(3),
                     prompt_lengths=jnp.array([12, 6]), stop_tokens=[0], page_size=16,
                     kv_dtype=jnp.int8)
print(out)

# %% [markdown]
# ## 5. Decode speed (GPU only)
#
# On a GPU: tokens per second of `generate` at a few batch sizes, for a bf16 and an int8 KV
# cache. On a CPU the kernels run in interpret mode and timings would mean nothing.

# %%
def tokens_per_second(model, batch, kv_dtype, prompt_length=256, new=128):
    """Generated tokens per second of `generate` (prefill included), compiled beforehand."""
    prompt = jnp.ones((batch, prompt_length), jnp.int32)
    for _ in range(2):  # the first call compiles
        start = time.perf_counter()
        model.generate(prompt, new, temperature=0.0, rng=jax.random.key(0), kv_dtype=kv_dtype,
                       page_size=16).block_until_ready()
    return batch * new / (time.perf_counter() - start)


if on_gpu:
    big = HybridLM(HybridLMConfig.preset("small", dtype=jnp.bfloat16), rngs=nnx.Rngs(0))
    rates = {(jnp.dtype(kv).name, b): tokens_per_second(big, b, kv)
             for kv in (jnp.bfloat16, jnp.int8) for b in (1, 8, 32)}
    for name in ("bfloat16", "int8"):
        plt.plot([1, 8, 32], [rates[name, b] for b in (1, 8, 32)], marker="o", label=name)
    plt.xlabel("batch")
    plt.ylabel("tokens / s (prefill included)")
    plt.legend()
    plt.show()
else:
    print("no GPU: skipped")
