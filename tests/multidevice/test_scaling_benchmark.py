"""`benchmarks/scaling.py` end to end on 2 of the 8 simulated devices, with the jnp references
(`--implementation xla`) at toy sizes: every section's rows, the columns a multi-GPU run
reports (efficiency, memory against one device's, fsdp), the JSON and the plot. A run on
lent GPUs must not be the first to execute it.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (`.ci/run` does).
"""

import json

import pytest

from benchmarks import scaling

pytestmark = pytest.mark.multidevice


def test_every_section_runs_and_reports_its_columns(tmp_path, monkeypatch):
    monkeypatch.setattr(scaling, "BATCH_S", 1e-9)  # batches of one call: this times nothing
    # 8 of the mixer's 80 heads: the section's code paths are the same, its steps 10x cheaper.
    monkeypatch.setattr(scaling, "SSD", {**scaling.SSD, "heads": 8})
    scaling.main(["--implementation", "xla", "--devices", "2", "--sections",
                  "attention,ssd,train", "--attention-lengths", "128", "--ssd-lengths", "512",
                  "--train-preset", "tiny", "--train-batch", "2", "--train-seq-len", "32",
                  "--rounds", "1", "--profile", "--tag", "smoke", "--out-dir", str(tmp_path)])
    payload = json.loads((tmp_path / "scaling_smoke.json").read_text())
    rows = payload["scaling"]
    assert payload["attention_shape"] == dict(heads=32, kv_heads=8, head_dim=128)
    assert {(r["section"], r["devices"]) for r in rows} == {
        (s, n) for s in ("attention", "ssd", "train") for n in (1, 2)}
    assert sum(r["section"] == "attention" for r in rows) == 8  # 2 strategies x 2 orders
    assert [r["variant"].split(",")[0] for r in rows if r["section"] == "train"] == [
        "tiny data parallel", "tiny data parallel", "tiny fsdp"]
    for r in rows:
        assert r["ms"] > 0 and r["efficiency"] > 0 and r["bytes_per_device"] > 0
        assert r["communication"] is None  # no GPU kernels in a CPU trace
        if r["devices"] == 2:
            assert r["memory_ratio"] > 0
    assert (tmp_path / "scaling_smoke.png").stat().st_size > 0


def test_a_failing_step_is_a_row_and_the_run_goes_on(tmp_path, monkeypatch):
    """Out of memory on the sharded steps (say): rows with the error, the direct call's
    measured, the run finished."""
    ssd_step = scaling._ssd_step

    def failing(*args, mesh=None, **kw):
        if mesh is not None:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
        return ssd_step(*args, mesh=mesh, **kw)

    monkeypatch.setattr(scaling, "_ssd_step", failing)
    monkeypatch.setattr(scaling, "BATCH_S", 1e-9)
    scaling.main(["--implementation", "xla", "--devices", "2", "--sections", "ssd",
                  "--ssd-lengths", "512", "--rounds", "1", "--tag", "oom",
                  "--out-dir", str(tmp_path)])
    rows = json.loads((tmp_path / "scaling_oom.json").read_text())["scaling"]
    assert [(r["devices"], r["error"]) for r in rows] == [
        (n, "RuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
        for n in (1, 2)]
