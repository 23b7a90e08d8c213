"""`_operands.call`'s guard: a block that overhangs its array is a ValueError naming the operand,
unless the kernel says it masks its edge tiles (jax 0.11's Pallas-Triton would read and write
past the array)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import _operands
from pallas_kernels._operands import Operands


def _copy(x, block, **kw):
    spec = pl.BlockSpec((block,), lambda i: (i,))

    def kernel(refs):
        refs.out[...] = refs.x[...]

    return _operands.call(kernel, Operands().add("x", spec, x),
                          Operands().add("out", spec, jax.ShapeDtypeStruct(x.shape, x.dtype)),
                          grid=(pl.cdiv(x.shape[0], block),), num_warps=4, num_stages=1,
                          interpret=True, name="copy", **kw)["out"]


def test_whole_blocks_run():
    x = jnp.arange(64, dtype=jnp.float32)
    np.testing.assert_array_equal(_copy(x, 16), x)


def test_a_block_that_overhangs_its_array_is_refused():
    with pytest.raises(ValueError, match=r"copy: operand 'x': block \(16,\) does not tile its "
                                         r"array \(77,\)"):
        _copy(jnp.zeros(77), 16)


def test_a_kernel_that_masks_its_edges_may_overhang():
    assert _copy(jnp.zeros(77), 16, masks_edges=True).shape == (77,)


def test_a_window_of_whole_blocks_in_a_wider_array_is_read():
    """A (16,)-block window from element 32 of a 77-element array: its blocks never reach the
    part that does not tile, so `windows` lets it through."""
    wide = jnp.arange(77, dtype=jnp.float32)
    spec = pl.BlockSpec((16,), lambda i: (i + 2,))

    def kernel(refs):
        refs.out[...] = refs.x[...]

    out = _operands.call(kernel, Operands().add("x", spec, wide),
                         Operands().add("out", pl.BlockSpec((16,), lambda i: (i,)),
                                        jax.ShapeDtypeStruct((32,), wide.dtype)),
                         grid=(2,), num_warps=4, num_stages=1, interpret=True, name="window",
                         windows=("x",))["out"]
    np.testing.assert_array_equal(out, wide[32:64])
