"""The ops on a mesh: which mesh axes shard the batch, the sequence and the heads of a call, and
the op's local computation run per shard under `jax.shard_map`.

Batch and head sharding gather no kernel input. A sharded sequence is context parallelism:
each op's `context` module says what its shards exchange. Its tokens are split over the
sequence axis's n devices either in order ("contiguous": device i holds the i-th n-th) or in
the zig-zag order that balances causal attention ("zigzag": 2n chunks, device i holds chunks i
and 2n-1-i; `zigzag` puts a sequence in that order once, before the model, `unzigzag` undoes
it).

The placement of a call comes from, in this order:

* the op's `sharding=` argument: a `NamedSharding` of the leading array (query, x), or a
  `PartitionSpec` of it on the mesh set with `jax.set_mesh` (classic meshes, whose Auto axes
  leave the arrays' types without a sharding);
* the leading array's own type on a mesh with Explicit axes (`jax.make_mesh`'s default), where
  `jax.typeof(x).sharding` says how it is sharded.

Inside a `jax.shard_map` whose axes are all Manual the arrays are already local and the op runs
as it is. With check_vma=True (jax's default) the kernels' outputs vary over the manual axes
their inputs vary over (`varying_struct`), and each backward rule sums a gradient over the
axes its input does not vary over (`cotangent_like`: a replicated parameter's gradient,
reduced once). jax's Pallas interpreter cannot run there; interpret mode asks for
check_vma=False. A sharded head dim (or other feature dim) raises a ValueError naming the
argument and the mesh axis.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
from jax.typing import ArrayLike

ORDERS = ("contiguous", "zigzag")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Mesh axes of a call's batch, sequence and heads (PartitionSpec entries: None, a name or
    a tuple of names) on `mesh`; `explicit` when it has Explicit axes (the arrays' types carry
    their sharding)."""

    mesh: object
    batch: object
    sequence: object
    heads: object
    explicit: bool

    def size(self, entry):
        """Devices along a PartitionSpec entry."""
        return math.prod(self.mesh.shape[name] for name in _axes(entry))

    def check_divides(self, name, what, count, entry):
        """A ValueError naming the argument unless `count` splits evenly over `entry`."""
        size = self.size(entry)
        if count % size:
            raise ValueError(f"{name}: {what} ({count}) does not divide over mesh axis "
                             f"{entry!r} of size {size}")

    def check_sequence(self, name, length, order):
        """A ValueError naming the argument unless its sequence of `length` tokens splits into
        equal pieces over the sequence axis (two per device in zig-zag order)."""
        pieces = self.size(self.sequence) * (2 if order == "zigzag" else 1)
        if length % pieces:
            raise ValueError(f"{name}: the sequence ({length}) does not split into {pieces} "
                             f"equal pieces over mesh axis {self.sequence!r} ({order} order)")


def _axes(entry):
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def find(name, x, sharding, *, feature_dims, batched=True):
    """The Placement of a call whose leading array `x` (called `name`) is (B, T, heads,
    features...) (without B when not `batched`), or None when nothing is sharded or the call
    runs inside a shard_map. Raises ValueError for a sharded feature dim."""
    if sharding is not None and not isinstance(sharding, NamedSharding | PartitionSpec):
        raise TypeError(f"sharding must be a jax.sharding.NamedSharding or PartitionSpec, got "
                        f"{type(sharding).__name__}")
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.manual_axes:
        return None  # inside a shard_map: the arrays are the local shards
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
        mesh, spec = own.mesh, own.spec
    if len(spec) > x.ndim:
        raise ValueError(f"sharding: {spec} has more entries than {name} has axes ({x.ndim})")
    entries = tuple(spec) + (None,) * (x.ndim - len(spec))
    if not batched:
        entries = (None, *entries)
    for dim in feature_dims:
        if entries[dim] is not None:
            raise ValueError(f"{name}'s head dim is sharded over mesh axis {entries[dim]!r}: "
                             "the kernels need whole heads")
    unknown = [a for e in entries for a in _axes(e) if a not in mesh.shape]
    if unknown:
        raise ValueError(f"sharding: mesh axes {unknown} are not in the mesh {dict(mesh.shape)}")
    if entries[:3] == (None, None, None):
        return None
    explicit = jax.sharding.AxisType.Explicit in mesh.axis_types
    return Placement(mesh, *entries[:3], explicit)


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
        arrays = [a if jax.typeof(a).sharding.spec == s
                  else jax.sharding.reshard(a, NamedSharding(placement.mesh, s))
                  for a, s in zip(arrays, specs, strict=True)]
    return jax.shard_map(local, mesh=placement.mesh, in_specs=specs, out_specs=out_specs,
                         check_vma=False)(*arrays)


def check_order(order):
    """`sequence_order`, checked: one of ORDERS."""
    if order not in ORDERS:
        raise ValueError(f"sequence_order must be one of {ORDERS}, got {order!r}")
    return order


def chunk_order(parts):
    """The zig-zag order of a sequence's 2 * parts chunks: device i holds chunks i and
    2 * parts - 1 - i, so the list reads 0, 2p-1, 1, 2p-2, ..."""
    return [c for i in range(parts) for c in (i, 2 * parts - 1 - i)]


def _reorder(x, order, axis):
    chunks = jnp.split(x, len(order), axis=axis)
    return jnp.concatenate([chunks[c] for c in order], axis=axis)


def zigzag(x: ArrayLike, parts: int, axis: int = 1) -> jax.Array:
    """`x` with its `axis` (a sequence, length divisible by 2 * parts) in zig-zag order for
    `parts` devices: cut into 2 * parts chunks, device i's shard of the result holds chunks i
    and 2 * parts - 1 - i. Apply it once to the tokens, positions and segment ids of a batch and
    pass `sequence_order="zigzag"` to the ops; `unzigzag` undoes it."""
    return _reorder(x, chunk_order(parts), axis)


def unzigzag(x: ArrayLike, parts: int, axis: int = 1) -> jax.Array:
    """The inverse of `zigzag`: back to the natural order."""
    order = chunk_order(parts)
    return _reorder(x, sorted(range(len(order)), key=order.__getitem__), axis)


def local_chunks(order, parts, index, length):
    """The pieces of a device's sequence shard of `length` tokens: (start in the shard, size,
    global offset as a traced int32) each; `index` is the device's (traced) place along the
    sequence axis of `parts` devices."""
    if order == "contiguous":
        return [(0, length, index * length)]
    half = length // 2
    return [(0, half, index * half), (half, half, (2 * parts - 1 - index) * half)]


def gather_sequence(x, axis_name, order, parts):
    """The whole sequence (axis 1) of `x`'s shards along mesh axis `axis_name`, in natural
    order (None stays None)."""
    if x is None:
        return None
    x = jax.lax.all_gather(x, axis_name, axis=1, tiled=True)
    return x if order == "contiguous" else unzigzag(x, parts)


def varying_axes(x):
    """The manual mesh axes x varies over inside a `jax.shard_map` with check_vma (a frozenset;
    empty outside one)."""
    return frozenset(jax.typeof(x).manual_axis_type.varying)


def vary(x, axes):
    """x marked as varying over `axes` too (a no-op for axes it already varies over)."""
    missing = tuple(sorted(frozenset(axes) - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def varying_struct(struct, axes):
    """A ShapeDtypeStruct like `struct` whose value varies over the manual mesh axes `axes`
    (how a pallas_call inside a shard_map with check_vma says its outputs vary)."""
    if not axes:
        return struct
    return jax.ShapeDtypeStruct(struct.shape, struct.dtype, manual_axis_type=jax.sharding.
                                ManualAxisType(varying=frozenset(axes)))


def cotangent_like(cotangent, primal):
    """A custom_vjp rule's `cotangent` typed as its `primal` inside a shard_map with check_vma:
    summed over the manual axes it varies over and the primal does not (a replicated parameter's
    gradient, reduced once), marked varying over those the primal varies over. None stays None."""
    if cotangent is None:
        return None
    extra = tuple(sorted(varying_axes(cotangent) - varying_axes(primal)))
    if extra:
        cotangent = jax.lax.psum(cotangent, extra)
    return vary(cotangent, varying_axes(primal))
