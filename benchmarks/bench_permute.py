"""Achieved bandwidth of the permutation kernels (permute = row gather, unpermute = weighted
combine) against a device-to-device copy, at the issue's shapes. Median of CUDA-event timings.

    python3 benchmarks/bench_permute.py [--out benchmarks/results/permute_h200.md]
"""
import argparse

import torch

from lrmoe_ds import ops
from timing import median_ms


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.cuda.get_device_name()
    rows = []
    big = torch.randn(512 * 2**20 // 2, dtype=torch.bfloat16, device="cuda")  # 512 MiB
    dst = torch.empty_like(big)
    ms = median_ms(lambda: dst.copy_(big), reps=30, warmup=5)
    copy_bw = 2 * big.numel() * 2 / ms / 1e6
    rows.append(("copy (ceiling)", "512 MiB bf16", ms, copy_bw))
    for H, T, K in [(2048, 8192, 8), (2048, 16384, 8), (4096, 8192, 8), (4096, 16384, 8)]:
        x = torch.randn(T, H, dtype=torch.bfloat16, device="cuda")
        P = T * K
        idx = torch.randint(0, T, (P,), device="cuda")
        ms = median_ms(lambda: ops.permute(x, idx, backend="cuda"), reps=30, warmup=5)
        rows.append(("permute", f"T={T} K={K} H={H}", ms, (2 * P * H * 2 + P * 8) / ms / 1e6))
        ms_t = median_ms(lambda: x.index_select(0, idx), reps=30, warmup=5)
        rows.append(("torch index_select", f"T={T} K={K} H={H}", ms_t, (2 * P * H * 2 + P * 8) / ms_t / 1e6))
        y = torch.randn(P, H, dtype=torch.bfloat16, device="cuda")
        rop = torch.randperm(P, device="cuda").view(T, K)
        w = torch.rand(T, K, device="cuda")
        ms = median_ms(lambda: ops.unpermute(y, rop, w, backend="cuda"), reps=30, warmup=5)
        rows.append(("unpermute", f"T={T} K={K} H={H}", ms, (P * H * 2 + T * H * 2 + P * 12) / ms / 1e6))
        # the retained backward's dx combine: half of each token's pairs at -1 (dropped), against K / 2 pairs
        # that all have rows (the same bytes): a kernel that skips dropped pairs well runs as fast as the latter
        dropped = torch.rand(T, K, device="cuda").argsort(1) < K // 2
        rop_half = rop.masked_fill(dropped, -1)
        ms = median_ms(lambda: ops.unpermute(y, rop_half, w, backend="cuda"), reps=30, warmup=5)
        moved = P // 2 * H * 2 + T * H * 2 + P * 12
        rows.append(("unpermute, half the pairs dropped", f"T={T} K={K} H={H}", ms, moved / ms / 1e6))
        rop_k2 = torch.randperm(P, device="cuda")[: P // 2].view(T, K // 2)
        w_k2 = w[:, : K // 2].contiguous()  # outside the timed call (before 2026-12-06 its copy was timed too)
        ms = median_ms(lambda: ops.unpermute(y, rop_k2, w_k2, backend="cuda"), reps=30, warmup=5)
        rows.append(("unpermute", f"T={T} K={K // 2} H={H}", ms, (moved - P * 6) / ms / 1e6))
    lines = [f"# Permutation bandwidth on {dev}", "",
             "Command: `python3 benchmarks/bench_permute.py` (bf16; bytes = reads + writes; median of 30 CUDA-event timings of 5 back-to-back calls)", "",
             "| kernel | shape | ms | GB/s | % of copy |", "| --- | --- | --- | --- | --- |"]
    for name, shape, ms, bw in rows:
        lines.append(f"| {name} | {shape} | {ms:.4f} | {bw:.0f} | {100 * bw / copy_bw:.0f}% |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        open(args.out, "w").write(text + "\n")


if __name__ == "__main__":
    main()
