"""The benchmarks' own arithmetic, which GPU runs rely on and a CPU can check: how much of a
device's collective kernels overlaps its other kernels (`benchmarks._profile`)."""

from benchmarks import _profile


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
