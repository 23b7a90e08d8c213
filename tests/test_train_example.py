"""examples/train_hybrid_lm.py: a short run learns and writes its outputs, --resume continues
exactly (past checkpoints that do not load), mistakes (bad flags, corpora, model
configurations, workdirs) exit with status 2 and one line instead of a traceback, before any
checkpoint is touched, --help answers before jax is imported, and output that is not a terminal
gets plain progress lines instead of a progress bar."""

import contextlib
import importlib.util
import io
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from pallas_kernels import _device

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


def _cli(*flags, cwd, python_options=()):
    """Runs the script as a command on the CPU."""
    return subprocess.run([sys.executable, *python_options, str(SCRIPT), *flags],
                          capture_output=True, text=True, cwd=cwd, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


def _main(argv, capsys):
    """(exit status, stderr) of `main(argv)` in this process."""
    try:
        code = trainer.main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code
    return code, capsys.readouterr().err


def _assert_usage_error(code, stderr, *fragments):
    """Exit status 2 and exactly one line on stderr, "error: ..." holding each fragment."""
    assert code == 2, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for fragment in fragments:
        assert fragment in lines[0]


def _files(directory):
    """{relative path: contents} of every file under `directory`."""
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _truncate(path):
    """Cuts a file to half its length, as a crash mid-write would."""
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _largest_file(directory):
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def test_short_run_learns_writes_outputs_and_resumes_exactly(tmp_path, capsys):
    # One uninterrupted run of STEPS steps (checkpoints at STEPS / 2 and STEPS) ...
    full_dir = tmp_path / "full"
    full = _run(full_dir, "--steps", str(STEPS), "--sample-tokens", "12")
    out = capsys.readouterr().out
    assert "step 6/24: loss " in out and "\r" not in out  # plain lines, no progress bar
    assert f"throughput {full['tokens_per_s']:,.0f} tokens/s over {STEPS - 1} steps" in out
    assert "sampling 12 bytes for each of 3 prompts" in out and "sample 3/3 done in" in out
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
    assert _device.peak_flops("NVIDIA H200") == 989e12
    assert _device.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert _device.peak_flops("cpu") is None
    config = trainer.make_config("tiny")
    assert config.vocab_size == 256


@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "argument --steps: must be a positive integer, got '0'"),
    (["--batch-size", "many"], "argument --batch-size: must be a positive integer, got 'many'"),
    (["--lr", "abc"], "argument --lr: must be a positive number, got 'abc'"),
    (["--lr", "inf"], "argument --lr: must be a positive number, got 'inf'"),
    (["--seed", "x"], "argument --seed: must be an integer, got 'x'"),
    (["--preset", "huge"], "argument --preset: invalid choice"),
    (["--implementation", "cuda"], "argument --implementation: invalid choice"),
    (["--eval-fraction", "1.5"], "argument --eval-fraction: must be a number between 0 and 1"),
    (["--override", "depth=3"], "--override: expected FIELD=VALUE"),
    (["--override", "sequence_order=zigzag"], "--override: expected FIELD=VALUE"),
    (["--override", "d_model=0"], "--override: d_model must be positive, got '0'"),
    (["--override", "num_layers=-2"], "--override: num_layers must be positive, got '-2'"),
    (["--resume", "--overwrite"], "argument --overwrite: not allowed with argument --resume"),
    (["--mesh", "pipeline=2"], "argument --mesh: must be AXIS=N pairs with AXIS one of "
                               "('data', 'fsdp', 'context', 'tensor'), each once, got "
                               "'pipeline=2'"),
    (["--mesh", "data=0"], "argument --mesh: must be a positive integer, got '0'"),
    (["--context-parallelism", "ulysses"], "argument --context-parallelism: invalid choice"),
])
def test_bad_flags_exit_2_with_one_line(flags, message, capsys):
    _assert_usage_error(*_main(flags, capsys), message, "see train_hybrid_lm.py --help")


def test_command_line_bad_flag_names_the_expectation(tmp_path):
    result = _cli("--lr", "abc", cwd=tmp_path)
    _assert_usage_error(result.returncode, result.stderr,
                        "argument --lr: must be a positive number, got 'abc'")


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
    result = _cli("--corpus", str(tmp_path / "missing.txt"), "--workdir", str(tmp_path / "run"),
                  cwd=tmp_path)
    _assert_usage_error(result.returncode, result.stderr, "error: corpus file not found")


@pytest.mark.parametrize("workdir, message", [
    ("afile", "--workdir afile is not a directory"),
    ("afile/run", "--workdir afile/run is below afile, which is not a directory"),
])
def test_workdir_that_is_or_is_below_a_file_exits_2(tmp_path, monkeypatch, capsys, workdir,
                                                    message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("not a directory")
    _assert_usage_error(*_main(["--workdir", workdir], capsys), message)


def test_command_line_workdir_below_a_file(tmp_path):
    (tmp_path / "afile").write_text("not a directory")
    result = _cli("--workdir", "afile/run", cwd=tmp_path)
    _assert_usage_error(result.returncode, result.stderr, "--workdir afile/run is below afile")
    assert (tmp_path / "afile").read_text() == "not a directory"


def test_command_line_help_answers_before_importing_jax(tmp_path):
    """--help takes a fraction of a second: argparse answers before the training stack (jax,
    flax, optax, orbax, tqdm and the package, seconds) is imported."""
    result = _cli("--help", cwd=tmp_path, python_options=("-X", "importtime"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: train_hybrid_lm.py") and "--override" in result.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    assert "argparse" in imported
    assert imported.isdisjoint({"jax", "flax", "optax", "orbax", "tqdm", "flax_layers",
                                "pallas_kernels"}), imported


@pytest.mark.parametrize("line_every_s, lines", [
    (0, ["step 0/20: loss 5.5000, eval loss 5.6000", "step 10/20: loss 3.0000, 1,234 tokens/s",
         "step 20/20: loss 2.5000, 1,500 tokens/s, MFU 25.0%"]),
    (math.inf, ["step 0/20: loss 5.5000, eval loss 5.6000"]),
])
def test_progress_off_a_terminal_is_plain_lines(capsys, line_every_s, lines):
    """Output that is not a terminal (here: captured) gets no progress bar, whose
    carriage-return redraws would fill a log, but plain lines: every record with an eval loss,
    the others at most every `line_every_s` seconds."""
    progress = trainer.Progress(20, 0, no_progress=False, line_every_s=line_every_s)
    progress.show({"step": 0, "loss": 5.5, "eval_loss": 5.6})
    for step in range(1, 21):
        progress.advance()
        if step == 10:
            progress.show({"step": 10, "loss": 3.0, "tokens_per_s": 1234.4})
    progress.show({"step": 20, "loss": 2.5, "tokens_per_s": 1500.0, "mfu": 0.25})
    progress.close()
    out, err = capsys.readouterr()
    assert out.splitlines() == lines and err == ""


def test_progress_bar_on_a_terminal_unless_no_progress(monkeypatch):
    """A progress bar when stdout and stderr are terminals, unless --no-progress."""
    for stream in (sys.stdout, sys.stderr):
        monkeypatch.setattr(stream, "isatty", lambda: True)
    for no_progress in (False, True):
        progress = trainer.Progress(10, 0, no_progress=no_progress)
        assert progress.has_bar is not no_progress
        progress.close()


def test_throughput_times_the_steps_after_the_first():
    """The first step of a run is not timed (the first run of a compiled step is slower), so a
    run of one step has no throughput: "n/a", not "0 tokens/s"."""
    assert trainer.tokens_per_second(0, 0.01) is None
    assert trainer.tokens_per_second(4096, 2.0) == 2048.0
    assert trainer.describe_throughput(None, 0, 0.5) == (
        "n/a (only one step ran, and the first step, 0.50 s, is not timed)")
    assert trainer.describe_throughput(2048.0, 3, 0.5) == (
        "2,048 tokens/s over 3 steps (not counted: the compilation and the first step, 0.50 s)")


def test_read_metrics_drops_a_torn_line(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "loss": 5.5}\n\n{"step": 1, "loss": 5.4}\n{"step": 2, "lo')
    assert trainer.read_metrics(path) == [{"step": 0, "loss": 5.5}, {"step": 1, "loss": 5.4}]
    assert capsys.readouterr().err == f"warning: dropped 1 unreadable line(s) of {path}\n"


# --------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    """(workdir, stderr) of a TINY run of 2 steps with a checkpoint at each, started with
    --overwrite in the workdir of an earlier run (a checkpoint of step 7 and its metrics)."""
    workdir = tmp_path_factory.mktemp("checkpointed")
    (workdir / "checkpoints" / "7").mkdir(parents=True)
    (workdir / "metrics.jsonl").write_text('{"step": 7, "loss": 1.0}\n')
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
        _run(workdir, "--steps", "2", "--checkpoint-every", "1", "--sample-tokens", "0",
             "--overwrite")
    return workdir, stderr.getvalue()


@pytest.fixture
def workdir(checkpointed, tmp_path):
    """A copy of the `checkpointed` workdir (checkpoints of steps 1 and 2) to change."""
    return Path(shutil.copytree(checkpointed[0], tmp_path / "run"))


def test_overwrite_replaces_the_previous_run(checkpointed):
    workdir, stderr = checkpointed
    assert "note: --overwrite: removed the checkpoints and metrics" in stderr
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["1", "2"]
    assert [r["step"] for r in trainer.read_metrics(workdir / "metrics.jsonl")] == [0, 1, 2]


def test_command_line_fresh_run_refuses_a_workdir_with_checkpoints(workdir, tmp_path):
    before = _files(workdir)
    result = _cli(*TINY, "--workdir", str(workdir), "--steps", "3", cwd=tmp_path)
    _assert_usage_error(result.returncode, result.stderr,
                        f"--workdir {workdir} holds checkpoints (steps 1, 2); pass --resume to "
                        "continue them or --overwrite to start over")
    assert _files(workdir) == before


@pytest.mark.parametrize("override, message", [
    ("num_heads=3", "num_heads (3) must be divisible by num_kv_heads (2)"),
    ("ngroups=3", "must be divisible by ngroups (3)"),
    ("chunk_size=24", "chunk_size must be a positive power of two, got 24"),
    ("num_layers=3", "num_layers (3) must be a multiple of shared_every (2)"),
])
def test_bad_model_configuration_exits_2_before_overwriting(workdir, capsys, override,
                                                            message):
    before = _files(workdir)
    argv = [*TINY, "--override", override, "--workdir", str(workdir), "--overwrite"]
    _assert_usage_error(*_main(argv, capsys), "invalid model configuration (--preset tiny",
                        f"--override {override}", message)
    assert _files(workdir) == before


@pytest.mark.parametrize("override, message", [
    ("num_heads=3", "num_heads (3) must be divisible by num_kv_heads (2)"),
    ("ngroups=3", "heads (4) must be divisible by ngroups (3)"),
    ("chunk_size=24", "chunk_size must be a positive power of two, got 24"),
])
def test_command_line_bad_model_configuration_keeps_checkpoints(workdir, tmp_path, override,
                                                                message):
    before = _files(workdir)
    result = _cli(*TINY, "--override", override, "--workdir", str(workdir), "--overwrite",
                  cwd=tmp_path)
    _assert_usage_error(result.returncode, result.stderr, f"--override {override}", message,
                        "see train_hybrid_lm.py --help")
    assert _files(workdir) == before


def _restore_newest(workdir):
    """`restore_newest` on the workdir's checkpoints, into a freshly initialised TINY run."""
    args = trainer.parse_args([*TINY, "--workdir", str(workdir)])
    params = nnx.state(trainer.HybridLM(args.config, rngs=nnx.Rngs(0)))
    tx, _ = trainer.make_optimizer(args.lr, args.warmup_steps, 2, args.weight_decay,
                                   args.clip_norm)
    manager = trainer.checkpoint_manager(workdir / "checkpoints", keep=2)
    try:
        return trainer.restore_newest(manager, params, tx.init(params), lambda meta: None)
    finally:
        manager.close()


@pytest.mark.parametrize("damaged, error", [
    ("state/_METADATA", "JSONDecodeError"),
    ("state/manifest.ocdbt", "ValueError: DATA_LOSS"),
    ("meta/metadata", "JSONDecodeError"),
    (None, "Exception: Encountered error while reading array"),  # the largest array data file
])
def test_restore_newest_skips_a_truncated_checkpoint(workdir, damaged, error):
    step_dir = workdir / "checkpoints" / "2"
    _truncate(step_dir / damaged if damaged else _largest_file(step_dir / "state"))
    restored, failed = _restore_newest(workdir)
    assert restored[0] == 1 and restored[3]["step"] == 1
    assert [step for step, _ in failed] == [2] and failed[0][1].startswith(error), failed


def test_resume_falls_back_past_a_checkpoint_that_does_not_load(workdir, capsys):
    _truncate(_largest_file(workdir / "checkpoints" / "2" / "state"))
    with (workdir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "lo')  # torn by a crash mid-write
    resumed = _run(workdir, "--steps", "3", "--checkpoint-every", "1", "--sample-tokens", "0",
                   "--resume")
    out, err = capsys.readouterr()
    assert resumed["start_step"] == 1 and "resuming from step 1" in out
    skipped, dropped = err.splitlines()
    assert skipped.startswith("warning: skipped the checkpoint of step 2, which does not load "
                              "(Exception: Encountered error while reading array")
    assert skipped.endswith(f"); moved it to {workdir / 'checkpoints' / '2.corrupt-1'}")
    assert dropped == f"warning: dropped 1 unreadable line(s) of {workdir / 'metrics.jsonl'}"
    # The resumed run saved its own checkpoints of steps 2 and 3 (step 1 aged out); the damaged
    # one is kept aside, and metrics.jsonl was rewritten without the torn line.
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == [
        "2", "2.corrupt-1", "3"]
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3]


def test_resume_with_other_model_settings_exits_2_before_reading_arrays(workdir, capsys):
    # A wider MLP: its arrays would not fit the checkpoint's, but the settings are compared
    # first, so the message names them. Step 2's meta does not load, so they are compared with
    # step 1's; nothing is set aside.
    _truncate(workdir / "checkpoints" / "2" / "meta" / "metadata")
    before = _files(workdir)
    argv = [*TINY, "--override", "mlp_hidden=128", "--workdir", str(workdir), "--steps", "3",
            "--resume"]
    _assert_usage_error(*_main(argv, capsys),
                        "--resume with settings that differ from the checkpoint's of step 1",
                        "'mlp_hidden': 128")
    assert _files(workdir) == before


def test_abandoned_checkpoint_reads_are_not_printed(monkeypatch):
    """A failed restore abandons orbax's other read coroutines; those that raise while being
    collected must not print a traceback after the one-line error. Anything else still does."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    trainer._ignore_reads_left_in_flight()
    trainer._ignore_reads_left_in_flight()  # installs once
    source = ("async def read():\n"
              "    try:\n"
              "        await sleep()\n"
              "    finally:\n"
              "        raise Exception('Encountered error while reading array')\n"
              "class sleep:\n"
              "    def __await__(self):\n"
              "        yield\n")
    for folder in ("orbax", "elsewhere"):
        scope = {}
        exec(compile(source, os.path.join(os.sep, "site", folder, "serialization.py"), "exec"),
             scope)
        coroutine = scope["read"]()
        coroutine.send(None)  # suspended at the await, like a read in flight
        del coroutine  # collected: close() raises from `finally`, an unraisable exception
    assert [str(u.exc_value) for u in seen] == ["Encountered error while reading array"]
    assert seen[0].object.cr_code.co_filename.endswith(os.path.join("elsewhere",
                                                                   "serialization.py"))
    # An abandoned orbax read task whose exception nobody retrieved: asyncio logs it.
    logged = []

    class Keep(logging.Handler):
        def emit(self, record):
            logged.append(record.getMessage())

    asyncio_logger = logging.getLogger("asyncio")
    handler = Keep()
    asyncio_logger.addHandler(handler)
    try:
        for folder in ("orbax", "elsewhere"):
            path = os.path.join(os.sep, "site", folder, "serialization.py")
            asyncio_logger.error("Task exception was never retrieved\nfuture: <Task finished "
                                 f"coro=<async_deserialize() done, defined at {path}:394>>")
        asyncio_logger.error(  # a future's, with tensorstore's error and no orbax path
            "Future exception was never retrieved\nfuture: <Future finished exception="
            "ValueError('OUT_OF_RANGE: Error reading \"opt_state/0.0\" in OCDBT database at "
            "local file \"/run/checkpoints/2/state/\"')>")
    finally:
        asyncio_logger.removeHandler(handler)
    assert len(logged) == 1 and "elsewhere" in logged[0]
    # An orbax read coroutine never awaited: its RuntimeWarning is filtered, others are not.
    with warnings.catch_warnings(record=True) as caught:
        trainer._ignore_reads_left_in_flight()
        for name in ("_read_array_index_and_device_put", "train_step"):
            warnings.warn(f"coroutine '{name}' was never awaited", RuntimeWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["coroutine 'train_step' was never awaited"]


def test_command_line_resume_with_no_checkpoint_that_loads(workdir, tmp_path):
    _truncate(_largest_file(workdir / "checkpoints" / "2" / "state"))
    _truncate(workdir / "checkpoints" / "1" / "meta" / "metadata")
    before = _files(workdir)
    result = _cli(*TINY, "--workdir", str(workdir), "--steps", "3", "--resume", cwd=tmp_path)
    _assert_usage_error(result.returncode, result.stderr,
                        f"--resume: no checkpoint in {workdir / 'checkpoints'} loads (step 2: "
                        "Exception: Encountered error while reading array",
                        "; step 1: JSONDecodeError: ")
    assert _files(workdir) == before


def _generate_script():
    spec = importlib.util.spec_from_file_location("generate", ROOT / "examples" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generate_example_samples_from_the_newest_checkpoint(workdir, capsys):
    """examples/generate.py: the model of the newest checkpoint, two prompts of different
    lengths in one batch through an int8 paged KV cache; and one line for a workdir without
    checkpoints."""
    generate = _generate_script()
    result = generate.run(generate.build_parser().parse_args([
        "--workdir", str(workdir), "--prompt", "ROMEO:", "--prompt", "A", "--new-tokens", "2",
        "--kv-dtype", "int8", "--page-size", "16", "--temperature", "0"]))
    assert result["step"] == 2
    assert [s[:len(p)] for s, p in zip(result["samples"], ("ROMEO:", "A"), strict=True)] == [
        "ROMEO:", "A"]
    assert result["decode_tokens_per_s"] > 0 and result["prefill_tokens_per_s"] > 0
    assert generate.main(["--workdir", str(workdir / "nothing")]) == 2
    assert "no checkpoints in" in capsys.readouterr().err
