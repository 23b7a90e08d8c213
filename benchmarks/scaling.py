"""Scaling of the ops over the local devices: the sharded path's cost at n = 1 and context
parallelism's strong scaling, on every device count from 1 to the machine's (or `--devices`).

Four sections, each timed amortised (10 calls, one sync; medians over `--rounds` rounds whose
order alternates); the first three time a forward and backward (jax.vjp):

* overhead (one device): the direct call against the same call through the sharded path on a
  one-device mesh: batch sharded (shard_map only) and sequence sharded (context parallelism:
  shifted kernels, the SSD's state passing). Attention d128 T 8192 causal (b 2, 16 heads), SSD T
  4096 N 128 G 1 chunk 256 at the Mamba2-2.7B mixer shape (b 4, 80 heads of 64).
* attention: causal d128 (b 1, 16 heads) with the sequence over n devices, "all_gather" and
  "ring", contiguous and zig-zag order. Tokens/s, efficiency = tokens/s / (n x one device's
  direct call's), and the compiled step's memory per device (arguments + outputs + temps).
* ssd: the Mamba2-2.7B mixer shape (b 1, 80 heads, N 128, chunk 256) from T 65536 up, the
  sequence over n devices; the same columns.

* train: data-parallel weak scaling of the HybridLM train step (bf16 Pallas kernels, AdamW,
  next-token loss), `--train-batch` rows of `--train-seq-len` tokens per device on a data mesh
  of n devices; efficiency = tokens/s / (n x one device's), and the compiled step's memory.

    python -m benchmarks.scaling [--devices N] [--sections overhead,attention,ssd,train]
        [--tag h200_n1]      # writes benchmarks/results/scaling_{tag}.json and .png
"""

import argparse
import contextlib
import dataclasses
import functools
import pathlib
import statistics
import warnings

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_kernels
from benchmarks import _harness, _timing
from flax_layers import HybridLM, HybridLMConfig

ATTENTION = dict(heads=16, head_dim=128)
SSD = dict(heads=80, head_dim=64, state=128, groups=1, chunk=256)
OVERHEAD_SHAPES = dict(attention=(2, 8192), ssd=(4, 4096))  # (batch, T)


def _mesh(n, names=("context",)):
    return jax.make_mesh((n,), names, axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:n])


@dataclasses.dataclass
class Step:
    """A jitted forward and backward, its arguments and the mesh to trace it under."""

    fn: object
    args: list
    mesh: object = None

    def _context(self):
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def __call__(self):
        with self._context():
            return self.fn(*self.args)

    def bytes_per_device(self):
        """Arguments, outputs and temporaries of the compiled step (one device's), or None."""
        with self._context():
            analysis = self.fn.lower(*self.args).compile().memory_analysis()
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


def _attention_step(batch, t, *, mesh=None, spec=None, **options):
    """The `Step` of causal attention, bf16; placed by `spec` on `mesh` if given."""
    keys = jax.random.split(jax.random.key(0), 4)
    shape = (batch, t, ATTENTION["heads"], ATTENTION["head_dim"])
    q, k, v, dout = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)

    def attention(q, k, v):
        return pallas_kernels.dot_product_attention(q, k, v, is_causal=True,
                                                    implementation="pallas", **options)

    return _vjp_step(attention, [q, k, v], dout, mesh, spec)


def _ssd_step(batch, t, *, mesh=None, spec=None):
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
            dt_softplus=True, implementation="pallas")

    return _vjp_step(scan, [x, dt, B, C], dy, mesh, spec)


def _time(steps, rounds):
    """({name: median ms}, {name: [ms per round]}) of `Step`s timed in rounds alternating
    their order."""
    for step in steps.values():
        jax.block_until_ready(step())
    times = {name: [] for name in steps}
    for r in range(rounds):
        for name in (list(steps) if r % 2 == 0 else list(reversed(steps))):
            times[name].append(1e3 * _timing.amortised_seconds(steps[name]))
    return {name: statistics.median(ms) for name, ms in times.items()}, times


def overhead(rounds):
    """The sharded path on a one-device mesh against the direct call."""
    rows = []
    one = _mesh(1, ("data",))
    seq = _mesh(1, ("context",))
    cases = {
        "attention d128 T8192 causal": (
            functools.partial(_attention_step, *OVERHEAD_SHAPES["attention"]),
            {"batch sharded": dict(mesh=one, spec=P("data")),
             "sequence all_gather": dict(mesh=seq, spec=P(None, "context")),
             "sequence ring": dict(mesh=seq, spec=P(None, "context"),
                                   context_parallelism="ring")}),
        "ssd T4096 N128 G1 c256": (
            functools.partial(_ssd_step, *OVERHEAD_SHAPES["ssd"]),
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


def _strong_scaling(section, make, lengths, variants, devices, rounds):
    """Yields the rows of one section: per T, the direct call on one device, then each variant
    on each device count."""
    for t in lengths:
        base = None
        try:
            base = _time({"direct": make(t)}, rounds)[0]["direct"]
        except Exception as error:  # noqa: BLE001 - too large for one device is a result
            print(f"{section} T{t}: one device failed: {type(error).__name__}", flush=True)
        for n in devices:
            if t % (2 * n):
                continue
            for name, options in variants.items():
                step = make(t, mesh=_mesh(n), spec=P(None, "context"), **options)
                ms = _time({name: step}, rounds)[0][name]
                tokens = t / (ms / 1e3)
                row = dict(section=section, seq_len=t, devices=n, variant=name, ms=ms,
                           tokens_per_s=tokens, one_device_ms=base,
                           ideal_tokens_per_s=None if base is None else n * t / (base / 1e3),
                           efficiency=None if base is None else base / (n * ms),
                           bytes_per_device=step.bytes_per_device())
                print(f"{section:9s} T{t:<7d} n{n} {name:24s} {ms:9.3f} ms "
                      f"{tokens / 1e6:8.3f} Mtok/s  efficiency "
                      f"{'-' if base is None else f'{row['efficiency']:.3f}'}", flush=True)
                yield row


def attention(devices, rounds, lengths):
    variants = {f"{strategy} {order}": dict(context_parallelism=strategy, sequence_order=order)
                for strategy in ("all_gather", "ring") for order in ("contiguous", "zigzag")}
    return _strong_scaling("attention", functools.partial(_attention_step, 1), lengths,
                           variants, devices, rounds)


def ssd(devices, rounds, lengths):
    return _strong_scaling("ssd", functools.partial(_ssd_step, 1), lengths,
                           {"state passing": {}}, devices, rounds)


def _train_step(n, preset, batch, seq_len):
    """The `Step` of one HybridLM train step (AdamW) on a data mesh of `n` devices, `batch`
    rows of `seq_len` tokens per device."""
    mesh = _mesh(n, ("data",))
    config = HybridLMConfig.preset(preset, dtype=jnp.bfloat16, implementation="pallas")
    tx = optax.adamw(1e-4)
    tokens = NamedSharding(mesh, P("data", None))
    with jax.set_mesh(mesh):
        graphdef, params = nnx.split(HybridLM(config, rngs=nnx.Rngs(0)))
        opt_state = jax.jit(tx.init)(params)
    data = jax.random.randint(jax.random.key(1), (n * batch, seq_len + 1), 0, config.vocab_size)
    data = jax.device_put(data, tokens)

    def loss(params, data):
        logits = nnx.merge(graphdef, params)(data[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, data[:, 1:]).mean()

    def step(params, opt_state, data):
        value, grads = jax.value_and_grad(loss)(params, data)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return Step(jax.jit(step), [params, opt_state, data], mesh)


def train(devices, rounds, preset, batch, seq_len):
    """Yields data-parallel weak scaling's rows: the same batch rows per device on 1, 2, 4, ...
    devices."""
    base = None
    for n in devices:
        step = _train_step(n, preset, batch, seq_len)
        ms = _time({"step": step}, rounds)[0]["step"]
        base = ms if n == 1 else base
        tokens = n * batch * seq_len / (ms / 1e3)
        print(f"train     {preset} n{n} {ms:9.3f} ms {tokens / 1e6:8.3f} Mtok/s  efficiency "
              f"{base / ms:.3f}", flush=True)
        yield dict(section="train", seq_len=seq_len, devices=n,
                   variant=f"{preset} data parallel, {batch} x {seq_len} per device", ms=ms,
                   tokens_per_s=tokens, one_device_ms=base,
                   ideal_tokens_per_s=n * batch * seq_len / (base / 1e3), efficiency=base / ms,
                   bytes_per_device=step.bytes_per_device())


def _plot(path, rows):
    """One panel per (section, T): tokens/s against devices, a line per variant, and the
    ideal n x one device's direct call, dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
                        default=[16384, 65536])
    parser.add_argument("--ssd-lengths", type=_harness.comma_list(int), default=[65536, 131072])
    parser.add_argument("--train-preset", default="small", help="HybridLMConfig.preset name")
    parser.add_argument("--train-batch", type=int, default=16, help="rows per device")
    parser.add_argument("--train-seq-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--tag", required=True, help="file names: scaling_{tag}.json / .png")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    devices = [n for n in (2**i for i in range(8)) if n <= args.devices]
    out = pathlib.Path(args.out_dir)
    payload = dict(environment=_timing.environment_info("benchmarks.scaling"),
                   rounds=args.rounds, devices=devices, attention_shape=ATTENTION,
                   ssd_shape=SSD)
    sections = {
        "attention": lambda: attention(devices, args.rounds, args.attention_lengths),
        "ssd": lambda: ssd(devices, args.rounds, args.ssd_lengths),
        "train": lambda: train(devices, args.rounds, args.train_preset, args.train_batch,
                               args.train_seq_len),
    }
    unknown = [s for s in args.sections if s != "overhead" and s not in sections]
    if unknown:
        raise SystemExit(f"--sections: unknown sections {unknown}")
    rows = payload["scaling"] = []
    path = str(out / f"scaling_{args.tag}.json")
    for section in args.sections:  # the file is rewritten after every result: a cut run keeps
        if section == "overhead":  # what it measured
            payload["overhead"] = overhead(args.rounds)
            _timing.write_json(path, payload)
            continue
        for row in sections[section]():
            rows.append(row)
            _timing.write_json(path, payload)
    _plot(out / f"scaling_{args.tag}.png", rows)
    print("\n| section | T | n | variant | ms | Mtok/s | efficiency | GiB per device |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        eff = "-" if r["efficiency"] is None else f"{r['efficiency']:.3f}"
        gib = "-" if r["bytes_per_device"] is None else f"{r['bytes_per_device'] / 2**30:.2f}"
        print(f"| {r['section']} | {r['seq_len']} | {r['devices']} | {r['variant']} | "
              f"{r['ms']:.3f} | {r['tokens_per_s'] / 1e6:.3f} | {eff} | {gib} |")
    for r in payload.get("overhead", []):
        print(f"overhead {r['case']} {r['path']}: {r['ratio']:.3f}")


if __name__ == "__main__":
    main()
