"""The rows the retained backward's grouped GEMMs pad, per quota allocation (CPU, no GPU needed).

A grouped GEMM tiles each expert's rows (64 rows per forward/dgrad tile on the H200, a 64-deep K step in the
wgrad) and computes a group's partial last tile in full. This counts, at bench_layer.py's shapes and routing
(its random routers, with its --skew), the retained rows per expert at retention ratios under the water-fill
(plain, and in whole tiles: ``plan_quotas(..., granule=64)``, what the layer does on CUDA) and one threshold
(``select_retained(..., total=...)`` on a grad_norm metric from random norms) and "metric_mass" (weights: each
expert's mean metric of that draw; plain and in whole tiles of 64), and the padding each leaves:
(rows rounded up to whole tiles - rows) / rows.

    python3 benchmarks/quota_tiles.py --out benchmarks/results/quota_tiles_cpu.md
"""
import argparse

import torch

import lrmoe_ds
from bench_layer import SHAPES, skew_routing
from lrmoe_ds.quotas import plan_quotas
from lrmoe_ds.retention import select_retained


def padding(sizes: torch.Tensor, tile: int) -> float:
    return float(((-sizes) % tile).sum()) / max(1, int(sizes.sum()))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--skews", type=float, nargs="+", default=[0.0, 0.1, 0.2, 0.3])
    p.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.3])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    lines = ["# Rows padded by the retained backward's GEMM tiles, per quota allocation", "",
             f"Command: `python3 benchmarks/quota_tiles.py --ratios {' '.join(f'{r:g}' for r in args.ratios)} "
             f"--skews {' '.join(f'{s:g}' for s in args.skews)}`", "",
             "Routing as in bench_layer.py (seeded random router, x ~ N(0, 1), `--skew`); "
             "pad 64 / 128 = rows added by rounding every expert's rows up to whole 64 / 128-row tiles, over the rows. "
             "max/mean: the hottest expert's routed pairs over the mean. rows kept vs plain: the tiled quotas' sum over "
             "the plain water-fill's (both within the target).", "",
             "| shape | tokens | skew | max/mean | retention | exact pad 64 | water-fill pad 64 / 128 | water-fill in tiles of 64: "
             "pad 64 / 128, rows kept vs plain | threshold pad 64 / 128 | metric_mass pad 64 / 128 | metric_mass in tiles "
             "of 64: pad 64 / 128, rows kept vs plain |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for shape, (title, H, _, E, k) in SHAPES.items():
        for T in args.tokens:
            for s in args.skews:
                torch.manual_seed(0)
                router = lrmoe_ds.LRMoE(H, num_experts=E, k=k, ffn_hidden_size=8)  # bench_layer's initialisation
                torch.manual_seed(T)
                x = torch.randn(T, H)
                if s:
                    skew_routing([router], x, s)
                gate, idx = (x @ router.deepspeed_moe.gate.wg.weight.t()).softmax(-1).topk(k, -1)
                gate = gate / gate.sum(-1, keepdim=True)
                counts = torch.bincount(idx.flatten(), minlength=E)
                order = torch.argsort(idx.flatten(), stable=True)
                norms = torch.randn(T, H).norm(dim=1) * x.norm(dim=1)
                metric = (gate.flatten() * norms.repeat_interleave(k))[order]
                for ratio in args.ratios:
                    plain = plan_quotas(counts, ratio)
                    tiled = plan_quotas(counts, ratio, granule=64)
                    mean_metric = torch.zeros(E, dtype=torch.float64).index_add_(
                        0, idx.flatten()[order], metric.double()) / counts.clamp_min(1)
                    mass = plan_quotas(counts, ratio, allocation="metric_mass", weights=mean_metric)
                    mass_tiled = plan_quotas(counts, ratio, allocation="metric_mass", weights=mean_metric, granule=64)
                    _, _, kept = select_retained(metric, counts, counts.clone(), seed=1, num_kept=T * k,
                                                 total=int(ratio * T * k))
                    lines.append(f"| {title} | {T} | {s:g} | {counts.max() / counts.float().mean():.2f} | {ratio:g} | "
                                 f"{padding(counts, 64):.3f} | {padding(plain, 64):.3f} / {padding(plain, 128):.3f} | "
                                 f"{padding(tiled, 64):.3f} / {padding(tiled, 128):.3f}, "
                                 f"{int(tiled.sum()) / int(plain.sum()):.4f} | "
                                 f"{padding(kept, 64):.3f} / {padding(kept, 128):.3f} | "
                                 f"{padding(mass, 64):.3f} / {padding(mass, 128):.3f} | "
                                 f"{padding(mass_tiled, 64):.3f} / {padding(mass_tiled, 128):.3f}, "
                                 f"{int(mass_tiled.sum()) / int(mass.sum()):.4f} |")
                    print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
