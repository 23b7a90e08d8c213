"""How the SSD scan kernels' work is cut into programs: the cost model and the plan of a call.

A walk is one (batch row, head, head-dim block) of a scan kernel: a serial pass over all chunks.
A serial walk over all chunks leaves most of the GPU idle when batch x heads is small, and with
more walks than run at once the last round of walks runs alone; so walks can be cut into parts
walked in parallel (`walks` numbers the programs and builds the unit sums they start from).
`forward_schedule` picks the forward's cut by a count of chunk steps; `plan` makes a call's Plan.
"""

import dataclasses
from typing import NamedTuple

from pallas_kernels import _device


class Schedule(NamedTuple):
    """How a scan kernel's walks are cut into programs (`walks` has the program order).

    A walk is cut into `num_units` units of equal length and walked in parts of `part_units`
    units, one program per part, except the first part of walks 0 .. `split_walks` - 1, walked
    one unit per program. No cut: (1, 1, 0).
    """

    num_units: int
    part_units: int
    split_walks: int

    @property
    def num_parts(self):
        return self.num_units // self.part_units


def unit_counts(num_chunks, min_chunks):
    """The numbers of equal units a walk of `num_chunks` chunks can be cut into: 1, and the
    divisors that leave units of at least `min_chunks` chunks."""
    return [u for u in range(1, num_chunks + 1)
            if num_chunks % u == 0 and (u == 1 or num_chunks // u >= min_chunks)]


def forward_schedule(walks, num_chunks, at_once, blocks):
    """The forward scan's Schedule: the cheapest of all cuts by a count of chunk steps.

    `at_once` programs run at once. A cut's cost is the chunk steps of its rounds of programs
    (whole parts fill rounds first, the split units follow), the unit sums it needs (a sum's
    chunk step costs `blocks.sum_step_cost` of a walk's) and `blocks.round_cost` steps for each
    round of either kernel. Units are at least `blocks.min_segment_chunks` chunks long.
    """
    best = None
    for num_units in unit_counts(num_chunks, blocks.min_segment_chunks):
        unit_chunks = num_chunks // num_units
        for part_units in (u for u in range(1, num_units + 1) if num_units % u == 0):
            num_parts = num_units // part_units
            full_rounds, rest = divmod(walks * num_parts, at_once)
            split_walks = rest if part_units > 1 else 0
            if part_units > 1 and not 0 < rest <= walks:
                continue  # nothing to split (the same as part_units 1), or more than first parts
            whole_rounds = full_rounds + (rest > 0 and split_walks == 0)
            split_rounds = _device.cdiv(split_walks * part_units, at_once)
            steps = (whole_rounds * part_units + split_rounds) * unit_chunks
            summed = (walks * (num_units - part_units) if num_parts > 1
                      else split_walks * (part_units - 1))
            sum_rounds = _device.cdiv(summed, at_once)
            cost = (steps + sum_rounds * unit_chunks * blocks.sum_step_cost
                    + (whole_rounds + split_rounds + sum_rounds) * blocks.round_cost)
            if best is None or cost < best[0]:
                best = (cost, Schedule(num_units, part_units, split_walks))
    return best[1]


@dataclasses.dataclass(frozen=True)
class Plan:
    """The scan kernels' work for one call (hashable: keys custom_vjp and jit).

    `walks` W = batch rows x heads x head-dim blocks, each `num_chunks` chunks long;
    `schedule` the cut the scan kernels run with; `backward` the cut of the backward's walks
    (parts of one unit), which `for_backward` makes the one in use.
    """

    num_chunks: int
    walks: int
    schedule: Schedule
    backward: Schedule

    def for_backward(self):
        """This Plan with the backward walks' cut in use."""
        return dataclasses.replace(self, schedule=self.backward)

    @property
    def unit_chunks(self):
        """Chunks per unit of the cut in use."""
        return self.num_chunks // self.schedule.num_units


def plan(blocks, *, batch, heads, p_pad, num_chunks, multiprocessors):
    """The Plan of a call with fitted `blocks` (`tuning.SSDBlocks.fit`).

    The forward scan cuts its walks by `forward_schedule`, with `blocks.programs_per_sm`
    programs at once on each of `multiprocessors`. Below `blocks.backward_segment_walks_below`
    walks, the backward's walks are cut into equal parts of at least `blocks.min_segment_chunks`
    chunks, as many as keep the programs within `blocks.scan_programs`.
    """
    walks = batch * heads * (p_pad // blocks.block_p)
    backward_units = 1
    if walks < blocks.backward_segment_walks_below:
        backward_units = max((
            u for u in unit_counts(num_chunks, blocks.min_segment_chunks)
            if u * walks <= blocks.scan_programs
        ), default=1)
    return Plan(
        num_chunks=num_chunks,
        walks=walks,
        schedule=forward_schedule(walks, num_chunks, blocks.programs_per_sm * multiprocessors,
                                  blocks),
        backward=Schedule(backward_units, 1, 0),
    )
