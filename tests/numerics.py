"""Comparisons shared by the tests of both ops."""

import numpy as np


def rel_error(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30)
