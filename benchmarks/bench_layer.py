"""One MoE layer, forward + backward, on one GPU: LRMoE (exact, and with retention) against DeepSpeed's
MoE (drop_tokens=False) and a plain dropless layer on torch._grouped_mm (the anchor), same run.

    python3 benchmarks/bench_layer.py --out benchmarks/results/layer_h200.md

bf16, Qwen3-30B-A3B expert shape by default (H 2048, F 768 SwiGLU, 128 experts, top-8); median of
CUDA-event timings of a full forward + backward; useful FLOPs = 3 passes x 2 x pairs x 3 H F.
"""
import argparse
import os
import socket

import torch
import torch.nn.functional as F
from torch import nn

import deepspeed
import lrmoe_ds
from lrmoe_ds import ops
from timing import median_ms


class GroupedMMMoE(nn.Module):
    """Dropless top-k MoE on torch._grouped_mm with stacked [E, ...] expert weights (the anchor)."""

    def __init__(self, H, Fh, E, k):
        super().__init__()
        self.k, self.E = k, E
        self.wg = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, H, 2 * Fh) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, Fh, H) * Fh ** -0.5)

    def forward(self, x):
        scores = torch.softmax(F.linear(x.float(), self.wg.weight.float()), -1)
        w, idx = scores.topk(self.k, -1)
        w = w / w.sum(-1, keepdim=True)
        order = idx.flatten().argsort(stable=True)
        counts = torch.bincount(idx.flatten(), minlength=self.E)
        offs = counts.cumsum(0).to(torch.int32)
        rows = x[order // self.k]
        h = torch._grouped_mm(rows, self.w1, offs=offs)
        g, u = h.chunk(2, -1)
        y = torch._grouped_mm(F.silu(g) * u, self.w2, offs=offs)
        out = torch.zeros_like(x).index_add_(0, order // self.k, y * w.flatten()[order, None].to(y.dtype))
        return out, None, counts


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed()
    H, Fh, E, k = args.hidden, args.ffn, args.experts, args.k
    dev, dt = "cuda", torch.bfloat16
    cuda_ok, why = ops.cuda_ops_status()
    layers = {"grouped_mm dropless (anchor)": GroupedMMMoE(H, Fh, E, k)}
    ds = deepspeed.moe.layer.MoE(H, expert=lrmoe_ds.SwiGLUExpert(H, Fh), num_experts=E, k=k, drop_tokens=False,
                                 use_rts=False, top2_2nd_expert_sampling=False)
    ds.set_deepspeed_parallelism()
    layers["DeepSpeed MoE (drop_tokens=False)"] = ds
    for name, cfg in [("LRMoE exact", {}), ("LRMoE retention 0.5", {"enabled": True, "retention_ratio": 0.5})]:
        layer = lrmoe_ds.LRMoE(H, num_experts=E, k=k, ffn_hidden_size=Fh)
        layer.configure(lrmoe_ds.LRMoEConfig(**cfg))
        layers[name] = layer
    rows = []
    for T in args.tokens:
        x = torch.randn(T, H, device=dev, dtype=dt)
        grad = torch.randn_like(x)
        flops = 3 * 2 * T * k * 3 * H * Fh
        times = {}
        for name, layer in layers.items():
            layer = layer.to(dev, dt)

            def step():
                xi = x.detach().requires_grad_(True)
                out = layer(xi)[0]
                out.backward(grad)

            times[name] = median_ms(step, reps=args.reps, warmup=3, inner=1)
            layer.zero_grad(set_to_none=True)
            layers[name] = layer.cpu()
            torch.cuda.empty_cache()
        anchor = times["grouped_mm dropless (anchor)"]
        for name, ms in times.items():
            rows.append(f"| {T} | {name} | {ms:.2f} | {flops / ms / 1e9:.0f} | {anchor / ms:.2f} |")
    lines = [f"# One MoE layer, forward + backward, {torch.cuda.get_device_name()} (torch {torch.__version__})", "",
             f"Command: `python3 benchmarks/bench_layer.py` (bf16; H {H}, F {Fh} SwiGLU, {E} experts, top-{k}; "
             f"median of {args.reps} CUDA-event timings). lrmoe_ds CUDA ops: {'built' if cuda_ok else why}.",
             "TFLOP/s counts the exact layer's useful expert FLOPs (also for retention, which does less work); "
             "ratio = anchor time / this time.", "",
             "| tokens | layer | ms | TFLOP/s | ratio to anchor |", "| --- | --- | --- | --- | --- |"] + rows
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
