"""The GPU kernels of a traced call (`jax.profiler`), read back with jax's own profile reader:
what a step launches and how long each kernel runs."""

import glob
import os
import tempfile

import jax


def kernel_events(call):
    """Runs `call()` under `jax.profiler` and returns ((name, start_ns, duration_ns) of every
    event on the GPU planes' stream lines, sorted by start; the trace's planes and lines with
    their event counts). Without CUPTI the trace has no GPU plane: the events are empty and
    the planes say what the trace held."""
    from jax._src.lib import _profile_data

    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        try:
            call()
        finally:
            jax.profiler.stop_trace()
        path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
        data = _profile_data.ProfileData.from_file(path)
    events, planes = [], {}
    for plane in data.planes:
        planes[plane.name] = {line.name: len(list(line.events)) for line in plane.lines}
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower() or "memcpy" in line.name.lower():
                continue
            events += [(e.name, e.start_ns, e.duration_ns) for e in line.events]
    return sorted(events, key=lambda e: e[1]), planes


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
