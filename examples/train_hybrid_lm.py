"""Train `flax_layers.HybridLM` as a byte-level language model on a public-domain corpus.

The model reads raw UTF-8 bytes (vocabulary 256) of the corpus shipped in `examples/data/`
(Shakespeare; see its README) and learns to predict the next byte. Everything a real training
run needs is here and small enough to read in one sitting:

- data: the file's bytes are the tokens; the last `--eval-fraction` is held out for evaluation;
  training batches are random windows drawn by a seeded `numpy.random.Generator` whose state is
  checkpointed, so a resumed run sees exactly the batches an uninterrupted run would have;
- a jit-compiled train step: AdamW with linear warmup and cosine decay, global-norm gradient
  clipping; float32 parameters, bfloat16 compute on a GPU (float32 on a CPU);
- a progress bar with the loss and tokens/s (and model FLOP utilisation on a known GPU) on a
  terminal, plain progress lines elsewhere (a log file, a pipe), an eval loss every
  `--eval-every` steps, orbax checkpoints every `--checkpoint-every` steps (parameters,
  optimizer state, step and data RNG state) and exact `--resume`;
- at the end, text sampled through the model's decode caches (`HybridLM.generate`);
- every local device: data parallel by default; `--mesh data=2,fsdp=2,context=2` also shards
  the parameters and optimizer state (fsdp, gathered for each step) and the sequence (context
  parallelism; the model follows its tokens' sharding); a tensor axis splits attention heads,
  MLP units, the vocabulary and the Mamba2 scan (tensor parallelism). A checkpoint restores
  onto any mesh.

With the package installed (`pip install -e .`, see the README), run from the repository root:

    python examples/train_hybrid_lm.py                 # tiny model, minutes on a CPU
    python examples/train_hybrid_lm.py --preset small  # on a GPU: Pallas kernels, bf16, MFU
    python examples/train_hybrid_lm.py --resume        # continue an interrupted run
    python examples/train_hybrid_lm.py --overwrite     # start over, deleting the old checkpoints
    python examples/train_hybrid_lm.py --mesh data=2,context=4  # 8 devices, sequence over 4

The flags are parsed before jax is imported: `--help` and a mistyped flag answer at once.

The default run (tiny preset, 1000 steps of 16 x 128 bytes) takes the held-out loss from
ln 256 = 5.55 to about 1.6 nats per byte. The small preset (23M parameters) is sized for a GPU;
on this 1 MB corpus it starts to overfit after ~200 steps of 16k bytes, hence its default of 250.

`--workdir` (default `runs/hybrid_lm`) receives `metrics.jsonl` (one JSON object per logged
step), `loss.png`, `samples.txt` and `checkpoints/`. A run never loses another's checkpoints:

- every flag, the corpus and the model configuration (built abstractly, so that all the model's
  own checks run) are checked before the workdir is changed; a mistake exits with status 2 and
  one line `error: ...`;
- a fresh run in a workdir that holds checkpoints is refused: pass `--resume` to continue them or
  `--overwrite` to delete them (and metrics.jsonl) and start over;
- `--resume` restores the newest checkpoint that loads. A newer one that does not (cut short or
  damaged: truncated array files, unreadable meta JSON, missing files) is reported, one line
  each, and moved to `checkpoints/<step>.corrupt-<n>`, out of the resumed run's way. A torn last
  line of metrics.jsonl (a crash mid-write) is dropped with a warning.
"""

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np


def import_training_stack() -> None:
    """Imports jax, flax, optax, orbax, tqdm and this repository's packages (seconds) as this
    module's globals, where the functions below find them.

    Run as a script, `parse_args` calls it once argparse has parsed the flags, so that --help
    and mistyped flags answer at once; imported as a module (tests, notebooks,
    examples/generate.py), the module calls it on import, below. Annotations that name these
    modules are strings: the functions are defined before the names exist."""
    global jax, jnp, optax, ocp, nnx, tqdm, AxisType, NamedSharding, P
    global HybridLM, HybridLMConfig, gather_parameters, parameter_shardings, _device
    import jax
    import jax.numpy as jnp
    import optax
    import orbax.checkpoint as ocp
    from flax import nnx
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P
    from tqdm import tqdm

    from flax_layers import HybridLM, HybridLMConfig, gather_parameters, parameter_shardings
    from pallas_kernels import _compat, _device

    _compat.silence_triton_deprecation()


if __name__ != "__main__":  # imported as a module: every function is usable at once
    import_training_stack()


DEFAULT_CORPUS = Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt"
DEFAULT_PROMPTS = ("ROMEO:\n", "First Citizen:\nWe are", "To be, or not to be")
VOCAB_SIZE = 256  # one token per byte

# Flags whose defaults depend on --preset: the tiny model trains on a CPU in minutes, the small
# one is sized for a GPU.
PRESET_DEFAULTS: dict[str, dict[str, Any]] = {
    "tiny": {"batch_size": 16, "seq_len": 128, "lr": 3e-3, "steps": 1000},
    # 23M parameters overfit the 1 MB corpus after ~3 epochs (~200 steps of 16k tokens).
    "small": {"batch_size": 32, "seq_len": 512, "lr": 1e-3, "steps": 250},
}

# Settings that define a run: resuming with a different value would not continue the same run.
RUN_KEYS = ("preset", "override", "batch_size", "seq_len", "lr", "warmup_steps", "weight_decay",
            "clip_norm", "seed", "eval_fraction", "dtype", "corpus_sha256")


class UsageError(Exception):
    """A problem with the inputs (flags, corpus, workdir) to report without a traceback."""


def _first_line(exc: BaseException, max_chars: int = 200) -> str:
    """The first line of an exception's message (its class name if it has none), cut to
    `max_chars`: tensorstore's run to kilobytes."""
    lines = str(exc).strip().splitlines()
    line = lines[0] if lines else type(exc).__name__
    return line if len(line) <= max_chars else line[:max_chars - 3] + "..."


# --------------------------------------------------------------------------- command line


def _number(text: str, kind: type, expected: str,
            accept: Callable[[int | float], bool]) -> int | float:
    """`text` as `kind` (int or float) when `accept(value)`; else ArgumentTypeError saying what
    was expected (argparse reports it as "argument --flag: must be ...")."""
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not accept(value):
        raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
    return value


def _integer(text: str) -> int:
    return _number(text, int, "an integer", lambda v: True)


def _positive_int(text: str) -> int:
    return _number(text, int, "a positive integer", lambda v: v > 0)


def _non_negative_int(text: str) -> int:
    return _number(text, int, "an integer >= 0", lambda v: v >= 0)


def _positive_float(text: str) -> float:
    return _number(text, float, "a positive number", lambda v: 0 < v < math.inf)


def _non_negative_float(text: str) -> float:
    return _number(text, float, "a number >= 0", lambda v: 0 <= v < math.inf)


def _fraction(text: str) -> float:
    return _number(text, float, "a number between 0 and 1 (exclusive)", lambda v: 0 < v < 1)


MESH_AXES = ("data", "fsdp", "context", "tensor")


def _mesh_axes(text: str) -> dict[str, int]:
    """"data=2,context=4" -> {"data": 2, "context": 4} (axes of MESH_AXES, sizes >= 1)."""
    axes = {}
    for item in text.split(","):
        name, sep, size = item.partition("=")
        if not sep or name.strip() not in MESH_AXES or name.strip() in axes:
            raise argparse.ArgumentTypeError(
                f"must be AXIS=N pairs with AXIS one of {MESH_AXES}, each once, got {text!r}")
        axes[name.strip()] = _positive_int(size)
    return axes


class _Parser(argparse.ArgumentParser):
    """Reports a bad flag in one line ("error: ...; see --help") and exits with status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}; see {self.prog} --help\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: ...)" only where there is a default worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface (see `parse_args`)."""
    parser = _Parser(
        prog="train_hybrid_lm.py",
        description="Train flax_layers.HybridLM as a byte-level language model.",
        formatter_class=_HelpFormatter,
    )
    model = parser.add_argument_group("model")
    model.add_argument("--preset", choices=("tiny", "small"), default="tiny",
                       help="HybridLMConfig preset (vocabulary forced to 256 bytes)")
    model.add_argument("--implementation", choices=("auto", "pallas", "xla"), default="auto",
                       help="auto: Pallas kernels on a GPU, the jnp reference elsewhere")
    model.add_argument("--override", action="append", default=[], metavar="FIELD=VALUE",
                       help="change one HybridLMConfig field of the preset, e.g. num_layers=2 "
                            "(repeatable)")
    model.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                       help="compute dtype (parameters stay float32); auto: bfloat16 on a GPU")
    devices = parser.add_argument_group("devices")
    devices.add_argument("--mesh", type=_mesh_axes, default=None, metavar="AXIS=N[,AXIS=N]",
                         help="the device mesh: data (the batch), fsdp (the batch, and the "
                              "parameters and optimizer state sharded), context (the "
                              "sequence) and tensor (heads, MLP units, vocabulary) axes, e.g. "
                              "data=2,fsdp=2,context=2 (default: data over every local device)")
    devices.add_argument("--context-parallelism", choices=("all_gather", "ring"),
                         default="all_gather",
                         help="how attention's devices share keys and values on a context "
                              "axis")
    data = parser.add_argument_group("data")
    data.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="a text file")
    data.add_argument("--eval-fraction", type=_fraction, default=0.1,
                      help="the last part of the corpus held out for evaluation")
    data.add_argument("--batch-size", type=_positive_int, default=None,
                      help="windows per step (default: 16 for tiny, 32 for small)")
    data.add_argument("--seq-len", type=_positive_int, default=None,
                      help="bytes per training window (default: 128 for tiny, 512 for small)")
    opt = parser.add_argument_group("optimisation")
    opt.add_argument("--steps", type=_positive_int, default=None,
                     help="train until this many optimizer steps in total (default: 1000 for "
                          "tiny, 250 for small)")
    opt.add_argument("--lr", type=_positive_float, default=None,
                     help="peak learning rate (default: 3e-3 for tiny, 1e-3 for small)")
    opt.add_argument("--warmup-steps", type=_non_negative_int, default=50,
                     help="steps of linear learning-rate warmup from 0")
    opt.add_argument("--schedule-steps", type=_positive_int, default=None,
                     help="length of the warmup + cosine schedule (default: --steps; on "
                          "--resume: the checkpoint's). Set it to the final step count when "
                          "training in parts")
    opt.add_argument("--weight-decay", type=_non_negative_float, default=0.1,
                     help="AdamW decoupled weight decay (matrices only)")
    opt.add_argument("--clip-norm", type=_positive_float, default=1.0,
                     help="global gradient-norm clip")
    opt.add_argument("--seed", type=_integer, default=0, help="parameters, data order and sampling")
    run = parser.add_argument_group("logging and checkpoints")
    run.add_argument("--workdir", type=Path, default=Path("runs/hybrid_lm"),
                     help="where metrics.jsonl, loss.png, samples.txt and checkpoints/ go")
    start = run.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true",
                       help="continue from the newest checkpoint in --workdir that loads; newer "
                            "ones that do not (e.g. cut short by a crash) are reported and moved "
                            "to checkpoints/STEP.corrupt-N")
    start.add_argument("--overwrite", action="store_true",
                       help="start a fresh run in a --workdir that holds checkpoints, deleting "
                            "them and metrics.jsonl once all flags are checked (without it, such "
                            "a run is refused)")
    run.add_argument("--log-every", type=_positive_int, default=10,
                     help="steps per metrics.jsonl record (loss averaged over them)")
    run.add_argument("--eval-every", type=_positive_int, default=100,
                     help="steps between eval losses (and at the last step)")
    run.add_argument("--eval-batches", type=_positive_int, default=8,
                     help="batches of held-out windows per evaluation")
    run.add_argument("--checkpoint-every", type=_positive_int, default=250,
                     help="steps between checkpoints (and at the last step)")
    run.add_argument("--keep-checkpoints", type=_positive_int, default=2,
                     help="how many of the newest checkpoints to keep")
    run.add_argument("--no-progress", action="store_true",
                     help="no progress bar, plain progress lines instead (as when the output is "
                          "not a terminal)")
    sample = parser.add_argument_group("samples")
    sample.add_argument("--sample-tokens", type=_non_negative_int, default=300,
                        help="bytes generated per prompt at the end (0: no samples)")
    sample.add_argument("--temperature", type=_non_negative_float, default=0.8,
                        help="sampling temperature (0: always the most likely byte)")
    sample.add_argument("--prompt", action="append", default=None, dest="prompts",
                        help="a prompt to continue (repeatable; default: three Shakespeare lines)")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses and checks the flags, the model configuration included: `args.config` is the
    checked HybridLMConfig (`model_config`). A mistake exits with status 2 and a one-line usage
    message.

    The training stack is imported (`import_training_stack`) only once argparse has parsed the
    flags, so that --help and malformed flags answer at once."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prompts is not None and any(not p for p in args.prompts):
        parser.error("--prompt must not be empty")
    import_training_stack()
    try:
        args.override = parse_overrides(args.override)
    except ValueError as exc:
        parser.error(f"--override: {exc}")
    if args.prompts is None:
        args.prompts = list(DEFAULT_PROMPTS)
    for name, value in PRESET_DEFAULTS[args.preset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        args.config = model_config(args)
    except UsageError as exc:
        parser.error(str(exc))
    return args


def overridable_fields() -> dict[str, type]:
    """The HybridLMConfig fields that --override may change, with their types: the sizes (int
    and float fields) but the vocabulary, which is the bytes'. Of the others, the dtype,
    implementation and context parallelism have flags; the sequence order stays contiguous,
    the order of the batches' tokens."""
    return {f.name: type(f.default) for f in dataclasses.fields(HybridLMConfig)
            if type(f.default) in (int, float) and f.name != "vocab_size"}


def parse_overrides(items: Sequence[str]) -> dict[str, int | float]:
    """["num_layers=2", ...] -> {"num_layers": 2, ...}, typed like the config's fields."""
    fields, overrides = overridable_fields(), {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in fields:
            raise ValueError(f"expected FIELD=VALUE with FIELD one of {sorted(fields)}, "
                             f"got {item!r}")
        try:
            value = fields[name](text)
        except ValueError:
            kind = "an integer" if fields[name] is int else "a number"
            raise ValueError(f"{name} must be {kind}, got {text!r}") from None
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {text!r}")
        overrides[name] = value
    return overrides


# --------------------------------------------------------------------------- data


def load_corpus(path: str | Path) -> np.ndarray:
    """The file's bytes as a uint8 array (the token ids). Raises UsageError if unusable."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"corpus file not found: {path}")
    if not path.is_file():
        raise UsageError(f"corpus is not a file: {path}")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read corpus {path}: {exc.strerror or exc}") from None
    if not data:
        raise UsageError(f"corpus file is empty: {path}")
    return np.frombuffer(data, dtype=np.uint8)


def split_corpus(tokens: np.ndarray, eval_fraction: float,
                 seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval): the last `eval_fraction` of the tokens is held out.

    Each part must hold at least one window of `seq_len + 1` tokens (inputs plus the next-token
    targets), else UsageError.
    """
    n_eval = int(len(tokens) * eval_fraction)
    train, held_out = tokens[:len(tokens) - n_eval], tokens[len(tokens) - n_eval:]
    for name, part in (("training", train), ("evaluation", held_out)):
        if len(part) < seq_len + 1:
            raise UsageError(
                f"corpus too small: its {name} split has {len(part)} bytes, fewer than "
                f"--seq-len + 1 = {seq_len + 1} (corpus {len(tokens)} bytes, eval fraction "
                f"{eval_fraction}); use a larger corpus or a shorter --seq-len")
    return train, held_out


class BatchSampler:
    """Random training windows: each batch is (batch_size, seq_len + 1) int32 token ids whose
    start offsets are drawn uniformly by a seeded numpy Generator (PCG64).

    `state()` / `set_state()` give the Generator's state as plain JSON-serialisable data, which
    the checkpoint stores so that a resumed run draws the same batches.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int):
        if len(tokens) < seq_len + 1:
            raise ValueError(f"need at least {seq_len + 1} tokens, got {len(tokens)}")
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self._offsets = np.arange(seq_len + 1)

    def __iter__(self) -> Iterator[np.ndarray]:
        return self

    def __next__(self) -> np.ndarray:
        starts = self.rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        return self.tokens[starts[:, None] + self._offsets].astype(np.int32)

    def state(self) -> dict[str, Any]:
        return self.rng.bit_generator.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state


def make_batches(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int) -> BatchSampler:
    """An endless iterator of shuffled training batches (see BatchSampler)."""
    return BatchSampler(tokens, batch_size, seq_len, seed)


def eval_batches(tokens: np.ndarray, batch_size: int, seq_len: int,
                 num_batches: int) -> list[np.ndarray]:
    """Fixed evaluation batches: windows at evenly spaced offsets of the held-out tokens, the
    same at every evaluation so that eval losses are comparable."""
    starts = np.linspace(0, len(tokens) - seq_len - 1, num=batch_size * num_batches)
    windows = tokens[starts.astype(np.int64)[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    return list(windows.reshape(num_batches, batch_size, seq_len + 1))


# --------------------------------------------------------------------------- model and steps


def make_config(preset: str, implementation: str = "auto", dtype: str = "auto",
                overrides: dict[str, Any] | None = None,
                context_parallelism: str = "all_gather") -> "HybridLMConfig":
    """The preset with a 256-byte vocabulary, the implementation (auto -> None: kernels on a GPU,
    the reference elsewhere), the compute dtype (auto -> bfloat16 on a GPU, else float32) and
    any field overrides. `HybridLMConfig` may reject the fields (ValueError); the model rejects
    what it cannot build or run (see `check_model`)."""
    config = HybridLMConfig.preset(preset, **(overrides or {}))
    if dtype == "auto":
        dtype = "bfloat16" if _device.on_gpu() else "float32"
    return dataclasses.replace(
        config, vocab_size=VOCAB_SIZE,
        implementation=None if implementation == "auto" else implementation,
        dtype=jnp.bfloat16 if dtype == "bfloat16" else None,
        context_parallelism=context_parallelism)


def check_model(config: "HybridLMConfig", seq_len: int) -> None:
    """Builds the model and runs it on one window of `seq_len` tokens abstractly (shapes only:
    no parameter is initialised, nothing is compiled), so that every check of the model's
    constructor and kernels runs. Raises what they raise (ValueError, TypeError, ...)."""

    def forward() -> "jax.Array":
        return HybridLM(config, rngs=nnx.Rngs(0))(jnp.zeros((1, seq_len), jnp.int32))

    jax.eval_shape(forward)


def model_config(args: argparse.Namespace) -> "HybridLMConfig":
    """`make_config` for the flags, checked by `check_model`. Raises UsageError, naming the
    flags, for a configuration that the config or the model rejects."""
    try:
        config = make_config(args.preset, args.implementation, args.dtype, args.override,
                             args.context_parallelism)
        check_model(config, args.seq_len)
    except (ValueError, TypeError, ZeroDivisionError) as exc:
        flags = " ".join([f"--preset {args.preset}",
                          *(f"--override {k}={v}" for k, v in args.override.items())])
        raise UsageError(f"invalid model configuration ({flags}): {_first_line(exc)}") from None
    return config


def make_optimizer(lr: float, warmup_steps: int, schedule_steps: int, weight_decay: float,
                   clip_norm: float) -> "tuple[optax.GradientTransformation, optax.Schedule]":
    """AdamW (b2 0.95) on a linear warmup to `lr` then cosine decay to lr / 10 at
    `schedule_steps`, after global-norm clipping. Norm scales and biases (1-D parameters) get no
    weight decay."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=warmup_steps,
        decay_steps=max(schedule_steps, warmup_steps + 1), end_value=lr / 10)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    tx = optax.chain(
        optax.clip_by_global_norm(clip_norm),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay_mask),
    )
    return tx, schedule


def next_token_loss(graphdef: "nnx.GraphDef", params: "nnx.State", batch: "jax.Array",
                    tokens: "NamedSharding | None" = None) -> "jax.Array":
    """Mean cross-entropy (nats per byte) of predicting batch[:, 1:] from batch[:, :-1], both
    placed by `tokens` on a mesh (the model's activations follow them). Parameters sharded
    over fsdp are gathered first (their gradients come back reduce-scattered)."""
    model = nnx.merge(graphdef, gather_parameters(params))
    inputs, labels = batch[:, :-1], batch[:, 1:]
    if tokens is not None:
        inputs, labels = (jax.sharding.reshard(x, tokens) for x in (inputs, labels))
    logits = model(inputs)
    # The label's logit by a masked sum, not a gather: over a tensor axis the vocabulary of
    # the logits is sharded, and a reduction needs no gather of it.
    with jax.named_scope("loss"):
        picked = jnp.sum(jnp.where(jnp.arange(logits.shape[-1]) == labels[..., None], logits,
                                   0.0), axis=-1)
        return (jax.nn.logsumexp(logits, axis=-1) - picked).mean()


def make_steps(graphdef: "nnx.GraphDef", tx: "optax.GradientTransformation",
               tokens: "NamedSharding | None" = None):
    """(train_step, eval_step), jit-compiled; `tokens` as in `next_token_loss`.

    train_step(params, opt_state, batch) -> (params, opt_state, loss) donates params and
    optimizer state; eval_step(params, batch) -> loss.
    """

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(next_token_loss, argnums=1)(graphdef, params, batch,
                                                                     tokens)
        with jax.named_scope("optimizer"):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

    def eval_step(params, batch):
        return next_token_loss(graphdef, params, batch, tokens)

    return jax.jit(train_step, donate_argnums=(0, 1)), jax.jit(eval_step)


def count_params(params: "nnx.State") -> int:
    return int(sum(x.size for x in jax.tree.leaves(params)))


def model_flops_per_token(config: "HybridLMConfig", params: "nnx.State", seq_len: int) -> float:
    """Approximate training FLOPs (forward + backward) per token.

    6 x the parameters each token multiplies with (the shared block counts once per use, the tied
    embedding once as the LM head), plus causal attention (6 x T x heads x attn_head_dim per
    use, the PaLM formula halved for causality), plus the chunked SSD scan of each Mamba2 block
    (forward ~ G*Q*N + H*(Q*P + 4*N*P) per token for chunk Q, state N, head dim P =
    ssm_head_dim; x3 with the backward).
    """
    uses = config.num_layers // config.shared_every
    shared = count_params(params["shared"])
    matmul_params = count_params(params) + (uses - 1) * shared
    attention = 6 * uses * seq_len * config.num_heads * config.attn_head_dim
    d_inner = config.expand * config.d_model
    heads = d_inner // config.ssm_head_dim
    q, n, p = min(config.chunk_size, seq_len), config.d_state, config.ssm_head_dim
    ssd = 3 * config.num_layers * (config.ngroups * q * n + heads * (q * p + 4 * n * p))
    return float(6 * matmul_params + attention + ssd)


# --------------------------------------------------------------------------- workdir


def check_workdir(workdir: Path) -> None:
    """Raises UsageError unless `workdir` is a writable directory or can be created as one."""
    existing = next(p for p in (workdir, *workdir.parents) if p.exists())
    if not existing.is_dir():
        where = "is" if existing == workdir else f"is below {existing}, which is"
        raise UsageError(f"--workdir {workdir} {where} not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--workdir {workdir}: {existing} is not writable")


def check_start(ckpt_dir: Path, resume: bool, overwrite: bool) -> None:
    """--resume needs a checkpoint in `ckpt_dir`; a fresh run must not replace checkpoints
    unless --overwrite. Raises UsageError otherwise."""
    names = [p.name for p in ckpt_dir.iterdir()] if ckpt_dir.is_dir() else []
    steps = sorted(int(name) for name in names if name.isdigit())  # orbax's step directories
    if resume and not steps:
        raise UsageError(f"--resume: no checkpoint in {ckpt_dir}")
    if steps and not resume and not overwrite:
        raise UsageError(f"--workdir {ckpt_dir.parent} holds checkpoints (steps "
                         f"{', '.join(map(str, steps))}); pass --resume to continue them or "
                         "--overwrite to start over")


# --------------------------------------------------------------------------- checkpoints


def checkpoint_manager(directory: Path, keep: int) -> "ocp.CheckpointManager":
    """Synchronous orbax checkpoints (the train step donates its buffers, so each save finishes
    before training continues), the newest `keep` kept."""
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=False)
    return ocp.CheckpointManager(directory.resolve(), options=options)


def save_checkpoint(manager: "ocp.CheckpointManager", step: int, params: "nnx.State",
                    opt_state: Any, sampler: BatchSampler, run_config: dict[str, Any]) -> None:
    """Saves parameters and optimizer state (arrays) and step, data RNG state and the run's
    settings (JSON) under `step`."""
    meta = {"step": step, "data_rng": sampler.state(), "run_config": run_config}
    manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
        meta=ocp.args.JsonSave(meta)), force=True)
    manager.wait_until_finished()


def restore_checkpoint(manager: "ocp.CheckpointManager", step: int, params: "nnx.State",
                       opt_state: Any, check_meta: Callable[[dict[str, Any]], None]
                       ) -> "tuple[nnx.State, Any, dict[str, Any]]":
    """(params, opt_state, meta) of the checkpoint of `step`, restored into the structure of the
    given (freshly initialised) `params` and `opt_state`. `check_meta(meta)` runs before the
    arrays are read (so that it can refuse a checkpoint of another run before a shape mismatch
    does). Raises whatever a damaged checkpoint makes orbax or tensorstore raise, or ValueError
    for meta that is not what `save_checkpoint` writes."""
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if (not isinstance(meta, dict) or meta.get("step") != step
            or not isinstance(meta.get("data_rng"), dict)
            or not isinstance(meta.get("run_config"), dict)):
        raise ValueError(f"its meta is not what save_checkpoint writes for step {step}")
    check_meta(meta)
    target = {"params": params, "opt_state": opt_state}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    state = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract)))["state"]
    return state["params"], state["opt_state"], meta


def restore_newest(manager: "ocp.CheckpointManager", params: "nnx.State", opt_state: Any,
                   check_meta: Callable[[dict[str, Any]], None]
                   ) -> tuple[tuple[int, "nnx.State", Any, dict[str, Any]] | None,
                              list[tuple[int, str]]]:
    """((step, params, opt_state, meta) of the newest checkpoint that loads, or None if none
    does; [(step, why), ...] of the newer ones that do not), see `restore_checkpoint`. A
    UsageError from `check_meta` is raised at once."""
    _ignore_reads_left_in_flight()
    failed = []
    for step in sorted(manager.all_steps(), reverse=True):
        try:
            return (step, *restore_checkpoint(manager, step, params, opt_state, check_meta)), failed
        except UsageError:
            raise
        except Exception as exc:  # any other failure to load means: try an older one
            failed.append((step, f"{type(exc).__name__}: {_first_line(exc)}"))
    return None, failed


_ORBAX_PATH = f"{os.sep}orbax{os.sep}"


# What tensorstore's errors say of a read (orbax reads its arrays through it).
_TENSORSTORE_READ = "OCDBT database at local file"
# The RuntimeWarning of an orbax read coroutine collected before it was awaited.
_UNAWAITED_READ = r"coroutine '_read_array\w*' was never awaited"


def _keep_log_record(record: logging.LogRecord) -> bool:
    """False for asyncio's report of an orbax task or future whose exception nobody
    retrieved."""
    message = record.getMessage()
    return not (message.startswith(("Task exception was never retrieved",
                                    "Future exception was never retrieved"))
                and (_ORBAX_PATH in message or _TENSORSTORE_READ in message))


def _ignore_reads_left_in_flight() -> None:
    """When a restore fails, the reads of the other arrays are abandoned. Those still in flight
    finish later, into orbax's closed event loop (an unraisable RuntimeError("Event loop is
    closed")), as orbax read coroutines that raise while being collected (an unraisable
    "Encountered error while reading array ..." with kilobytes of tensorstore spec), or as
    orbax read tasks or futures whose exception nobody retrieved (asyncio logs "Task (or
    Future) exception was never retrieved" with the same spec, or tensorstore's read error,
    when they are collected), or as read coroutines never awaited (a RuntimeWarning at exit).
    Python would print each, although the failed restore is reported once already. Installs
    (once) a `sys.unraisablehook` that drops the first two kinds and passes anything else on to
    the previous hook, a filter on asyncio's logger that drops the third, and a warnings filter
    for the fourth."""
    warnings.filterwarnings("ignore", message=_UNAWAITED_READ, category=RuntimeWarning)
    asyncio_logger = logging.getLogger("asyncio")
    if _keep_log_record not in asyncio_logger.filters:
        asyncio_logger.addFilter(_keep_log_record)
    previous = sys.unraisablehook
    if getattr(previous, "drops_abandoned_reads", False):
        return

    def from_orbax(obj: Any) -> bool:
        code = getattr(obj, "cr_code", None)
        return code is not None and _ORBAX_PATH in code.co_filename

    def hook(unraisable: Any) -> None:
        exc = unraisable.exc_value
        closed_loop = isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"
        if not (closed_loop or from_orbax(unraisable.object)):
            previous(unraisable)

    hook.drops_abandoned_reads = True
    sys.unraisablehook = hook


def set_aside(step_dir: Path) -> Path:
    """Renames a checkpoint directory that does not load to `<step>.corrupt-<n>` (the first
    free n), out of orbax's way (it lists only numeric names) but kept for inspection."""
    n = 1
    while (aside := step_dir.with_name(f"{step_dir.name}.corrupt-{n}")).exists():
        n += 1
    step_dir.rename(aside)
    return aside


# --------------------------------------------------------------------------- outputs


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of metrics.jsonl. Lines that are not a record (e.g. the last one, torn by a
    crash mid-write) are dropped with a warning."""
    if not path.exists():
        return []
    records, unreadable = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
        else:
            unreadable += 1
    if unreadable:
        print(f"warning: dropped {unreadable} unreadable line(s) of {path}", file=sys.stderr)
    return records


def plot_losses(records: Sequence[dict[str, Any]], path: Path, title: str = "") -> None:
    """Training and eval loss against step, as a PNG (Agg renderer; no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", lw=1.2)
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval loss", lw=1.5, ms=4)
    ax.axhline(math.log(VOCAB_SIZE), color="gray", ls=":", lw=1, label="ln 256 (uniform)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title or "HybridLM, byte-level")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def generate_samples(graphdef: "nnx.GraphDef", params: "nnx.State", prompts: Sequence[str],
                     max_new_tokens: int, temperature: float, seed: int) -> list[str]:
    """Continues each prompt by `max_new_tokens` bytes through the model's decode caches;
    returns prompt + continuation, decoded as UTF-8 with errors replaced (the parameters
    whole on every device). Prints a line before the first sample and after each one: a
    sample takes seconds, or a minute on a CPU (the first one compiles)."""
    model = nnx.merge(graphdef, gather_parameters(params, axes=None))
    keys = jax.random.split(jax.random.key(seed), len(prompts))
    print(f"sampling {max_new_tokens} bytes for each of {len(prompts)} prompts", flush=True)
    samples = []
    for i, (prompt, key) in enumerate(zip(prompts, keys, strict=True), start=1):
        t_sample = time.perf_counter()
        prompt_bytes = prompt.encode("utf-8")
        tokens = jnp.asarray(np.frombuffer(prompt_bytes, np.uint8)[None].astype(np.int32))
        new = model.generate(tokens, max_new_tokens, temperature=temperature, rng=key)
        samples.append((prompt_bytes + bytes(np.asarray(new[0]).astype(np.uint8).tolist()))
                       .decode("utf-8", errors="replace"))
        print(f"sample {i}/{len(prompts)} done in {time.perf_counter() - t_sample:.1f} s",
              flush=True)
    return samples


# --------------------------------------------------------------------------- training


def _sha256(tokens: np.ndarray) -> str:
    return hashlib.sha256(tokens.tobytes()).hexdigest()


def run_settings(args: argparse.Namespace, config: "HybridLMConfig",
                 tokens: np.ndarray) -> dict[str, Any]:
    """The settings that define the run, stored in each checkpoint: `RUN_KEYS` must match on
    --resume; `schedule_steps` is continued unless --schedule-steps is given."""
    return {
        "preset": args.preset, "override": args.override, "batch_size": args.batch_size,
        "seq_len": args.seq_len, "lr": args.lr, "warmup_steps": args.warmup_steps,
        "weight_decay": args.weight_decay, "clip_norm": args.clip_norm, "seed": args.seed,
        "eval_fraction": args.eval_fraction,
        "dtype": "bfloat16" if config.dtype == jnp.bfloat16 else "float32",
        "corpus_sha256": _sha256(tokens), "schedule_steps": args.schedule_steps or args.steps,
    }


def _check_resume(run_config: dict[str, Any], meta: dict[str, Any]) -> None:
    """Raises UsageError unless the checkpoint (`meta`) was saved by a run with these settings."""
    saved = meta["run_config"]
    diffs = [f"{key}: {run_config[key]!r} now, {saved.get(key)!r} in the checkpoint"
             for key in RUN_KEYS if saved.get(key) != run_config[key]]
    if diffs:
        raise UsageError(f"--resume with settings that differ from the checkpoint's of step "
                         f"{meta['step']} (" + "; ".join(diffs) + "); resume with the same flags "
                         "or use a new --workdir")


@dataclasses.dataclass
class Run:
    """A training run, as `setup` builds it from the flags. `resume_run` moves it to a
    checkpoint; `train_loop` trains it on (its `params`, `opt_state`, `records` and sampler
    state advance with the steps)."""

    args: argparse.Namespace  # `parse_args`: the flags and the model's `config`
    workdir: Path
    tokens: np.ndarray  # the whole corpus, one token per byte
    train_tokens: np.ndarray
    eval_tokens: np.ndarray
    run_config: dict[str, Any]  # `run_settings`, stored in each checkpoint
    graphdef: "nnx.GraphDef"
    params: "nnx.State"
    opt_state: Any
    schedule: "optax.Schedule"  # learning rate by step
    train_step: Callable[..., Any]  # jitted, see `make_steps`
    eval_step: Callable[..., Any]
    sampler: BatchSampler  # training batches
    eval_set: list["jax.Array"]  # the fixed evaluation batches
    n_params: int
    flops_per_token: float  # `model_flops_per_token`
    device_kind: str
    peak: float | None  # the devices' peak FLOP/s (`_device.peak_flops`); None if unknown
    mesh: "jax.sharding.Mesh | None"  # `make_run_mesh`; None on one device
    start_step: int = 0  # where this invocation starts: 0, or the checkpoint's step on --resume
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # metrics.jsonl's

    @property
    def token_sharding(self) -> "NamedSharding | None":
        """Where the model's (B, T) input tokens go: the batch over data, the sequence over
        context (the activations follow them)."""
        if self.mesh is None:
            return None
        batch = tuple(a for a in ("data", "fsdp") if a in self.mesh.shape) or None
        return NamedSharding(self.mesh, P(batch, "context" if "context" in self.mesh.shape
                                          else None))

    @property
    def batch_sharding(self) -> "NamedSharding | None":
        """Where a (B, T + 1) batch goes: its rows over data and fsdp (T + 1 does not
        split)."""
        return None if self.mesh is None else NamedSharding(self.mesh,
                                                            P(self.token_sharding.spec[0]))

    def place(self, batch: np.ndarray) -> "jax.Array":
        """A (B, T + 1) batch on the devices (`batch_sharding`)."""
        return jnp.asarray(batch) if self.mesh is None else jax.device_put(batch,
                                                                           self.batch_sharding)

    @property
    def ckpt_dir(self) -> Path:
        return self.workdir / "checkpoints"

    @property
    def metrics_path(self) -> Path:
        return self.workdir / "metrics.jsonl"


def _optimizer(args: argparse.Namespace, graphdef: "nnx.GraphDef", schedule_steps: int,
               tokens: "NamedSharding | None"):
    """(tx, schedule, train_step, eval_step) for the flags and a schedule of `schedule_steps`
    (see `make_optimizer`, `make_steps`)."""
    tx, schedule = make_optimizer(args.lr, args.warmup_steps, schedule_steps, args.weight_decay,
                                  args.clip_norm)
    return (tx, schedule, *make_steps(graphdef, tx, tokens))


def make_run_mesh(axes: dict[str, int] | None, batch_size: int, seq_len: int,
                  config: "HybridLMConfig") -> "jax.sharding.Mesh | None":
    """The mesh of --mesh (default: data over every local device), with Explicit axes, or None
    on one device. Raises UsageError when it needs more devices than there are, or the batch,
    the sequence (at least the Mamba2 conv's d_conv - 1 tokens per device) or the attention
    heads and Mamba2 groups do not split over it."""
    axes = axes or {"data": jax.device_count()}
    size = math.prod(axes.values())
    if size > jax.device_count():
        raise UsageError(f"--mesh {axes} needs {size} devices; {jax.device_count()} are here")
    if size == 1:
        return None
    rows, context = axes.get("data", 1) * axes.get("fsdp", 1), axes.get("context", 1)
    if batch_size % rows:
        raise UsageError(f"--batch-size {batch_size} does not split over {rows} data and fsdp "
                         "devices (--mesh)")
    if seq_len % context or seq_len // context < config.d_conv - 1:
        raise UsageError(f"--seq-len {seq_len} does not split over {context} context devices "
                         f"(--mesh) into pieces of at least {config.d_conv - 1} tokens")
    tensor = axes.get("tensor", 1)  # what does not split over it (MLP units, ...) stays whole
    if config.num_kv_heads % tensor:
        raise UsageError(f"the model's {config.num_kv_heads} attention kv heads do not split "
                         f"over {tensor} tensor devices (--mesh)")
    if config.ngroups > 1 and config.ngroups % tensor:
        raise UsageError(f"the model's {config.ngroups} Mamba2 groups do not split over "
                         f"{tensor} tensor devices (--mesh)")
    return jax.make_mesh(tuple(axes.values()), tuple(axes),
                         axis_types=(AxisType.Explicit,) * len(axes),
                         devices=jax.devices()[:size])


def on_mesh(run: Run) -> contextlib.AbstractContextManager:
    """`jax.set_mesh` of the run's mesh (nothing on one device)."""
    return contextlib.nullcontext() if run.mesh is None else jax.set_mesh(run.mesh)


def setup(args: argparse.Namespace) -> Run:
    """Checks the inputs that `parse_args` has not, then builds a fresh run: the corpus
    (`load_corpus`, `split_corpus`), the workdir (`check_workdir`, `check_start`) and the mesh
    (`make_run_mesh`); then the initialised model of `args.config`, optimizer, steps and data.
    Changes nothing on disk. Raises UsageError for unusable inputs."""
    tokens = load_corpus(args.corpus)
    train_tokens, eval_tokens = split_corpus(tokens, args.eval_fraction, args.seq_len)
    config = args.config
    workdir = Path(args.workdir)
    check_workdir(workdir)
    check_start(workdir / "checkpoints", args.resume, args.overwrite)
    run_config = run_settings(args, config, tokens)
    mesh = make_run_mesh(args.mesh, args.batch_size, args.seq_len, config)

    graphdef, params = nnx.split(HybridLM(config, rngs=nnx.Rngs(args.seed)))
    if mesh is not None:  # embedding dimension over fsdp, heads/units/vocabulary over tensor
        params = jax.device_put(params, parameter_shardings(params, mesh))
    device_kind = jax.devices()[0].device_kind
    peak = _device.peak_flops(device_kind)
    run = Run(
        args=args, workdir=workdir, tokens=tokens, train_tokens=train_tokens,
        eval_tokens=eval_tokens, run_config=run_config, graphdef=graphdef,
        params=params, opt_state=None, schedule=None, train_step=None, eval_step=None,
        sampler=make_batches(train_tokens, args.batch_size, args.seq_len, args.seed),
        eval_set=[], n_params=count_params(params),
        flops_per_token=model_flops_per_token(config, params, args.seq_len),
        device_kind=device_kind,
        peak=peak and peak * (1 if mesh is None else mesh.size), mesh=mesh,
    )
    tx, run.schedule, run.train_step, run.eval_step = _optimizer(
        args, graphdef, run_config["schedule_steps"], run.token_sharding)
    with on_mesh(run):  # the optimizer state sharded as the parameters, counts replicated
        run.opt_state = jax.jit(tx.init)(params)
    run.eval_set = [run.place(b) for b in eval_batches(eval_tokens, args.batch_size,
                                                        args.seq_len, args.eval_batches)]
    return run


def resume_run(run: Run) -> None:
    """Moves `run` to the newest checkpoint in its workdir that loads, checked to continue this
    run (same settings, see `_check_resume`; fewer steps than --steps): its step, parameters,
    optimizer state and data RNG state, the metrics up to its step and, unless --schedule-steps
    is given, its schedule length.

    Only then are the newer checkpoints that do not load reported (one line each) and set aside,
    so that the resumed run can save its own checkpoints of those steps. Raises UsageError when
    no checkpoint loads or the one that does cannot be continued (`run` is then unchanged).
    """
    args, ckpt_dir = run.args, run.ckpt_dir
    manager = checkpoint_manager(ckpt_dir, args.keep_checkpoints)
    try:
        restored, failed = restore_newest(manager, run.params, run.opt_state,
                                          lambda meta: _check_resume(run.run_config, meta))
    finally:
        manager.close()
    if restored is None:
        reasons = "; ".join(f"step {step}: {why}" for step, why in failed)
        raise UsageError(f"--resume: no checkpoint in {ckpt_dir}"
                         + (f" loads ({reasons})" if failed else ""))
    step, params, opt_state, meta = restored
    if step >= args.steps:
        raise UsageError(f"--resume: the newest checkpoint that loads is at step {step}, nothing "
                         f"to do for --steps {args.steps}; pass a larger --steps")
    for bad_step, why in failed:
        aside = set_aside(ckpt_dir / str(bad_step))
        print(f"warning: skipped the checkpoint of step {bad_step}, which does not load ({why}); "
              f"moved it to {aside}", file=sys.stderr, flush=True)
    print(f"resuming from step {step}", flush=True)

    run.start_step, run.params, run.opt_state = step, params, opt_state
    run.sampler.set_state(meta["data_rng"])
    run.records = [r for r in read_metrics(run.metrics_path) if r["step"] <= step]
    if args.schedule_steps is None:
        # Continue the checkpoint's schedule. Its length does not change the structure of the
        # optimizer state, so the state restored above fits the rebuilt optimizer.
        run.run_config["schedule_steps"] = meta["run_config"]["schedule_steps"]
        _, run.schedule, run.train_step, run.eval_step = _optimizer(
            args, run.graphdef, run.run_config["schedule_steps"], run.token_sharding)


def open_workdir(run: Run) -> None:
    """The run's first change to its workdir, once every input is checked: --overwrite deletes
    the previous run's checkpoints; metrics.jsonl is rewritten with `run.records` (those up to
    the resumed step; none for a fresh run)."""
    if run.args.overwrite and run.ckpt_dir.exists():
        shutil.rmtree(run.ckpt_dir)
        print(f"note: --overwrite: removed the checkpoints and metrics of the previous run in "
              f"{run.workdir}", file=sys.stderr)
    run.workdir.mkdir(parents=True, exist_ok=True)
    run.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in run.records))


def _devices(run: Run) -> str:
    """"NVIDIA H200" or, on a mesh, "8 x NVIDIA H200 (data=2, context=4)"."""
    if run.mesh is None:
        return run.device_kind
    axes = ", ".join(f"{name}={size}" for name, size in run.mesh.shape.items())
    return f"{run.mesh.size} x {run.device_kind} ({axes})"


def compile_steps(run: Run) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(train_step, eval_step) of the run compiled ahead of time for its batch shape, so that the
    first logged tokens/s is not the compile time."""
    t_compile = time.perf_counter()
    batch_shape = jax.ShapeDtypeStruct(
        (run.args.batch_size, run.args.seq_len + 1), jnp.int32,
        sharding=run.batch_sharding)
    train_step = run.train_step.lower(run.params, run.opt_state, batch_shape).compile()
    eval_step = run.eval_step.lower(run.params, batch_shape).compile()
    print(f"compiled in {time.perf_counter() - t_compile:.1f} s", flush=True)
    return train_step, eval_step


PROGRESS_LINE_S = 30.0  # without a progress bar, a plain progress line at most this often


class Progress:
    """The training progress on the console. On a terminal (stdout and stderr both), unless
    --no-progress: a tqdm bar showing the latest metrics record. Elsewhere (a log file, a pipe,
    a notebook) the bar's carriage-return redraws would write hundreds of updates, so there is
    none: a plain line shows the latest record at most every `line_every_s` seconds instead.
    Records with an eval loss get a line either way."""

    def __init__(self, steps: int, start_step: int, no_progress: bool,
                 line_every_s: float = PROGRESS_LINE_S):
        self.has_bar = not no_progress and sys.stdout.isatty() and sys.stderr.isatty()
        self.bar = tqdm(total=steps, initial=start_step, disable=not self.has_bar, unit="step",
                        dynamic_ncols=True, desc="train")
        self.steps, self.line_every_s = steps, line_every_s
        self.last_line = time.perf_counter()

    def show(self, record: dict[str, Any]) -> None:
        """Shows a metrics record in the bar, and as a line ("step 100/1000: loss 2.3456, eval
        loss 2.4012, 51,234 tokens/s, MFU 31.2%", as far as it has them) when it has an eval
        loss or, without a bar, when the last line is `line_every_s` old."""
        summary = [f"loss {record['loss']:.4f}"]
        if "eval_loss" in record:
            summary.append(f"eval loss {record['eval_loss']:.4f}")
        if record.get("tokens_per_s") is not None:
            summary.append(f"{record['tokens_per_s']:,.0f} tokens/s")
        if "mfu" in record:
            summary.append(f"MFU {100 * record['mfu']:.1f}%")
        self.bar.set_postfix_str(", ".join(summary), refresh=False)
        now = time.perf_counter()
        if "eval_loss" in record or (not self.has_bar
                                     and now - self.last_line >= self.line_every_s):
            self.bar.write(f"step {record['step']}/{self.steps}: {', '.join(summary)}")
            sys.stdout.flush()
            self.last_line = now

    def advance(self) -> None:
        """Counts one more step done."""
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def tokens_per_second(tokens: int, seconds: float) -> float | None:
    """`tokens / seconds`; None when no token was timed (a window, or a run, of only the untimed
    first step)."""
    return tokens / seconds if tokens else None


def describe_throughput(tokens_per_s: float | None, timed_steps: int, first_step_s: float) -> str:
    """The run's throughput and what it leaves out: "51,234 tokens/s over 999 steps (...)", or
    "n/a (...)" when the only step was the first, which is not timed."""
    if tokens_per_s is None:
        return (f"n/a (only one step ran, and the first step, {first_step_s:.2f} s, is not "
                "timed)")
    return (f"{tokens_per_s:,.0f} tokens/s over {timed_steps} steps (not counted: the "
            f"compilation and the first step, {first_step_s:.2f} s)")


def train_loop(run: Run) -> dict[str, Any]:
    """Trains `run` from `run.start_step` to --steps, leaving its `params` and `opt_state` at the
    last step. On a fresh run, step 0 is logged first (the untrained model's losses). Every
    --log-every steps a record (mean loss, learning rate, tokens/s, MFU where the peak is known)
    is appended to metrics.jsonl and shown (`Progress`), with an eval loss every --eval-every
    steps; a checkpoint is saved every --checkpoint-every steps; both at the last step too.

    Tokens/s times the steps after this invocation's first (the first run of a compiled step is
    slower), without evaluations and checkpoints. Returns initial_eval_loss (None when
    resumed), final_eval_loss, final_loss, tokens_per_s (None when only one step ran) and mfu
    (None when the peak or the throughput is unknown).
    """
    args, run_config, sampler, schedule = run.args, run.run_config, run.sampler, run.schedule
    start_step, flops_per_token, peak = run.start_step, run.flops_per_token, run.peak
    impl = args.config.implementation or ("pallas" if _device.on_gpu() else "xla")
    print(f"HybridLM {args.preset}: {run.n_params:,} parameters, {run_config['dtype']} compute, "
          f"{impl} kernels on {_devices(run)}; corpus {len(run.tokens):,} bytes "
          f"({len(run.train_tokens):,} train / {len(run.eval_tokens):,} eval); "
          f"steps {start_step} -> {args.steps}, batch {args.batch_size} x {args.seq_len}",
          flush=True)
    train_step, eval_step = compile_steps(run)
    params, opt_state = run.params, run.opt_state
    progress = Progress(args.steps, start_step, args.no_progress)

    def evaluate(params) -> float:
        return float(np.mean([float(eval_step(params, b)) for b in run.eval_set]))

    def log(record: dict[str, Any]) -> None:
        run.records.append(record)
        with run.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        progress.show(record)

    initial_eval = None
    if start_step == 0:
        # Step 0: the untrained model's eval loss and its loss on the first training batch
        # (peeked: the sampler is put back, so step 1 trains on that same batch).
        initial_eval = evaluate(params)
        rng_state = sampler.state()
        first_loss = float(eval_step(params, run.place(next(sampler))))
        sampler.set_state(rng_state)
        log({"step": 0, "loss": first_loss, "eval_loss": initial_eval, "lr": float(schedule(0))})

    manager = checkpoint_manager(run.ckpt_dir, args.keep_checkpoints)
    tokens_per_step = args.batch_size * args.seq_len
    window_losses, window_start, last = [], time.perf_counter(), {}
    timed_steps, timed_s, untimed, first_step_s = 0, 0.0, 0, 0.0
    for step in range(start_step + 1, args.steps + 1):
        # Drawing the next batch overlaps with the device still running the previous step.
        batch = run.place(next(sampler))
        params, opt_state, loss = train_step(params, opt_state, batch)
        window_losses.append(loss)
        if step == start_step + 1:  # the first run of a compiled step is slower: not timed
            jax.block_until_ready(loss)
            first_step_s = time.perf_counter() - window_start
            window_start, untimed = time.perf_counter(), 1
        evaluate_now = step % args.eval_every == 0 or step == args.steps
        if step % args.log_every == 0 or evaluate_now:
            mean_loss = float(np.mean(jax.device_get(window_losses)))  # waits for the device
            window_steps = len(window_losses) - untimed
            elapsed = time.perf_counter() - window_start
            if window_steps:  # else the window is the untimed first step alone
                timed_steps, timed_s = timed_steps + window_steps, timed_s + elapsed
            untimed = 0
            tokens_per_s = tokens_per_second(window_steps * tokens_per_step, elapsed)
            record = {"step": step, "loss": mean_loss, "lr": float(schedule(step - 1)),
                      "tokens_per_s": None if tokens_per_s is None else round(tokens_per_s, 1)}
            if peak and tokens_per_s:
                record["mfu"] = round(tokens_per_s * flops_per_token / peak, 4)
            if evaluate_now:
                record["eval_loss"] = evaluate(params)
            log(record)
            last = record
            window_losses, window_start = [], time.perf_counter()
        progress.advance()
        if step % args.checkpoint_every == 0 or step == args.steps:
            jax.block_until_ready(params)  # steps still running count as training time
            t_save = time.perf_counter()
            save_checkpoint(manager, step, params, opt_state, sampler, run_config)
            window_start += time.perf_counter() - t_save  # not counted in tokens/s
    progress.close()
    manager.close()
    run.params, run.opt_state = params, opt_state

    tokens_per_s = tokens_per_second(timed_steps * tokens_per_step, timed_s)
    mfu = tokens_per_s * flops_per_token / peak if peak and tokens_per_s else None
    print(f"throughput {describe_throughput(tokens_per_s, timed_steps, first_step_s)}; model "
          f"FLOPs/token {flops_per_token:.3g}; MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}"
          + ("" if peak else f" (no peak FLOP/s known for {run.device_kind!r})"), flush=True)
    final_eval = last.get("eval_loss")
    if initial_eval is not None:
        print(f"eval loss {initial_eval:.4f} -> {final_eval:.4f} nats/byte "
              f"(uniform: ln 256 = {math.log(VOCAB_SIZE):.4f})", flush=True)
    else:
        print(f"eval loss {final_eval:.4f} nats/byte", flush=True)
    return {"initial_eval_loss": initial_eval, "final_eval_loss": final_eval,
            "final_loss": last.get("loss"), "tokens_per_s": tokens_per_s, "mfu": mfu}


def write_outputs(run: Run) -> tuple[list[dict[str, Any]], list[str]]:
    """Writes loss.png (all of metrics.jsonl) and, unless --sample-tokens is 0, samples.txt (the
    trained model's continuations of the prompts); returns (records, samples)."""
    args = run.args
    records = read_metrics(run.metrics_path)
    plot_losses(records, run.workdir / "loss.png",
                f"HybridLM {args.preset}, byte-level, {Path(args.corpus).name}")
    samples = []
    if args.sample_tokens:
        samples = generate_samples(run.graphdef, run.params, args.prompts, args.sample_tokens,
                                   args.temperature, args.seed)
        text = "".join(f"=== sample {i + 1}, prompt {p!r}, step {args.steps}, temperature "
                       f"{args.temperature} ===\n{s}\n\n"
                       for i, (p, s) in enumerate(zip(args.prompts, samples, strict=True)))
        (run.workdir / "samples.txt").write_text(text, encoding="utf-8")
        print(f"--- sample ---\n{samples[0]}\n---", flush=True)
    return records, samples


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Trains (or resumes) as the flags say; writes the workdir's outputs; returns a summary.

    `setup` checks every input before anything on disk changes (on --resume `resume_run` then
    checks the checkpoint), `open_workdir` makes the first change, `train_loop` trains and
    `write_outputs` writes loss.png and samples.txt.

    Summary keys: steps, start_step, n_params, initial_eval_loss (None when resumed),
    final_eval_loss, final_loss, tokens_per_s, mfu (None when unknown), flops_per_token,
    device_kind, wall_s, workdir, records (all of metrics.jsonl), samples, model (the trained
    HybridLM).
    Raises UsageError for unusable inputs.
    """
    t_start = time.perf_counter()
    run = setup(args)
    with on_mesh(run):
        if args.resume:
            resume_run(run)
        open_workdir(run)
        progress = train_loop(run)
        records, samples = write_outputs(run)
    wall = time.perf_counter() - t_start
    print(f"done in {wall:.1f} s; outputs in {run.workdir}", flush=True)
    return {
        "steps": args.steps, "start_step": run.start_step, "n_params": run.n_params, **progress,
        "flops_per_token": run.flops_per_token, "device_kind": run.device_kind, "wall_s": wall,
        "workdir": str(run.workdir), "records": records, "samples": samples,
        "model": nnx.merge(run.graphdef, run.params),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: 0 on success, 2 for unusable flags or inputs (one line on
    stderr), 130 when interrupted."""
    args = parse_args(argv)
    try:
        train(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; continue from the last checkpoint with --resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
