"""Host time of the retention plan that every training forward of a retaining layer makes (quotas.plan_quotas,
"metric_mass"'s weights, one rank's shares), on this machine's CPU: no GPU needed. Where a layer step is bound by
its host (few tokens per GPU), this time is part of the step's.

Counts of --experts experts around --tokens * --top_k / experts pairs each (10% spread), the CUDA path's 64-row
granule; per function the best and the median of --blocks blocks of 100 calls (the best is the least disturbed).

    python3 benchmarks/plan_time.py --out benchmarks/results/plan_time_cpu.md
"""
import argparse
import platform
import statistics
import time

import torch

from lrmoe_ds.quotas import mass_weights, plan_quotas, rank_shares


def per_call_us(f, blocks):
    best = []
    for _ in range(blocks):
        ts = []
        for _ in range(100):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        best.append(min(ts) * 1e6)
    return min(best), statistics.median(best)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--top_k", type=int, default=8)
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    E, mean = args.experts, args.tokens * args.top_k / args.experts
    n = (torch.randn(E) * 0.1 * mean + mean).round().long().clamp_min(0)
    mass = (torch.rand(E) * n.double()).float()
    w = mass_weights(mass, n)
    rows = [("metric_mass weights (quotas.mass_weights)", lambda: mass_weights(mass, n)),
            ("quotas, water-fill (plan_quotas, granule 64)",
             lambda: plan_quotas(n, args.ratio, 1, allocation="waterfill", granule=64)),
            ("quotas, metric_mass (plan_quotas, granule 64)",
             lambda: plan_quotas(n, args.ratio, 1, allocation="metric_mass", granule=64, weights=w)),
            ("one rank's shares (rank_shares)", lambda: rank_shares(n, n.view(1, -1)))]
    lines = [f"# Host time of the retention plan, {platform.processor() or platform.machine()}", "",
             f"Command: `python3 benchmarks/plan_time.py --experts {E} --tokens {args.tokens} --top_k {args.top_k} "
             f"--ratio {args.ratio:g}`", "",
             f"{E} experts, about {mean:.0f} pairs each, retention {args.ratio:g}, torch {torch.__version__}; "
             f"best and median over {args.blocks} blocks of each block's fastest of 100 calls.", "",
             "| part | best us | median us |", "| --- | --- | --- |"]
    for name, f in rows:
        best, med = per_call_us(f, args.blocks)
        lines.append(f"| {name} | {best:.1f} | {med:.1f} |")
        print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
