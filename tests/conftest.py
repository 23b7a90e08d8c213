"""Shared test set-up: float32 matmuls at full precision, and `gpu` tests skipped without a GPU."""

import jax
import pytest

from pallas_kernels import _compat, _device

jax.config.update("jax_default_matmul_precision", "highest")
_compat.silence_triton_deprecation()


def pytest_collection_modifyitems(config, items):
    if _device.on_gpu():
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
