"""Host time of one MoE layer step and of its host-heavy parts, without a profiler (which inflates
host time two- to three-fold). A layer is host-bound when its host time per step exceeds its GPU time:
retention then saves GPU time that the step cannot show.

Per layer row: the host time of the forward and of the backward, each measured from a synchronised
start to the return of the Python call (so it is what the host spends launching, plus any wait inside);
at a small token count (default 256) the GPU is idle most of the step, so forward + backward is close
to the step's wall time, and the anchor rows show where the floor lies. Then micro-timings (host
microseconds per call, no synchronisation inside the timed loop) of the router's logits GEMM in three
forms, the wgrad gradients' split (unbind vs the ops' split_groups), one grouped GEMM call over E
groups (E weight tensors, and one stacked tensor), and the autograd engine's AccumulateGrad of 2E
expert parameters (2 E leaves vs 2); and a cProfile of each LRMoE row's forward (the functions with the
most own and cumulative host time, and what the layer's forward functions call) and of its backward (run
on the calling thread for it).

    python3 benchmarks/host_time.py --shape qwen3-30b-a3b --tokens 256 --out host_time.md
"""
import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import torch.nn.functional as F
from bench_layer import ALLOCATIONS, SHAPES, build, init_one_process, to_device_flat

import lrmoe_ds
from lrmoe_ds import ops
from lrmoe_ds.ops.cuda import load as load_ext


def phase_ms(layer, x, grad, reps):
    """Median host ms of the forward and of the backward (each from a synchronised start to its return)."""
    fwd, bwd = [], []
    for i in range(reps + 3):
        layer.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_(True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = layer(xi)[0]
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        out.backward(grad)
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        if i >= 3:
            fwd.append(t1 - t0)
            bwd.append(t3 - t2)
    return statistics.median(fwd) * 1e3, statistics.median(bwd) * 1e3


def forward_profile(layer, x, grad, reps, rows=22):
    """cProfile of the forward alone (the backward runs on autograd's device thread, which cProfile does
    not see): the functions with the most own time, torch ops included, as text."""
    prof = cProfile.Profile()
    for _ in range(reps):
        layer.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_(True)
        torch.cuda.synchronize()
        prof.enable()
        out = layer(xi)[0]
        prof.disable()
        out.backward(grad)
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    stats.print_callees("forward|_backward_spec|plan_shares")
    return text.getvalue()


def backward_profile(layer, x, grad, reps, rows=40):
    """cProfile of the backward alone, run on the calling thread (autograd's multithreading off, so that
    cProfile sees it): the functions with the most own time, torch ops included, as text."""
    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        for i in range(reps + 2):  # the first two unprofiled: a first backward on this thread imports modules
            layer.zero_grad(set_to_none=True)
            out = layer(x.detach().requires_grad_(True))[0]
            torch.cuda.synchronize()
            if i >= 2:
                prof.enable()
            out.backward(grad)
            prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(rows)
    stats.print_callees("backward|select_retained|mlp_backward")
    return text.getvalue()


def host_us(fn, reps=200, after=None):
    """Host microseconds per call of fn() (no synchronisation inside the loop; ``after`` runs untimed)."""
    for _ in range(5):
        fn()
        if after:
            after()
    torch.cuda.synchronize()
    total = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        total += time.perf_counter() - t0
        if after:
            after()
    torch.cuda.synchronize()
    return total / reps * 1e6


class _HandOver(torch.autograd.Function):
    """Returns one gradient per parameter (split from one preallocated buffer: no GPU work), so that its
    backward's host time is the autograd engine's, mostly AccumulateGrad."""

    @staticmethod
    def forward(ctx, x, buf, *ws):
        ctx.buf = buf
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return (g, None, *load_ext().split_groups(ctx.buf))


def micro_rows(H, Fh, E, k, tokens):
    dev, bf = "cuda", torch.bfloat16
    x, wg = torch.randn(tokens, H, device=dev, dtype=bf), torch.randn(E, H, device=dev, dtype=bf)
    ext = load_ext()
    buf = torch.empty(E, 2 * Fh, H, device=dev, dtype=bf)
    rows = torch.randn(tokens * k, H, device=dev, dtype=bf)
    sizes = torch.full((E,), tokens * k // E, device=dev, dtype=torch.long)
    sizes[0] += tokens * k - int(sizes.sum())
    w1 = [torch.randn(2 * Fh, H, device=dev, dtype=bf) for _ in range(E)]
    stacked_w1 = torch.stack(w1)
    out = [("router logits: torch.mm(x, wg^T, out_dtype=float32)", host_us(lambda: torch.mm(x, wg.t(), out_dtype=torch.float32))),
           ("router logits: bf16 torch.mm(x, wg^T)", host_us(lambda: torch.mm(x, wg.t()))),
           ("router logits: F.linear on fp32 copies", host_us(lambda: F.linear(x.float(), wg.float()))),
           (f"split a [{E}, {2 * Fh}, {H}] gradient buffer: unbind(0)", host_us(lambda: buf.unbind(0))),
           (f"split a [{E}, {2 * Fh}, {H}] gradient buffer: ops split_groups", host_us(lambda: ext.split_groups(buf))),
           (f"one grouped GEMM call (forward, {E} groups, {tokens * k} rows)",
            host_us(lambda: ops.grouped_linear(rows, w1, sizes))),
           (f"the same with the weights as one stacked [{E}, {2 * Fh}, {H}] tensor (how the layer passes them)",
            host_us(lambda: ops.grouped_linear(rows, stacked_w1, sizes)))]
    for n in (2 * E, 2):
        params = [torch.nn.Parameter(torch.zeros(2 * Fh, H, device=dev, dtype=bf)) for _ in range(n)]
        grads_of = torch.empty(n, 2 * Fh, H, device=dev, dtype=bf)
        xs, g = torch.zeros(4, device=dev, requires_grad=True), torch.ones(4, device=dev)

        def clear(params=params):
            for p in params:
                p.grad = None
        out.append((f"autograd backward handing {n} parameters their gradients (AccumulateGrad)",
                    host_us(lambda: _HandOver.apply(xs, grads_of, *params).backward(g), reps=100, after=clear)))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=list(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--allocations", nargs="+", choices=ALLOCATIONS,
                   default=["waterfill"], help="quota_allocation of the retention rows, one row each")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    init_one_process()
    title, H, Fh, E, k = SHAPES[args.shape]
    torch.manual_seed(0)
    x = torch.randn(args.tokens, H, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    lines = [f"# Host time of one MoE layer, {torch.cuda.get_device_name()}", "",
             f"Command: `python3 benchmarks/host_time.py --shape {args.shape} --tokens {args.tokens} --ratio "
             f"{args.ratio:g}"
             + ("" if args.allocations == ["waterfill"] else " --allocations " + " ".join(args.allocations)) + "`",
             "", f"{title}, {args.tokens} tokens, bf16, torch {torch.__version__}. Host ms "
             f"per phase: median over {args.reps} steps, from a synchronised start to the Python call's return.", "",
             "| layer | forward host ms | backward host ms | sum |", "| --- | --- | --- | --- |"]
    rows = [("grouped_mm dropless (anchor)", "anchor", None), ("LRMoE exact (enabled false)", "lrmoe", {})]
    rows += [(f"LRMoE retention {args.ratio:g}, stash" + ("" if alloc == "waterfill" else f", {alloc}"), "lrmoe",
              {"enabled": True, "retention_ratio": args.ratio, "quota_allocation": alloc})
             for alloc in args.allocations]
    profiles = []
    for name, kind, block in rows:
        torch.manual_seed(0)
        layer = to_device_flat(build(kind, H, Fh, E, k).to(torch.bfloat16), "cuda")
        if block is not None:
            layer.configure(lrmoe_ds.LRMoEConfig(**block))
        f_ms, b_ms = phase_ms(layer, x, grad, args.reps)
        lines.append(f"| {name} | {f_ms:.2f} | {b_ms:.2f} | {f_ms + b_ms:.2f} |")
        print(lines[-1], flush=True)
        if kind == "lrmoe":
            profiles.append((f"forwards of {name}", forward_profile(layer, x, grad, args.reps)))
            profiles.append((f"backwards of {name}", backward_profile(layer, x, grad, args.reps)))
        del layer
    lines += ["", "| part | host us per call |", "| --- | --- |"]
    for name, us in micro_rows(H, Fh, E, k, args.tokens):
        lines.append(f"| {name} | {us:.1f} |")
        print(lines[-1], flush=True)
    for name, prof in profiles:
        lines += ["", f"cProfile of {args.reps} {name} (own time first; seconds over all of them):",
                  "", "```", prof.strip(), "```"]
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
