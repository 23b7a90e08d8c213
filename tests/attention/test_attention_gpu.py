"""The attention kernels compiled for a real GPU, at training sizes (run on the H200)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import NAMES, exact, loss_and_grads, make_inputs, pallas

from pallas_kernels.attention import reference

pytestmark = pytest.mark.gpu

CASES = [
    ("gqa4-causal-h128", dict(b=2, t=2048, n=16, k=4, h=128), ("causal",)),
    ("h80-ragged-window", dict(b=1, t=4097, s=3001, n=8, k=8, h=80), ("window", "causal")),
    ("h64-segments-lengths", dict(b=2, t=4096, n=8, k=1, h=64), ("segments", "lengths")),
    ("h256-softcap", dict(b=1, t=2048, n=4, k=2, h=256), ("cap", "causal")),
    ("h96-full", dict(b=2, t=1536, s=2500, n=8, k=2, h=96), ()),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bf16_error_at_most_twice_reference(case):
    _, shape, mask = case
    args, kw = make_inputs(1, dtype=jnp.bfloat16, mask=mask, **shape)
    ours = jax.jit(functools.partial(loss_and_grads, pallas(), **kw))(*args)
    truth = jax.jit(functools.partial(loss_and_grads, exact, **kw))(*args)
    low = jax.jit(functools.partial(
        loss_and_grads, functools.partial(reference.dot_product_attention, upcast=False), **kw
    ))(*args)
    for name, x, lo, tr in zip(NAMES, ours, low, truth, strict=True):
        x, lo, tr = (np.asarray(a, np.float32) for a in (x, lo, tr))
        finite = np.isfinite(tr)
        assert np.array_equal(finite, np.isfinite(x)), name
        err = np.linalg.norm(x[finite] - tr[finite])
        base = np.linalg.norm(lo[finite] - tr[finite])
        assert err <= 2 * base + 1e-6 * np.linalg.norm(tr[finite]), f"{name}: {err} vs {base}"


def test_bitwise_deterministic_on_gpu():
    args, kw = make_inputs(2, b=2, t=4096, n=16, k=4, h=128, dtype=jnp.bfloat16, mask=("causal",))
    run = jax.jit(functools.partial(loss_and_grads, pallas(), **kw))
    first, second = run(*args), run(*args)
    for name, x, y in zip(NAMES, first, second, strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y)), name


def test_long_sequence_memory_is_linear():
    """T 32768 at head dim 128 trains; XLA's temporary memory grows linearly with T."""

    def temp_bytes(t):
        q = jax.ShapeDtypeStruct((1, t, 16, 128), jnp.bfloat16)
        step = jax.jit(lambda q, k, v: jax.grad(
            lambda q, k, v: jnp.sum(pallas()(q, k, v, is_causal=True).astype(jnp.float32)),
            argnums=(0, 1, 2))(q, k, v))
        return step.lower(q, q, q).compile().memory_analysis().temp_size_in_bytes, step

    small, _ = temp_bytes(16384)
    large, step = temp_bytes(32768)
    assert large <= 2.2 * small, (small, large)
    q = jax.random.normal(jax.random.key(0), (1, 32768, 16, 128), jnp.bfloat16)
    grads = step(q, q, q)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


@pytest.mark.parametrize("mask_shape", [(2, 8, 1000, 777), (2, 1, 1, 777), (1, 8, 1, 777)],
                         ids=["BNTS", "B11S", "1N1S"])
def test_user_mask_and_bias_match_jax_nn(mask_shape):
    """A user's mask (packed 8 keys a byte on NVIDIA) and a bias, GQA 4:1, ragged T and S:
    outputs and every gradient, the bias's too, against jax.nn's XLA attention in float32."""
    b, t, s, n, k, h = 2, 1000, 777, 8, 2, 128
    keys = jax.random.split(jax.random.key(3), 6)
    q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
    kv = [jax.random.normal(key, (b, s, k, h), jnp.bfloat16) for key in keys[1:3]]
    bias = jax.random.normal(keys[3], (1, n, t, s), jnp.bfloat16)
    mask = jax.random.uniform(keys[4], mask_shape) < 0.7
    mask = mask.at[..., :1].set(True)  # every query sees a key (jax.nn differs on those that don't)
    weights = jax.random.normal(keys[5], q.shape, jnp.float32)

    def grads(attention, dtype):
        def loss(q, k, v, bias):
            out = attention(q, k, v, bias, mask)
            return jnp.sum(out.astype(jnp.float32) * weights), out

        args = [x.astype(dtype) for x in (q, *kv, bias)]
        (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(*args)
        return out, *grads

    ours = grads(functools.partial(pallas(), is_causal=False), jnp.bfloat16)
    theirs = grads(functools.partial(jax.nn.dot_product_attention, implementation="xla"),
                   jnp.float32)
    for name, x, ref in zip(("out", "dq", "dk", "dv", "dbias"), ours, theirs, strict=True):
        x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
        assert np.isfinite(x).all(), name
        error = np.linalg.norm(x - ref) / np.linalg.norm(ref)
        assert error < 2e-2, f"{name}: relative error {error:.2e}"
