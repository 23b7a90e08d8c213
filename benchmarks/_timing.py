"""Timing, environment, table and plot helpers shared by the benchmarks in this folder.

Three timings of each benchmarked function:
  per call   the median of `iters` single calls. JAX: wall clock around the call and
             `jax.block_until_ready` (host dispatch and the sync included). torch: CUDA events
             around the call (the device's time from the first launch to the last kernel's end,
             so where Python launches the kernels slower than they run, the idle gaps too).
  amortised  wall clock of `iters` back-to-back calls with one sync at the end, divided by
             `iters` (the same method for both frameworks; dispatch overlaps the device work).
  device     the device's time per call without the host's launch costs. JAX: the amortised
             time (one dispatch runs the whole compiled step, so the device stays busy). torch:
             a CUDA graph of the function, replayed in batches of `iters` between CUDA events
             (the median batch; None where capture fails). A peer whose Python launches many small
             kernels (mamba_ssm's backward) reads slower per call and amortised than its
             kernels run; in a training step that is GPU-bound the launches overlap earlier
             work, so this is the time to compare kernels by.
"""

import dataclasses
import datetime
import hashlib
import importlib.metadata
import json
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import time

import jax


@dataclasses.dataclass(frozen=True)
class Timing:
    """Milliseconds of one benchmarked function: per-call median (and spread), amortised and
    device time (see the module docstring; None where it could not be measured)."""

    median_ms: float
    min_ms: float
    max_ms: float
    amortised_ms: float
    device_ms: float | None
    iters: int


def _timing(per_call_s, amortised_s, iters, device_s):
    return Timing(
        median_ms=1e3 * statistics.median(per_call_s),
        min_ms=1e3 * min(per_call_s),
        max_ms=1e3 * max(per_call_s),
        amortised_ms=1e3 * amortised_s / iters,
        device_ms=None if device_s is None else 1e3 * device_s,
        iters=iters,
    )


def time_jax(fn, args, *, iters, warmup):
    """Times `fn(*args)`, a compiled or jitted JAX function; `warmup` untimed calls first."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    per_call = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        per_call.append(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    amortised = time.perf_counter() - start
    return _timing(per_call, amortised, iters, device_s=amortised / iters)


def amortised_seconds(fn, *args, calls=10, repeats=7):
    """Median seconds per call of a jitted fn over `repeats` batches of `calls` back-to-back
    calls, one sync per batch (the tuning scripts' quick amortised timing)."""
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def chained_seconds(fn, *args, calls=20, repeats=5):
    """Median seconds per call of `fn(*args)` run `calls` times in one jitted function, over
    `repeats` runs of it. Each call's arguments pass through an optimization barrier with the
    previous call's outputs, so XLA neither merges the calls nor hoists them, and every output
    is returned, so none is dropped as dead (memory: `calls` times the outputs). The calls run
    back to back from one dispatch: device time even for kernels shorter than a Python
    dispatch (which `amortised_seconds` measures instead below about 0.1 ms per call)."""

    return amortised_seconds(chain(fn, calls), *args, calls=1, repeats=repeats) / calls


def chain(fn, calls):
    """`fn` run `calls` times in one jitted function, each call's arguments passed through an
    optimization barrier with the previous call's outputs (`chained_seconds`)."""

    def chained(*args):
        outs = [fn(*args)]
        for _ in range(calls - 1):
            args, _ = jax.lax.optimization_barrier((args, outs[-1]))
            outs.append(fn(*args))
        return outs

    return jax.jit(chained)


def time_torch(fn, *, iters, warmup):
    """Times `fn()`, which launches CUDA work through torch; `warmup` untimed calls first."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    per_call = [1e-3 * start.elapsed_time(end) for start, end in events]
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    amortised = time.perf_counter() - start
    return _timing(per_call, amortised, iters, device_s=_torch_graph_seconds(fn, iters=iters))


def _torch_graph_seconds(fn, *, iters, repeats=7):
    """Seconds per replay of `fn()` captured in a CUDA graph: the median over `repeats` batches
    of `iters` back-to-back replays between CUDA events. None where capture fails (a function
    that syncs with the host). `fn` must have run before (autotuning, lazy initialisation)."""
    import torch

    side = torch.cuda.Stream()  # capture wants warm-up calls on a side stream first
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:
        return None
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(1e-3 * start.elapsed_time(end) / iters)
    del graph
    return statistics.median(samples)


def tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12


def _version(distribution):
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit():
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip()


def source_digest():
    """sha256 of the package sources (path and bytes of every .py under pallas_kernels/ and
    flax_layers/): names the code that ran even where the machine's git metadata is stale."""
    root = pathlib.Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted((*root.glob("pallas_kernels/**/*.py"), *root.glob("flax_layers/**/*.py"))):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def environment_info(module):
    """Versions, device and command line (`python -m module ...`) for a results file's header."""
    device = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", module, *sys.argv[1:]]),
        "argv": sys.argv,
        "git_commit": _git_commit(),
        "source_sha256": source_digest(),
        "python": platform.python_version(),
        "versions": {
            name: _version(name)
            for name in ("jax", "jaxlib", "jax-cuda13-plugin", "flax", "torch", "triton",
                         "tokamax", "numpy")
        },
        "device_kind": device.device_kind,
        "platform": device.platform,
        "device_count": jax.device_count(),
        "env": {
            name: os.environ.get(name)
            for name in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_FLAGS", "CUDA_VISIBLE_DEVICES")
        },
    }


def write_json(path, payload):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(path + ".tmp", path)


def format_table(header, rows):
    """Plain fixed-width table: first column left-aligned, the rest right-aligned."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(row):
        cells = [str(row[0]).ljust(widths[0])]
        cells += [str(cell).rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        return "  ".join(cells)

    rule = "-" * len(line(header))
    return "\n".join([line(header), rule, *map(line, rows)])


def save_grouped_bar_plot(path, group_labels, panels, *, ylabel, title):
    """One subplot per panel, a bar group per label, one bar per series (None: no bar).

    `panels` is a list of (panel title, {series name: [value per group label]}); a series with
    no value in any panel gets no slot.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series_names = list(dict.fromkeys(
        name for _, series in panels for name, values in series.items()
        if any(v is not None for v in values)
    ))
    colors = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(series_names)}
    width = 0.8 / max(1, len(series_names))
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(max(8, 1.1 * len(group_labels) + 3), 4 * len(panels)),
        squeeze=False,
    )
    for ax, (panel_title, series) in zip(axes[:, 0], panels, strict=True):
        for i, name in enumerate(series_names):
            values = series.get(name, [None] * len(group_labels))
            xs = [g + (i - (len(series_names) - 1) / 2) * width for g in range(len(group_labels))]
            kept = [(x, v) for x, v in zip(xs, values, strict=True) if v is not None]
            if kept:
                ax.bar(*zip(*kept, strict=True), width=width, label=name, color=colors[name])
        ax.set_title(panel_title)
        ax.set_ylabel(ylabel)
        ax.set_xticks(range(len(group_labels)))
        ax.set_xticklabels(group_labels, rotation=30, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        if series_names:
            ax.legend(fontsize=8, ncol=min(4, len(series_names)))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
