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
# # The kernels on a mesh: batch, heads and sequence sharding
#
# Both ops find how their inputs are sharded and run the kernels per shard under
# `jax.shard_map`. This notebook, on 8 simulated CPU devices,
#
# 1. shards the batch and the heads, and reads from the compiled program that no kernel input
#    is gathered;
# 2. shards the **sequence** (context parallelism): draws the zig-zag order that balances
#    causal attention, checks both attention strategies ("all_gather" and "ring") and the SSD's
#    state passing against the unsharded call, forward and every gradient, and counts the
#    collectives each issues;
# 3. trains a step of `HybridLM` on a (data, context) mesh and compares it with one device.
#
# Every claim is checked with an `assert`. On a CPU the kernels run in Pallas interpret mode,
# so the shapes are small.

# %%
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"  # before jax starts

import collections
import functools
import re

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import pallas_kernels
from flax_layers import HybridLM, HybridLMConfig

jax.config.update("jax_default_matmul_precision", "highest")
print(jax.device_count(), "devices")


def run_counting_collectives(fn, *args):
    """(fn(*args), {collective: count} in its compiled program), from one compile."""
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled(*args), dict(collections.Counter(re.findall(
        r"= \S+ (all-gather|reduce-scatter|all-reduce|collective-permute|all-to-all)\(",
        compiled.as_text())))


def rel_error(x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return np.linalg.norm(x - y) / np.linalg.norm(y)


# %% [markdown]
# ## 1. Batch and heads
#
# On a mesh made by `jax.make_mesh` (Explicit axes) an array's type carries its sharding, and
# the op reads it: here the batch over `data` (4) and the heads over `tensor` (2). Each device
# runs the kernels on 2 of 8 rows and 4 of 8 heads.

# %%
mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2)
keys = jax.random.split(jax.random.key(0), 3)
q, k, v = (jax.random.normal(key, (8, 64, 8, 32)) for key in keys)
attention = functools.partial(pallas_kernels.dot_product_attention, is_causal=True,
                              implementation="pallas")


def train_step(q, k, v):
    """The forward and the gradients of a loss: what a training step runs."""
    return jax.value_and_grad(lambda q, k, v: jnp.sum(attention(q, k, v) ** 2),
                              argnums=(0, 1, 2))(q, k, v)


with jax.set_mesh(mesh):
    placed = [jax.device_put(x, P("data", None, "tensor")) for x in (q, k, v)]
    (loss, grads), counts = run_counting_collectives(train_step, *placed)
want_loss, want_grads = jax.jit(train_step)(q, k, v)
print("output sharded as", jax.typeof(attention(*placed)))
print("collectives:", counts)
assert abs(float(loss) - float(want_loss)) < 1e-5 * float(want_loss)
assert all(rel_error(g, w) < 1e-5 for g, w in zip(grads, want_grads, strict=True))
assert "all-gather" not in counts

# %% [markdown]
# ## 2. The sequence: context parallelism
#
# With the sequence sharded over n devices each device computes its own tokens' outputs. For
# causal attention the work is lopsided when device i holds the i-th n-th of the tokens: the
# last device's queries see every key, the first's almost none. In **zig-zag** order the
# sequence is cut into 2n chunks and device i holds chunks i and 2n-1-i, one cheap and one
# dear. `pallas_kernels.zigzag` reorders a batch once, before the model; `sequence_order=
# "zigzag"` tells the op.

# %%
n, t = 4, 64
order = np.asarray(pallas_kernels.zigzag(jnp.arange(t)[None], n))[0]  # positions, zig-zag
fig, axes = plt.subplots(1, 2, figsize=(11, 2.8))
for ax, (name, positions) in zip(axes, [("contiguous", np.arange(t)), ("zig-zag", order)],
                                 strict=True):
    device = np.repeat(np.arange(n), t // n)
    ax.scatter(positions, device, c=device, cmap="tab10", s=12)
    work = [int(np.sum(positions[device == d] + 1)) for d in range(n)]  # causal pairs
    ax.set_title(f"{name}: causal (query, key) pairs per device {work}", fontsize=9)
    ax.set_xlabel("token position")
    ax.set_ylabel("device")
    ax.set_yticks(range(n))
plt.tight_layout()
plt.show()
work = [int(np.sum(order[d * t // n:(d + 1) * t // n] + 1)) for d in range(n)]
assert max(work) == min(work)

# %% [markdown]
# Both strategies on a (data 2, context 4) mesh, in zig-zag order, against the unsharded call.
# Queries are pieces of the sequence; each piece's mask is shifted to its global position, so
# causal masks, windows, segments and lengths mean what they mean on the whole sequence.
#
# * `"all_gather"` gathers K, V (and key segment ids) and reduce-scatters their gradients;
# * `"ring"` passes K and V round the ring, n - 1 times each, overlapping the kernels; its
#   backward passes dK and dV along with them.

# %%
mesh = jax.make_mesh((2, 4), ("data", "context"), axis_types=(AxisType.Explicit,) * 2)
q, k, v = (jax.random.normal(key, (2, t, 4, 32)) for key in keys)
segments = jnp.asarray(np.repeat([[0] * 22 + [1] * 30 + [2] * 12], 2, axis=0))


def loss_of(**options):
    def loss(q, k, v, segments):
        out = pallas_kernels.dot_product_attention(
            q, k, v, is_causal=True, q_segment_ids=segments, kv_segment_ids=segments,
            implementation="pallas", **options)
        return jnp.sum(out**2)  # the same in any token order
    return jax.value_and_grad(loss, argnums=(0, 1, 2))


want_loss, want_grads = jax.jit(loss_of())(q, k, v, segments)
for strategy in ("all_gather", "ring"):
    step = loss_of(context_parallelism=strategy, sequence_order="zigzag")
    with jax.set_mesh(mesh):
        placed = [jax.device_put(pallas_kernels.zigzag(x, n), P("data", "context"))
                  for x in (q, k, v, segments)]
        (got_loss, got_grads), counts = run_counting_collectives(step, *placed)
    got_grads = [pallas_kernels.unzigzag(np.asarray(g), n) for g in got_grads]
    errors = [rel_error(g, w) for g, w in zip(got_grads, want_grads, strict=True)]
    print(f"{strategy:10s} loss {float(got_loss):.6f} (unsharded {float(want_loss):.6f}), "
          f"gradient errors {np.max(errors):.1e}, collectives {counts}")
    assert abs(float(got_loss) - float(want_loss)) < 1e-5 * abs(float(want_loss))
    assert max(errors) < 1e-5

# %% [markdown]
# The SSD needs its shards in order (contiguous). Each device first walks its shard's states
# from a zero state (no outputs); the devices all-gather only those final states and decays,
# chain them, and each runs the kernels once from the state entering its shard. The backward
# mirrors it: a walk from the output's gradient gives the gradient at each shard's start, the
# chain carries it back, and each device's backward runs once from the gradient of the state
# leaving its shard. On one GPU this costs 1.04-1.12x of the unsharded call on the same tokens
# (`benchmarks/REPORT.md`). `seq_idx` boundaries cut the carried state as they do within a row.

# %%
h, p, N = 4, 16, 16
ks = jax.random.split(jax.random.key(1), 6)
x = jax.random.normal(ks[0], (2, t, h, p))
dt = jax.random.normal(ks[1], (2, t, h)) * 0.5 - 1.0
A = -jnp.exp(jax.random.uniform(ks[2], (h,)))
B, C = (jax.random.normal(key, (2, t, 1, N)) for key in ks[3:5])
seq_idx = jnp.asarray(np.repeat([[0] * 30 + [1] * 34], 2, axis=0))


def ssd_loss(x, dt, A, B, C):
    y, final = pallas_kernels.mamba_chunk_scan_combined(
        x, dt, A, B, C, 16, D=jnp.ones(h), seq_idx=seq_idx, dt_softplus=True,
        return_final_states=True, implementation="pallas")
    return jnp.sum(y * jnp.sin(jnp.arange(y.size).reshape(y.shape))) + jnp.sum(final)


ssd_step = jax.value_and_grad(ssd_loss, argnums=(0, 1, 2, 3, 4))
want_loss, want_grads = jax.jit(ssd_step)(x, dt, A, B, C)
with jax.set_mesh(mesh):
    placed = [jax.device_put(a, P("data", "context")) for a in (x, dt)]
    (got_loss, got_grads), counts = run_counting_collectives(ssd_step, *placed, A, B, C)
errors = [rel_error(g, w) for g, w in zip(got_grads, want_grads, strict=True)]
print(f"SSD loss {float(got_loss):.6f} (unsharded {float(want_loss):.6f}), gradient errors "
      f"{np.max(errors):.1e}, collectives {counts}")
assert abs(float(got_loss) - float(want_loss)) < 1e-5 * abs(float(want_loss))
assert max(errors) < 1e-5

# %% [markdown]
# ## 3. A model on a mesh
#
# `HybridLM` follows its tokens: with the (B, T) tokens on `P("data", "context")` every
# activation is sharded that way, the kernels run per shard and each Mamba2 conv takes its
# history tokens from the previous sequence shard. Parameters stay replicated.

# %%
model = HybridLM(HybridLMConfig.preset("tiny", chunk_size=16), rngs=nnx.Rngs(0))
tokens = jax.random.randint(jax.random.key(2), (4, t), 0, 256)


def lm_loss(model, tokens):
    logits = model(tokens)
    picked = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


step = nnx.jit(nnx.value_and_grad(lm_loss))
want_loss, want_grads = step(model, tokens)
with jax.set_mesh(mesh):
    got_loss, got_grads = step(model, jax.device_put(tokens, P("data", "context")))
errors = [rel_error(g, w) for g, w in zip(jax.tree.leaves(got_grads),
                                          jax.tree.leaves(want_grads), strict=True)]
print(f"HybridLM loss {float(got_loss):.6f} on 8 devices, {float(want_loss):.6f} on one; "
      f"gradient errors up to {max(errors):.1e}")
assert abs(float(got_loss) - float(want_loss)) < 1e-5 * float(want_loss)
assert max(errors) < 1e-5
