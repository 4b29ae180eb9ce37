"""Where the segmented GEMM's time goes, against torch._grouped_mm: each kernel's device time under
torch.profiler (mean per call), beside the wall time of the call (CUDA events, calls back to back).
It tells a slower kernel from time between kernels (the setup kernel, launch gaps, host latency).

    python3 benchmarks/profile_gemm.py [--cells qwen3-30b-a3b:8192:uniform:down:wgrad,...] [--out FILE]
"""
import argparse
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench_grouped_gemm import SHAPES, ours_call, pass_inputs, routed_sizes, torch_call, weight_layouts
from lrmoe_ds.ops import cuda
from timing import median_ms_interleaved

DEFAULT_CELLS = ("qwen3-30b-a3b:8192:uniform:up:fwd,qwen3-30b-a3b:8192:uniform:down:wgrad,"
                 "glm-4.5-air:8192:uniform:down:dgrad,glm-4.5-air:16384:zipf:down:dgrad")


def make_calls(shape, tokens, skew, proj, pname):
    """(ours, torch's) callables for one cell, on the inputs bench_grouped_gemm.py builds."""
    H, F, E, k = SHAPES[shape]
    sizes = routed_sizes(tokens, k, E, skew, torch.Generator().manual_seed(0))
    N, K = (2 * F, H) if proj == "up" else (H, F)
    layouts, stacked = weight_layouts(E, [(N, K)])
    ws, W = layouts["separate"][0], stacked[0]
    sizes_d, offs, x, dy = pass_inputs(sizes, N, K)
    grads = [torch.empty(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(E)]
    return ours_call(pname, x, dy, ws, sizes_d, grads), torch_call(pname, x, dy, W, offs)


def kernel_times(fns, calls, block=5):
    """{who: {kernel name: (launches per call, mean device us per launch)}} over ``calls`` calls of each fn.

    One profiler session; the fns take turns in blocks of ``block`` calls back to back (the order rotating per
    round), as the wall timing runs them: the GPU stays loaded, as in training, and a drift of the clocks
    favours none. (Profiled one call at a time instead, from an idle GPU, a kernel can run much faster, presumably
    before the power limit lowers the clocks: torch's GLM 8k down dgrad took 1382 us so on an H200, against
    1610 us a call back to back; profile_gemm_h200_single_calls.md.)
    A kernel belongs to the block whose host range holds its start: each block ends in a synchronisation."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    names = list(fns)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(-(-calls // block)):
            for who in names[i % len(names):] + names[:i % len(names)]:
                with record_function(f"block:{who}"):
                    for _ in range(block):
                        fns[who]()
                    torch.cuda.synchronize()
    events = prof.events()
    blocks = [(ev.time_range.start, ev.time_range.end, ev.name[len("block:"):]) for ev in events
              if ev.device_type == torch.autograd.DeviceType.CPU and ev.name.startswith("block:")]
    total = {who: defaultdict(float) for who in fns}
    count = {who: defaultdict(int) for who in fns}
    for ev in events:
        if ev.device_type != torch.autograd.DeviceType.CUDA or ev.name.startswith("block:"):
            continue  # (the blocks' own ranges have a GPU-side copy: a span, not a kernel)
        who = next((w for start, end, w in blocks if start <= ev.time_range.start <= end), None)
        if who is not None:
            total[who][ev.name] += ev.time_range.elapsed_us()  # a kernel's own span
            count[who][ev.name] += 1
    if any(not count[who] for who in fns):  # the host ranges and the kernels' times did not line up
        raise RuntimeError(f"profile_gemm: no kernel was placed in the blocks of {[w for w in fns if not count[w]]}")
    n_calls = -(-calls // block) * block
    return {who: {name: (count[who][name] / n_calls, total[who][name] / count[who][name]) for name in total[who]}
            for who in fns}


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
             "calls of each (ours and torch's in turns, 5 calls back to back per turn, in one profiler session), "
             "every kernel's device time per launch and its launches per call.", ""]
    for cell in args.cells.split(","):
        shape, tokens, skew, proj, pname = cell.split(":")
        ours, theirs = make_calls(shape, int(tokens), skew, proj, pname)
        wall = median_ms_interleaved({"ours": ours, "torch": theirs})
        lines += [f"## {shape}, {tokens} tokens, {skew}, {proj} {pname}", "",
                  f"wall per call: ours {wall['ours'] * 1e3:.1f} us, torch {wall['torch'] * 1e3:.1f} us "
                  f"(torch / ours {wall['torch'] / wall['ours']:.3f})", "",
                  "| who | kernel | launches per call | device us per launch |", "| --- | --- | --- | --- |"]
        for who, kernels in kernel_times({"ours": ours, "torch": theirs}, args.calls).items():
            for name, (per_call, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
                lines.append(f"| {who} | `{short(name)}` | {per_call:.2f} | {us:.1f} |")
        lines.append("")
        text = "\n".join(lines)
        if args.out:
            open(args.out, "w").write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
