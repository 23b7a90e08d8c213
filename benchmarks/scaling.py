"""Scaling of the ops over the local devices: the sharded path's cost at n = 1 and context
parallelism's strong scaling, on every device count from 1 to the machine's (or `--devices`).

Four sections, each timed amortised (batches of back-to-back calls, one sync each; a call
longer than half a second alone; medians over `--rounds` rounds whose order alternates); the
first three time a forward and backward (jax.vjp):

* overhead (one device): the direct call against the same call through the sharded path on a
  one-device mesh: batch sharded (shard_map only) and sequence sharded (context parallelism:
  shifted kernels, the SSD's state passing). Attention d128 T 8192 causal (b 2, 32 query and 8
  key/value heads), SSD T 4096 N 128 G 1 chunk 256 at the Mamba2-2.7B mixer shape (b 4, 80
  heads of 64).
* attention: causal d128 (b 1, 32 query and 8 key/value heads) with the sequence over n
  devices, "all_gather" and "ring", contiguous and zig-zag order. Tokens/s, efficiency =
  tokens/s / (n x one device's direct call's), and the compiled step's memory per device
  (arguments + outputs + temps) against one device's divided by n.
* ssd: the Mamba2-2.7B mixer shape (b 1, 80 heads, N 128, chunk 256), the sequence over n
  devices; the same columns.
* train: weak scaling of the HybridLM train step (the zamba2-1.2b preset, bf16, AdamW,
  next-token loss), `--train-batch` rows of `--train-seq-len` tokens per device on n devices,
  data parallel, and fully sharded (fsdp) at the most devices; the same columns, memory
  against one device's (weak scaling).

With `--profile`, each variant at the most devices also runs under `jax.profiler`: the time of
its collective (NCCL/RCCL) kernels per call and the share of it during which other kernels ran
(whether the communication overlaps the compute), as the mean over the devices.

    python -m benchmarks.scaling [--devices N] [--sections overhead,attention,ssd,train]
        [--profile] [--tag h200_n1]      # writes benchmarks/results/scaling_{tag}.json, .png
"""

import argparse
import contextlib
import dataclasses
import functools
import pathlib
import statistics
import time
import warnings

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_kernels
from benchmarks import _harness, _profile, _timing
from flax_layers import HybridLM, HybridLMConfig, gather_parameters, parameter_shardings

ATTENTION = dict(heads=32, kv_heads=8, head_dim=128)
SSD = dict(heads=80, head_dim=64, state=128, groups=1, chunk=256)
OVERHEAD_SHAPES = dict(attention=(2, 8192), ssd=(4, 4096))  # (batch, T)


def _mesh(n, names=("context",)):
    return jax.make_mesh((n,), names, axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:n])


@dataclasses.dataclass
class Step:
    """A jitted step, its arguments and the mesh to trace it under; compiled once, at the
    first call, for the calls and the memory analysis both."""

    fn: object
    args: list
    mesh: object = None
    compiled: object = None

    def _compile(self):
        if self.compiled is None:
            with contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh):
                self.compiled = self.fn.lower(*self.args).compile()
        return self.compiled

    def __call__(self):
        return self._compile()(*self.args)

    def bytes_per_device(self):
        """Arguments, outputs and temporaries of the compiled step (one device's), or None."""
        analysis = self._compile().memory_analysis()
        if analysis is None:
            return None
        return int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes
                   + analysis.temp_size_in_bytes)


def _vjp_step(fn, args, cotangent, mesh, spec):
    """fn's forward and vjp under jit; the token arrays and cotangent placed by `spec`."""
    args = [*args, cotangent]
    if mesh is not None:
        args = [jax.device_put(a, NamedSharding(mesh, spec)) for a in args]

    def step(*args):
        out, vjp = jax.vjp(fn, *args[:-1])
        return out, *vjp(args[-1])

    return Step(jax.jit(step), args, mesh)


def _attention_step(batch, t, *, implementation, mesh=None, spec=None, **options):
    """The `Step` of causal attention, bf16; placed by `spec` on `mesh` if given."""
    keys = jax.random.split(jax.random.key(0), 4)
    heads, kv_heads, head_dim = (ATTENTION[k] for k in ("heads", "kv_heads", "head_dim"))
    q, dout = (jax.random.normal(key, (batch, t, heads, head_dim), jnp.bfloat16)
               for key in keys[:2])
    k, v = (jax.random.normal(key, (batch, t, kv_heads, head_dim), jnp.bfloat16)
            for key in keys[2:])

    def attention(q, k, v):
        return pallas_kernels.dot_product_attention(q, k, v, is_causal=True,
                                                    implementation=implementation, **options)

    return _vjp_step(attention, [q, k, v], dout, mesh, spec)


def _ssd_step(batch, t, *, implementation, mesh=None, spec=None):
    """The `Step` of the SSD at the mixer shape, bf16, with D and dt_bias."""
    h, p, n, g = (SSD[k] for k in ("heads", "head_dim", "state", "groups"))
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (batch, t, h, p), jnp.bfloat16)
    dt = (jax.random.normal(keys[1], (batch, t, h)) * 0.5 - 1.0).astype(jnp.bfloat16)
    A = -jnp.exp(jax.random.uniform(keys[2], (h,), minval=-1.0, maxval=1.5))
    B, C = (jax.random.normal(key, (batch, t, g, n), jnp.bfloat16) for key in keys[3:5])
    dy = jax.random.normal(keys[5], x.shape, jnp.bfloat16)

    def scan(x, dt, B, C):
        return pallas_kernels.mamba_chunk_scan_combined(
            x, dt, A, B, C, SSD["chunk"], D=jnp.ones((h,)), dt_bias=jnp.zeros((h,)),
            dt_softplus=True, implementation=implementation)

    return _vjp_step(scan, [x, dt, B, C], dy, mesh, spec)


LONG_CALL_S = 0.5  # timed one call at a time, in at most 3 rounds: dispatch is noise there
BATCH_S = 0.2  # shorter calls: batches of back-to-back calls of about this long


def _time(steps, rounds):
    """({name: median ms}, {name: [ms per round]}) of `Step`s timed in rounds alternating
    their order (`_seconds`)."""
    first = {}
    for name, step in steps.items():
        jax.block_until_ready(step())  # compiles
        first[name] = _call_seconds(step)
    if all(s > LONG_CALL_S for s in first.values()):
        rounds = min(rounds, 3)
    times = {name: [] for name in steps}
    for r in range(rounds):
        for name in (list(steps) if r % 2 == 0 else list(reversed(steps))):
            times[name].append(1e3 * _seconds(steps[name], first[name]))
    return {name: statistics.median(ms) for name, ms in times.items()}, times


def _seconds(step, first_call_s):
    """One round's seconds per call: a single call past LONG_CALL_S, else amortised over
    batches of up to 10 calls about BATCH_S long (7 batches of 10, 3 of fewer), so that a
    train step of 0.4 s costs a round about 2 s, not 30."""
    if first_call_s > LONG_CALL_S:
        return _call_seconds(step)
    calls = max(1, min(10, int(BATCH_S / first_call_s)))
    return _timing.amortised_seconds(step, calls=calls, repeats=7 if calls == 10 else 3)


def _call_seconds(step):
    start = time.perf_counter()
    jax.block_until_ready(step())
    return time.perf_counter() - start


def _communication(step, calls=3):
    """{collective_ms: per call, overlapped: the share of it during which other kernels ran},
    the means over the devices of a profile of `calls` calls (`_profile.collective_overlap`);
    None where the trace has no GPU kernels."""
    by_device, _ = _profile.device_kernel_events(
        lambda: [jax.block_until_ready(step()) for _ in range(calls)])
    sums = [_profile.collective_overlap(events) for events in by_device.values() if events]
    if not sums:
        return None
    total = statistics.mean(ns for ns, _ in sums)
    return dict(collective_ms=total / calls / 1e6,
                overlapped=statistics.mean(o / ns if ns else 0.0 for ns, o in sums))


def _memory_ratio(bytes_per_device, one_device_bytes, n):
    """A device's compiled memory against one device's divided by n (None where unknown)."""
    if not bytes_per_device or not one_device_bytes:
        return None
    return bytes_per_device * n / one_device_bytes


def overhead(rounds, implementation):
    """The sharded path on a one-device mesh against the direct call."""
    rows = []
    one = _mesh(1, ("data",))
    seq = _mesh(1, ("context",))
    cases = {
        "attention d128 T8192 causal": (
            functools.partial(_attention_step, *OVERHEAD_SHAPES["attention"],
                              implementation=implementation),
            {"batch sharded": dict(mesh=one, spec=P("data")),
             "sequence all_gather": dict(mesh=seq, spec=P(None, "context")),
             "sequence ring": dict(mesh=seq, spec=P(None, "context"),
                                   context_parallelism="ring")}),
        "ssd T4096 N128 G1 c256": (
            functools.partial(_ssd_step, *OVERHEAD_SHAPES["ssd"], implementation=implementation),
            {"batch sharded": dict(mesh=one, spec=P("data")),
             "sequence": dict(mesh=seq, spec=P(None, "context"))}),
    }
    for case, (make, variants) in cases.items():
        steps = {"direct": make(), **{name: make(**kw) for name, kw in variants.items()}}
        medians, times = _time(steps, rounds)
        for name in variants:
            rows.append(dict(case=case, path=name, direct_ms=medians["direct"],
                             sharded_ms=medians[name], ratio=medians[name] / medians["direct"],
                             times_ms=dict(direct=times["direct"], sharded=times[name])))
            print(f"overhead  {case:30s} {name:22s} direct {medians['direct']:8.3f} ms  "
                  f"sharded {medians[name]:8.3f} ms  ratio {rows[-1]['ratio']:.3f}", flush=True)
    return rows


def _strong_scaling(section, make, lengths, variants, devices, rounds, profile):
    """Yields the rows of one section: per T, the direct call on one device, then each variant
    on each device count (profiled at the most devices where `profile`). A step that fails
    (out of memory, say) is a row with its error; each step's arrays are freed before the
    next is built."""
    for t in lengths:
        base = base_bytes = None
        try:
            base, base_bytes = _measure(make(t), rounds)
        except Exception as error:  # noqa: BLE001 - too large for one device is a result
            print(f"{section} T{t}: one device failed: {_error(error)}", flush=True)
        for n in devices:
            if t % (2 * n):
                continue
            for name, options in variants.items():
                row = dict(section=section, seq_len=t, devices=n, variant=name)
                try:
                    ms, memory, communication = _measure(
                        make(t, mesh=_mesh(n), spec=P(None, "context"), **options), rounds,
                        profile=profile and n == devices[-1])
                except Exception as error:  # noqa: BLE001 - a failure is a result
                    print(f"{section:9s} T{t:<7d} n{n} {name:24s} failed: {_error(error)}",
                          flush=True)
                    yield dict(row, error=_error(error))
                    continue
                tokens = t / (ms / 1e3)
                row |= dict(ms=ms, tokens_per_s=tokens, one_device_ms=base,
                            ideal_tokens_per_s=None if base is None else n * t / (base / 1e3),
                            efficiency=None if base is None else base / (n * ms),
                            bytes_per_device=memory, one_device_bytes=base_bytes,
                            memory_ratio=_memory_ratio(memory, base_bytes, n),
                            communication=communication)
                print(f"{section:9s} T{t:<7d} n{n} {name:24s} {ms:9.3f} ms "
                      f"{tokens / 1e6:8.3f} Mtok/s  efficiency "
                      f"{'-' if base is None else f'{row['efficiency']:.3f}'}", flush=True)
                yield row


def _measure(step, rounds, profile=None):
    """(median ms, compiled bytes per device) of a `Step`, and with `profile` (True or False)
    also its `_communication` (None unless True)."""
    ms = _time({"step": step}, rounds)[0]["step"]
    memory = step.bytes_per_device()
    if profile is None:
        return ms, memory
    return ms, memory, _communication(step) if profile else None


def _error(error):
    return f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"


def attention(devices, rounds, lengths, implementation, profile):
    variants = {f"{strategy} {order}": dict(context_parallelism=strategy, sequence_order=order)
                for strategy in ("all_gather", "ring") for order in ("contiguous", "zigzag")}
    return _strong_scaling(
        "attention", functools.partial(_attention_step, 1, implementation=implementation),
        lengths, variants, devices, rounds, profile)


def ssd(devices, rounds, lengths, implementation, profile):
    return _strong_scaling(
        "ssd", functools.partial(_ssd_step, 1, implementation=implementation), lengths,
        {"state passing": {}}, devices, rounds, profile)


def _train_step(n, preset, batch, seq_len, implementation, axis="data"):
    """The `Step` of one HybridLM train step (AdamW) on a mesh of `n` devices along `axis`
    ("data", or "fsdp": the parameters and optimizer state sharded, gathered for the step),
    `batch` rows of `seq_len` tokens per device."""
    mesh = _mesh(n, (axis,))
    config = HybridLMConfig.preset(preset, dtype=jnp.bfloat16, implementation=implementation)
    tx = optax.adamw(1e-4)
    tokens = NamedSharding(mesh, P(axis, None))
    with jax.set_mesh(mesh):
        graphdef, params = nnx.split(HybridLM(config, rngs=nnx.Rngs(0)))
        params = jax.device_put(params, parameter_shardings(params, mesh))
        opt_state = jax.jit(tx.init)(params)
    data = jax.random.randint(jax.random.key(1), (n * batch, seq_len + 1), 0, config.vocab_size)
    data = jax.device_put(data, tokens)

    def loss(params, data):
        logits = nnx.merge(graphdef, gather_parameters(params))(data[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, data[:, 1:]).mean()

    def step(params, opt_state, data):
        value, grads = jax.value_and_grad(loss)(params, data)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return Step(jax.jit(step), [params, opt_state, data], mesh)


def train(devices, rounds, preset, batch, seq_len, implementation, profile):
    """Yields weak scaling's rows: the same batch rows per device on 1, 2, 4, ... devices, data
    parallel, and fully sharded at the most devices (each step compiles for about a minute
    at the zamba2-1.2b shape: five fit one 10-minute device call). A failure is a row with its
    error."""
    base = base_bytes = None
    for n in devices:
        for axis in ("data", "fsdp") if n == devices[-1] > 1 else ("data",):
            row = dict(section="train", seq_len=seq_len, devices=n,
                       variant=f"{preset} {'data parallel' if axis == 'data' else 'fsdp'}, "
                               f"{batch} x {seq_len} per device")
            try:
                ms, memory, communication = _measure(
                    _train_step(n, preset, batch, seq_len, implementation, axis), rounds,
                    profile=profile and n == devices[-1])
            except Exception as error:  # noqa: BLE001 - a failure is a result
                print(f"train     {preset} {axis} n{n} failed: {_error(error)}", flush=True)
                yield dict(row, error=_error(error))
                continue
            if n == 1:
                base, base_bytes = ms, memory
            tokens = n * batch * seq_len / (ms / 1e3)
            efficiency = None if base is None else base / ms
            print(f"train     {preset} {axis} n{n} {ms:9.3f} ms {tokens / 1e6:8.3f} Mtok/s  "
                  f"efficiency {'-' if efficiency is None else f'{efficiency:.3f}'}",
                  flush=True)
            yield row | dict(
                ms=ms, tokens_per_s=tokens, one_device_ms=base,
                ideal_tokens_per_s=None if base is None else n * batch * seq_len / (base / 1e3),
                efficiency=efficiency, bytes_per_device=memory, one_device_bytes=base_bytes,
                memory_ratio=None if n == 1 or not memory or not base_bytes
                else memory / base_bytes,
                communication=communication)


def _plot(path, rows):
    """One panel per (section, T): tokens/s against devices, a line per variant, and the
    ideal n x one device's direct call, dashed (failed steps left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "error" not in r]
    panels = sorted({(r["section"], r["seq_len"]) for r in rows})
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for ax, (section, t) in zip(axes[0], panels, strict=True):
        chosen = [r for r in rows if (r["section"], r["seq_len"]) == (section, t)]
        for variant in dict.fromkeys(r["variant"] for r in chosen):
            line = sorted((r["devices"], r["tokens_per_s"] / 1e6) for r in chosen
                          if r["variant"] == variant)
            ax.plot(*zip(*line, strict=True), marker="o", label=variant)
        ideal = sorted({(r["devices"], r["ideal_tokens_per_s"] / 1e6) for r in chosen
                        if r["ideal_tokens_per_s"]})
        counts = sorted({r["devices"] for r in chosen})
        if ideal:
            ax.plot(*zip(*ideal, strict=True), "k--", lw=1, label="ideal (n x one device)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.set_title(f"{section}, T {t}" + (" per row" if section == "train" else ""))
        ax.set_xlabel("devices")
        ax.set_ylabel("million tokens/s (train step)" if section == "train"
                      else "million tokens/s (fwd+bwd)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Context-parallel strong scaling; data-parallel weak scaling (train)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaling",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=jax.device_count(),
                        help="the largest device count (counts double from 1 up to it)")
    parser.add_argument("--sections", type=_harness.comma_list(str),
                        default=["overhead", "attention", "ssd", "train"])
    parser.add_argument("--attention-lengths", type=_harness.comma_list(int),
                        default=[32768, 131072, 524288])
    parser.add_argument("--ssd-lengths", type=_harness.comma_list(int),
                        default=[65536, 262144, 1048576])
    parser.add_argument("--train-preset", default="zamba2-1.2b",
                        help="HybridLMConfig.preset name")
    parser.add_argument("--train-batch", type=int, default=4, help="rows per device")
    parser.add_argument("--train-seq-len", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--implementation", choices=("pallas", "xla"), default="pallas",
                        help="the kernels, or the jnp references (a smoke run on a CPU)")
    parser.add_argument("--profile", action="store_true",
                        help="the collectives' time and overlap at the most devices")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--tag", required=True, help="file names: scaling_{tag}.json / .png")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    devices = [n for n in (2**i for i in range(8)) if n <= args.devices]
    out = pathlib.Path(args.out_dir)
    payload = dict(environment=_timing.environment_info("benchmarks.scaling"),
                   rounds=args.rounds, devices=devices, attention_shape=ATTENTION,
                   ssd_shape=SSD, implementation=args.implementation)
    impl, profile = args.implementation, args.profile
    sections = {
        "attention": lambda: attention(devices, args.rounds, args.attention_lengths, impl,
                                       profile),
        "ssd": lambda: ssd(devices, args.rounds, args.ssd_lengths, impl, profile),
        "train": lambda: train(devices, args.rounds, args.train_preset, args.train_batch,
                               args.train_seq_len, impl, profile),
    }
    unknown = [s for s in args.sections if s != "overhead" and s not in sections]
    if unknown:
        raise SystemExit(f"--sections: unknown sections {unknown}")
    rows = payload["scaling"] = []
    path = str(out / f"scaling_{args.tag}.json")
    for section in args.sections:  # the file is rewritten after every result: a cut run keeps
        if section == "overhead":  # what it measured
            payload["overhead"] = overhead(args.rounds, impl)
            _timing.write_json(path, payload)
            continue
        for row in sections[section]():
            rows.append(row)
            _timing.write_json(path, payload)
    _plot(out / f"scaling_{args.tag}.png", rows)
    print("\n| section | T | n | variant | ms | Mtok/s | efficiency | GiB per device | "
          "memory ratio | collectives ms (overlapped) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['section']} | {r['seq_len']} | {r['devices']} | {r['variant']} | "
                  f"failed: {r['error']} |")
            continue
        eff = "-" if r["efficiency"] is None else f"{r['efficiency']:.3f}"
        gib = "-" if r["bytes_per_device"] is None else f"{r['bytes_per_device'] / 2**30:.2f}"
        ratio = "-" if r["memory_ratio"] is None else f"{r['memory_ratio']:.2f}"
        comm = r["communication"]
        comm = "-" if comm is None else f"{comm['collective_ms']:.3f} ({comm['overlapped']:.0%})"
        print(f"| {r['section']} | {r['seq_len']} | {r['devices']} | {r['variant']} | "
              f"{r['ms']:.3f} | {r['tokens_per_s'] / 1e6:.3f} | {eff} | {gib} | {ratio} | "
              f"{comm} |")
    for r in payload.get("overhead", []):
        print(f"overhead {r['case']} {r['path']}: {r['ratio']:.3f}")


if __name__ == "__main__":
    main()
