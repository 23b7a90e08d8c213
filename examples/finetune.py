"""Fine-tune a Mamba2 or Zamba2 checkpoint on a text file, and save it in transformers' format.

The checkpoint is a directory in transformers' format (config.json with model_type "mamba2"
or "zamba2", and model.safetensors or shards), for example one downloaded from the Hugging
Face Hub, or mamba_ssm's (its Mamba2 config.json and weights). It loads into
`flax_layers.Mamba2LM` or `flax_layers.Zamba2LM` (float32 parameters; the kernels and bf16
compute on a GPU), trains with the training example's machinery (`train_hybrid_lm.py`: AdamW
with warmup and cosine decay, global-norm clipping, next-token loss, a jit-compiled step that
donates its state), and is written to `--out` as config.json + model.safetensors in the
checkpoint's dtype, which transformers' `from_pretrained` reads; the tokenizer's and the
generation config's files are copied beside them.

Tokens: with a `tokenizer.json` in the checkpoint and the `tokenizers` package installed, the
text is encoded by it; otherwise each byte is a token (the model's vocabulary must then hold
every byte of the text).

    python examples/finetune.py CHECKPOINT_DIR --text corpus.txt --out finetuned/ --steps 200

The flags are checked before jax is imported; a mistake exits with status 2 and one line.
An interrupt (Ctrl-C) saves the parameters reached so far before it exits.
"""

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np

MODEL_TYPES = ("mamba2", "zamba2")
# Copied from the checkpoint to --out where present, so that the output loads as a whole.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "generation_config.json")
EXAMPLES = Path(__file__).resolve().parent


class UsageError(Exception):
    """A mistake in the flags, the checkpoint or the text: one line, exit status 2."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="directory with config.json and weights")
    parser.add_argument("--text", type=Path, required=True, help="UTF-8 text to train on")
    parser.add_argument("--out", type=Path, required=True, help="directory to save into")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--clip-norm", type=float, default=1.0)
    parser.add_argument("--eval-fraction", type=float, default=0.05)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="compute dtype; auto: bfloat16 on a GPU, float32 elsewhere")
    parser.add_argument("--implementation", choices=("auto", "pallas", "xla"), default="auto",
                        help="auto: the kernels on a GPU, the jnp reference elsewhere")
    parser.add_argument("--remat", action="store_true",
                        help="recompute each layer in the backward: less memory, more time")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        parser.error(f"--lr must be a finite number > 0, got {args.lr}")
    if not 0 < args.eval_fraction < 1:
        parser.error(f"--eval-fraction must lie in (0, 1), got {args.eval_fraction}")
    return args


def read_config(checkpoint: Path) -> dict:
    """The checkpoint's config.json, checked to be a model this example fine-tunes."""
    path = checkpoint / "config.json"
    if not path.is_file():
        raise UsageError(f"no config.json in {checkpoint}")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot read {path}: {error}") from None
    model_type = "mamba2" if "ssm_cfg" in config else config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UsageError(f"{path}: model_type {model_type!r} is not one of {MODEL_TYPES}")
    return config


def tokenize(text_path: Path, checkpoint: Path, vocab_size: int) -> np.ndarray:
    """The text's token ids (int32): by the checkpoint's tokenizer.json where the `tokenizers`
    package is installed, else its bytes; every id must lie in the model's vocabulary."""
    if not text_path.is_file():
        raise UsageError(f"text file not found: {text_path}")
    data = text_path.read_bytes()
    if not data:
        raise UsageError(f"text file is empty: {text_path}")
    tokenizer_file = checkpoint / "tokenizer.json"
    if tokenizer_file.is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError:
            print(f"note: {tokenizer_file} is there but the tokenizers package is not; "
                  "using bytes", file=sys.stderr)
        else:
            ids = np.asarray(Tokenizer.from_file(str(tokenizer_file)).encode(
                data.decode("utf-8", errors="replace")).ids, np.int32)
            if ids.size and ids.max() >= vocab_size:
                raise UsageError(f"{tokenizer_file} gives id {ids.max()}, outside the model's "
                                 f"vocabulary of {vocab_size}")
            return ids
    ids = np.frombuffer(data, np.uint8).astype(np.int32)
    if ids.max() >= vocab_size:
        raise UsageError(f"byte tokens: the text has byte {ids.max()}, the model's vocabulary "
                         f"holds {vocab_size} ids (add a tokenizer.json and install tokenizers)")
    return ids


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        config = read_config(args.checkpoint)
        vocab = config.get("vocab_size")
        if not isinstance(vocab, int) or vocab < 1:
            raise UsageError(f"{args.checkpoint / 'config.json'} has no vocab_size")
        tokens = tokenize(args.text, args.checkpoint, vocab)
        held_out = max(int(len(tokens) * args.eval_fraction), args.seq_len + 1)
        if len(tokens) - held_out < args.seq_len + 1:
            raise UsageError(f"the text has {len(tokens)} tokens: too few for --seq-len "
                             f"{args.seq_len} with an evaluation split")
        return finetune(args, config, tokens[:-held_out], tokens[-held_out:])
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def finetune(args, config, train_tokens, eval_tokens) -> int:
    import jax.numpy as jnp
    from flax import nnx

    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import train_hybrid_lm as training

    from flax_layers import Mamba2LM, Zamba2LM
    from pallas_kernels import _device

    on_gpu = _device.on_gpu()
    dtype = {"auto": jnp.bfloat16 if on_gpu else None, "float32": None,
             "bfloat16": jnp.bfloat16}[args.dtype]
    implementation = None if args.implementation == "auto" else args.implementation
    model_class = Zamba2LM if config.get("model_type") == "zamba2" else Mamba2LM
    started = time.perf_counter()
    try:
        model = model_class.from_pretrained(args.checkpoint, dtype=dtype,
                                            implementation=implementation, remat=args.remat)
    except (KeyError, ValueError, FileNotFoundError) as error:
        raise UsageError(f"cannot load {args.checkpoint}: {error}") from None
    graphdef, params = nnx.split(model)
    count = training.count_params(params)
    print(f"loaded {model_class.__name__} ({count:,} parameters) from "
          f"{args.checkpoint} in {time.perf_counter() - started:.1f} s; {len(train_tokens):,} "
          f"training tokens, {len(eval_tokens):,} held out")
    tx, _ = training.make_optimizer(args.lr, args.warmup_steps, args.steps, args.weight_decay,
                                    args.clip_norm)
    opt_state = tx.init(params)
    train_step, eval_step = training.make_steps(graphdef, tx)
    batches = training.make_batches(train_tokens, args.batch_size, args.seq_len, args.seed)
    evals = training.eval_batches(eval_tokens, 1, args.seq_len, 4)

    def evaluate(params):
        return float(np.mean([float(eval_step(params, jnp.asarray(b))) for b in evals]))

    print(f"held-out loss before: {evaluate(params):.4f}")
    step, window_start, window_tokens = 0, None, 0
    try:
        for step in range(1, args.steps + 1):
            params, opt_state, loss = train_step(params, opt_state, jnp.asarray(next(batches)))
            if step == 1:
                loss.block_until_ready()
                window_start = time.perf_counter()  # the first step compiles: not timed
            else:
                window_tokens += args.batch_size * args.seq_len
            if step % args.log_every == 0 or step == args.steps:
                loss = float(loss)
                rate = training.tokens_per_second(window_tokens,
                                                  time.perf_counter() - window_start)
                speed = "" if rate is None else f", {rate:,.0f} tokens/s"
                print(f"step {step}/{args.steps}: loss {loss:.4f}{speed}", flush=True)
    except KeyboardInterrupt:
        print(f"interrupted after step {step}: saving what it reached", file=sys.stderr)
    print(f"held-out loss after: {evaluate(params):.4f}")
    path = nnx.merge(graphdef, params).save_pretrained(args.out)
    for name in TOKENIZER_FILES:
        if (args.checkpoint / name).is_file():
            shutil.copy2(args.checkpoint / name, args.out / name)
    print(f"saved to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
