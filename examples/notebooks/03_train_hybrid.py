# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Training a hybrid Mamba2 + attention language model on Shakespeare
#
# `flax_layers.HybridLM` is a small Zamba2-style language model: a stack of Mamba2 blocks
# (state-space layers, computed by the SSD kernels) with one *shared* attention + MLP block
# (FlashAttention kernels) applied after every few of them. This notebook trains it as a
# **byte-level** language model: the tokens are the raw bytes of a text file, so the vocabulary
# has 256 entries and no tokenizer is needed.
#
# All the training code lives in `examples/train_hybrid_lm.py`, the repository's training
# script; this notebook imports its functions and walks through them:
#
# 1. the data: bytes to tokens, a train/eval split, random training windows;
# 2. the model and its untrained loss;
# 3. a short training run (AdamW, warmup + cosine schedule, gradient clipping, checkpoints);
# 4. the loss curve;
# 5. text sampled through the model's decode caches.
#
# On a CPU it takes about a minute. On a GPU the same code runs the Pallas kernels in bfloat16;
# for a longer run use the script itself: `python examples/train_hybrid_lm.py --preset small`.

# %%
import importlib.util
import math
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np


def find_script(name="train_hybrid_lm.py"):
    """examples/<name>, found from the repository root, `examples/` or `examples/notebooks/`."""
    for base in (Path.cwd(), *Path.cwd().parents):
        if (base / "examples" / name).is_file():
            return base / "examples" / name
    raise FileNotFoundError(f"examples/{name} not found above {Path.cwd()}")


script = find_script()
spec = importlib.util.spec_from_file_location("train_hybrid_lm", script)
trainer = importlib.util.module_from_spec(spec)
sys.modules["train_hybrid_lm"] = trainer
spec.loader.exec_module(trainer)  # the package itself is installed (pip install -e .)
print("training script:", script.relative_to(script.parents[1]))
print("JAX devices:", jax.devices())

# %% [markdown]
# ## 1. Data: bytes are tokens
#
# The corpus ships with the repository (`examples/data/tinyshakespeare.txt`, about 1.1 MB of
# Shakespeare's plays, public domain; see `examples/data/README.md`). `load_corpus` reads the
# file as a `uint8` array: each byte is one token id in `[0, 256)`. `split_corpus` holds out the
# last 10% of the text for evaluation, so the eval loss measures text the model never trained
# on.

# %%
tokens = trainer.load_corpus(trainer.DEFAULT_CORPUS)
train_tokens, eval_tokens = trainer.split_corpus(tokens, eval_fraction=0.1, seq_len=128)
print(f"{len(tokens):,} bytes: {len(train_tokens):,} for training, {len(eval_tokens):,} held out")
print("distinct byte values:", len(np.unique(tokens)))
print(bytes(tokens[:160]).decode())

# %% [markdown]
# Training batches are windows of `seq_len + 1` bytes at random offsets: the model reads the
# first `seq_len` bytes and, at every position, predicts the next one (the targets are the window
# shifted by one). The offsets come from a seeded `numpy.random.Generator`; the script stores its
# state in every checkpoint, so a resumed run draws exactly the batches an uninterrupted run
# would have drawn.

# %%
sampler = trainer.make_batches(train_tokens, batch_size=4, seq_len=48, seed=0)
batch = next(sampler)
print("batch:", batch.shape, batch.dtype)
for row in batch[:2]:
    print("inputs :", repr(bytes(row[:-1].astype(np.uint8)).decode()))
    print("targets:", repr(bytes(row[1:].astype(np.uint8)).decode()))

# %% [markdown]
# ## 2. The model
#
# `make_config` takes a `HybridLMConfig` preset (here `"tiny"`), fixes the vocabulary at 256,
# and picks the implementation: `None` means the Pallas kernels on a GPU and the pure-`jnp`
# reference on a CPU, with bfloat16 compute on a GPU (parameters stay float32).
#
# Before training, the model's predictions are close to uniform over the 256 byte values, so
# its cross-entropy is close to $\ln 256 \approx 5.55$ nats per byte.

# %%
from flax import nnx  # noqa: E402

config = trainer.make_config("tiny")
print(config)
model = trainer.HybridLM(config, rngs=nnx.Rngs(0))
graphdef, params = nnx.split(model)
print(f"{trainer.count_params(params):,} parameters")
loss_fn = jax.jit(trainer.next_token_loss, static_argnums=0)  # the graphdef is static
untrained = loss_fn(graphdef, params, jnp.asarray(batch))
print(f"untrained loss {float(untrained):.3f} nats/byte; ln 256 = {math.log(256):.3f}")
assert abs(float(untrained) - math.log(256)) < 0.2

# %% [markdown]
# ## 3. Train
#
# `train(args)` is the whole training run of the script. It takes the same flags as the command
# line (`parse_args`), so everything below can be reproduced with
# `python examples/train_hybrid_lm.py --steps 80 ...`. What it does:
#
# - builds the model and an optimizer: AdamW on a linear warmup then cosine decay of the
#   learning rate, after clipping the gradients' global norm to 1;
# - compiles one train step with `jax.jit` (forward, backward through the kernels'
#   `custom_vjp`s, optimizer update) and runs it `--steps` times with a progress bar showing the
#   loss and tokens/s;
# - evaluates on fixed held-out windows every `--eval-every` steps, writes one JSON line per
#   logged step to `metrics.jsonl`, and saves orbax checkpoints (parameters, optimizer state,
#   step and data RNG state) every `--checkpoint-every` steps;
# - finally plots `loss.png` and samples text from a few prompts into `samples.txt`.
#
# We keep the run short so that the notebook finishes in about a minute on a CPU, and write
# into a temporary directory.

# %%
workdir = Path(tempfile.mkdtemp(prefix="hybrid_lm_"))
args = trainer.parse_args([
    "--preset", "tiny",
    "--steps", "80", "--batch-size", "16", "--seq-len", "128",
    "--lr", "3e-3", "--warmup-steps", "10",
    "--log-every", "5", "--eval-every", "20", "--eval-batches", "4", "--checkpoint-every", "40",
    "--sample-tokens", "100",
    "--workdir", str(workdir),
])
summary = trainer.train(args)

# %% [markdown]
# The summary holds the eval losses, the throughput and, on a GPU with a known peak, the model
# FLOP utilisation (MFU: model FLOPs per token x tokens/s / peak FLOP/s). The work directory
# holds what a longer run would leave behind, including the checkpoints that
# `--resume` continues from.

# %%
print(f"eval loss: {summary['initial_eval_loss']:.3f} -> {summary['final_eval_loss']:.3f}")
mfu = "n/a" if summary["mfu"] is None else f"{100 * summary['mfu']:.1f}%"
print(f"throughput: {summary['tokens_per_s']:,.0f} tokens/s on {summary['device_kind']}, "
      f"MFU {mfu}")
print(sorted(p.name for p in workdir.iterdir()))
print("checkpoints at steps", sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()))
assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 1.0

# %% [markdown]
# ## 4. The loss curve
#
# Each record of `metrics.jsonl` has the step, the training loss (averaged since the previous
# record), the learning rate and tokens/s; evaluation steps also have `eval_loss`.
#
# Two count-based baselines put the numbers in perspective: a **unigram** model (byte
# frequencies of the training split, ignoring all context) and a **bigram** model (the next
# byte's frequencies given the previous byte). Their cross-entropies on the held-out split are
# what a network that uses no context, or only one byte of it, could reach. The first drop of
# the loss, from ln 256 towards the unigram line, is the model learning which bytes are common
# (letters, spaces, newlines); getting below the unigram line means it uses context.


# %%
def count_model_loss(train_part, eval_part, order):
    """Held-out cross-entropy of an add-0.01-smoothed unigram (order 1) or bigram (order 2)."""
    if order == 1:
        counts = np.bincount(train_part, minlength=256) + 0.01
        return float(-np.log(counts / counts.sum())[eval_part].mean())
    counts = np.full((256, 256), 0.01)
    np.add.at(counts, (train_part[:-1], train_part[1:]), 1)
    log_p = np.log(counts / counts.sum(axis=1, keepdims=True))
    return float(-log_p[eval_part[:-1], eval_part[1:]].mean())


unigram = count_model_loss(train_tokens, eval_tokens, 1)
bigram = count_model_loss(train_tokens, eval_tokens, 2)
print(f"held-out cross-entropy: unigram {unigram:.3f}, bigram {bigram:.3f}, "
      f"HybridLM after {args.steps} steps {summary['final_eval_loss']:.3f} nats/byte")
assert summary["final_eval_loss"] < unigram

# %%
records = summary["records"]
train_steps = [r["step"] for r in records]
eval_records = [r for r in records if "eval_loss" in r]

fig, (ax_loss, ax_lr) = plt.subplots(1, 2, figsize=(11, 3.8))
ax_loss.plot(train_steps, [r["loss"] for r in records], label="train")
ax_loss.plot([r["step"] for r in eval_records], [r["eval_loss"] for r in eval_records], "o-",
             label="eval (held out)")
ax_loss.axhline(math.log(256), color="gray", ls=":", label="ln 256 (uniform)")
ax_loss.axhline(unigram, color="tab:red", ls="--", lw=1, label="unigram counts")
ax_loss.axhline(bigram, color="tab:green", ls="--", lw=1, label="bigram counts")
ax_loss.set(xlabel="step", ylabel="cross-entropy (nats / byte)", title="loss")
ax_loss.legend()
ax_lr.plot(train_steps, [r["lr"] for r in records])
ax_lr.set(xlabel="step", ylabel="learning rate", title="warmup + cosine schedule")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 5. Sampling through the decode caches
#
# `HybridLM.generate` first runs the prompt through the model once (the "prefill"), which leaves
# each Mamba2 block's convolution and SSM state and each attention use's key/value cache at the
# end of the prompt. It then feeds one byte at a time: every step costs the same, however long
# the text already is, because the Mamba2 state has a fixed size (only the attention cache
# grows). At the end of `train`, the script did this for three prompts:

# %%
for sample in summary["samples"]:
    print(sample)
    print("-" * 60)

# %% [markdown]
# After well under a minute of training on a CPU the model has learnt byte frequencies, word
# lengths, spaces and line breaks and a few short words, but little more: the samples are
# mostly gibberish. The script's default run (1000 steps, a few minutes on a CPU) gets to about
# 1.6 nats per byte, well below the bigram line, and its samples look like a play: speaker
# names in capitals, verse-length lines, mostly real words.
#
# The trained model is in `summary["model"]`. Temperature 0 always picks the most likely next
# byte (and quickly falls into a loop), higher temperatures sample more freely:

# %%
trained = summary["model"]
prompt = jnp.asarray(np.frombuffer(b"KING HENRY:\n", np.uint8)[None].astype(np.int32))
for temperature in (0.0, 1.0):
    new = trained.generate(prompt, 80, temperature=temperature, rng=jax.random.key(1))
    text = bytes(np.asarray(new[0]).astype(np.uint8)).decode("utf-8", errors="replace")
    print(f"temperature {temperature}:\nKING HENRY:\n{text}\n")

# %% [markdown]
# To continue this run for more steps, resume from its last checkpoint; the data order, the
# optimizer state and the learning-rate schedule continue where they stopped:
#
# ```bash
# python examples/train_hybrid_lm.py --resume --steps 160 --workdir <workdir> ...same flags...
# ```
#
# The schedule's length is taken from the checkpoint (here 80 steps, so further steps run at its
# final learning rate) unless `--schedule-steps` says otherwise; a run meant to be trained in
# parts sets `--schedule-steps` to its final step count from the start.
