"""Replicas for the retained backward (``replica_slots``), as planned: how level the ranks' retained rows
get, what is dropped, what crosses the network, and the host time of the plan. Host-side only (the plan
is the same on every rank and needs no GPU), at the Qwen3-30B-A3B and GLM-4.5-Air layer shapes.

Per case: R expert-parallel ranks, each with T tokens routed top-8 over 128 experts, uniform or Zipf-like
(expert shares ~ 1/(i+1), the experts shuffled over the ranks); retention 1.0 or 0.5 under the
"recompute" policy with the defaults (balance factor 1.25, replica_min_rows 1024). Columns:
- max/mean: the most loaded rank's retained rows over the mean (the backward waits for the slowest rank);
- kept: retained rows over the target (below 1 where the balance factor cut a hot rank);
- on replicas: share of the retained rows that run on a replica; local: share that runs on its own rank;
- MB out: the most any rank sends in the backward (bf16): retained rows to other ranks (x and dy, under
  recompute) and their dx back, plus replica weights out and gradients back;
- plan ms: median host time of the quotas, placement and routing (plan_with_replicas or plan_quotas and
  rank_shares) plus one rank's row runs.

    python3 benchmarks/bench_placement.py --out benchmarks/results/placement_cpu.md
"""
import argparse
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from lrmoe_ds.config import LRMoEConfig  # noqa: E402
from lrmoe_ds.placement import plan_with_replicas  # noqa: E402
from lrmoe_ds.quotas import plan_quotas, rank_shares  # noqa: E402

SHAPES = {"qwen3": (2048, 768), "glm45air": (4096, 1408)}  # hidden, expert FFN (SwiGLU)
E, K, BALANCE = 128, 8, 1.25
MIN_ROWS = LRMoEConfig().replica_min_rows


def routed_counts(R, T, skew, gen):
    """[R, E] pairs from each rank's T tokens to each expert (top-K draws), the experts' shares shuffled."""
    p = torch.ones(E, dtype=torch.float64) if skew == "uniform" else 1.0 / torch.arange(1, E + 1, dtype=torch.float64)
    p = p[torch.randperm(E, generator=gen)]
    return torch.stack([torch.multinomial(p, T * K, replacement=True, generator=gen).bincount(minlength=E)
                        for _ in range(R)])


def plan(all_counts, ratio, slots):
    n = all_counts.sum(0)
    R = all_counts.shape[0]
    if slots == 0:
        quotas = plan_quotas(n, ratio, R, balance_factor=BALANCE)
        shares = rank_shares(quotas, all_counts)
        return quotas, shares, None
    return plan_with_replicas(n, all_counts, slots, ratio, balance_factor=BALANCE, min_rows=MIN_ROWS)


def measure(all_counts, ratio, slots, shape, reps=5):
    R = all_counts.shape[0]
    El = E // R
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        quotas, shares, placed = plan(all_counts, ratio, slots)
        if placed is not None:
            placed.runs(0)
        times.append((time.perf_counter() - t0) * 1e3)
    H, F = shape
    row_bytes, dx_bytes, expert_bytes = 2 * H * 2, H * 2, 3 * H * F * 2
    if placed is None:  # [source, destination] rows: each expert's at its home rank
        flows = shares.view(R, R, El).sum(2)
        replica_rows, sent_weights = 0, [0] * R
    else:
        flows = placed.counts.view(R, R, -1).sum(2)
        replica_rows = placed.replica_rows()
        sent_weights = [len(placed.weight_exchange(r)[0]) + int((placed.replica_expert[r] >= 0).sum())
                        for r in range(R)]  # weights out from homes, gradients back from replicas
    load = flows.sum(0).double()
    total = float(load.sum())
    target = float(plan_quotas(all_counts.sum(0), ratio, R).sum())
    remote = flows - torch.diag(torch.diag(flows))
    mb_out = [(int(remote[r].sum()) * row_bytes + int(remote[:, r].sum()) * dx_bytes + sent_weights[r] * expert_bytes)
              / 1e6 for r in range(R)]
    return {"max_mean": float(load.max() / load.mean()), "kept": total / target,
            "replicas": replica_rows / total, "local": float(torch.diag(flows).sum()) / total,
            "mb_out": max(mb_out), "plan_ms": statistics.median(times)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384], help="tokens per rank")
    p.add_argument("--slots", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--ratios", type=float, nargs="+", default=[1.0, 0.5])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path)
    args = p.parse_args(argv)
    lines = ["| shape | ranks | tokens/rank | routing | retention | slots | max/mean | kept | on replicas | local "
             "| MB out | plan ms |", "|" + " --- |" * 12]
    for R in args.ranks:
        for T in args.tokens:
            for skew in ("uniform", "zipf"):
                counts = routed_counts(R, T, skew, torch.Generator().manual_seed(args.seed))
                for ratio in args.ratios:
                    for S in args.slots:
                        for name, shape in SHAPES.items():
                            m = measure(counts, ratio, S, shape)
                            lines.append(f"| {name} | {R} | {T} | {skew} | {ratio} | {S} | {m['max_mean']:.3f} | "
                                         f"{m['kept']:.3f} | {m['replicas']:.3f} | {m['local']:.3f} | "
                                         f"{m['mb_out']:.0f} | {m['plan_ms']:.2f} |")
                            print(lines[-1], flush=True)
    if args.out:
        cmd = "python3 benchmarks/bench_placement.py " + " ".join(argv if argv is not None else sys.argv[1:])
        args.out.write_text(f"# Replica placement, as planned (host only)\n\n{__doc__}\nCommand: `{cmd}`\n\n"
                            + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
