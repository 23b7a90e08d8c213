"""Compiles the Pallas-Triton kernels to gfx942 and sm_90a machine code without a GPU, and checks
what the hardware can hold. Used by tests/test_machine_code.py (which also prints the table).

How, per case (a public call of tests/lowering_cases.py, which the lowering tests lower too)
and target ("gfx942" or "sm_90a"):
  1. lower the call ahead of time under an abstract mesh of the target device;
  2. take each `__gpu$xla.gpu.triton` custom call out of the StableHLO: its backend config holds
     the kernel's name, num_warps, num_stages and `ir`, the Triton IR (TTIR) as MLIR bytecode;
  3. re-read that bytecode with jaxlib's MLIR (its Triton dialect registered) and print it as
     TTIR text;
  4. in a worker process that imports the upstream `triton` package and not jax (each bundles
     its own LLVM and MLIR), run Triton's backend stages: make_ttir, make_ttgir,
     make_llir, then make_amdgcn for GPUTarget("hip", "gfx942", 64) (assembly only, no linking),
     or make_ptx and the wheel's `ptxas -v` for sm_90a;
  5. read the resources: gfx942 from the AMDGPU metadata of the assembly (.vgpr_count = arch +
     acc VGPRs, .agpr_count, .sgpr_count, .vgpr_spill_count, .private_segment_fixed_size =
     scratch bytes per lane, .group_segment_fixed_size = static LDS), sm_90a from ptxas;
     LDS / shared memory = Triton's `shared` (dynamic, at launch) + the static part.

Occupancy models (resident per CU / SM; only registers, LDS/shared memory and wave/warp slots):
  gfx942: 4 SIMDs per CU, 512 VGPRs per lane per SIMD (granule 8), 800 SGPRs per SIMD (granule
    16), at most 8 waves per SIMD, 64 KiB LDS per CU (granule 512 B). As in AMD's Triton tuning
    guide: workgroups/CU = min(waves/SIMD by registers * 4 // num_warps, 65536 // LDS), and
    waves/SIMD = workgroups/CU * num_warps / 4.
  sm_90a: 64 Ki registers per SM in 4 partitions (per warp in units of 256), 64 warps and 32
    blocks per SM, 228 KiB shared memory per SM with 1 KiB reserved per block.

Nothing here imports jax or triton at module level: the worker (`python _machine_code.py
--worker`, jobs as JSON on stdin) must not load jax.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

LDS_LIMIT = 65536  # gfx942: LDS per workgroup (and per CU)
SHARED_LIMIT = 232448  # sm_90a: shared memory per block (227 KiB, opt-in)
MIN_HOT_WAVES = 1  # gfx942: waves per SIMD a hot kernel keeps resident

# Hot kernels, by what their pallas_call `name=` contains (pallas_kernels/attention/*.py,
# pallas_kernels/mamba2/*.py, pallas_kernels/kv_cache/*.py, pallas_kernels/norm/*.py,
# pallas_kernels/conv/*.py; SSD scan kernels launched together get their names joined by "_").
HOT = {
    "attention": (r"attention_forward", r"attention_dkv", r"attention_dq"),
    "ssd": (r"ssd_forward_output",),
    "state_update": (),
    "decode_step": (),
    "decode": (r"attention_with_kv_cache",),
    "norm": (r"rms_norm_gated_forward", r"rms_norm_gated_backward"),
    "conv": (r"causal_conv1d_forward", r"causal_conv1d_backward"),
    "mixer": (r"ssd_forward_output", r"rms_norm_gated_forward", r"rms_norm_gated_backward",
              r"causal_conv1d_forward", r"causal_conv1d_backward"),
}


# ------------------------------------------------------------------------------------------
# Lowering and extraction (imports jax).
# ------------------------------------------------------------------------------------------

def _operations(op):
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                yield child.operation
                yield from _operations(child.operation)


def lower_kernels(case, target):
    """(family, kernels) of `lowering_cases.CASES[case]` lowered for `target`; a kernel is a
    dict with name, num_warps, num_stages and ttir (text)."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering as triton_lowering
    from lowering_cases import TRITON_CALL, lower

    family, lowered = lower(case, target)
    kernels = []
    for op in _operations(lowered.compiler_ir("stablehlo").operation):
        if (op.name != "stablehlo.custom_call"
                or ir.StringAttr(op.attributes["call_target_name"]).value != TRITON_CALL):
            continue
        # jax 0.12 keeps the dictionary in `mhlo.backend_config`.
        names = {op.attributes[i].name for i in range(len(op.attributes))}
        config = ir.DictAttr(
            op.attributes["mhlo.backend_config" if "mhlo.backend_config" in names
                          else "backend_config"])
        with triton_lowering._new_ir_context():  # jaxlib's MLIR with the Triton dialect
            ttir = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes).operation.get_asm()
        kernels.append(dict(
            name=ir.StringAttr(config["name"]).value,
            num_warps=ir.IntegerAttr(config["num_warps"]).value,
            num_stages=ir.IntegerAttr(config["num_stages"]).value,
            ttir=ttir))
    return family, kernels


# ------------------------------------------------------------------------------------------
# Compilation with upstream Triton (worker process, no jax).
# ------------------------------------------------------------------------------------------

def _compile(ttir, target, num_warps, num_stages):
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget, Language
    from triton.compiler.compiler import make_backend

    gpu = GPUTarget("hip", "gfx942", 64) if target == "gfx942" else GPUTarget("cuda", 90, 32)
    last = "amdgcn" if target == "gfx942" else "ptx"
    backend = make_backend(gpu)
    options = backend.parse_options(dict(num_warps=num_warps, num_stages=num_stages))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "kernel.ttir")
        path.write_text(ttir)
        src = ir.parse_mlir_module(str(path), context)
        src.context = context
        stages = {}
        backend.add_stages(stages, options, Language.TRITON)
        metadata = dict(hash="0" * 64, target=gpu, **options.__dict__)  # as triton.compile
        for name, stage in stages.items():
            src = stage(src, metadata)
            if name == last:
                break
        metrics = dict(shared=metadata.get("shared") or 0)
        if target == "gfx942":
            def meta(key):
                m = re.search(rf"^[\s-]*\.{key}:\s+(\d+)", src, re.MULTILINE)
                return int(m.group(1)) if m else 0

            return dict(metrics, vgpr=meta("vgpr_count"), agpr=meta("agpr_count"),
                        sgpr=meta("sgpr_count"), vgpr_spill=meta("vgpr_spill_count"),
                        sgpr_spill=meta("sgpr_spill_count"),
                        scratch=meta("private_segment_fixed_size"),
                        static_lds=meta("group_segment_fixed_size"))
        from triton.backends.nvidia.compiler import get_ptxas

        Path(tmp, "kernel.ptx").write_text(src)
        log = subprocess.run(
            [get_ptxas(gpu.arch).path, "-v", "--gpu-name=sm_90a", str(Path(tmp, "kernel.ptx")),
             "-o", str(Path(tmp, "kernel.cubin"))],
            capture_output=True, text=True, check=True).stderr

    def ptxas(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    return dict(metrics, regs=ptxas(r"Used (\d+) registers"),
                spill_stores=ptxas(r"(\d+) bytes spill stores"),
                spill_loads=ptxas(r"(\d+) bytes spill loads"),
                static_smem=ptxas(r"(\d+) bytes smem"))


def _worker():
    results = []
    for job in json.load(sys.stdin):
        try:
            results.append(_compile(**job))
        except Exception as e:  # noqa: BLE001 - reported per kernel by the caller
            import triton

            detail = getattr(e, "stderr", "") or ""  # ptxas' message
            results.append(dict(error=f"{type(e).__name__}: {str(e)[-1500:]} {detail[-1500:]} "
                                      f"(triton {triton.__version__}; the test extra pins the "
                                      "one that reads jaxlib's Triton IR)"))
    json.dump(results, sys.stdout)


def compile_kernels(jobs, timeout=900):
    """Metrics of each job (dict(ttir, target, num_warps, num_stages)), compiled one after the
    other in one worker process."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, minus its warning
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker"],
                              input=json.dumps(jobs), capture_output=True, text=True, env=env,
                              timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"compile worker exit {proc.returncode}: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


# ------------------------------------------------------------------------------------------
# Occupancy, limits, rows.
# ------------------------------------------------------------------------------------------

def _up(x, granule):
    return -(-x // granule) * granule


def gfx942_waves_per_simd(vgpr, sgpr, lds, num_warps):
    by_regs = min(8, 512 // max(_up(vgpr, 8), 8), 800 // max(_up(sgpr, 16), 16))
    workgroups = min(by_regs * 4 // num_warps, LDS_LIMIT // _up(lds, 512) if lds else 10**9)
    return workgroups * num_warps / 4


def sm90_blocks_per_sm(regs, smem, num_warps):
    per_warp = _up(max(regs, 1) * 32, 256)
    return min(4 * (16384 // per_warp) // num_warps, 233472 // _up(smem + 1024, 128),
               64 // num_warps, 32)


def assess(case, family, kernel, target, m):
    """A table row for one compiled kernel; row["failures"] lists what breaks a limit,
    row["spill_note"] the spills that are reported only: sm_90a spills, and gfx942 VGPR spills
    into AGPRs (no scratch memory)."""
    name, warps = kernel["name"], kernel["num_warps"]
    hot = any(re.search(p, name) for p in HOT[family])
    row = dict(case=case, kernel=name, target=target, hot=hot, warps=warps,
               stages=kernel["num_stages"], failures=[], spill_note=None)
    where = f"{name} ({case}, {target})"
    if "error" in m:
        row.update(mem="-", regs="-", spills="-", occupancy="-")
        row["failures"].append(f"{where}: does not compile: {m['error']}")
        return row
    if target == "gfx942":
        lds = m["shared"] + m["static_lds"]
        waves = gfx942_waves_per_simd(m["vgpr"], m["sgpr"], lds, warps)
        row.update(mem=lds, regs=f"{m['vgpr']} ({m['agpr']} AGPR) / {m['sgpr']}",
                   spills=f"{m['vgpr_spill']} VGPR, {m['sgpr_spill']} SGPR, "
                          f"{m['scratch']} B scratch",
                   occupancy=f"{waves:g} waves/SIMD")
        if lds > LDS_LIMIT:
            row["failures"].append(f"{where}: LDS {lds} B > {LDS_LIMIT} B")
        if m["scratch"]:
            row["failures"].append(f"{where}: {m['vgpr_spill']} VGPRs spilled to scratch memory, "
                                   f"{m['scratch']} B per lane > 0")
        elif m["vgpr_spill"]:  # no scratch: spilled into AGPRs (register moves, no memory)
            row["spill_note"] = f"{where}: {m['vgpr_spill']} VGPRs spilled into AGPRs"
        if hot and waves < MIN_HOT_WAVES:
            row["failures"].append(f"{where}: hot kernel at {waves:g} waves per SIMD "
                                   f"< {MIN_HOT_WAVES} ({m['vgpr']} VGPRs, {lds} B LDS, "
                                   f"{warps} warps)")
    else:
        smem = m["shared"] + m["static_smem"]
        blocks = sm90_blocks_per_sm(m["regs"], smem, warps)
        row.update(mem=smem, regs=str(m["regs"]),
                   spills=f"{m['spill_stores']} B stores, {m['spill_loads']} B loads",
                   occupancy=f"{blocks * warps}/64 warps ({blocks} blocks/SM)")
        if smem > SHARED_LIMIT:
            row["failures"].append(f"{where}: shared memory {smem} B > {SHARED_LIMIT} B")
        if m["spill_stores"] or m["spill_loads"]:
            row["spill_note"] = f"{where}: spills {row['spills']} ({m['regs']} registers)"
    return row


def kernels_of(case, target):
    """(family, kernels): `case` lowered for `target`, each distinct kernel once."""
    family, kernels = lower_kernels(case, target)
    distinct = {(k["ttir"], k["num_warps"], k["num_stages"]): k for k in kernels}
    return family, list(distinct.values())


def jobs_of(kernels, target):
    return [dict(ttir=k["ttir"], target=target, num_warps=k["num_warps"],
                 num_stages=k["num_stages"]) for k in kernels]


def unmatched_hot(family, kernels):
    """The hot-kernel patterns of `family` that name no kernel (a kernel was renamed)."""
    return [p for p in HOT[family] if not any(re.search(p, k["name"]) for k in kernels)]


def check(case, target):
    """(rows, unmatched hot-kernel patterns) of `case` on `target`."""
    family, kernels = kernels_of(case, target)
    metrics = compile_kernels(jobs_of(kernels, target))
    rows = [assess(case, family, k, target, m) for k, m in zip(kernels, metrics, strict=True)]
    return rows, unmatched_hot(family, kernels)


COLUMNS = [("case", "case"), ("kernel", "kernel"), ("target", "target"), ("hot", "hot"),
           ("warps", "warps"), ("stages", "stages"), ("mem", "LDS / shared B"),
           ("regs", "VGPR (AGPR) / SGPR, or registers"), ("spills", "spills"),
           ("occupancy", "occupancy (est.)"), ("status", "status")]


def markdown(rows):
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |",
             "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for r in rows:
        # A failure reads "kernel (case, target): what"; the row names the kernel already.
        status = ("FAIL: " + "; ".join(f.split(": ", 1)[1] for f in r["failures"])
                  if r["failures"] else "ok")
        cells = dict(r, hot="hot" if r["hot"] else "", status=status)
        lines.append("| " + " | ".join(str(cells[c]) for c, _ in COLUMNS) + " |")
    return "\n".join(lines)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker()
