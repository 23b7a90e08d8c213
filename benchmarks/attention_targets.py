"""Issue 28's attention targets, read from `benchmarks.attention` sweeps' JSON files.

    python -m benchmarks.attention_targets benchmarks/results/attention_h100_sweep_*.json \
        --out benchmarks/results/attention_h100_sweep_targets.png

For every shape that ours measured forward+backward: its speed relative to each peer, against
the issue's line for that peer (tokamax's Pallas-Triton ≥ 1.3x, PyTorch's FA2 ≥ 1.1x, jax.nn's
cuDNN ≥ 0.8x), and a grouped or MQA shape's TFLOP/s relative to MHA at the same head dim, length
and mask (≥ 0.9). Prints how many shapes meet each line and the worst, and plots the ratios with
the lines (a bar below its line is red and hatched).
"""

import argparse
import json

from benchmarks import _harness, _timing
from benchmarks.attention import METRIC_FIELDS

# (peer, the least fwd+bwd speed-up over it that issue 28 asks for)
PEER_LINES = (("tokamax_triton", 1.3), ("torch_flash", 1.1), ("jax_cudnn", 0.8))
GROUPED_LINE = 0.9  # grouped / MQA TFLOP/s over MHA's at the same shape


def mha_label(label):
    """The MHA shape of a grouped label ("d128 T8192 causal 16:4" -> "d128 T8192 causal");
    None for an MHA label (the harness labels MHA shapes without a heads field)."""
    parts = label.split()
    return " ".join(parts[:-1]) if ":" in parts[-1] else None


def target_ratios(records, metric):
    """{line name: (line, [(label, ratio), ...])} over the shapes ours measured fwd+bwd."""
    by_key = _harness.index_records(records)
    field = METRIC_FIELDS[metric]

    def tflops(label, impl):
        return _harness.metric_value(by_key.get((label, impl, "fwdbwd")), field)

    # Shapes by head dim, then length, each in the order the sweep measured them.
    ordered = sorted(records, key=lambda r: (r["head_dim"], r["seq_len"]))
    labels = [label for label in dict.fromkeys(r["label"] for r in ordered)
              if tflops(label, "ours") is not None]
    ratios = {}
    for peer, line in PEER_LINES:
        pairs = [(label, tflops(label, "ours") / tflops(label, peer))
                 for label in labels if tflops(label, peer) is not None]
        ratios[f"vs {peer}"] = (line, pairs)
    grouped = [(label, tflops(label, "ours") / tflops(mha_label(label), "ours"))
               for label in labels
               if mha_label(label) is not None and tflops(mha_label(label), "ours") is not None]
    ratios["grouped / MHA"] = (GROUPED_LINE, grouped)
    return ratios


def summary_table(ratios):
    rows = []
    for name, (line, pairs) in ratios.items():
        met = sum(ratio >= line for _, ratio in pairs)
        worst_label, worst = min(pairs, key=lambda pair: pair[1])
        rows.append([name, f"≥ {line}", f"{met} / {len(pairs)}", f"{worst:.2f}", worst_label])
    return _timing.format_table(["target", "line", "shapes met", "worst", "worst shape"], rows)


def save_plot(path, ratios, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    longest = max(len(pairs) for _, pairs in ratios.values())
    fig, axes = plt.subplots(len(ratios), 1, figsize=(max(12, 0.22 * longest), 3.2 * len(ratios)))
    for ax, (name, (line, pairs)) in zip(axes, ratios.items(), strict=True):
        labels = [label for label, _ in pairs]
        values = [ratio for _, ratio in pairs]
        bars = ax.bar(range(len(values)), values, color=[
            "tab:blue" if value >= line else "tab:red" for value in values])
        for bar, value in zip(bars, values, strict=True):
            if value < line:
                bar.set_hatch("//")
        ax.axhline(line, color="black", linestyle="--", linewidth=1)
        if max(values) > 4 * line:  # tokamax's window (no block skipping) dwarfs the rest
            ax.set_yscale("log")
        ax.set_ylabel(f"{name} (line {line})", fontsize=8)
        ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=6)
        ax.set_xlim(-0.6, len(labels) - 0.4)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="benchmarks.attention JSON files")
    parser.add_argument("--metric", choices=sorted(METRIC_FIELDS), default="amortised")
    parser.add_argument("--out", help="PNG of the ratios against their lines")
    args = parser.parse_args(argv)
    records, devices = [], set()
    for path in args.results:
        with open(path) as f:
            payload = json.load(f)
        records += payload["results"]
        devices.add(payload["environment"].get("device_kind"))
    ratios = target_ratios(records, args.metric)
    title = (f"attention fwd+bwd, bf16, {' / '.join(sorted(map(str, devices)))}: ours against "
             f"issue 28's lines ({_harness.metric_text(args.metric)} TFLOP/s)")
    print(title + "\n" + summary_table(ratios))
    if args.out:
        save_plot(args.out, ratios, title)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
