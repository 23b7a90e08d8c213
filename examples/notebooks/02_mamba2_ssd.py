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
# # Mamba2's SSD, chunk by chunk: `pallas_kernels.mamba_chunk_scan_combined`
#
# Mamba2's state-space layer (SSD, "state-space duality") is a linear recurrence with a
# matrix-valued state. This notebook
#
# 1. writes the recurrence down and runs it token by token (the ground truth);
# 2. derives the **chunked** algorithm the kernels implement, step by step in plain `jnp`,
#    with plots of the decay matrix `L` of one chunk and of the state across chunks;
# 3. checks the Pallas kernel against the token-by-token recurrence, and its gradients
#    against the reference;
# 4. shows that decoding with `selective_state_update`, one token at a time, gives the same
#    outputs and final state as the chunked scan, also after a chunked "prefill".
#
# Every claim is checked with an `assert`. On a CPU the kernels run in Pallas interpret mode
# (`implementation="pallas", interpret=True`), which is slow, so the shapes are small.

# %%
import functools

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import pallas_kernels
from pallas_kernels.mamba2 import reference, semantics

# float32 matmuls at full precision, so the references are exact (no TF32 on a GPU).
jax.config.update("jax_default_matmul_precision", "highest")

ON_GPU = jax.default_backend() == "gpu"
KERNELS = dict(implementation="pallas", interpret=not ON_GPU)  # the Pallas kernels
REFERENCE = dict(implementation="xla")  # the chunked algorithm in plain jnp
# Tolerances relative to the largest reference value. On a GPU, float32 dots inside the Triton
# kernels run at TF32-class precision; in interpret mode they are exact float32.
TOL = 1e-2 if ON_GPU else 1e-5
GRAD_TOL = 3e-2 if ON_GPU else 1e-4
print(f"jax {jax.__version__} on {jax.default_backend()}")


def rel_err(x, ref):
    """max |x - ref| / max |ref|, in float32."""
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


# %% [markdown]
# ## 1. The recurrence
#
# For each batch row and head `h` (with head dim `P` and state size `N`) the layer keeps a state
# `h_t` of shape `(P, N)` and, token by token,
#
# $$ h_t = e^{\Delta_t A}\, h_{t-1} + \Delta_t\, x_t B_t^\top, \qquad
#    y_t = h_t C_t + D\, x_t , $$
#
# with `x_t` `(P,)` the input, `B_t`, `C_t` `(N,)` input-dependent projections (shared by the
# heads of a group, like GQA), `A < 0` a per-head scalar, and `Δ_t = softplus(dt_t + dt_bias)`
# a per-head, per-token step size. `exp(Δ_t A)` in (0, 1) is how much of the state survives
# one step: a selective, input-dependent forget gate.
#
# The shapes follow mamba_ssm: `x` `(b, T, H, P)`, `dt` `(b, T, H)`, `A` `(H,)`,
# `B`, `C` `(b, T, G, N)` with `H % G == 0`, `D` `(H,)`.

# %%
b, T, H, P, G, N = 1, 128, 4, 32, 2, 16
CHUNK = 16  # Q: tokens per chunk, so T / Q = 8 chunks

keys = jax.random.split(jax.random.key(0), 8)
x = jax.random.normal(keys[0], (b, T, H, P), jnp.float32)
dt = jax.random.normal(keys[1], (b, T, H), jnp.float32) - 1.0  # raw step sizes
dt_bias = 0.5 * jax.random.normal(keys[2], (H,), jnp.float32)
A = -jnp.array([0.02, 0.1, 0.5, 2.0], jnp.float32)  # from long to short memory
Bm = jax.random.normal(keys[3], (b, T, G, N), jnp.float32)
Cm = jax.random.normal(keys[4], (b, T, G, N), jnp.float32)
D = jnp.ones((H,), jnp.float32)
ssd_args = (x, dt, A, Bm, Cm, CHUNK)
ssd_kw = dict(D=D, dt_bias=dt_bias, dt_softplus=True)

# The ground truth: `reference.ssd_recurrence` is a lax.scan over the T tokens.
y_rec, final_rec = reference.ssd_recurrence(*ssd_args, **ssd_kw, return_final_states=True)
print("y", y_rec.shape, "final state", final_rec.shape)

# %% [markdown]
# ## 2. The chunked algorithm
#
# A scan over tokens is sequential: T steps, each a tiny outer product. SSD instead splits the
# sequence into chunks of `Q` tokens. Unrolling the recurrence inside a chunk, with
# `a_t = Δ_t A` and the in-chunk cumulative sum `s_l = a_1 + ... + a_l`,
#
# $$ y_l = \underbrace{\sum_{s \le l} (C_l \cdot B_s)\, L_{ls}\, \Delta_s x_s}_{\text{inside
#          the chunk}}
#        + \underbrace{e^{s_l}\, H_{c-1} C_l}_{\text{from earlier chunks}} + D x_l ,
#   \qquad L_{ls} = e^{s_l - s_s} = e^{a_{s+1} + \dots + a_l}\ (s \le l),\ 0\ (s > l). $$
#
# `L` is the **decay mask**: `exp` of the "segment sum" of the log decays between token `s` and
# token `l`. The first term is attention-like: a `Q x Q` matrix `(C B^T) ∘ L` times the inputs,
# which runs on matrix units. The algorithm has four steps:
#
# 1. **intra-chunk (diagonal) outputs**: `Y_diag = ((C B^T) ∘ L) (Δ x)`, per chunk;
# 2. **chunk states**: the state each chunk would leave behind if it started from zero,
#    `S_c = sum_s e^{s_Q - s_s} Δ_s x_s B_s^T`;
# 3. **state passing**: a scan over the `T / Q` chunks (not the T tokens):
#    `H_c = e^{s_Q} H_{c-1} + S_c`, where `e^{s_Q}` is the decay across the whole chunk;
# 4. **outputs from the states**: `Y_off = e^{s_l} C_l H_{c-1}` for the tokens of chunk `c`.
#
# The kernels run steps 1-4 in one pass over the chunks with the state in float32 registers.
# Below they are written out for a single head in plain `jnp`.

# %%
def segsum(a):
    """(..., Q) log decays -> (..., Q, Q): [l, s] = a_{s+1} + ... + a_l for s <= l, else -inf."""
    cum = jnp.cumsum(a, axis=-1)
    diff = cum[..., :, None] - cum[..., None, :]
    causal = jnp.tril(jnp.ones((a.shape[-1], a.shape[-1]), bool))
    return jnp.where(causal, diff, -jnp.inf)


def ssd_chunked_one_head(x, delta, a_h, Bm, Cm, d_h, chunk):
    """Chunked SSD for one head: x (T, P), delta (T,), a_h scalar, Bm/Cm (T, N), d_h scalar."""
    (t, p), n = x.shape, Bm.shape[-1]
    nc = t // chunk
    xc = x.reshape(nc, chunk, p)
    dc = delta.reshape(nc, chunk)
    Bc, Cc = Bm.reshape(nc, chunk, n), Cm.reshape(nc, chunk, n)
    a = dc * a_h  # (nc, Q) log decays, <= 0
    cum = jnp.cumsum(a, axis=-1)

    # 1. Intra-chunk outputs with the decay mask L (nc, Q, Q).
    L = jnp.exp(segsum(a))
    y_diag = jnp.einsum("cln,csn,cls,cs,csp->clp", Cc, Bc, L, dc, xc)

    # 2. Chunk states: decay from each token to the chunk's end.
    to_end = jnp.exp(cum[:, -1:] - cum)  # (nc, Q)
    chunk_states = jnp.einsum("cs,cs,csp,csn->cpn", to_end, dc, xc, Bc)

    # 3. State passing over chunks; also keep the state entering each chunk.
    def pass_state(state, inputs):
        chunk_state, chunk_decay = inputs
        return chunk_decay * state + chunk_state, state

    final, states_in = jax.lax.scan(
        pass_state, jnp.zeros((p, n)), (chunk_states, jnp.exp(cum[:, -1]))
    )

    # 4. Outputs from the carried-in states.
    y_off = jnp.einsum("cl,cln,cpn->clp", jnp.exp(cum), Cc, states_in)
    y = (y_diag + y_off).reshape(t, p) + d_h * x
    return y, final, states_in, L


delta = semantics.step_sizes(dt, dt_bias, dt_softplus=True)  # Δ = softplus(dt + dt_bias)
group_of = jnp.arange(H) // (H // G)  # head h reads the B, C of group h // (H / G)
chunked = jax.vmap(ssd_chunked_one_head, in_axes=(1, 1, 0, 1, 1, 0, None))(
    x[0], delta[0], A, Bm[0][:, group_of], Cm[0][:, group_of], D, CHUNK
)
y_chunk, final_chunk, states_in, L = chunked  # per head: (H, T, P), (H, P, N), ...

err_y = rel_err(jnp.moveaxis(y_chunk, 0, 1), y_rec[0])
err_h = rel_err(final_chunk, final_rec[0])
print(f"chunked (by hand) vs token-by-token: y {err_y:.2e}, final state {err_h:.2e}")
assert err_y < 1e-5 and err_h < 1e-5

# %% [markdown]
# The decay mask `L` of the first chunk, for the head with the longest memory and the head with
# the shortest. `L` is lower triangular; along a row, the weight of older tokens shrinks by
# `exp(Δ A)` per step, fast where `Δ_t` is large. (The colour scale is logarithmic.)

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 4.4))
for ax, head in zip(axes, (0, H - 1), strict=True):
    Lh = np.asarray(L[head, 0])
    shown = np.where(Lh > 0, Lh, np.nan)
    image = ax.imshow(shown, cmap="viridis", norm="log", vmin=1e-4, vmax=1)
    ax.set_title(f"L, chunk 0, head {head} (A = {float(A[head]):g})")
    ax.set_xlabel("source token s")
    ax.set_ylabel("output token l")
fig.colorbar(image, ax=axes, label="L[l, s] = exp(a_{s+1} + ... + a_l)")
plt.show()

Lh = np.asarray(L[0, 0])
assert np.all(np.triu(Lh, 1) == 0) and np.allclose(np.diag(Lh), 1)  # causal, no decay at s = l
assert np.all(np.diff(np.tril(Lh), axis=0)[np.tril_indices(CHUNK - 1)] <= 0)  # decays down a column

# %% [markdown]
# The states `H_c` that step 3 passes between chunks are exactly the token-by-token states at
# chunk boundaries. Below: the state norm `||h_t||` of every token (a `lax.scan` of one decode
# step, `reference.selective_state_update`) and, as dots, the chunk-boundary states of the
# chunked algorithm. Heads with a small `|A|` remember more and their state grows; heads with a
# large `|A|` forget within a few tokens.

# %%
def token_states(state, token):
    x_t, dt_t, B_t, C_t = token
    _, state = reference.selective_state_update(state, x_t, dt_t, A, B_t, C_t, **ssd_kw)
    return state, state


time_major = [jnp.moveaxis(v, 1, 0) for v in (x, dt, Bm, Cm)]
_, all_states = jax.lax.scan(token_states, jnp.zeros((b, H, P, N)), time_major)  # (T, b, H, P, N)
token_norms = np.linalg.norm(np.asarray(all_states[:, 0]), axis=(-2, -1))  # (T, H)
# states_in[:, c] is the state entering chunk c, i.e. the state after token c * Q - 1.
boundary = np.arange(1, T // CHUNK) * CHUNK - 1
chunk_norms = np.linalg.norm(np.asarray(states_in[:, 1:]), axis=(-2, -1)).T  # (nc - 1, H)
np.testing.assert_allclose(chunk_norms, token_norms[boundary], rtol=1e-5)

fig, ax = plt.subplots(figsize=(9, 4))
for head in range(H):
    line, = ax.plot(token_norms[:, head], label=f"head {head}, A = {float(A[head]):g}")
    ax.plot(boundary, chunk_norms[:, head], "o", color=line.get_color())
for edge in boundary:
    ax.axvline(edge + 0.5, color="0.85", lw=0.8, zorder=0)
ax.set_xlabel("token t (grey lines: chunk boundaries)")
ax.set_ylabel("||h_t|| (Frobenius)")
ax.set_title("State norm: token by token (lines) and passed between chunks (dots)")
ax.legend()
plt.show()

# %% [markdown]
# ## 3. The Pallas kernel
#
# `pallas_kernels.mamba_chunk_scan_combined` has mamba_ssm's signature:
# `(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
# seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0, inf), return_final_states=False,
# return_varlen_states=False)`.
# Here it runs the kernels (`implementation="pallas"`); we check it against the token-by-token
# recurrence.

# %%
ssd = jax.jit(
    functools.partial(pallas_kernels.mamba_chunk_scan_combined, **KERNELS),
    static_argnames=("chunk_size", "dt_softplus", "return_final_states"),
)
y_kernel, final_kernel = ssd(*ssd_args, **ssd_kw, return_final_states=True)
err_y, err_h = rel_err(y_kernel, y_rec), rel_err(final_kernel, final_rec)
print(f"Pallas kernel vs token-by-token recurrence: y {err_y:.2e}, final state {err_h:.2e}")
assert err_y < TOL and err_h < TOL

# %% [markdown]
# **Packed sequences.** `seq_idx` `(b, T)` marks documents packed into one row: where it
# changes, the state is reset to zero, also in the middle of a chunk (here at token 40, inside
# the third chunk). The packed run then equals two separate runs.

# %%
CUT = 40
seq_idx = jnp.where(jnp.arange(T) < CUT, 0, 1)[None].astype(jnp.int32)
y_packed = ssd(*ssd_args, **ssd_kw, seq_idx=seq_idx)
y_first = reference.ssd_recurrence(x[:, :CUT], dt[:, :CUT], A, Bm[:, :CUT], Cm[:, :CUT], CHUNK,
                                   **ssd_kw)
y_second = reference.ssd_recurrence(x[:, CUT:], dt[:, CUT:], A, Bm[:, CUT:], Cm[:, CUT:],
                                    CHUNK, **ssd_kw)
err = rel_err(y_packed, jnp.concatenate([y_first, y_second], axis=1))
print(f"packed (seq_idx) vs two separate runs: y {err:.2e}")
assert err < TOL

# %% [markdown]
# ### Gradients
#
# The kernels sit in a `jax.custom_vjp`; the backward recomputes the chunk states, runs a reverse
# state-gradient pass over the chunks and a per-chunk gradient kernel. We differentiate
# `sum(y * w) + sum(final_state * w_final)` with respect to every array argument, including the
# gate `z` and `initial_states`, and compare with JAX's autodiff of the jnp reference.

# %%
z = jax.random.normal(keys[5], x.shape, jnp.float32)
h0 = jax.random.normal(keys[6], (b, H, P, N), jnp.float32)
w, w_final = jax.random.normal(keys[7], x.shape), jax.random.normal(keys[7], h0.shape)
names = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def make_grads(options):
    def loss(x, dt, A, Bm, Cm, D, z, dt_bias, h0):
        y, final = pallas_kernels.mamba_chunk_scan_combined(
            x, dt, A, Bm, Cm, CHUNK, D=D, z=z, dt_bias=dt_bias, initial_states=h0,
            dt_softplus=True, return_final_states=True, **options,
        )
        return jnp.sum(y * w) + jnp.sum(final * w_final)

    return jax.jit(jax.grad(loss, argnums=tuple(range(len(names)))))


grad_args = (x, dt, A, Bm, Cm, D, z, dt_bias, h0)
grads = make_grads(KERNELS)(*grad_args)
grads_ref = make_grads(REFERENCE)(*grad_args)
for name, g, g_ref in zip(names, grads, grads_ref, strict=True):
    err = rel_err(g, g_ref)
    print(f"d{name:15} {str(g.shape):16} relative error {err:.2e}")
    assert g.shape == g_ref.shape and err < GRAD_TOL, (name, err)

# %% [markdown]
# ## 4. Decoding equals the scan
#
# For generation, one token at a time, `selective_state_update(state, x_t, dt_t, A, B_t, C_t,
# D, z, dt_bias, dt_softplus)` applies one step of the recurrence to a stored state and returns
# `(y_t, new_state)`. Stepping it over all T tokens from a zero state must give the chunked
# scan's outputs and, with `return_final_states=True`, its final state.

# %%
step = functools.partial(pallas_kernels.selective_state_update, **ssd_kw, **KERNELS)


@jax.jit
def decode(state, x, dt, Bm, Cm):
    """Steps the decode kernel over the tokens of x (b, t, H, P); returns (y, final state)."""

    def one_token(state, token):
        x_t, dt_t, B_t, C_t = token
        y_t, state = step(state, x_t, dt_t, A, B_t, C_t)
        return state, y_t

    tokens = [jnp.moveaxis(v, 1, 0) for v in (x, dt, Bm, Cm)]
    final, y = jax.lax.scan(one_token, state, tokens)
    return jnp.moveaxis(y, 0, 1), final


y_dec, final_dec = decode(jnp.zeros((b, H, P, N)), x, dt, Bm, Cm)
err_y, err_h = rel_err(y_dec, y_kernel), rel_err(final_dec, final_kernel)
print(f"{T} decode steps vs chunked scan: y {err_y:.2e}, final state {err_h:.2e}")
assert err_y < TOL and err_h < TOL

# %% [markdown]
# In a language model the prompt is processed by the chunked scan ("prefill") and generation
# continues by decoding from the prefill's final state. Prefill on the first 96 tokens plus
# 32 decode steps gives the same outputs as one scan over all 128.

# %%
PREFILL = 96
y_pre, state = ssd(x[:, :PREFILL], dt[:, :PREFILL], A, Bm[:, :PREFILL], Cm[:, :PREFILL], CHUNK,
                   **ssd_kw, return_final_states=True)
y_gen, final_gen = decode(state, x[:, PREFILL:], dt[:, PREFILL:], Bm[:, PREFILL:],
                          Cm[:, PREFILL:])
err_y = rel_err(jnp.concatenate([y_pre, y_gen], axis=1), y_rec)
err_h = rel_err(final_gen, final_rec)
print(f"prefill {PREFILL} + decode {T - PREFILL} vs recurrence: y {err_y:.2e}, "
      f"final state {err_h:.2e}")
assert err_y < TOL and err_h < TOL
