"""Where one MoE layer's forward + backward spends its GPU time: torch.profiler's kernel table (CUDA time,
summed over a few steps) for the anchor, LRMoE exact and LRMoE with retention, one shape and token count.

    python3 benchmarks/profile_layer.py --shape glm-4.5-air --tokens 16384 --ratio 0.5 > profile.txt
"""
import argparse
import os
import socket

import deepspeed
import torch
from bench_layer import SHAPES, build
from torch.profiler import ProfilerActivity, profile

import lrmoe_ds


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=list(SHAPES), default="glm-4.5-air")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--policy", choices=["stash", "recompute"], default="stash")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=25, help="kernels listed per layer")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed()
    _, H, Fh, E, k = SHAPES[args.shape]
    torch.manual_seed(args.tokens)
    x = torch.randn(args.tokens, H, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    cases = [("anchor", "anchor", None), ("LRMoE exact", "lrmoe", {}),
             (f"LRMoE retention {args.ratio:g}, {args.policy}", "lrmoe",
              {"enabled": True, "retention_ratio": args.ratio, "policy": args.policy})]
    for name, kind, block in cases:
        torch.manual_seed(0)
        layer = build(kind, H, Fh, E, k).to("cuda", torch.bfloat16)
        if block is not None:
            layer.configure(lrmoe_ds.LRMoEConfig(**block))

        def step():
            layer.zero_grad(set_to_none=True)
            layer(x.detach().requires_grad_(True))[0].backward(grad)
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        print(f"## {name}: {args.shape}, {args.tokens} tokens, {args.steps} steps", flush=True)
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=args.rows,
                                        max_name_column_width=70))
        del layer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
