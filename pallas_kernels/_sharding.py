"""The ops on a mesh: which mesh axes shard the batch and the heads of a call, and the op's local
computation run per shard under `jax.shard_map`, so that no kernel input is gathered.

The placement of a call comes from, in this order:

* the op's `sharding=` argument: a `NamedSharding` of the leading array (query, x), or a
  `PartitionSpec` of it on the mesh set with `jax.set_mesh` (classic meshes, whose Auto axes
  leave the arrays' types without a sharding);
* the leading array's own type on a mesh with Explicit axes (`jax.make_mesh`'s default), where
  `jax.typeof(x).sharding` says how it is sharded.

Inside a `jax.shard_map` whose axes are all Manual the arrays are already local and the op runs
as it is. Only the batch and head axes may be sharded; a sharded sequence or head dim raises a
ValueError naming the argument and the mesh axis.
"""

import dataclasses
import math

import jax
from jax.sharding import NamedSharding, PartitionSpec


@dataclasses.dataclass(frozen=True)
class Placement:
    """Mesh axes of a call's batch and heads (PartitionSpec entries: None, a name or a tuple
    of names) on `mesh`; `explicit` when the arrays' types carry their sharding."""

    mesh: object
    batch: object
    heads: object
    explicit: bool

    def size(self, entry):
        """Devices along a PartitionSpec entry."""
        names = () if entry is None else (entry,) if isinstance(entry, str) else entry
        return math.prod(self.mesh.shape[name] for name in names)

    def check_divides(self, name, what, count, entry):
        """A ValueError naming the argument unless `count` splits evenly over `entry`."""
        size = self.size(entry)
        if count % size:
            raise ValueError(f"{name}: {what} ({count}) does not divide over mesh axis "
                             f"{entry!r} of size {size}")


def _axes(entry):
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def find(name, x, sharding, *, sequence_dim, feature_dims, batched=True):
    """The Placement of a call whose leading array `x` (called `name`) is (B, T, heads,
    features...) (without B when not `batched`), or None when nothing is sharded or the call
    runs inside a shard_map. Raises ValueError for a sharded sequence or feature dim."""
    if sharding is not None and not isinstance(sharding, NamedSharding | PartitionSpec):
        raise TypeError(f"sharding must be a jax.sharding.NamedSharding or PartitionSpec, got "
                        f"{type(sharding).__name__}")
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.manual_axes:
        return None  # inside a shard_map: the arrays are the local shards
    explicit = False
    if isinstance(sharding, NamedSharding):
        mesh, spec = sharding.mesh, sharding.spec
    elif isinstance(sharding, PartitionSpec):
        if context.empty:
            raise ValueError("sharding: a PartitionSpec needs a mesh; set one with "
                             "jax.set_mesh(mesh) or pass a NamedSharding")
        mesh, spec = context, sharding
    else:
        own = getattr(jax.typeof(x), "sharding", None)
        if own is None or not any(own.spec):
            return None
        mesh, spec, explicit = own.mesh, own.spec, True
    if len(spec) > x.ndim:
        raise ValueError(f"sharding: {spec} has more entries than {name} has axes ({x.ndim})")
    entries = tuple(spec) + (None,) * (x.ndim - len(spec))
    if not batched:
        entries = (None, *entries)
    for dim, what in ((sequence_dim, "sequence"), *((d, "head dim") for d in feature_dims)):
        if entries[dim] is not None:
            hint = (": context parallelism is not supported yet" if what == "sequence"
                    else ": the kernels need whole heads")
            raise ValueError(f"{name}'s {what} axis is sharded over mesh axis "
                             f"{entries[dim]!r}{hint}")
    unknown = [a for e in entries for a in _axes(e) if a not in mesh.shape]
    if unknown:
        raise ValueError(f"sharding: mesh axes {unknown} are not in the mesh {dict(mesh.shape)}")
    if entries[0] is None and entries[2] is None:
        return None
    return Placement(mesh, entries[0], entries[2], explicit)


def run(placement, fn, args, in_specs, out_specs):
    """`fn(*args)` per shard: `jax.shard_map` over the placement's mesh with `in_specs` (one
    PartitionSpec per arg; an arg may be None) and `out_specs`. On explicit meshes each array
    is first resharded to its spec (a local slice for a replicated parameter)."""
    present = [i for i, a in enumerate(args) if a is not None]

    def local(*arrays):
        full = list(args)
        for i, a in zip(present, arrays, strict=True):
            full[i] = a
        return fn(*full)

    arrays = [args[i] for i in present]
    specs = tuple(in_specs[i] for i in present)
    if placement.explicit:
        arrays = [a if jax.typeof(a).sharding.spec == s else jax.sharding.reshard(a, s)
                  for a, s in zip(arrays, specs, strict=True)]
    return jax.shard_map(local, mesh=placement.mesh, in_specs=specs, out_specs=out_specs,
                         check_vma=False)(*arrays)
