"""The sweep, records, reports and command line shared by the attention and SSD benchmarks.

A benchmark module keeps what is its own: its shapes (a frozen dataclass with a `label`), its
implementations, their inputs and reference check, its units (TFLOP/s or ms) and its report
tables. This module runs the sweep over (shape, implementation, mode), measuring each on its own
and recording a failure as a result, and holds the pieces of the records, tables, plots and
command line that the benchmarks have in common. Timing itself is in _timing.py.

A record is one flat dict per measurement: the shape's fields, label, impl, mode, status ("ok",
"error" or "skipped"), then either error or the result fields and the timing fields (ms, ms_min,
ms_max, ms_amortised, ms_device, iters; ms_device None where it could not be measured).
"""

import dataclasses
import os
import sys
import time

import jax
import numpy as np

from benchmarks import _timing

MODES = ("fwd", "fwdbwd")
REL_ERR_TOLERANCE = 2e-2


class SkippedError(Exception):
    """An implementation deliberately not run at a shape (recorded as 'skipped')."""


# --- Measuring. ---


def relative_error(out, reference):
    """max |out - ref| / max |ref|."""
    out = np.asarray(out, np.float32)
    return float(np.max(np.abs(out - reference)) / np.max(np.abs(reference)))


def measure_jax(step, args, opts, forward_error=None):
    """Compiles jax.jit(step) for `args` ahead of time and times it: (result fields, Timing).

    The result fields are compile_s, temp_bytes (where XLA reports it) and, given
    `forward_error` (a function of the compiled step's output), fwd_rel_err.
    """
    start = time.perf_counter()
    compiled = jax.jit(step).lower(*args).compile()
    result = {"compile_s": time.perf_counter() - start}
    memory = compiled.memory_analysis()
    if memory is not None:
        result["temp_bytes"] = int(memory.temp_size_in_bytes)
    if forward_error is not None:
        result["fwd_rel_err"] = forward_error(compiled(*args))
    return result, _timing.time_jax(compiled, args, iters=opts.iters, warmup=opts.warmup)


def import_torch_cuda():
    """The torch module, after checking that it sees a CUDA device."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device")
    return torch


def release_torch_memory():
    """Hands torch's cached GPU memory back to the device (JAX may need it), if torch is in use."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def base_record(shape, impl, mode):
    """The fields that name a measurement: the shape's fields, its label, impl and mode."""
    return {**dataclasses.asdict(shape), "label": shape.label, "impl": impl, "mode": mode}


def measured_record(record, measure, *, uses_torch):
    """`record` completed by `measure()` -> (result fields, Timing), or by the failure it raised.

    Never raises (short of KeyboardInterrupt); torch's cached memory is released afterwards when
    `uses_torch`.
    """
    try:
        result, timing = measure()
    except SkippedError as e:
        return {**record, "status": "skipped", "error": str(e)}
    except Exception as e:  # any failure is a result to record
        return {**record, "status": "error", "error": f"{type(e).__name__}: {e}"}
    finally:
        if uses_torch:
            release_torch_memory()
    return {
        **record, **result, "status": "ok",
        "ms": timing.median_ms, "ms_min": timing.min_ms, "ms_max": timing.max_ms,
        "ms_amortised": timing.amortised_ms, "ms_device": timing.device_ms,
        "iters": timing.iters,
    }


def format_progress(index, total, record, *, label_width, impl_width, timing_text, show_temp):
    """One printed line of a record; `timing_text(record)` formats an ok record's timings."""
    head = (f"[{index}/{total}] {record['label']:<{label_width}} "
            f"{record['impl']:<{impl_width}} {record['mode']:<6}")
    if record["status"] != "ok":
        return f"{head} {record['status']}: {record['error'].splitlines()[0][:160]}"
    line = f"{head} {timing_text(record)}"
    if "compile_s" in record:
        line += f" compile {record['compile_s']:.1f}s"
    if show_temp and "temp_bytes" in record:
        line += f" temp {record['temp_bytes'] / 2**20:.0f} MiB"
    if "fwd_rel_err" in record:
        line += f" rel_err {record['fwd_rel_err']:.1e}"
    return line


# --- The sweep. ---


def output_paths(out_dir, name, tag):
    """{out_dir}/{name}_{tag}.json and .png."""
    return tuple(os.path.join(out_dir, f"{name}_{tag}.{ext}") for ext in ("json", "png"))


def run_sweep(name, shapes, environment, args, *, inputs_and_reference, run_one,
              progress_line, save_plot):
    """Measures every (shape, args.impls, args.modes) and returns (records, json_path, png_path).

    `inputs_and_reference(shape, seed)` makes a shape's inputs and reference output;
    `run_one(impl, shape, mode, inputs, reference, args)` measures one record, never raising;
    `progress_line(index, total, record)` is the line printed after each measurement;
    `save_plot(path, records, labels, impls, metric, device_kind)` draws the plot. The JSON
    (environment, config: the arguments but out_dir, tag and ssd's merge, and the records) and
    the plot are rewritten after each shape.
    """
    config = {k: v for k, v in vars(args).items() if k not in ("out_dir", "tag", "merge")}
    json_path, png_path = output_paths(args.out_dir, name, args.tag)
    print(f"{environment['device_kind']}, jax {environment['versions']['jax']}: "
          f"{len(shapes)} shapes x {len(args.impls)} implementations x {len(args.modes)} modes",
          flush=True)

    records = []
    total = len(shapes) * len(args.impls) * len(args.modes)
    for shape_index, shape in enumerate(shapes):
        inputs, reference = inputs_and_reference(shape, args.seed + shape_index)
        for impl in args.impls:
            for mode in args.modes:
                record = run_one(impl, shape, mode, inputs, reference, args)
                records.append(record)
                print(progress_line(len(records), total, record), flush=True)
        del inputs
        jax.clear_caches()
        labels = [s.label for s in shapes[: shape_index + 1]]
        _timing.write_json(
            json_path, {"environment": environment, "config": config, "results": records}
        )
        save_plot(png_path, records, labels, args.impls, args.metric,
                  environment["device_kind"])
    return records, json_path, png_path


# --- Reports. ---


def index_records(records):
    """{(label, impl, mode): record}; where a key repeats, the last record counts."""
    return {(r["label"], r["impl"], r["mode"]): r for r in records}


def metric_value(record, field):
    """The record's `field` (e.g. "ms" or "tflops") if it was measured, else None."""
    if record is None or record["status"] != "ok":
        return None
    return record.get(field)  # records from before ms_device lack it


def cell_text(record, field):
    """A table cell: the value, "!" after it where the forward check failed; or why not."""
    if record is None:
        return "-"
    if record["status"] != "ok":
        return "skip" if record["status"] == "skipped" else "err"
    value = metric_value(record, field)
    if value is None:
        return "n/a"
    flag = "!" if record.get("fwd_rel_err", 0.0) > REL_ERR_TOLERANCE else ""
    return f"{value:.3g}{flag}"


def mode_cells(by_key, label, impl, field):
    """The cells of (label, impl) in each mode, "fwd / fwdbwd"."""
    return " / ".join(cell_text(by_key.get((label, impl, mode)), field) for mode in MODES)


def plot_panels(records, labels, impls, field, mode_titles):
    """save_grouped_bar_plot's panels: one per (mode, title) measured, in the order given."""
    by_key = index_records(records)
    return [
        (title, {impl: [metric_value(by_key.get((label, impl, mode)), field) for label in labels]
                 for impl in impls})
        for mode, title in mode_titles
        if any(r["mode"] == mode for r in records)
    ]


def metric_text(metric):
    """"per-call", "amortised" or "device", for legends and axis labels."""
    return metric.replace("_", "-")


# --- Command line. ---


def comma_list(item_type):
    """An argparse type: "a,b" -> [item_type("a"), item_type("b")]."""
    return lambda text: [item_type(item) for item in text.split(",") if item]


def add_selection_arguments(parser, *, default_impls, impls_help, quick_help, interpret_help):
    """--impls, --modes, --quick and --interpret."""
    parser.add_argument("--impls", type=comma_list(str), default=list(default_impls),
                        help=impls_help)
    parser.add_argument("--modes", type=comma_list(str), default=list(MODES), help="fwd,fwdbwd")
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--interpret", action="store_true", help=interpret_help)


def add_timing_arguments(parser, *, warmup_help):
    """--iters, --warmup and --metric."""
    parser.add_argument("--iters", type=int, default=30, help="timed calls per measurement")
    parser.add_argument("--warmup", type=int, default=3, help=warmup_help)
    parser.add_argument("--metric", choices=["per_call", "amortised", "device"],
                        default="per_call",
                        help="timing shown in the table and plot (the JSON has all three)")


def add_output_arguments(parser, name):
    """--seed, --out-dir and --tag (file names {name}_{tag}.json/.png)."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--tag", default=time.strftime("%Y%m%d_%H%M%S"),
                        help=f"file names: {name}_{{tag}}.json/.png")


def check_common_arguments(parser, args, impls):
    """Rejects implementations not in `impls` and unknown modes, puts the modes in MODES' order
    and, with --quick, sets 3 timed calls after 1 warm-up call."""
    unknown = sorted(set(args.impls) - set(impls))
    if unknown:
        parser.error(f"unknown implementations: {','.join(unknown)}")
    if not set(args.modes) <= set(MODES):
        parser.error(f"modes must be among {','.join(MODES)}, got {','.join(args.modes)}")
    args.modes = [mode for mode in MODES if mode in args.modes]
    if args.quick:
        args.iters, args.warmup = 3, 1
