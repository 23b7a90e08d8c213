"""Samples from a checkpoint of examples/train_hybrid_lm.py and reports the throughput.

    python examples/generate.py --workdir runs/hybrid_lm --prompt "ROMEO:" --new-tokens 300

Loads the newest checkpoint of the workdir that loads (or `--step`'s), rebuilding the model from
the settings stored with it, and continues each prompt (bytes) through `HybridLM.generate`: one
compiled call that prefills the prompts (FlashAttention and the chunked SSD on a GPU) and
decodes in a `lax.while_loop`, sampling on the device (`--temperature`, `--top-k`, `--top-p`),
with the KV caches in `--kv-dtype` and pages of `--page-size` tokens, the Mamba2 states in
`--ssm-dtype`. Prompts of different lengths share the batch (`prompt_lengths`). `--batch`
repeats the prompts to that many rows.

Prints the samples, then the throughput of the compiled call, timed again after compiling:
prompt tokens/s from a call that generates one token (the prefill and its sample), decode
tokens/s from the difference with the full call. Exit status 2 with one line for an unusable
workdir or flag.
"""

import argparse
import importlib.util
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from flax_layers import HybridLM


def _load_trainer():
    """The training example's module (its configuration and checkpoint helpers)."""
    path = Path(__file__).resolve().parent / "train_hybrid_lm.py"
    spec = importlib.util.spec_from_file_location("train_hybrid_lm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


trainer = _load_trainer()
KV_DTYPES = ("model", "bfloat16", "float32", "int8", "float8_e4m3fn", "float8_e4m3fnuz")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True,
                        help="the training example's --workdir")
    parser.add_argument("--step", type=int, default=None, help="default: the newest that loads")
    parser.add_argument("--prompt", action="append", default=None, dest="prompts",
                        help="repeatable; default: one newline")
    parser.add_argument("--new-tokens", type=int, default=200, help="bytes generated per prompt")
    parser.add_argument("--batch", type=int, default=None,
                        help="rows: the prompts repeated (default: one row each)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: the likeliest byte")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="model",
                        help="the KV caches' storage")
    parser.add_argument("--page-size", type=int, default=None,
                        help="a paged KV cache of pages this long (a power of two >= 16)")
    parser.add_argument("--ssm-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the Mamba2 states' storage (bfloat16: half the bytes a step)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def load_model(workdir: Path, step: int | None = None) -> tuple[HybridLM, int]:
    """(the model of the workdir's checkpoint, its step): the newest that loads, or `step`'s.
    Raises trainer.UsageError when there is none."""
    directory = Path(workdir) / "checkpoints"
    if not directory.is_dir():
        raise trainer.UsageError(f"no checkpoints in {workdir} (train with "
                                 "examples/train_hybrid_lm.py --workdir first)")
    manager = trainer.checkpoint_manager(directory, keep=1)  # keep applies to saves only
    steps = sorted(manager.all_steps(), reverse=True)
    if step is not None:
        if step not in steps:
            raise trainer.UsageError(f"no checkpoint of step {step} in {directory} (steps: "
                                     f"{sorted(steps)})")
        steps = [step]
    for candidate in steps:
        try:
            meta = manager.restore(candidate, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))["meta"]
            settings = meta["run_config"]
            config = trainer.make_config(settings["preset"], "auto", settings["dtype"],
                                         settings["override"])
            graphdef, params = nnx.split(HybridLM(config, rngs=nnx.Rngs(0)))
            tx, _ = trainer.make_optimizer(settings["lr"], settings["warmup_steps"],
                                           settings["schedule_steps"], settings["weight_decay"],
                                           settings["clip_norm"])
            params, _, _ = trainer.restore_checkpoint(
                manager, candidate, params, jax.eval_shape(tx.init, params), lambda meta: None)
            return nnx.merge(graphdef, params), candidate
        except Exception as exc:  # a damaged or foreign checkpoint: try an older one
            reason = str(exc).strip().split("\n")[0][:200]
            print(f"step {candidate} does not load ({type(exc).__name__}: {reason}); trying "
                  "older ones", file=sys.stderr)
    raise trainer.UsageError(f"no checkpoint in {directory} loads")


def encode(prompts: Sequence[str], rows: int) -> tuple[jax.Array, jax.Array]:
    """(tokens (rows, T) int32, lengths (rows,)): the prompts' UTF-8 bytes, repeated to `rows`,
    padded at the end to the longest."""
    encoded = [np.frombuffer(p.encode("utf-8"), np.uint8) for p in prompts]
    encoded = [encoded[i % len(encoded)] for i in range(rows)]
    width = max(len(e) for e in encoded)
    tokens = np.zeros((rows, width), np.int32)
    for i, e in enumerate(encoded):
        tokens[i, :len(e)] = e
    return jnp.asarray(tokens), jnp.asarray([len(e) for e in encoded], jnp.int32)


def run(args: argparse.Namespace) -> dict:
    """Loads, samples, times; returns {"step", "samples", "prefill_tokens_per_s",
    "decode_tokens_per_s"}."""
    prompts = args.prompts or ["\n"]
    if any(not p for p in prompts):
        raise trainer.UsageError("--prompt must not be empty")
    if args.new_tokens < 2:
        raise trainer.UsageError("--new-tokens must be at least 2 (decode is timed)")
    if args.batch is not None and args.batch < 1:
        raise trainer.UsageError(f"--batch must be at least 1, got {args.batch}")
    model, step = load_model(args.workdir, args.step)
    tokens, lengths = encode(prompts, args.batch or len(prompts))
    options = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   rng=jax.random.key(args.seed), prompt_lengths=lengths,
                   kv_dtype=None if args.kv_dtype == "model" else args.kv_dtype,
                   page_size=args.page_size, ssm_dtype=args.ssm_dtype)

    def timed(new_tokens):
        model.generate(tokens, new_tokens, **options).block_until_ready()  # compiles
        start = time.perf_counter()
        out = model.generate(tokens, new_tokens, **options).block_until_ready()
        return out, time.perf_counter() - start

    try:
        _, prefill_s = timed(1)
        out, total_s = timed(args.new_tokens)
    except (TypeError, ValueError) as exc:
        raise trainer.UsageError(str(exc).split("\n")[0]) from None
    rows = tokens.shape[0]
    samples = [(bytes(np.asarray(tokens[i, :lengths[i]]).astype(np.uint8).tolist())
                + bytes(np.asarray(out[i]).astype(np.uint8).tolist())).decode("utf-8", "replace")
               for i in range(rows)]
    return {"step": step, "samples": samples,
            "prefill_tokens_per_s": float(jnp.sum(lengths)) / prefill_s,
            "decode_tokens_per_s": rows * (args.new_tokens - 1) / max(total_s - prefill_s, 1e-9)}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = run(args)
    except trainer.UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for sample in result["samples"]:
        print(sample, "\n" + "-" * 40)
    print(f"checkpoint of step {result['step']} on {jax.devices()[0].device_kind}: prefill "
          f"{result['prefill_tokens_per_s']:,.0f} tokens/s, decode "
          f"{result['decode_tokens_per_s']:,.0f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
