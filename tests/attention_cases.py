"""Inputs and comparisons shared by the attention tests."""

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from pallas_kernels.attention import reference


def make_inputs(seed, *, b=2, t=33, s=None, n=4, k=None, h=32, dtype=jnp.float32, mask=()):
    """Random q, k, v, output/lse cotangents and the mask keyword arguments named in `mask`.

    `mask` may hold "causal", "window", "segments", "lengths", "cap"; segments and lengths are
    drawn so that some query rows see no key.
    """
    s = t if s is None else s
    k = n if k is None else k
    keys = jax.random.split(jax.random.key(seed), 8)
    q = jax.random.normal(keys[0], (b, t, n, h), dtype)
    kk = jax.random.normal(keys[1], (b, s, k, h), dtype)
    v = jax.random.normal(keys[2], (b, s, k, h), dtype)
    dout = jax.random.normal(keys[3], (b, t, n, h), jnp.float32)
    dlse = jax.random.normal(keys[4], (b, t, n), jnp.float32)
    kw = {}
    if "causal" in mask:
        kw["is_causal"] = True
    if "window" in mask:
        kw["local_window_size"] = (max(1, s // 5), max(1, s // 7))
    if "cap" in mask:
        kw["logits_soft_cap"] = 2.0
    if "segments" in mask:
        # Sorted ids with a query-only segment (7) whose rows see no key.
        q_ids = jnp.sort(jax.random.randint(keys[5], (b, t), 0, 4))
        q_ids = q_ids.at[:, -max(1, t // 6):].set(7)
        kw["q_segment_ids"] = q_ids
        kw["kv_segment_ids"] = jnp.sort(jax.random.randint(keys[6], (b, s), 0, 4))
    if "lengths" in mask:
        kw["query_seq_lengths"] = jnp.array([t, max(1, t // 2)] + [t] * (b - 2), jnp.int32)
        kw["key_value_seq_lengths"] = jnp.array([max(1, s // 3), 0] + [s] * (b - 2), jnp.int32)
    return (q, kk, v, dout, dlse), kw


def loss_and_grads(attention, q, k, v, dout, dlse, **kw):
    """(out, lse, dq, dk, dv) of sum(out * dout) + sum(lse * dlse) over rows that see a key."""

    def loss(q, k, v):
        out, lse = attention(q, k, v, return_residual=True, **kw)
        lse_term = jnp.where(jnp.isfinite(lse), lse * dlse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * dout) + jnp.sum(lse_term), (out, lse)

    # jit: one compile of the whole step instead of op-by-op dispatch (much faster on a CPU).
    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v)
    return (out, lse, *grads)


def pallas(**fixed):
    def attention(*args, **kw):
        return pallas_kernels.dot_product_attention(*args, implementation="pallas", **fixed, **kw)

    return attention


def exact(*args, **kw):
    """The float32 reference on float32 copies of the inputs."""
    args = [x.astype(jnp.float32) for x in args]
    return reference.dot_product_attention(*args, **kw)


def assert_close(name, x, ref, *, rtol, atol):
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    assert np.array_equal(np.isinf(x), np.isinf(ref)), f"{name}: infinities differ"
    finite = np.isfinite(ref)
    assert np.all(np.isfinite(x[finite])), f"{name}: non-finite values"
    np.testing.assert_allclose(x[finite], ref[finite], rtol=rtol, atol=atol, err_msg=name)


NAMES = ("out", "lse", "dq", "dk", "dv")
