"""The layers on a mesh.

Parameters carry logical axis names, so that a later mesh can shard a model:
`logical("embed", "mlp")` is the metadata dict for flax's `kernel_metadata`, `bias_metadata`,
`scale_metadata` and `embedding_metadata` arguments; `logical_param` wraps an array directly.
Sharding is not applied eagerly: without a mesh the names are only recorded.

`parameter_shardings` maps the names through `LOGICAL_AXIS_RULES` to a mesh's axes, and
`gather_parameters` gathers the fsdp-sharded ones at a step's start (fully sharded data
parallel); those sharded over tensor stay sharded (tensor parallelism).

Activations follow their tokens: on a mesh with Explicit axes (`jax.make_mesh`) a (B, T)
batch of tokens sharded over the batch and/or the sequence shards every (B, T, features)
activation the same way (`token_features`); the kernels find it from the types, and the
Mamba2 conv takes its history across sequence shards (`causal_halo`). Over a tensor axis the
projections into heads (attention's, the MLP's hidden units, the vocabulary) come out sharded
by their weights, the kernels run per head shard (`heads_sharded` places the Mamba2 scan's),
and the projections back to `embed` sum the shards (`out_sharding=token_features(...)`).
"""

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from pallas_kernels import unzigzag, zigzag

# Logical axis -> mesh axes (a name, a tuple, or None: whole). Parameters: the embedding
# dimension over fsdp (gathered for the step: `gather_parameters`), attention heads, MLP hidden
# units and the vocabulary over tensor (Megatron-style: kept sharded). Mamba2's packed
# projections ("inner") stay whole: its in_proj and conv run whole on each tensor device, its
# scan, norm and out_proj per head shard. Activations shard their batch over data and fsdp and
# their sequence over context, from the tokens.
LOGICAL_AXIS_RULES = (
    ("batch", ("data", "fsdp")),
    ("length", "context"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
)
GATHERED_AXES = ("fsdp",)  # mesh axes that `gather_parameters` gathers by default


def logical(*names):
    return {"out_sharding": names, "eager_sharding": False}


def logical_param(value, *names):
    return nnx.Param(value, **logical(*names))


def _explicit_sharding(x):
    """x's sharding where its type carries one on a mesh with Explicit axes, else None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    if sharding is None or sharding.mesh.empty or AxisType.Explicit not in sharding.mesh.axis_types:
        return None
    return sharding


def features_sharded(x):
    """Whether x's last axis is split over a mesh axis (its type says so on a mesh with
    Explicit axes)."""
    sharding = _explicit_sharding(x)
    if sharding is None or len(sharding.spec) < x.ndim:
        return False
    return sharding.spec[x.ndim - 1] is not None


def token_features(tokens):
    """The sharding of (B, T, features) activations of `tokens` (B, T, ...): the tokens' batch
    and sequence axes, features whole; None off meshes with Explicit axes."""
    sharding = _explicit_sharding(tokens)
    if sharding is None:
        return None
    spec = tuple(sharding.spec) + (None,) * (2 - len(sharding.spec))
    return NamedSharding(sharding.mesh, PartitionSpec(*spec[:2], None))


def heads_sharded(x, name="heads", rules=LOGICAL_AXIS_RULES):
    """`x` (B, T, H, ...) with its H over the mesh axes that `rules` give `name` (those the mesh
    has, that its batch and sequence do not use and that divide H: a local slice), on a mesh with
    Explicit axes; unchanged elsewhere."""
    sharding = _explicit_sharding(x)
    if sharding is None:
        return x
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    used = {a for entry in spec[:2] for a in _names(entry)}
    heads = _mesh_axes(dict(rules).get(name), sharding.mesh, x.shape[2], used)
    if heads is None or spec[2] == heads:
        return x
    return jax.sharding.reshard(
        x, NamedSharding(sharding.mesh, PartitionSpec(*spec[:2], heads, *spec[3:])))


def causal_halo(fn, x, history, seq_idx, *weights):
    """`fn(x, history, seq_idx, history_ids, *weights)` of `x` (B, T, C) on a mesh with
    Explicit axes, run per shard under `jax.shard_map`: `history` (B, W, C) holds the W tokens
    before the first, and where the sequence is sharded each shard's history is the last W
    tokens of the shard before it (one collective-permute); `history_ids` (B, W) are their
    sequence ids (before the first token, the first token's), None without `seq_idx` (B, T).
    `weights` (replicated; None stays None) pass through whole."""
    sharding = token_features(x)
    mesh, (batch, sequence) = sharding.mesh, sharding.spec[:2]
    width = history.shape[1]
    parts = sequence_parts(x)
    if sequence is not None and width > x.shape[1] // parts:
        raise ValueError(f"the sequence shards ({x.shape[1] // parts} tokens over mesh axis "
                         f"{sequence!r}) must hold at least the conv's {width} history tokens")
    present = [i for i, w in enumerate(weights) if w is not None]

    def local(x, history, seq_idx, *given):
        history_ids = None if seq_idx is None else jnp.broadcast_to(
            seq_idx[:, :1], (seq_idx.shape[0], width))
        if sequence is not None and width:
            first = jax.lax.axis_index(sequence) == 0
            forward = [(i, i + 1) for i in range(parts - 1)]

            def before(a, own):
                return jnp.where(first, own, jax.lax.ppermute(a[:, -width:], sequence, forward))

            history = before(x, history)
            if seq_idx is not None:
                history_ids = before(seq_idx, history_ids)
        full = [None] * len(weights)
        for i, w in zip(present, given, strict=True):
            full[i] = w
        return fn(x, history, seq_idx, history_ids, *full)

    specs = [PartitionSpec(batch, sequence, None), PartitionSpec(batch, None, None),
             None if seq_idx is None else PartitionSpec(batch, sequence)]
    specs += [PartitionSpec()] * len(present)
    args = [x, history, seq_idx, *(weights[i] for i in present)]
    args = [a if a is None else jax.sharding.reshard(a, NamedSharding(mesh, s))
            for a, s in zip(args, specs, strict=True)]
    return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=specs[0],
                         check_vma=False)(*args)


def sequence_parts(x):
    """How many devices shard the sequence (axis 1) of `x` on a mesh with Explicit axes: 1
    elsewhere."""
    sharding = _explicit_sharding(x)
    if sharding is None or len(sharding.spec) < 2:
        return 1
    return math.prod(sharding.mesh.shape[a] for a in _names(sharding.spec[1]))


def on_whole_sequence(fn, x, order="contiguous"):
    """`fn(x)` for (B, T) `x` (ids, positions: small) with T whole and in natural order:
    gathered (and, in zig-zag `order`, put back in natural order) first where the sequence is
    sharded on a mesh with Explicit axes; the result in `x`'s order and sharding."""
    parts = sequence_parts(x)
    if parts == 1:
        return fn(x)
    sharding = jax.typeof(x).sharding
    whole = NamedSharding(sharding.mesh, PartitionSpec(sharding.spec[0], None))
    x = jax.sharding.reshard(x, whole)
    if order == "zigzag":
        return jax.sharding.reshard(zigzag(fn(unzigzag(x, parts)), parts), sharding)
    return jax.sharding.reshard(fn(x), sharding)


def reorder_sequence(x, source, target):
    """`x` (B, T, ...) with its sequence sharded on a mesh with Explicit axes, moved from
    `source` to `target` order ("contiguous" or "zigzag"; `pallas_kernels.zigzag`): each
    device's two half shards go where the target order puts them, two collective-permutes of
    half a shard each. Unchanged where the orders agree or the sequence is not sharded."""
    parts = sequence_parts(x)
    if source == target or parts == 1:
        return x
    sharding = jax.typeof(x).sharding
    axis = sharding.spec[1]
    if x.shape[1] % (2 * parts):
        raise ValueError(f"the sequence ({x.shape[1]}) does not split into {2 * parts} equal "
                         f"pieces over mesh axis {axis!r} (zigzag order)")
    natural = list(range(2 * parts))  # the 2 * parts chunks, two per device in each order
    with jax.ensure_compile_time_eval():
        zigzagged = [int(c) for c in zigzag(jnp.asarray(natural), parts, axis=0)]
    chunks = {"contiguous": natural, "zigzag": zigzagged}
    moves = _half_moves(*([tuple(chunks[o][2 * d:2 * d + 2]) for d in range(parts)]
                          for o in (source, target)))

    def local(x):
        index = jax.lax.axis_index(axis)
        halves = jnp.split(x, 2, axis=1)
        received = []
        for group in moves:  # (source, destination, source half, destination half)
            sent_half = jnp.asarray([m[2] for m in sorted(group)])[index]
            sent = jnp.where(sent_half == 0, halves[0], halves[1])
            got = jax.lax.ppermute(sent, axis, [(m[0], m[1]) for m in group])
            by_destination = sorted(group, key=lambda m: m[1])
            received.append((got, jnp.asarray([m[3] for m in by_destination])[index]))
        (a, a_half), (b, _) = received
        return jnp.concatenate([jnp.where(a_half == 0, a, b), jnp.where(a_half == 0, b, a)],
                               axis=1)

    spec = PartitionSpec(*sharding.spec)
    return jax.shard_map(local, mesh=sharding.mesh, in_specs=spec, out_specs=spec,
                         check_vma=False)(x)


def _half_moves(source, target):
    """Two collective-permutes moving chunks from `source` (per device, the chunks of its two
    halves) to `target`: per permute, (source device, destination device, source half,
    destination half), each device sending once and receiving once."""
    place = {c: (d, h) for d, pair in enumerate(target) for h, c in enumerate(pair)}
    every = [(s, place[c][0], h, place[c][1]) for s, pair in enumerate(source)
             for h, c in enumerate(pair)]
    for key in (3, 2):  # grouped by destination half, else by source half
        groups = [[m for m in every if m[key] == half] for half in (0, 1)]
        if all(len({m[0] for m in g}) == len({m[1] for m in g}) == len(source) for g in groups):
            return groups
    raise AssertionError("no two permutes move these chunks")  # not reached for the orders


def _names(entry):
    """The mesh axis names of a PartitionSpec entry."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _mesh_axes(entry, mesh, size, used):
    """The mesh axes of one logical axis's rule entry that exist in `mesh`, are not `used`
    yet, and split `size` evenly (as a PartitionSpec entry, or None)."""
    names = _names(entry)
    kept = []
    for name in names:
        if name in mesh.shape and name not in used and size % (
                math.prod(mesh.shape[a] for a in kept) * mesh.shape[name]) == 0:
            kept.append(name)
    used.update(kept)
    return None if not kept else kept[0] if len(kept) == 1 else tuple(kept)


def parameter_shardings(
    state: nnx.State,
    mesh: Mesh,
    rules: Sequence[tuple[str, str | tuple[str, ...] | None]] = LOGICAL_AXIS_RULES,
) -> nnx.State:
    """NamedShardings on `mesh` for a model's parameter state (`nnx.state(model, nnx.Param)`
    or `nnx.split`'s), from each parameter's logical axis names and `rules` ((logical name,
    mesh axes) pairs): a dimension is sharded over the rule's mesh axes that the mesh has and
    that divide it; every other dimension, and every parameter without names, is whole.
    `jax.device_put(state, parameter_shardings(state, mesh))` places a model. The Mamba2
    scan's heads follow the default rules (`heads_sharded`) whatever `rules` say."""
    table = dict(rules)

    def sharding(variable):
        names = variable.get_metadata().get("out_sharding") or ()
        used = set()
        spec = [_mesh_axes(table.get(name), mesh, size, used)
                for name, size in zip(names, variable.shape, strict=False)]
        return NamedSharding(mesh, PartitionSpec(*spec))

    return jax.tree.map(sharding, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def sharded_parameters(module):
    """The paths ("a.b.c") of `module`'s parameters that are sharded on a mesh with Explicit
    axes."""
    def sharded(variable):
        sharding = _explicit_sharding(variable[...])
        return sharding is not None and any(sharding.spec)

    return [".".join(map(str, path)) for path, variable in
            nnx.to_flat_state(nnx.state(module, nnx.Param)) if sharded(variable)]


def check_whole_parameters(module):
    """A ValueError unless `module`'s parameters are whole on every device (decoding does not
    run tensor-parallel), naming the first sharded one."""
    sharded = sharded_parameters(module)
    if sharded:
        raise ValueError(f"decode=True needs whole parameters; {sharded[0]} (and "
                         f"{len(sharded) - 1} more) are sharded: merge the model from "
                         "flax_layers.gather_parameters(state, axes=None)")


def row_placement(name, x):
    """(mesh, the mesh axes of x's rows) for an (B, T) array on a mesh with Explicit axes whose
    rows (only) are split over devices; None where nothing is split. A ValueError naming `name`
    where its other axis is split."""
    sharding = _explicit_sharding(x)
    if sharding is None or not any(sharding.spec):
        return None
    rows, *rest = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    if any(rest):
        raise ValueError(f"{name}: only its rows may be split over devices; its sharding is "
                         f"{sharding.spec}")
    return sharding.mesh, _names(rows)


def gather_parameters(state: nnx.State,
                      axes: str | Sequence[str] | None = GATHERED_AXES) -> nnx.State:
    """The parameters gathered over the mesh `axes` (None: all of them, the parameters whole on
    every device), on a mesh with Explicit axes; unchanged elsewhere. The default gathers what
    fully sharded data parallelism shards, at a step's start (the gradients come back
    reduce-scattered) and keeps tensor-parallel shards."""
    axes = None if axes is None else _names(axes)

    def gathered(x):
        sharding = _explicit_sharding(x)
        if sharding is None or not any(sharding.spec):
            return x
        spec = [None if axes is None else
                _entry([a for a in _names(e) if a not in axes]) for e in sharding.spec]
        if spec == list(sharding.spec):
            return x
        return jax.sharding.reshard(x, NamedSharding(sharding.mesh, PartitionSpec(*spec)))

    return jax.tree.map(gathered, state)


def _entry(names):
    """A PartitionSpec entry of mesh axis `names`."""
    return None if not names else names[0] if len(names) == 1 else tuple(names)
