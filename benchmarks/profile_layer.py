"""Where one MoE layer's forward + backward spends its time: torch.profiler's tables (kernels by GPU
time, operators by host time, summed over a few steps) and, per layer, the wall time per step against
the time the GPU was busy (the union of its kernels, copies and memsets): a layer whose GPU is busy
for much less than the wall time is bound by the host. The longest GPU idle gaps are listed with the
host operators that ran during them (what the host was doing while the GPU waited).

    python3 benchmarks/profile_layer.py --shape glm-4.5-air --tokens 16384 --ratio 0.5 > profile.txt
    python3 benchmarks/profile_layer.py --shape qwen3-30b-a3b --tokens 8192 --policies stash recompute \
        --trace /tmp/traces     # also keep each layer's Chrome trace (.json.gz) for chrome://tracing
    python3 benchmarks/profile_layer.py --dropped_router_dots saved recomputed   # the two router-dot routes
    python3 benchmarks/profile_layer.py --shape qwen3-30b-a3b --tokens 8192 --skew 0.2 \
        --allocations waterfill metric_mass                                     # two quota splits, skewed routing
"""
import argparse
import gzip
import hashlib
import json
import os
import shutil
import tempfile
import time

import torch
from bench_layer import ALLOCATIONS, SHAPES, build, init_one_process, skew_routing, to_device_flat
from torch.profiler import ProfilerActivity, profile

import lrmoe_ds

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def trace_events(trace_path):
    """The complete ("X") events of a Chrome trace that last, read once for both summaries below."""
    with open(trace_path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e.get("dur", 0) > 0]


def gpu_timeline(events, top=8):
    """From a Chrome trace: (microseconds the GPU was busy: the union of its kernel, copy and memset
    intervals; the ``top`` longest idle gaps between them, each as (gap us, the next kernel's name, the
    host operators that ran longest during the gap, with their us))."""
    spans = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") in GPU_CATEGORIES)
    busy, end, gaps = 0.0, float("-inf"), []
    for a, b, name in spans:
        if a > end and end > float("-inf"):
            gaps.append((a - end, end, a, name))
        if b > end:
            busy += b - max(a, end)
            end = b
    host = [e for e in events if e.get("cat") == "cpu_op"]
    worst = []
    for gap, a, b, name in sorted(gaps, reverse=True)[:top]:
        during = {}
        for e in host:
            overlap = min(e["ts"] + e["dur"], b) - max(e["ts"], a)
            if overlap > 0:
                during[e["name"]] = during.get(e["name"], 0.0) + overlap
        ops = sorted(during.items(), key=lambda kv: -kv[1])[:4]
        worst.append((gap, name, ops))
    return busy, worst


def kernel_name(name):
    """A kernel's name, short: C++ templates and arguments dropped; a mangled CUTLASS kernel named by a hash of
    its full name (its tile and schedule are in there), so that two configurations stay apart."""
    if name.startswith("_Z"):
        return "cutlass/" + hashlib.md5(name.encode()).hexdigest()[:6] if "cutlass" in name else name[:40]
    name = (name[5:] if name.startswith("void ") else name).replace("(anonymous namespace)::", "")
    if name.startswith("at::"):  # torch's generic kernels: the functor in the template arguments says what it is
        return name.replace("at::native::", "").replace("c10::", "").split("(")[0][:90]
    out, depth = [], 0
    for ch in name.split("(")[0]:
        depth += ch == "<"
        if depth == 0:
            out.append(ch)
        depth -= ch == ">"
    return "".join(out).strip()[:60]


def kernel_times(events):
    """{short kernel name: (launches, total us)} over a trace's kernels, copies and memsets."""
    out = {}
    for e in events:
        if e.get("cat") in GPU_CATEGORIES:
            name = kernel_name(e["name"])
            n, us = out.get(name, (0, 0.0))
            out[name] = (n + 1, us + e["dur"])
    return out


def print_kernel_table(names, per_case, steps):
    """One row per kernel, one column per layer: launches per step and ms per step, the largest first."""
    kernels = sorted({k for t in per_case for k in t}, key=lambda k: -max(t.get(k, (0, 0))[1] for t in per_case))
    print("## kernels per step (launches x, ms), every layer\n")
    print("| kernel | " + " | ".join(names) + " |")
    print("| --- |" + " --- |" * len(names))
    for k in kernels:
        cells = [f"{t[k][0] / steps:g}x {t[k][1] / 1e3 / steps:.3f}" if k in t else "-" for t in per_case]
        print(f"| {k} | " + " | ".join(cells) + " |")
    print("| total | " + " | ".join(f"{sum(v[1] for v in t.values()) / 1e3 / steps:.3f}" for t in per_case) + " |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=list(SHAPES), default="glm-4.5-air")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--policies", nargs="+", choices=["stash", "recompute"], default=["stash"])
    p.add_argument("--dropped_router_dots", nargs="+", choices=["saved", "recomputed"], default=["saved"],
                   help="each with every policy (recomputed under stash alone: recompute saves no outputs anyway)")
    p.add_argument("--allocations", nargs="+", choices=ALLOCATIONS,
                   default=["waterfill"], help="quota_allocation of the retention cases (each with every policy)")
    p.add_argument("--skew", type=float, default=0.0, help="routing skew, as bench_layer.py's --skew")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=25, help="kernels and operators listed per layer")
    p.add_argument("--trace", default=None, help="directory to keep each layer's Chrome trace in")
    args = p.parse_args()
    init_one_process()
    _, H, Fh, E, k = SHAPES[args.shape]
    torch.manual_seed(args.tokens)
    x = torch.randn(args.tokens, H, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    cases = [("anchor", "anchor", None), ("LRMoE exact", "lrmoe", {})]
    cases += [(f"LRMoE retention {args.ratio:g}, {policy}" + ("" if dots == "saved" else ", dropped dots recomputed")
               + ("" if allocation == "waterfill" else f", {allocation}"),
               "lrmoe", {"enabled": True, "retention_ratio": args.ratio, "policy": policy, "dropped_router_dots": dots,
                         "quota_allocation": allocation})
              for allocation in args.allocations for dots in args.dropped_router_dots for policy in args.policies
              if dots == "saved" or policy == "stash"]
    tmp = tempfile.mkdtemp()
    per_case = []
    for name, kind, block in cases:
        torch.manual_seed(0)
        layer = to_device_flat(build(kind, H, Fh, E, k).to(torch.bfloat16), "cuda")
        if args.skew:  # the same offsets for every case (x's feature 0 set to 1 by the first)
            skew_routing([layer], x, args.skew)
        if block is not None:
            layer.configure(lrmoe_ds.LRMoEConfig(**block))

        def step(layer=layer):
            layer.zero_grad(set_to_none=True)
            layer(x.detach().requires_grad_(True))[0].backward(grad)
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = trace_events(path)
        busy_us, gaps = gpu_timeline(events)
        per_case.append(kernel_times(events))
        busy_ms = busy_us / 1e3 / args.steps
        print(f"## {name}: {args.shape}, {args.tokens} tokens, {args.steps} steps", flush=True)
        print(f"\nper step, under the profiler: wall {wall_ms:.2f} ms, GPU busy {busy_ms:.2f} ms "
              f"({100 * busy_ms / wall_ms:.0f}%)\n")
        print("longest GPU idle gaps (over all steps), and the host operators that ran longest in each (the gap "
              "before a step's first kernel holds the .grad reset, which bench_layer.py does not time):")
        for gap, kernel, ops in gaps:
            print(f"  {gap / 1e3:.3f} ms before {kernel[:60]}: " + ", ".join(f"{n} {t / 1e3:.3f} ms" for n, t in ops))
        print()
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=args.rows,
                                        max_name_column_width=90))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows,
                                        max_name_column_width=90), flush=True)
        if args.trace:
            os.makedirs(args.trace, exist_ok=True)
            slug = name.lower().replace(" ", "_").replace(",", "").replace(".", "")
            with open(path, "rb") as src, gzip.open(os.path.join(args.trace, f"{slug}.json.gz"), "wb") as dst:
                shutil.copyfileobj(src, dst)
        del layer, prof
        torch.cuda.empty_cache()
    shutil.rmtree(tmp)
    print_kernel_table([c[0] for c in cases], per_case, args.steps)


if __name__ == "__main__":
    main()
