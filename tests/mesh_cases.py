"""Meshes and seeds shared by the 8-device tests."""

import zlib

import jax
import numpy as np
from jax.sharding import AxisType


def mesh(shape, names, explicit):
    """A mesh of the first prod(shape) devices: `jax.make_mesh` with Explicit axes, or a
    classic `Mesh` with Auto axes (whose arrays' types carry no sharding)."""
    if explicit:
        return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))
    devices = np.array(jax.devices()[:np.prod(shape)]).reshape(shape)
    return jax.sharding.Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def seed(*parts):
    """A seed that differs per test case and stays fixed across runs."""
    return zlib.crc32("-".join(map(str, parts)).encode()) % 1000
