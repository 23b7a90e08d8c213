"""Makes the tiny Hugging Face checkpoints that tests/checkpoints compare against.

Needs torch and transformers (not the package's dependencies; the GPU machine has them):

    python tests/checkpoints/make_fixtures.py

For each architecture it builds a tiny random `Mamba2ForCausalLM` / `Zamba2ForCausalLM`
with a fixed seed (float32, eval mode: transformers' pure-PyTorch path, no mamba_ssm),
saves it with `save_pretrained` (config.json + model.safetensors) under
fixtures/<name>/, and writes fixtures/<name>/expected.npz:

  logits_<T>    the model's float32 logits for `tokens_<T>` (B, T) at T = 1, 37 and 200
                (a seed whose float32 logits stray from float64's by over 1e-5 relative is
                refused: the test's 1e-4 must measure the port, not float32's rounding);
  prompt        (1, 12) token ids, and greedy_20: the 20 greedy tokens after it, each the
                argmax of a full forward of everything before it (no cache);
  margin_20     the gap between the best and second-best logit at each of those steps
                (the script refuses a seed whose gap is below 1e-3: a tie would make the
                test's token equality a coin toss).
"""

import json
import pathlib
import sys

import numpy as np
import torch
import transformers

HERE = pathlib.Path(__file__).resolve().parent / "fixtures"

# Mamba2: two blocks, chunk 32 (T = 37 and 200 end in partial chunks); vocab 128 so the
# fine-tuning example can feed it ASCII bytes. One group: transformers' PyTorch path normalises the
# gated RMSNorm over all channels, mamba_ssm's kernels (and ours) per group; at one group they
# agree.
MAMBA2 = dict(vocab_size=128, hidden_size=32, num_heads=4, head_dim=16, expand=2,
              state_size=16, n_groups=1, conv_kernel=4, num_hidden_layers=2, chunk_size=32,
              tie_word_embeddings=False, use_bias=False, use_conv_bias=True,
              layer_norm_epsilon=1e-5, initializer_range=0.5, pad_token_id=0,
              bos_token_id=1, eos_token_id=None)

# Zamba2: five Mamba2 layers, three of them hybrid (shared blocks A B A with per-use LoRA
# adapters on q, k, v and the MLP), rotary embeddings, two SSM groups, chunk 32.
ZAMBA2 = dict(vocab_size=64, hidden_size=16, num_hidden_layers=5,
              layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid"],
              mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2,
              n_mamba_heads=2, chunk_size=32, intermediate_size=32, num_attention_heads=2,
              num_key_value_heads=2, num_mem_blocks=2, use_shared_attention_adapter=True,
              adapter_rank=4, use_mem_rope=True, rope_parameters=dict(rope_type="default",
                                                                      rope_theta=10000.0),
              max_position_embeddings=512, initializer_range=0.1, use_mamba_kernels=False,
              pad_token_id=0, bos_token_id=1, eos_token_id=None)


def _make(name, config_cls, model_cls, options, seed):
    torch.manual_seed(seed)
    config = config_cls(**options)
    model = model_cls(config).float().eval()
    with torch.no_grad():  # random, not the init's constants: every parameter matters
        for param_name, param in model.named_parameters():
            if param_name.endswith(("A_log", "D", "dt_bias")) or "norm" in param_name:
                param.add_(0.2 * torch.randn_like(param))
    out = HERE / name
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)

    def logits(tokens, model=model):
        with torch.no_grad():
            return model(torch.as_tensor(tokens), use_cache=False).logits.double().numpy()

    exact = model_cls.from_pretrained(out).double().eval()

    rng = np.random.default_rng(seed)
    expected = {}
    for t, batch in ((1, 2), (37, 2), (200, 1)):
        tokens = rng.integers(0, options["vocab_size"], (batch, t))
        expected[f"tokens_{t}"] = tokens
        expected[f"logits_{t}"] = logits(tokens).astype(np.float32)
        truth = logits(tokens, exact)
        error = np.abs(expected[f"logits_{t}"] - truth).max() / np.abs(truth).max()
        if error > 1e-5:  # float32 itself strays: a 1e-4 comparison would test rounding
            print(f"{name} seed {seed}: float32 logits off float64 by {error:.1e} at T={t}")
            return False
    prompt = rng.integers(0, options["vocab_size"], (1, 12))
    sequence, margins = prompt, []
    for _ in range(20):
        last = logits(sequence)[0, -1]
        top2 = np.sort(last)[-2:]
        margins.append(top2[1] - top2[0])
        sequence = np.concatenate([sequence, [[int(np.argmax(last))]]], axis=1)
    expected.update(prompt=prompt, greedy_20=sequence[:, 12:], margin_20=np.array(margins))
    if min(margins) < 1e-3:
        return False
    with torch.no_grad():  # transformers' own cached greedy decoding, for the record
        generated = model.generate(torch.as_tensor(prompt), max_new_tokens=20, do_sample=False,
                                   pad_token_id=0)[:, 12:].numpy()
    expected["hf_generate_20"] = generated
    np.savez_compressed(out / "expected.npz", **expected)
    meta = dict(torch=torch.__version__, transformers=transformers.__version__, seed=seed,
                hf_generate_equals_greedy=bool((generated == sequence[:, 12:]).all()))
    (out / "made_with.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(name, meta, "min margin", min(margins))
    return True


def main():
    made = {"mamba2": False, "zamba2": False}
    for seed in range(20):
        if not made["mamba2"]:
            made["mamba2"] = _make("mamba2", transformers.Mamba2Config,
                                   transformers.Mamba2ForCausalLM, MAMBA2, seed)
        if not made["zamba2"]:
            made["zamba2"] = _make("zamba2", transformers.Zamba2Config,
                                   transformers.Zamba2ForCausalLM, ZAMBA2, seed)
        if all(made.values()):
            return 0
    print("no seed gave clear greedy margins:", made, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
