# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # FlashAttention in Pallas: `pallas_kernels.dot_product_attention`
#
# This notebook shows how to call the FlashAttention kernels, and checks each claim with an
# `assert`, so a broken kernel fails the notebook:
#
# 1. calling convention: `(B, T, N, H)` layout, grouped-query attention (GQA);
# 2. parity with `jax.nn.dot_product_attention` and gradients against the pure-jnp reference;
# 3. masks: causal, local window, packed documents (segment ids); a query that sees no key;
# 4. the log-sum-exp (LSE) residual, and how it merges attention over split keys;
# 5. a speed table (only on a GPU).
#
# On a GPU the kernels are compiled through Pallas' Triton lowering. On a CPU we run the *same*
# kernels with `implementation="pallas", interpret=True`: Pallas then executes the kernel body
# with ordinary XLA ops, block by block. That is slow, so the shapes here are small.

# %%
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import pallas_kernels

# float32 matmuls at full precision, so the references are exact (no TF32 on a GPU).
jax.config.update("jax_default_matmul_precision", "highest")

ON_GPU = jax.default_backend() == "gpu"
# implementation="pallas" forces the kernels (None would pick the XLA reference on a CPU);
# interpret=True runs them in Pallas interpret mode.
KERNELS = dict(implementation="pallas", interpret=not ON_GPU)
REFERENCE = dict(implementation="xla")  # the pure-jnp reference: quadratic memory, exact
# Tolerances relative to the largest reference value. On a GPU, float32 dots inside the Triton
# kernels run at TF32-class precision; in interpret mode they are exact float32.
TOL = 1e-2 if ON_GPU else 1e-5
LSE_TOL = 1e-2 if ON_GPU else 1e-4  # absolute, for log-sum-exps
print(f"jax {jax.__version__} on {jax.default_backend()}: {jax.devices()}")


def rel_err(x, ref):
    """max |x - ref| / max |ref|, in float32."""
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


# %% [markdown]
# ## 1. Calling it
#
# The signature follows `jax.nn.dot_product_attention`: query `(B, T, N, H)` (batch, query
# length, heads, head dim), key and value `(B, S, K, H)`. When `K < N` the heads are grouped
# (GQA): query head `n` reads key/value head `n // (N // K)`. The kernels never repeat K/V in
# memory; the gradients dK, dV come back with K heads, summed over each group inside the kernel.
# The output has the query's shape and dtype, and `scale` defaults to `1 / sqrt(H)`.

# %%
B, T, N, K, H = 2, 128, 8, 2, 64  # 8 query heads share 2 key/value heads: GQA 4:1
kq, kk, kv, kw = jax.random.split(jax.random.key(0), 4)
q = jax.random.normal(kq, (B, T, N, H), jnp.float32)
k = jax.random.normal(kk, (B, T, K, H), jnp.float32)
v = jax.random.normal(kv, (B, T, K, H), jnp.float32)

attention = jax.jit(
    functools.partial(pallas_kernels.dot_product_attention, **KERNELS),
    static_argnames=("is_causal", "local_window_size", "return_residual"),
)
out = attention(q, k, v, is_causal=True)
print("q", q.shape, "k/v", k.shape, "-> out", out.shape, out.dtype)
assert out.shape == q.shape and out.dtype == q.dtype

# %% [markdown]
# ## 2. Parity with `jax.nn.dot_product_attention`
#
# `is_causal=True` means query `i` sees keys `j <= i` (aligned top-left, as in `jax.nn`).
# `jax.nn` also accepts GQA inputs, so it is a direct reference.

# %%
for causal in (False, True):
    ours = attention(q, k, v, is_causal=causal)
    theirs = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    err = rel_err(ours, theirs)
    print(f"is_causal={causal!s:5}: max |ours - jax.nn| / max |jax.nn| = {err:.2e}")
    assert err < TOL, err

# %% [markdown]
# ### Gradients
#
# The kernels are wrapped in a `jax.custom_vjp`: the forward saves the output and the LSE, and
# the backward runs a dK/dV kernel and a dQ kernel. We differentiate a scalar loss
# `sum(out * w)` with a random `w` through the kernels and through the reference
# (`implementation="xla"`, plain jnp differentiated by JAX) and compare all three gradients.

# %%
w = jax.random.normal(kw, q.shape, jnp.float32)


def make_grads(options):
    def loss(q, k, v):
        out = pallas_kernels.dot_product_attention(q, k, v, is_causal=True, **options)
        return jnp.sum(out * w)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


grads = make_grads(KERNELS)(q, k, v)
grads_ref = make_grads(REFERENCE)(q, k, v)
for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref, strict=True):
    err = rel_err(g, g_ref)
    print(f"{name} {str(g.shape):16} relative error {err:.2e}")
    assert g.shape == g_ref.shape and err < TOL, (name, err)

# %% [markdown]
# ## 3. Masks: causal, local window, packed documents
#
# Query `i` sees key `j` when every active rule allows it:
#
# - `is_causal=True`: `j <= i`;
# - `local_window_size=w` or `(left, right)`: `i - left <= j <= i + right` (`w` means `(w, w)`;
#   with `is_causal` the right side is cut to 0), a sliding window;
# - `q_segment_ids`, `kv_segment_ids` (`(B, T)` and `(B, S)` integers): `q_seg[i] == kv_seg[j]`.
#   Several documents packed into one row then never attend to each other.
#
# The kernels skip key blocks that are fully masked and run fully visible blocks without any
# mask arithmetic, so a sliding window or short documents also make attention cheaper.
#
# To *see* the mask the kernel applies, we use a trick: with `q = k = 0` every visible logit
# is equal, so each row's softmax is uniform over the visible keys; with `v` the identity
# matrix (`H = S`), the output row `i` *is* that probability row. Below, the last 8 tokens
# are padding: padding queries get segment id -1 and padding keys -2, so a padding query sees
# no key at all.

# %%
S = H_VIS = 64
WINDOW = 16
segments = np.array([0] * 20 + [1] * 24 + [2] * 12 + [-1] * 8, np.int32)  # 3 documents + padding
q_seg = jnp.asarray(segments)[None]
kv_seg = jnp.asarray(np.where(segments == -1, -2, segments))[None]

zeros = jnp.zeros((1, S, 1, H_VIS), jnp.float32)
identity = jnp.eye(S, dtype=jnp.float32)[None, :, None, :]  # value j is the one-hot e_j


def probabilities(**mask):
    """The (S, S) attention probabilities the kernel uses for this mask."""
    return np.asarray(pallas_kernels.dot_product_attention(zeros, zeros, identity, **mask,
                                                           **KERNELS)[0, :, 0, :])


panels = {
    "causal": dict(is_causal=True),
    f"causal + window {WINDOW}": dict(is_causal=True, local_window_size=WINDOW),
    "causal + window + segments": dict(is_causal=True, local_window_size=WINDOW,
                                       q_segment_ids=q_seg, kv_segment_ids=kv_seg),
}
probs = {title: probabilities(**mask) for title, mask in panels.items()}

# The same rules written out in numpy.
i, j = np.arange(S)[:, None], np.arange(S)[None, :]
kv_np = np.asarray(kv_seg[0])
visible = {
    "causal": j <= i,
    f"causal + window {WINDOW}": (j <= i) & (j >= i - WINDOW),
    "causal + window + segments": (j <= i) & (j >= i - WINDOW) & (segments[:, None] == kv_np),
}
for title, p in probs.items():
    vis = visible[title]
    counts = vis.sum(axis=1, keepdims=True)
    expected = np.where(vis, 1.0 / np.maximum(counts, 1), 0.0)
    assert np.array_equal(p > 0, vis), title
    np.testing.assert_allclose(p, expected, atol=1e-6)
    print(f"{title:28}: {int(vis.sum()):5d} visible (query, key) pairs of {S * S}")

fig, axes = plt.subplots(1, 3, figsize=(13, 4.4))
for ax, (title, p) in zip(axes, probs.items(), strict=True):
    ax.imshow(p > 0, cmap="Blues", interpolation="nearest")
    ax.set_title(title)
    ax.set_xlabel("key j")
axes[0].set_ylabel("query i")
fig.suptitle("Which keys each query sees (blue), read off the kernel's attention weights")
fig.tight_layout()
plt.show()

# %% [markdown]
# Now random inputs with the full mask, against `jax.nn.dot_product_attention` given the same
# rule as a dense boolean `mask` of shape `(B, N, T, S)` (`jax.nn` has no segment ids).
#
# **A query that sees no key gets output 0** (and LSE `-inf`, and zero gradients), never NaN.
# `jax.nn` instead returns an average of all values for such rows (its masked logits are a large
# finite negative number), so we compare only the rows that see at least one key.

# %%
mask_kw = panels["causal + window + segments"]
vis = visible["causal + window + segments"]
has_key = vis.any(axis=1)
kq2, kk2, kv2 = jax.random.split(jax.random.key(1), 3)
q2 = jax.random.normal(kq2, (1, S, 4, 32), jnp.float32)
k2 = jax.random.normal(kk2, (1, S, 2, 32), jnp.float32)
v2 = jax.random.normal(kv2, (1, S, 2, 32), jnp.float32)

ours = pallas_kernels.dot_product_attention(q2, k2, v2, **mask_kw, **KERNELS)
theirs = jax.nn.dot_product_attention(q2, k2, v2, mask=jnp.asarray(vis)[None, None])
err = rel_err(ours[:, has_key], theirs[:, has_key])
print(f"rows that see a key: relative error vs jax.nn {err:.2e}")
print(f"rows that see no key ({int((~has_key).sum())} padding queries): "
      f"max |out| = {float(jnp.max(jnp.abs(ours[:, ~has_key]))):.1f}")
assert err < TOL, err
assert bool(jnp.all(ours[:, ~has_key] == 0.0))

dq2 = jax.grad(
    lambda q: jnp.sum(pallas_kernels.dot_product_attention(q, k2, v2, **mask_kw, **KERNELS))
)(q2)
assert bool(jnp.all(jnp.isfinite(dq2))) and bool(jnp.all(dq2[:, ~has_key] == 0.0))
print("dq is finite everywhere and exactly 0 for the padding queries")

# %% [markdown]
# ## 4. The LSE residual
#
# With `return_residual=True` the call also returns the natural-log log-sum-exp of each query's
# scaled, masked logits, `lse[b, i, n] = log sum_j exp(scale * q_i . k_j)`, shaped `(B, T, N)`
# in float32. The kernel computes it anyway (online softmax) and saves it for the backward.
# It is differentiable too.

# %%
out, lse = attention(q, k, v, is_causal=True, return_residual=True)
scale = H**-0.5
groups = N // K
logits = scale * jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, groups, axis=2))
logits = jnp.where(jnp.tril(jnp.ones((T, T), bool)), logits, -jnp.inf)
lse_check = jnp.moveaxis(jax.nn.logsumexp(logits, axis=-1), 1, 2)  # (B, T, N)
err = float(jnp.max(jnp.abs(lse - lse_check)))
print("lse", lse.shape, lse.dtype, f"max |lse - logsumexp(logits)| = {err:.2e}")
assert lse.shape == (B, T, N) and err < LSE_TOL

_, lse_masked = pallas_kernels.dot_product_attention(q2, k2, v2, **mask_kw, return_residual=True,
                                                     **KERNELS)
assert bool(jnp.all(lse_masked[:, ~has_key] == -jnp.inf))
print("lse of the padding queries:", np.unique(np.asarray(lse_masked[:, ~has_key])))

# %% [markdown]
# The LSE is what lets attention over a long key sequence be computed in pieces (split-K
# decoding, ring attention across devices): attend to each piece separately, then weight each
# partial output by `exp(lse_piece - lse_total)`, with `lse_total = logaddexp(lse_1, lse_2)`.

# %%
half = T // 2
out_1, lse_1 = attention(q, k[:, :half], v[:, :half], return_residual=True)
out_2, lse_2 = attention(q, k[:, half:], v[:, half:], return_residual=True)
lse_total = jnp.logaddexp(lse_1, lse_2)
merged = (jnp.exp(lse_1 - lse_total)[..., None] * out_1
          + jnp.exp(lse_2 - lse_total)[..., None] * out_2)
full, lse_full = attention(q, k, v, return_residual=True)
err_out, err_lse = rel_err(merged, full), float(jnp.max(jnp.abs(lse_total - lse_full)))
print(f"merged halves vs full attention: output {err_out:.2e}, lse {err_lse:.2e}")
assert err_out < TOL and err_lse < LSE_TOL

# %% [markdown]
# ## 5. Speed (GPU only)
#
# On a GPU we time the compiled kernels against `jax.nn.dot_product_attention` with cuDNN and
# with XLA, in bfloat16 with a causal mask: forward, and forward + backward. Each entry is the
# median of several timed runs after a warm-up (compilation) run, synchronising with
# `block_until_ready`. On a CPU the kernels only run in interpret mode, which measures the
# Python interpreter rather than the kernel, so the table is skipped. For the full benchmark
# (more sizes, tokamax, PyTorch) see `benchmarks/attention.py`.

# %%
def median_ms(fn, *args, repeats=20):
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def timed(impl, shape):
    b, t, n, h = shape
    keys = jax.random.split(jax.random.key(2), 3)
    q, k, v = (jax.random.normal(key, (b, t, n, h), jnp.bfloat16) for key in keys)
    if impl == "ours":
        attn = functools.partial(pallas_kernels.dot_product_attention, implementation="pallas")
    else:
        attn = functools.partial(jax.nn.dot_product_attention, implementation=impl)
    fwd = jax.jit(lambda q, k, v: attn(q, k, v, is_causal=True))

    def loss(q, k, v):
        return jnp.sum(attn(q, k, v, is_causal=True).astype(jnp.float32))

    fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    try:
        return median_ms(fwd, q, k, v), median_ms(fwd_bwd, q, k, v)
    except Exception as error:  # e.g. cuDNN not available for this GPU or shape
        print(f"{impl} at {shape}: {type(error).__name__}: {str(error)[:120]}")
        return float("nan"), float("nan")


if ON_GPU:
    print(jax.devices()[0].device_kind, "| bf16, causal | median ms (forward / forward+backward)")
    print(f"{'B, T, N, H':22} {'ours (Pallas)':>18} {'jax.nn cudnn':>18} {'jax.nn xla':>18}")
    for shape in [(4, 2048, 16, 128), (1, 8192, 16, 128)]:
        cells = [timed(impl, shape) for impl in ("ours", "cudnn", "xla")]
        row = " ".join(f"{fwd:8.3f} / {bwd:7.3f}" for fwd, bwd in cells)
        print(f"{str(shape):22} {row}")
else:
    print("No GPU: the speed table is skipped (interpret mode measures Python, not the kernel).")
