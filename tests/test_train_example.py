"""examples/train_hybrid_lm.py: a short run learns and writes its outputs, --resume continues
exactly, and bad flags or corpora fail with a clear message instead of a traceback."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_hybrid_lm.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("train_hybrid_lm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


trainer = _load_script()

# A two-block model on 4 x 32-byte batches: compiles and trains in seconds on a CPU.
TINY = [
    "--preset", "tiny", "--override", "num_layers=2", "--override", "d_model=32",
    "--override", "mlp_hidden=64", "--override", "chunk_size=16",
    "--batch-size", "4", "--seq-len", "32", "--warmup-steps", "3", "--lr", "3e-3",
    "--log-every", "1", "--eval-every", "6", "--eval-batches", "2", "--checkpoint-every", "12",
    "--no-progress",
]
STEPS = 24


def _run(workdir, *flags):
    return trainer.train(trainer.parse_args([*TINY, "--workdir", str(workdir), *flags]))


def test_short_run_learns_writes_outputs_and_resumes_exactly(tmp_path):
    # One uninterrupted run of STEPS steps (checkpoints at STEPS / 2 and STEPS) ...
    full_dir = tmp_path / "full"
    full = _run(full_dir, "--steps", str(STEPS), "--sample-tokens", "12")
    records = trainer.read_metrics(full_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS + 1))
    assert all(math.isfinite(r["loss"]) for r in records)
    assert records[0]["eval_loss"] == pytest.approx(math.log(256), abs=0.1)
    assert full["final_eval_loss"] < full["initial_eval_loss"] - 0.4
    assert np.mean([r["loss"] for r in records[-4:]]) < records[0]["loss"] - 0.4
    assert all(r["tokens_per_s"] > 0 for r in records[2:])
    assert {r["step"] for r in records if "eval_loss" in r} == {0, 6, 12, 18, 24}
    assert (full_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    samples = (full_dir / "samples.txt").read_text()
    assert samples.count("=== sample") == 3 and "ROMEO:" in samples
    assert len(full["samples"]) == 3
    assert sorted(p.name for p in (full_dir / "checkpoints").iterdir()) == ["12", "24"]

    # ... equals a run stopped at STEPS / 2 (same schedule) and resumed from its checkpoint.
    part_dir = tmp_path / "parts"
    half = STEPS // 2
    _run(part_dir, "--steps", str(half), "--schedule-steps", str(STEPS), "--sample-tokens", "0")
    resumed = _run(part_dir, "--steps", str(STEPS), "--resume", "--sample-tokens", "0")
    assert resumed["start_step"] == half and resumed["initial_eval_loss"] is None
    parts = trainer.read_metrics(part_dir / "metrics.jsonl")
    assert [r["step"] for r in parts] == list(range(STEPS + 1))
    for mine, reference in zip(parts[half + 1:], records[half + 1:], strict=True):
        assert mine["loss"] == pytest.approx(reference["loss"], rel=1e-6, abs=1e-6), mine
        assert ("eval_loss" in mine) == ("eval_loss" in reference)
        if "eval_loss" in reference:
            assert mine["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-6)
    assert resumed["final_eval_loss"] == pytest.approx(full["final_eval_loss"], rel=1e-6)

    # Resuming a finished run, or with a different batch size, is refused with a message.
    with pytest.raises(trainer.UsageError, match="nothing to do"):
        _run(part_dir, "--steps", str(STEPS), "--resume")
    with pytest.raises(trainer.UsageError, match="batch_size"):
        _run(part_dir, "--steps", str(2 * STEPS), "--resume", "--batch-size", "2")


def test_batch_sampler_state_round_trip():
    tokens = np.arange(1000, dtype=np.uint8)
    sampler = trainer.make_batches(tokens, batch_size=3, seq_len=7, seed=5)
    next(sampler)
    state = json.loads(json.dumps(sampler.state()))  # what the checkpoint stores
    expected = [next(sampler) for _ in range(3)]
    sampler.set_state(state)
    for batch, want in zip([next(sampler) for _ in range(3)], expected, strict=True):
        np.testing.assert_array_equal(batch, want)
    assert batch.shape == (3, 8) and batch.dtype == np.int32
    # Windows are contiguous slices of the corpus.
    assert np.all(np.diff(batch.astype(np.int64), axis=1) % 256 == 1)


def test_mfu_helpers():
    assert trainer.peak_flops("NVIDIA H200") == 989e12
    assert trainer.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert trainer.peak_flops("cpu") is None
    config = trainer.make_config("tiny")
    assert config.vocab_size == 256


@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "--steps: must be a positive integer"),
    (["--batch-size", "many"], "--batch-size: invalid"),
    (["--preset", "huge"], "--preset: invalid choice"),
    (["--implementation", "cuda"], "--implementation: invalid choice"),
    (["--eval-fraction", "1.5"], "--eval-fraction"),
    (["--override", "depth=3"], "--override: expected FIELD=VALUE"),
])
def test_bad_flags_exit_2_with_usage(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        trainer.main(flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    (None, "corpus file not found"),
    (b"", "corpus file is empty"),
    (b"to be or not to be", "corpus too small"),
])
def test_bad_corpus_exits_2_with_message(tmp_path, capsys, content, message):
    corpus = tmp_path / "corpus.txt"
    if content is not None:
        corpus.write_bytes(content)
    code = trainer.main(["--corpus", str(corpus), "--workdir", str(tmp_path / "run")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_resume_without_checkpoint_exits_2(tmp_path, capsys):
    assert trainer.main(["--resume", "--workdir", str(tmp_path / "empty")]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_command_line_missing_corpus_has_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--corpus", str(tmp_path / "missing.txt"),
         "--workdir", str(tmp_path / "run")],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 2
    assert "error: corpus file not found" in result.stderr
    assert "Traceback" not in result.stderr
