"""examples/finetune.py: a tiny transformers checkpoint fine-tunes and is saved in its format
(loadable, changed, same names); mistakes exit 2 with one line before jax runs anything."""

import importlib.util
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from flax_layers import Mamba2LM, Zamba2LM

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "checkpoints" / "fixtures"
spec = importlib.util.spec_from_file_location("finetune", ROOT / "examples" / "finetune.py")
finetune = importlib.util.module_from_spec(spec)
spec.loader.exec_module(finetune)


@pytest.mark.parametrize("name, model_class, text", [
    ("mamba2", Mamba2LM, "To be, or not to be, that is the question. " * 40),
    ("zamba2", Zamba2LM, "0123456789 (1+2)=3; 4*5=20? " * 40),  # bytes < its vocab of 64
])
def test_a_checkpoint_fine_tunes_and_saves_in_its_format(tmp_path, capsys, name, model_class,
                                                         text):
    (tmp_path / "text.txt").write_text(text)
    checkpoint, out = tmp_path / name, tmp_path / "out"
    shutil.copytree(FIXTURES / name, checkpoint)
    (checkpoint / "generation_config.json").write_text('{"do_sample": false}')
    code = finetune.main([str(checkpoint), "--text", str(tmp_path / "text.txt"),
                          "--out", str(out), "--steps", "4", "--batch-size", "2",
                          "--seq-len", "48", "--lr", "1e-2", "--log-every", "2",
                          *(["--remat"] if name == "zamba2" else [])])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "step 4/4: loss" in printed and "held-out loss after" in printed
    before = load_file(FIXTURES / name / "model.safetensors")
    after = load_file(out / "model.safetensors")
    assert sorted(after) == sorted(before)
    assert all(after[k].dtype == before[k].dtype for k in before)
    assert any(not np.array_equal(after[k], before[k]) for k in before)
    assert json.loads((out / "config.json").read_text())["model_type"] == name
    assert (out / "generation_config.json").read_text() == '{"do_sample": false}'
    model_class.from_pretrained(out)


@pytest.mark.parametrize("setup, flags, message", [
    (lambda d: None, [], "no config.json"),
    (lambda d: (d / "config.json").write_text('{"model_type": "llama"}'), [],
     "model_type 'llama' is not one of"),
    (lambda d: (d / "config.json").write_text('{"model_type": "zamba2"}'), [],
     "has no vocab_size"),
    (lambda d: (d / "config.json").write_text('{"model_type": "mamba2", "vocab_size": 64}'),
     [], "the text has byte 1[0-9][0-9], the model's vocabulary holds 64"),
    (lambda d: (d / "config.json").write_text('{"model_type": "mamba2", "vocab_size": 256}'),
     ["--seq-len", "4096"], "too few for --seq-len 4096"),
])
def test_mistakes_exit_2_with_one_line(tmp_path, capsys, setup, flags, message):
    setup(tmp_path)
    (tmp_path / "text.txt").write_text("hello world, " * 50)
    code = finetune.main([str(tmp_path), "--text", str(tmp_path / "text.txt"),
                          "--out", str(tmp_path / "out"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert re.search(message, err), err
