"""Decode attention over a KV cache lowers to two Triton kernels (the split pass and the merge)
for GPUs that are not attached (NVIDIA H200, AMD gfx942) for every KV dtype, paged and dense
(`lowering_cases`); the cache write, donated, updates the caches in place."""

import jax
import jax.numpy as jnp
import pytest
from lowering_cases import CASES, TARGETS, TRITON_CALL, lower

import pallas_kernels


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("case", [name for name in CASES if name.startswith("decode-")])
def test_decode_lowers_to_the_split_and_merge_kernels(case, target):
    _, lowered = lower(case, target)
    text = lowered.as_text()
    assert text.count(TRITON_CALL) == 2
    # The caches go to the kernel as they are (no pad, convert or copy): their type appears
    # only in the function's signature and the kernel's call.
    (args,) = CASES[case]()[2]
    cache_type = "tensor<" + "x".join(map(str, args["k_cache"].shape)) + "x"
    lines = [line for line in text.splitlines() if cache_type in line]
    assert len(lines) == 2 and TRITON_CALL in lines[1], lines


@pytest.mark.parametrize("dtype, scaled", [(jnp.bfloat16, False), (jnp.int8, True)])
def test_a_donated_cache_write_updates_in_place(dtype, scaled):
    """update_kv_cache under jit with the caches donated: the outputs alias the donated inputs
    and no cache-sized buffer (nor scales) is copied."""
    pages, page, heads, dim = 64, 16, 2, 64
    shape = (pages, page, heads, dim)
    caches = [jnp.zeros(shape, dtype) for _ in range(2)]
    scales = [jnp.zeros((pages, heads, page), jnp.float32) if scaled else None for _ in range(2)]
    new = jnp.ones((4, 1, heads, dim), jnp.bfloat16)
    table = jnp.arange(64, dtype=jnp.int32).reshape(4, 16)
    lengths = jnp.array([0, 5, 16, 255], jnp.int32)

    def write(k_cache, v_cache, k_scale, v_scale):
        return pallas_kernels.update_kv_cache(k_cache, v_cache, new, new, lengths,
                                              block_table=table, k_scale=k_scale,
                                              v_scale=v_scale)

    compiled = jax.jit(write, donate_argnums=(0, 1, 2, 3)).lower(*caches, *scales).compile()
    text = compiled.as_text()
    aliased = text.split("input_output_alias=")[1].split("\n")[0]
    assert aliased.count("may-alias") + aliased.count("must-alias") == (4 if scaled else 2)
    assert not [line for line in text.splitlines() if " copy(" in line and (
        f"{pages},{page},{heads},{dim}" in line or f"{pages},{heads},{page}]" in line)]
