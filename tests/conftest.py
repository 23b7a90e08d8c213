"""Shared test set-up: float32 matmuls at full precision; `gpu` tests skipped without a GPU,
`multidevice` tests without 8 devices (on a CPU:
XLA_FLAGS=--xla_force_host_platform_device_count=8).
"""

import jax
import pytest

from pallas_kernels import _compat, _device

jax.config.update("jax_default_matmul_precision", "highest")
_compat.silence_triton_deprecation()


def pytest_collection_modifyitems(config, items):
    skips = {}
    if not _device.on_gpu():
        skips["gpu"] = pytest.mark.skip(reason="needs a GPU")
    if jax.device_count() < 8:
        skips["multidevice"] = pytest.mark.skip(
            reason="needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)
