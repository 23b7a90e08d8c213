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
