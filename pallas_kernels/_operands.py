"""Named operands of a Pallas kernel: one builder for its specs, its arguments and its refs.

A kernel whose inputs depend on flags (segment ids, seq_idx, D, z, ...) would otherwise take
`*refs` and pop them in an order that must match the caller's list of specs. Here the caller
adds each operand by name (an absent one, None, is skipped) and the kernel reads `refs.<name>`,
None for an operand that was not added:

    ins = Operands().add("x", spec, x).add("seq", seq_spec, seq)   # seq may be None
    outs = Operands().add("y", spec, jax.ShapeDtypeStruct(...))
    y = call(kernel, ins, outs, grid=..., ...)["y"]          # kernel(refs): refs.x, refs.seq
"""

import types

from jax.experimental import pallas as pl

from pallas_kernels import _compat, _sharding


class Operands:
    """An ordered list of (name, BlockSpec, value): arrays for inputs, ShapeDtypeStructs for
    outputs."""

    def __init__(self):
        self.names, self.specs, self.values = [], [], []

    def add(self, name, spec, value):
        """Appends an operand unless `value` is None; returns self."""
        if value is not None:
            self.names.append(name)
            self.specs.append(spec)
            self.values.append(value)
        return self

    def __len__(self):
        return len(self.names)


class Refs(types.SimpleNamespace):
    """A kernel's refs by operand name; a name that was not added reads as None."""

    def __getattr__(self, name):
        return None


def bind(inputs, outputs, refs):
    """The Refs of a kernel's positional refs (inputs then outputs, as Pallas passes them)."""
    names = inputs.names + outputs.names
    return Refs(**dict(zip(names, refs, strict=True)))


def call(kernel, inputs, outputs, *, grid, num_warps, num_stages, interpret, name,
         aliases=None, masks_edges=False, windows=()):
    """`pl.pallas_call` of `kernel(refs)` (`Refs`) over the named inputs and outputs, lowered
    through Triton with `num_warps` and `num_stages`; returns the outputs as a dict by name.

    Every block must tile its array whole (each blocked size divides the array's), unless
    `masks_edges`: the kernel then loads and stores its edge tiles through explicit masks
    (`plt.load` / `plt.store`). jax 0.11's Pallas-Triton masks no block that overhangs its
    array (0.12's does), so there an edge tile would read and write other buffers: a
    ValueError names the operand before anything runs. `windows` names operands read through
    whole blocks inside a wider array (a packed projection's columns): their index maps never
    reach the part that does not tile.

    `aliases` {input name: output name} makes each such output share its input's buffer (the
    kernel updates it in place; under `jax.jit` with the input donated no copy is made): the
    output must have the input's shape and dtype, and the kernel must write every part of it
    that should change, as the rest keeps the input's values.
    """

    if not masks_edges:
        _check_whole_blocks(name, windows, inputs, outputs)

    def positional(*refs):
        kernel(bind(inputs, outputs, refs))

    # Inside a shard_map with check_vma the outputs vary over every manual axis an input varies
    # over (the kernel mixes its inputs); the inputs are marked so too.
    axes = frozenset().union(*(_sharding.varying_axes(x) for x in inputs.values))
    if axes and interpret:
        raise NotImplementedError(
            f"{name}: interpret mode cannot run inside a jax.shard_map with check_vma=True (jax's "
            "Pallas interpreter does not type values that vary over manual axes); pass "
            "check_vma=False to the shard_map, or implementation='xla', or run on a GPU")
    results = pl.pallas_call(
        positional, grid=grid, in_specs=inputs.specs, out_specs=outputs.specs,
        out_shape=[_sharding.varying_struct(s, axes) for s in outputs.values],
        compiler_params=_compat.triton_params(num_warps, num_stages),
        input_output_aliases={inputs.names.index(i): outputs.names.index(o)
                              for i, o in (aliases or {}).items()},
        interpret=interpret, name=name,
    )(*(_sharding.vary(x, axes) for x in inputs.values))
    return dict(zip(outputs.names, results, strict=True))


def _check_whole_blocks(name, windows, *groups):
    """Raises ValueError for an operand (but `windows`) whose block does not tile its array
    whole."""
    for group in groups:
        for operand, spec, value in zip(group.names, group.specs, group.values, strict=True):
            block = getattr(spec, "block_shape", None)
            if block is None or operand in windows:
                continue
            for size, extent in zip(block, value.shape, strict=True):
                if isinstance(size, int) and extent % size:
                    raise ValueError(
                        f"{name}: operand {operand!r}: block {tuple(block)} does not tile its "
                        f"array {tuple(value.shape)}; pad the array to whole blocks, or mask the "
                        "edge tiles in the kernel and pass masks_edges=True")
