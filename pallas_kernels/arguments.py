"""The ops' rules for their settings, public for layers built on the ops (`flax_layers`, or a
user's own), so that a layer checks its settings when it is built, as the op would, and masks
a decode step as the kernels do.

* `IMPLEMENTATIONS`: the values of `implementation=` besides None.
* `check_window(local_window_size)`, `check_soft_cap(logits_soft_cap)`: attention's settings,
  normalised (a (left, right) pair or None; a float or None); a TypeError or ValueError naming
  the argument.
* `check_dt_limit(dt_limit)`: the SSD's (low, high) step-size limits, the same way.
* `check_context_parallelism(name)`: attention's `context_parallelism`, a ValueError unless it
  is one of "all_gather", "ring"; `check_sequence_order(order)`: "contiguous" or "zigzag".
* `band(is_causal, local_window_size)` and `visible(rows, cols, *, band, row_len, col_len)`:
  which keys a query sees, on absolute positions (`attention.masking`).
* `known_value(x)`: x as a numpy array when its value is known at trace time, else None (checks
  that need values run where it is not None).
"""

from pallas_kernels import _sharding
from pallas_kernels._compat import concrete_value as known_value
from pallas_kernels._dispatch import IMPLEMENTATIONS
from pallas_kernels.attention.checks import check_soft_cap, check_window
from pallas_kernels.attention.context import strategy as _strategy
from pallas_kernels.attention.masking import band, visible
from pallas_kernels.mamba2.checks import check_dt_limit

__all__ = ["IMPLEMENTATIONS", "band", "check_context_parallelism", "check_dt_limit",
           "check_sequence_order", "check_soft_cap", "check_window", "known_value", "visible"]


def check_context_parallelism(name):
    """`name` if it is one of attention's context-parallel strategies, else a ValueError."""
    _strategy(name)
    return name


def check_sequence_order(order):
    """`order` if it is "contiguous" or "zigzag" (how a sharded sequence lies on the devices),
    else a ValueError."""
    return _sharding.check_order(order)
