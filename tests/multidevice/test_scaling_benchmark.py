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
