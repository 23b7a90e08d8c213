"""The decode kernel compiled for a real GPU, at serving sizes, on NaN-poisoned caches (run on
the H200): what interpret mode cannot show (the head dim read through a masked
power-of-two block, page gathers, the splits' launch) against the float32 reference; and
`generate` on the kernels against the references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from kv_cache_cases import assert_matches, make_case, tolerance

import pallas_kernels
from flax_layers import HybridLM, HybridLMConfig
from pallas_kernels.kv_cache import reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("cache_dtype, h, page_size, heads", [
    (jnp.bfloat16, 128, 16, (32, 4)),
    (jnp.bfloat16, 80, None, (32, 32)),   # H 80: lanes past H masked on load
    (jnp.int8, 80, 16, (32, 4)),          # and through the pages
    (jnp.int8, 128, 16, (32, 4)),
    (jnp.float8_e4m3fn, 256, 32, (8, 1)),
    (jnp.uint8, 64, 16, (16, 2)),        # AMD's float8_e4m3fnuz bits, decoded in the kernel
])
@pytest.mark.parametrize("num_splits", [1, None])
def test_poisoned_caches_match_the_reference(cache_dtype, h, page_size, heads, num_splits):
    n, k = heads
    b, capacity = 8, 2048
    lengths = [capacity, 1, 0, 1000, 16 * 37, 2047, 5, 1536]
    paged = dict(page_size=page_size, max_pages=capacity // page_size) if page_size else dict(
        s=capacity)
    q, seqlens, _, dirty = make_case(3, b=b, t=1, n=n, k=k, h=h, lengths=lengths,
                                     cache_dtype=cache_dtype, q_dtype=jnp.bfloat16, **paged)
    k_cache, v_cache, kw = dirty
    out, lse = jax.jit(functools.partial(
        pallas_kernels.attention_with_kv_cache, num_splits=num_splits, return_residual=True,
        implementation="pallas"))(q, k_cache, v_cache, seqlens, **kw)
    ref_out, ref_lse = reference.attention_with_kv_cache(  # it reads only the valid slots
        q.astype(jnp.float32), k_cache, v_cache, seqlens, return_residual=True, **kw)
    assert_matches(f"{jnp.dtype(cache_dtype).name} h{h}", out, lse, ref_out, ref_lse,
                   tol=tolerance(jnp.bfloat16, cache_dtype))


def test_generate_on_the_kernels_equals_the_references():
    """Greedy, float32: the prefill (FlashAttention, chunked SSD) and the decode loop (the
    KV-cache kernel over an int8 paged cache, the in-place state update) against the
    references over the same caches."""
    prompt = jax.random.randint(jax.random.key(0), (4, 40), 0, 256)
    lengths = jnp.array([40, 17, 33, 1])
    tokens = [np.asarray(HybridLM(HybridLMConfig.preset("tiny", implementation=impl),
                                  rngs=nnx.Rngs(0)).generate(
        prompt, 24, temperature=0.0, rng=jax.random.key(1), prompt_lengths=lengths,
        kv_dtype=jnp.int8, page_size=16)) for impl in ("pallas", "xla")]
    np.testing.assert_array_equal(*tokens)
