"""Compile gate: every .cu file of ops/csrc compiles for sm_90a with this machine's nvcc
(compile only, no GPU needed). Skips, saying why, without nvcc or CUTLASS headers.

A CUTLASS grouped-GEMM unit takes about 3.5 GB and a minute in cicc, the small kernels seconds each. Short
of memory (no swap), a compile does not fail at once, it crawls: in CI two compiles at once were killed
after 2000 s, and then one at a time ran past the 90-minute limit, while our own machine's /dev/shm held
20 GB of DeepSpeed's leaked all-reduce segments (3 GB left available). So the gate first checks the memory
it needs, compiles two units at once only where there is memory for two (and two cores), the longest
first, and bounds each compile, failing with the reason either way."""
import glob
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

CSRC = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "ops", "csrc"))


def _cutlass_includes():
    sys.path.insert(0, os.path.dirname(CSRC))
    try:
        import builder
        return builder.cutlass_include_dirs()
    except (ImportError, RuntimeError) as exc:
        pytest.skip(f"CUTLASS headers unavailable: {exc}")
    finally:
        sys.path.pop(0)


NEEDS_GB = 5.0          # the largest unit's 3.5 GB peak, with room for pytest and the page cache
COMPILE_TIMEOUT_S = 900  # 59 s for the largest unit on an idle 2-core machine


def _available_gb():
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) / 2**20


def _shm_gb():
    paths = glob.glob("/dev/shm/*")
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p)) / 2**30, len(paths)


def test_every_cu_compiles_for_sm90a(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH")
    includes = _cutlass_includes()
    sources = sorted(glob.glob(os.path.join(CSRC, "*.cu")))
    assert sources, "no .cu sources found"
    available = _available_gb()
    shm_gb, shm_files = _shm_gb()
    assert available >= NEEDS_GB, (
        f"only {available:.1f} GB of memory available; the CUTLASS units need {NEEDS_GB} GB to compile in "
        f"reasonable time. /dev/shm holds {shm_gb:.1f} GB in {shm_files} files (DeepSpeed's CPU all-reduce "
        "leaves deepspeed_allreduce_buffer_* there; .ci/run removes those no process maps)")

    def compile_one(src):
        obj = tmp_path / (os.path.basename(src) + ".o")
        cmd = [nvcc, "-std=c++17", "-O1", "-DNDEBUG", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
               "-I", CSRC] + [f"-I{p}" for p in includes] + ["-c", src, "-o", str(obj)]
        t0 = time.time()
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            res = subprocess.CompletedProcess(cmd, -9, "", f"timed out after {COMPILE_TIMEOUT_S} s "
                                              f"({_available_gb():.1f} GB of memory available now)")
        return src, res, time.time() - t0

    # two at a time where memory and cores allow (the suite's longest test: 420 s serially on 2 cores); the
    # CUTLASS units (gemm_*.cu: about a minute each, the rest seconds) first
    workers = 2 if available >= 2 * NEEDS_GB and (os.cpu_count() or 1) >= 2 else 1
    ordered = sorted(sources, key=lambda src: (not os.path.basename(src).startswith("gemm_"), src))
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(compile_one, ordered))
    failed = [(s, r) for s, r, _ in results if r.returncode != 0]
    for s, r, dt in results:
        print(f"{os.path.basename(s)}: {'ok' if r.returncode == 0 else 'FAILED'} in {dt:.0f} s")
    killed = [os.path.basename(s) for s, r in failed if r.returncode in (-9, 137)]
    assert not failed, (f"killed or timed out (out of memory?): {killed}\n\n" if killed else "") + "\n\n".join(
        f"{s}:\n{r.stderr[-4000:]}" for s, r in failed)
