"""Where the segmented GEMM's time goes, against torch._grouped_mm: each kernel's device time under
torch.profiler (mean per call), beside the wall time of the call (CUDA events, calls back to back).
It tells a slower kernel from time between kernels (the setup kernel, launch gaps, host latency).

    python3 benchmarks/profile_gemm.py [--cells qwen3-30b-a3b:8192:uniform:down:wgrad,...] [--out FILE]
"""
import argparse
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from bench_grouped_gemm import SHAPES, routed_sizes, weight_layouts
from lrmoe_ds import ops
from lrmoe_ds.ops import cuda
from timing import median_ms_interleaved

DEFAULT_CELLS = ("qwen3-30b-a3b:8192:uniform:up:fwd,qwen3-30b-a3b:8192:uniform:down:wgrad,"
                 "glm-4.5-air:8192:uniform:down:dgrad,glm-4.5-air:16384:zipf:down:dgrad")


def make_calls(shape, tokens, skew, proj, pname):
    """(ours, torch's) callables for one cell, on the inputs bench_grouped_gemm.py builds."""
    H, F, E, k = SHAPES[shape]
    sizes = routed_sizes(tokens, k, E, skew, torch.Generator().manual_seed(0))
    M = int(sizes.sum())
    N, K = (2 * F, H) if proj == "up" else (H, F)
    layouts, stacked = weight_layouts(E, [(N, K)])
    ws, W = layouts["separate"][0], stacked[0]
    sizes_d, offs = sizes.cuda(), torch.cumsum(sizes, 0).to(torch.int32).cuda()
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    grads = [torch.empty(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(E)]
    if pname == "fwd":
        return (lambda: ops.grouped_linear(x, ws, sizes_d, backend="cuda"),
                lambda: torch._grouped_mm(x, W.transpose(-2, -1), offs=offs))
    if pname == "dgrad":
        return (lambda: ops.grouped_linear_dgrad(dy, ws, sizes_d, backend="cuda"),
                lambda: torch._grouped_mm(dy, W, offs=offs))
    return (lambda: ops.grouped_linear_wgrad(dy, x, sizes_d, out=grads, backend="cuda"),
            lambda: torch._grouped_mm(dy.t(), x, offs=offs))


def kernel_times(fn, calls):
    """{kernel name: (launches per call, mean device us per launch)} over ``calls`` calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total, count = defaultdict(float), defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name] += ev.time_range.elapsed_us()  # a kernel's own span
            count[ev.name] += 1
    return {name: (count[name] / calls, total[name] / count[name]) for name in total}


def short(name, width=90):
    return name if len(name) <= width else name[:width - 3] + "..."


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cells", default=DEFAULT_CELLS, help="shape:tokens:routing:proj:pass, comma-separated")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ext = cuda.load()
    lines = [f"# Segmented GEMM kernels against torch._grouped_mm, {torch.cuda.get_device_name()}", "",
             f"Command: `python3 benchmarks/profile_gemm.py {' '.join(sys.argv[1:])}` (torch {torch.__version__}; "
             f"our default kernels here: {ext.gemm_default_config()}, built with CUTLASS {ext.cutlass_version()}, peak memory bandwidth "
             f"{ext.peak_memory_tbps():.2f} TB/s). Per cell: the wall time per call (median of CUDA-event timings "
             f"of 5 calls back to back, the two timed in turns) and, under torch.profiler over {args.calls} "
             "calls, every kernel's device time per launch and its launches per call.", ""]
    for cell in args.cells.split(","):
        shape, tokens, skew, proj, pname = cell.split(":")
        ours, theirs = make_calls(shape, int(tokens), skew, proj, pname)
        wall = median_ms_interleaved({"ours": ours, "torch": theirs})
        lines += [f"## {shape}, {tokens} tokens, {skew}, {proj} {pname}", "",
                  f"wall per call: ours {wall['ours'] * 1e3:.1f} us, torch {wall['torch'] * 1e3:.1f} us "
                  f"(torch / ours {wall['torch'] / wall['ours']:.3f})", "",
                  "| who | kernel | launches per call | device us per launch |", "| --- | --- | --- | --- |"]
        for who, fn in (("ours", ours), ("torch", theirs)):
            for name, (per_call, us) in sorted(kernel_times(fn, args.calls).items(), key=lambda kv: -kv[1][1]):
                lines.append(f"| {who} | `{short(name)}` | {per_call:.2f} | {us:.1f} |")
        lines.append("")
        text = "\n".join(lines)
        if args.out:
            open(args.out, "w").write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
