"""Every Pallas-Triton kernel, at the shapes of the lowering tests, compiled to AMD gfx942 and
NVIDIA sm_90a machine code on a CPU: jax lowers the public calls for an abstract device, and the
upstream `triton` package (the `test` extra pins the version that reads jaxlib's Triton IR)
compiles the kernels it emits. The method and occupancy models: tests/_machine_code.py.

Fails on: gfx942 LDS above 64 KiB, or VGPRs spilled to scratch memory; sm_90a shared memory
above 232,448 B; a hot kernel (attention forward, dK/dV, dQ; the SSD forward output) below one
wave per SIMD on gfx942; a kernel that does not compile. Only warns (SpillWarning) on sm_90a
register spills (today: attention dK/dV at head dims 80 to 256, the SSD forward output, the SSD
state terms at N 64, the SSD chunk gradients with seq_idx)
and on gfx942 VGPRs spilled into AGPRs, which use no memory (today: attention dK/dV with segment
ids and lengths, 1 VGPR). The head dim 80 attention cases are compiled as their head dim 128
twins (`SAME_AS`), after a check that only the softmax scale's constant differs.

The numbers as a Markdown table (exit status 1 on a failure):
    python tests/test_machine_code.py [--case CASE ...] [--target gfx942|sm_90a] [-j JOBS]
"""

import argparse
import concurrent.futures
import os
import re
import sys
import warnings

import _machine_code as mc
import pytest
from lowering_cases import CASES, TARGETS

try:
    import triton
except ImportError:
    triton = None

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(triton is None, reason="needs the `triton` package (the `test` extra)"),
]


class SpillWarning(UserWarning):
    """sm_90a register spills: reported, not failed."""


# The attn-h80 cases lower to the attn-h128 cases' kernels but for the softmax scale's constant
# (the head dim pads to 128; `test_h80_kernels_are_h128s_but_for_the_scale`): compiled once.
SAME_AS = {f"attn-h80-{f}": f"attn-h128-{f}"
           for f in ("causal", "window-softcap", "segments-lengths")}


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("case", [c for c in CASES if c not in SAME_AS])
def test_kernels_fit_the_target(case, target):
    rows, unmatched = mc.check(case, target)
    assert not unmatched, (
        f"{case}, {target}: no kernel name matches the hot-kernel pattern(s) {unmatched}; "
        f"kernels: {[r['kernel'] for r in rows]} (update HOT in tests/_machine_code.py)")
    for row in rows:
        if row["spill_note"]:
            warnings.warn(row["spill_note"], SpillWarning, stacklevel=1)
    failures = [f for row in rows for f in row["failures"]]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("target", list(TARGETS))
def test_h80_kernels_are_h128s_but_for_the_scale(target):
    def without_floats(kernel):
        return {**kernel, "ttir": re.sub(r"arith.constant [-+0-9.e]+ : f32", "arith.constant F",
                                         kernel["ttir"])}

    for case, same in SAME_AS.items():
        kernels = [[without_floats(k) for k in mc.kernels_of(c, target)[1]]
                   for c in (case, same)]
        assert kernels[0] == kernels[1], (case, same)


def main(argv=None):
    ap = argparse.ArgumentParser(description="The kernels' compiled resources, as Markdown.")
    ap.add_argument("--case", action="append", choices=list(CASES), help="default: all")
    ap.add_argument("--target", action="append", choices=list(TARGETS), help="default: both")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count(), help="compile workers")
    a = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
    todo = [(c, t) for c in a.case or CASES for t in a.target or TARGETS]
    lowered = [(c, t, *mc.kernels_of(c, t)) for c, t in todo]  # jax: in this process
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:  # triton: worker processes
        metrics = pool.map(lambda x: mc.compile_kernels(mc.jobs_of(x[3], x[1])), lowered)
        rows = [mc.assess(c, fam, k, t, m)
                for (c, t, fam, kernels), ms in zip(lowered, metrics, strict=True)
                for k, m in zip(kernels, ms, strict=True)]
    print(mc.markdown(rows))
    unmatched = {(c, t): mc.unmatched_hot(fam, ks) for c, t, fam, ks in lowered}
    problems = [f"{c}, {t}: no kernel matches hot pattern(s) {u}" for (c, t), u in
                unmatched.items() if u] + [f for r in rows for f in r["failures"]]
    print(f"\ntriton {triton.__version__ if triton else '(not installed)'}; {len(rows)} kernels; "
          f"{len(problems)} failure(s)", *problems, sep="\n", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
