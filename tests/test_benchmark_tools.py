"""The benchmarks' own arithmetic and runs, which GPU runs rely on and a CPU can check: how much
of a device's collective kernels overlaps its other kernels and which trace lines hold kernels
(`benchmarks._profile`), and decode.py's smoke run (device time is too scarce to find a broken
benchmark there)."""

import json
import os
import pathlib
import subprocess
import sys

from benchmarks import _profile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_collective_overlap_counts_time_under_other_kernels_once():
    events = [  # (name, start_ns, duration_ns), one device
        ("ncclDevKernel_AllGather_RING_LL", 0, 100),  # under gemm from 50 to 100
        ("sm90_gemm", 50, 100),
        ("ncclKernel_SendRecv", 200, 50),  # under two overlapping fusions, 210 to 235
        ("loop_fusion", 210, 10),
        ("input_fusion", 215, 20),
        ("rcclKernel_AllReduce", 300, 40),  # alone
        ("ssd_forward_output", 400, 10),
    ]
    assert _profile.collective_overlap(events) == (190, 75)


def test_collective_overlap_without_collectives_or_compute():
    assert _profile.collective_overlap([("gemm", 0, 10)]) == (0, 0)
    assert _profile.collective_overlap([("ncclDevKernel_AllReduce", 0, 10),
                                        ("ncclDevKernel_AllReduce", 5, 10)]) == (15, 0)


def test_kernel_lines_are_the_streams_that_compute():
    assert _profile.runs_kernels("Stream #14(Compute)")
    assert _profile.runs_kernels("Stream #14(Memset,MemcpyD2D,Compute)")
    assert _profile.runs_kernels("Stream #3(Kernel)")  # ROCm's
    assert _profile.runs_kernels("Stream #7")
    assert not _profile.runs_kernels("Stream #15(MemcpyH2D)")
    assert not _profile.runs_kernels("Stream #16(Memset,MemcpyD2H)")
    assert not _profile.runs_kernels("XLA Modules")
    assert not _profile.runs_kernels("XLA Ops")


def test_the_decode_benchmark_runs_its_kernels_and_generate_on_a_cpu(tmp_path):
    """decode.py at its tiny shapes in interpret mode: the kernel rows (bf16 and int8 caches)
    and `generate` with each SSM state dtype, every record ok."""
    command = [sys.executable, "-m", "benchmarks.decode", "--interpret", "--quick",
               "--impls", "ours,ours-int8", "--shapes", "gqa", "--generate", "B2:bfloat16",
               "--ssm-dtypes", "float32,bfloat16", "--tag", "smoke", "--out-dir", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads((tmp_path / "decode_smoke.json").read_text())
    assert [(r["impl"], r["status"]) for r in data["results"]] == [("ours", "ok"),
                                                                     ("ours-int8", "ok")]
    assert [(r["ssm_dtype"], r["status"]) for r in data["generate"]] == [("float32", "ok"),
                                                                          ("bfloat16", "ok")]
    assert (tmp_path / "decode_smoke.png").is_file()
