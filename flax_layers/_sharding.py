"""Logical axis names on parameters, so that a later mesh can shard a model.

`logical("embed", "mlp")` is the metadata dict for flax's `kernel_metadata`, `bias_metadata`,
`scale_metadata` and `embedding_metadata` arguments; `logical_param` wraps an array directly.
Sharding is not applied eagerly: without a mesh the names are only recorded.
"""

from flax import nnx


def logical(*names):
    return {"out_sharding": names, "eager_sharding": False}


def logical_param(value, *names):
    return nnx.Param(value, **logical(*names))
