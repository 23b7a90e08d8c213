"""The GPU kernels of a traced call (`jax.profiler`), read back with jax's own profile reader:
what a step launches and how long each kernel runs."""

import collections
import glob
import itertools
import os
import re
import tempfile

import jax


def kernel_events(call):
    """Runs `call()` under `jax.profiler` and returns ((name, start_ns, duration_ns) of every
    event on the GPU planes' stream lines, sorted by start; the trace's planes and lines with
    their event counts). Without CUPTI the trace has no GPU plane: the events are empty and
    the planes say what the trace held."""
    by_device, planes = device_kernel_events(call)
    return sorted(itertools.chain(*by_device.values()), key=lambda e: e[1]), planes


def device_kernel_events(call):
    """`kernel_events` per GPU: ({GPU plane name: its events, sorted by start}, planes)."""
    from jax._src.lib import _profile_data

    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        try:
            call()
        finally:
            jax.profiler.stop_trace()
        path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
        data = _profile_data.ProfileData.from_file(path)
    by_device, planes = {}, {}
    for plane in data.planes:
        planes[plane.name] = {line.name: len(list(line.events)) for line in plane.lines}
        if not plane.name.startswith("/device:GPU"):
            continue
        events = by_device.setdefault(plane.name, [])
        for line in plane.lines:
            if runs_kernels(line.name):
                events += [(e.name, e.start_ns, e.duration_ns) for e in line.events]
        events.sort(key=lambda e: e[1])
    return by_device, planes


def runs_kernels(line_name):
    """Whether a GPU plane's line is a stream that runs kernels: CUDA's "Stream #14(Compute)"
    or "Stream #14(Memset,MemcpyD2D,Compute)" (a stream that also copies; its copies count as
    its work), ROCm's "Stream #3(Kernel)"; not a stream that only copies or sets memory
    ("Stream #15(MemcpyH2D)") nor the plane's summary lines."""
    name = line_name.lower()
    if "stream" not in name:
        return False
    kinds = re.search(r"\((.*)\)", name)
    return kinds is None or not all(kind.strip().startswith(("memcpy", "memset"))
                                    for kind in kinds.group(1).split(","))


_COLLECTIVE = re.compile(r"nccl|rccl", re.IGNORECASE)  # NCCL's and RCCL's kernels


def collective_overlap(events):
    """(ns of collective kernels, ns of those during which another kernel ran) in one device's
    events (name, start_ns, duration_ns): how much of the communication hides behind compute."""
    collective, compute = [], []
    for name, start, duration in events:
        (collective if _COLLECTIVE.search(name) else compute).append((start, start + duration))
    collective, compute = _union(collective), _union(compute)
    overlapped, j = 0, 0
    for start, end in collective:  # both lists sorted and disjoint
        while j < len(compute) and compute[j][1] <= start:
            j += 1
        k = j
        while k < len(compute) and compute[k][0] < end:
            overlapped += min(end, compute[k][1]) - max(start, compute[k][0])
            k += 1
    return sum(end - start for start, end in collective), overlapped


def _union(intervals):
    """Sorted, disjoint (start, end) covering the same time as `intervals`."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def kernel_span_seconds(fn, *args, calls=20):
    """Seconds per call that the GPU spends on `fn(*args)`, from a profile of `calls` calls
    chained in one jit (`_timing.chain`): the first kernel's start to the last one's end, over
    `calls`, gaps between kernels included; what a CUDA-graph replay measures for torch, without
    the executable's per-dispatch host cost that `_timing.chained_seconds` still counts. None
    when the trace has no GPU kernels (no CUPTI)."""
    from benchmarks import _timing

    chained = _timing.chain(fn, calls)
    jax.block_until_ready(chained(*args))
    events, _ = kernel_events(lambda: jax.block_until_ready(chained(*args)))
    if not events:
        return None
    return (max(start + duration for _, start, duration in events) - events[0][1]) / calls / 1e9


# A fusion's output is an array or, for a multi-output fusion, a tuple "(f32[..], bf16[..])".
_FUSION = re.compile(
    r"^\s*(?:ROOT )?%?([\w.\-]+) = (\([^=]*?\)|\S+) fusion\(.*\bcalls=%?([\w.\-]+)")
_OP = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = \S+ [\w\-]+\(.*op_name=\"([^\"]+)\"")


def _op_label(op_name):
    """A fused op's op_name without the jit and its transforms' wrappers: its last two named
    scopes and the op, "(bwd)" where it is the backward's ("mamba2_block/conv/mul (bwd)")."""
    parts = op_name.rstrip("/").split("/")
    if len(parts) > 1 and parts[0].startswith("jit("):
        parts = parts[1:]
    scopes = [re.sub(r"^(?:[\w.]+\()*([^()]*)\)*$", r"\1", p) for p in parts[:-1]]
    backward = " (bwd)" if any(p.startswith("transpose(") for p in parts[:-1]) else ""
    return "/".join([s for s in scopes if s][-2:] + parts[-1:]) + backward


def fusion_contents(hlo_text, top=6):
    """{kernel name: what it fuses} for every fusion of an optimized HLO module (a compiled
    call's `as_text()`): its output shape and the jax ops it holds (`_op_label`), most frequent
    first ("f32[4,4096,4224]: mamba2_block/conv/mul (bwd) 6, ..."). Kernel names are the
    fusions' with "." and "-" as "_", as the profile shows them; XLA launches one kernel for
    identical fusions under the first one's name, so a name can stand for several sites."""
    fusions, bodies, body = {}, collections.defaultdict(collections.Counter), None
    for line in hlo_text.splitlines():
        match = _FUSION.match(line)
        if match:
            fusions[re.sub(r"[.\-]", "_", match.group(1))] = (match.group(2), match.group(3))
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            body = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
        elif line.startswith("}"):
            body = None
        elif body is not None:
            op = _OP.match(line)
            if op:
                bodies[body][_op_label(op.group(1))] += 1
    return {name: re.sub(r"\{[^}]*\}", "", shape) + ": " + ", ".join(
        f"{op} {n}" for op, n in bodies[called].most_common(top))
            for name, (shape, called) in fusions.items()}
