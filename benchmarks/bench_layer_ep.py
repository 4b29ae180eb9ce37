"""One MoE layer, forward + backward, over an expert-parallel group of every launched rank (issue 5's layer
table): DeepSpeed's MoE (drop_tokens=False) with the same ep_size, LRMoE exact, and LRMoE with retention
(stash, recompute, recompute with replicas), under uniform and skewed routing, in one run.

    deepspeed --num_gpus 8 benchmarks/bench_layer_ep.py --out benchmarks/results/layer_ep8_h200.md
    deepspeed --num_gpus 2 benchmarks/bench_layer_ep.py --hidden 64 --ffn 96 --experts 8 --tokens 256 --reps 3

Each rank routes --tokens tokens of its own. Skewed routing: every token gets a constant feature that the
router weights by a Zipf-like bias (expert shares ~1/(i+1), the experts shuffled over the ranks); the
DeepSpeed layer gets the same router weights, so both route alike. Per row: median step time (the slowest
rank's; CUDA synchronised on GPUs, wall time on CPU ranks), tokens/s over all ranks, the peak memory of
a step above what was allocated before it (GPU), the all-to-all bytes the busiest rank sends in the
forward and in the backward (LRMoE's dispatcher counts them; DeepSpeed's are not counted), the most
loaded rank's retained rows over the mean, and the retained rows run on replicas (both as planned, for
the last step). bf16 on GPUs, fp32 on CPU ranks.
"""
import argparse
import shlex
import statistics
import sys
import time

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

import lrmoe_ds
from lrmoe_ds import dispatcher as dispatcher_module

DEEPSPEED = "DeepSpeed MoE (drop_tokens=False)"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=768, help="expert FFN (SwiGLU)")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top_k", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--replica_slots", type=int, default=2)
    p.add_argument("--replica_min_rows", type=int, default=lrmoe_ds.LRMoEConfig().replica_min_rows,
                   help="the replica rows' replica_min_rows (lower it for toy shapes)")
    p.add_argument("--skew", type=float, default=1.0, help="strength of the skewed routing's bias (logits)")
    p.add_argument("--routing", nargs="+", choices=["uniform", "zipf"], default=["uniform", "zipf"])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def row_specs(args):
    """(row name, "lrmoe" block, or None for DeepSpeed's layer)."""
    r = args.ratio
    retained = {"enabled": True, "retention_ratio": r}
    replicas = {"policy": "recompute", "replica_slots": args.replica_slots, "replica_min_rows": args.replica_min_rows}
    return [(DEEPSPEED, None), ("LRMoE exact (enabled false)", {}),
            (f"LRMoE retention {r:g}, stash", {**retained, "policy": "stash"}),
            (f"LRMoE retention {r:g}, recompute", {**retained, "policy": "recompute"}),
            (f"LRMoE retention {r:g}, recompute, {args.replica_slots} replica slots", {**retained, **replicas}),
            ("LRMoE retention 1, recompute", {"enabled": True, "retention_ratio": 1.0, "policy": "recompute"}),
            (f"LRMoE retention 1, recompute, {args.replica_slots} replica slots",
             {"enabled": True, "retention_ratio": 1.0, **replicas})]


def engine_of(layer, ep_size):
    """An engine only for DeepSpeed's expert-parallel groups (the layers run outside its step)."""
    model = nn.ModuleDict({"moe": layer})
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}, "steps_per_print": 10 ** 9}
    lrmoe_ds.initialize(model=model, config=config)
    return layer


def skew_router(weight, args, gen):
    """Feature 0 of every token is 1 (see make_input); the router weighs it by a shuffled Zipf-like bias."""
    E = weight.shape[0]
    bias = -torch.log(torch.arange(1, E + 1, dtype=torch.float64)) * args.skew
    with torch.no_grad():
        weight[:, 0] = (bias - bias.mean())[torch.randperm(E, generator=gen)].to(weight.dtype)


def time_step(layer, x, grad, reps, dev):
    """Median seconds of forward + backward on this rank, the ranks starting every step together."""
    times = []
    for i in range(reps + 2):
        layer.zero_grad(set_to_none=True)
        dist.barrier()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        layer(x.detach().requires_grad_(True))[0].backward(grad)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:  # two warm-up steps
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(layer, x, grad, reps, dev):
    """(ms of the slowest rank, peak GiB above the step's start (max over ranks; None on CPU), a2a bytes
    sent in the forward and the backward (max over ranks))."""
    seconds = time_step(layer, x, grad, reps, dev)
    layer.zero_grad(set_to_none=True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    dispatcher_module.COLLECTIVE_BYTES.clear()
    out = layer(x.detach().requires_grad_(True))[0]
    forward = dispatcher_module.COLLECTIVE_BYTES["all_to_all"]
    out.backward(grad)
    del out
    backward = dispatcher_module.COLLECTIVE_BYTES["all_to_all"] - forward
    peak = 0.0
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    worst = torch.tensor([seconds * 1e3, peak, forward, backward], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    ms, peak, forward, backward = worst.tolist()
    return ms, (peak if dev.type == "cuda" else None), int(forward), int(backward)


def main(argv=None):
    args = parse_args(argv)
    deepspeed.init_distributed()
    R, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", args.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    H, Fh, E, k, T = args.hidden, args.ffn, args.experts, args.top_k, args.tokens
    torch.manual_seed(0)  # the same initial weights on every rank
    ours = engine_of(lrmoe_ds.LRMoE(H, num_experts=E, ep_size=R, k=k, ffn_hidden_size=Fh).to(dev, dt), R)
    theirs = engine_of(deepspeed.moe.layer.MoE(H, expert=lrmoe_ds.SwiGLUExpert(H, Fh), num_experts=E, ep_size=R, k=k,
                                               drop_tokens=False, use_rts=False).to(dev, dt), R)
    cmd = " ".join(["deepspeed --num_gpus", str(R), "benchmarks/bench_layer_ep.py"] + [shlex.quote(a) for a in
                                                                                       sys.argv[1:] if "local_rank" not in a])
    lines = [f"# One MoE layer over {R} expert-parallel ranks, forward + backward "
             f"({torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU ranks'})", "", f"Command: `{cmd}`", "",
             f"H {H}, F {Fh} SwiGLU, {E} experts top-{k}, {T} tokens per rank, {dt}; torch {torch.__version__}, "
             f"deepspeed {deepspeed.__version__}. " + " ".join(__doc__.split("\n\n")[2].split())]
    for routing in args.routing:
        gen = torch.Generator().manual_seed(1)
        weight = ours.deepspeed_moe.gate.wg.weight
        with torch.no_grad():
            weight.copy_(torch.randn(weight.shape, generator=gen) * H ** -0.5)
            if routing == "zipf":
                skew_router(weight, args, gen)
            theirs.deepspeed_moe.gate.wg.weight.copy_(weight)
        data = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens
        x = torch.randn(T, H, generator=data).to(dev, dt)
        x[:, 0] = 1.0
        grad = torch.randn(T, H, generator=data).to(dev, dt)
        lines += ["", f"## {routing} routing", "",
                  "| layer | ms | tokens/s (all ranks) | speed vs DeepSpeed | peak GiB | a2a MB forward | "
                  "a2a MB backward | retained max/mean | rows on replicas |", "| --- " * 9 + "|"]
        base = None
        for name, block in row_specs(args):
            layer = theirs if block is None else ours
            if block is not None:
                layer.configure(lrmoe_ds.LRMoEConfig(**block))
                layer.last_stats = None
            ms, peak, fwd, bwd = measure(layer, x, grad, args.reps, dev)
            base = ms if block is None else base
            stats = getattr(layer, "last_stats", None)
            level = on_replicas = "-"
            if stats is not None:
                per_rank = stats.retained_per_rank.float()
                level, on_replicas = f"{float(per_rank.max() / per_rank.mean()):.2f}", str(stats.replica_rows)
            a2a = ("-", "-") if block is None else (f"{fwd / 1e6:.2f}", f"{bwd / 1e6:.2f}")
            lines.append(f"| {name} | {ms:.2f} | {R * T / ms * 1e3:.0f} | {base / ms:.2f} | "
                         f"{'-' if peak is None else f'{peak:.2f}'} | {a2a[0]} | {a2a[1]} | {level} | {on_replicas} |")
            if rank == 0:
                print(lines[-1], flush=True)
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    lrmoe_ds.integration.shutdown()


if __name__ == "__main__":
    main()
