"""One MoE layer, forward + backward, on one GPU (bf16): DeepSpeed's MoE (drop_tokens=False), a plain
dropless layer on torch._grouped_mm (the anchor), LRMoE exact and LRMoE with retention under the
"stash" and "recompute" policies, all in one run per shape and token count.

    python3 benchmarks/bench_layer.py --out benchmarks/results/layer_retention_h200.md

Per row: median of CUDA-event timings of a full forward + backward, the rows of a table timed in turns
(timing.median_ms_interleaved: each round times every row once, in an order shuffled per round, so that a
drift of the GPU's clocks favours no row, nor does a light row before it; the .grad reset and the layer's reconfiguration before each step
are not timed; by default each timing is one step from an idle GPU, so the host's latency to the first
kernel counts in full; `--back_to_back N` times N steps in a row instead); speed ratios
(the anchor's, DeepSpeed's time / this time); the activation memory held after the forward and the
peak memory of one forward + backward, both above what was allocated before the forward (layer and
inputs; .grad is set to None before every step, as DeepSpeed's optimizers leave it), in GiB.
TFLOP/s counts the exact layer's useful expert FLOPs (3 passes x 2 x pairs x 3 H F), also for
retention, which does less work. All the layers of a shape are on the GPU together (bf16).
"""
import argparse
import os
import shlex
import socket
import sys
import typing

import deepspeed
import torch
import torch.nn.functional as F
from timing import median_ms_interleaved
from torch import nn

import lrmoe_ds
from lrmoe_ds import ops
from lrmoe_ds.ops import cuda

# the config's quota_allocation values (--allocations of this script, profile_layer.py and host_time.py)
ALLOCATIONS = typing.get_args(lrmoe_ds.LRMoEConfig.model_fields["quota_allocation"].annotation)

SHAPES = {  # --shapes name: (title, hidden, expert ffn (SwiGLU), experts, top-k)
    "qwen3-30b-a3b": ("Qwen3-30B-A3B", 2048, 768, 128, 8),
    "glm-4.5-air": ("GLM-4.5-Air", 4096, 1408, 128, 8),
}
ANCHOR, DEEPSPEED = "grouped_mm dropless (anchor)", "DeepSpeed MoE (drop_tokens=False)"
GIB = 2 ** 30


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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--ratios", type=float, nargs="+", default=[1.0, 0.75, 0.5, 0.25],
                   help="retention_ratio of the enabled LRMoE rows")
    p.add_argument("--policies", nargs="+", choices=["stash", "recompute", "auto"], default=["stash", "recompute"])
    p.add_argument("--router_grad", choices=["exact", "retained"], default="exact")
    p.add_argument("--metric", choices=["grad_norm", "gate", "uniform"], default="grad_norm")
    p.add_argument("--allocations", nargs="+", choices=ALLOCATIONS,
                   default=["waterfill"], help="quota_allocation of the enabled rows (each with every ratio)")
    p.add_argument("--dropped_router_dots", nargs="+", choices=["saved", "recomputed"], default=["saved"],
                   help="dropped_router_dots of the enabled rows (each with every ratio)")
    p.add_argument("--reps", type=int, default=15, help="timed forward + backward steps per row")
    p.add_argument("--back_to_back", type=int, default=1,
                   help="steps per timing: 1 (default) times one step from an idle, synchronised GPU, so the "
                        "host's latency to the first kernel counts in full; N > 1 times N steps back to back "
                        "(the .grad reset inside each step), the host then running ahead of the GPU as it does "
                        "when other layers' work fills the GPU in training")
    p.add_argument("--gemm_configs", nargs="+", choices=["auto", "coop", "pingpong", "m64"], default=["auto"],
                   help="the segmented GEMM's kernels (LRMOE_GEMM_CONFIG) per LRMoE row: more than one repeats "
                        "every LRMoE row per config, timed in turns with the others")
    p.add_argument("--quota_granules", nargs="+", type=int, default=None,
                   help="LRMOE_QUOTA_GRANULE per LRMoE row (the water-fill's capped quotas in whole tiles of this "
                        "many rows; 1: off): more than one repeats every LRMoE row per value, timed in turns")
    p.add_argument("--skew", type=float, default=0.0,
                   help="routing skew s: every layer's router gets a logit offset -s ln(rank_e) per expert (ranks a "
                        "fixed shuffle, through input feature 0, set to 1), so loads fall off with an expert's rank and "
                        "the hot experts sit anywhere in the list, as a trained router's: at the Qwen3 shape s = 0.05 / "
                        "0.1 / 0.2 put the hottest expert at about 1.8x / 3x / 6x the mean; 0 (default): the random "
                        "routers' near-uniform loads (1.16x)")
    p.add_argument("--out", default=None, help="write the markdown here (rewritten after every table)")
    return p.parse_args(argv)


def row_specs(args):
    """(row name, layer kind, "lrmoe" block or None, GEMM config or None); rows of one kind are consecutive."""
    rows = [(ANCHOR, "anchor", None), (DEEPSPEED, "deepspeed", None), ("LRMoE exact (enabled false)", "lrmoe", {})]
    for allocation in args.allocations:
        for dots in args.dropped_router_dots:
            for policy in args.policies:
                for r in args.ratios:
                    if dots == "recomputed" and (policy != "stash" or r >= 1):
                        continue  # the saved rows' very path: nothing dropped, or no outputs saved anyway
                    named = ("" if allocation == "waterfill" else f", {allocation}") + \
                        ("" if dots == "saved" else ", dropped dots recomputed")
                    rows.append((f"LRMoE retention {r:g}, {policy}{named}", "lrmoe",
                                 {"enabled": True, "retention_ratio": r, "policy": policy, "metric": args.metric,
                                  "router_grad": args.router_grad, "quota_allocation": allocation,
                                  "dropped_router_dots": dots}))
    variants = [(f", gemm {c}" if len(args.gemm_configs) > 1 else "", {"LRMOE_GEMM_CONFIG": c})
                for c in args.gemm_configs]
    if args.quota_granules:
        variants = [(name + (f", granule {g}" if len(args.quota_granules) > 1 else ""),
                     dict(env, LRMOE_QUOTA_GRANULE=str(g))) for name, env in variants for g in args.quota_granules]
    return [(name + suffix if kind == "lrmoe" else name, kind, block, env if kind == "lrmoe" else None)
            for name, kind, block in rows for suffix, env in (variants if kind == "lrmoe" else [("", None)])]


def skew_routing(layers, x, s, seed=0):
    """Every router's logits offset by -s ln(rank_e), through input feature 0 (set to 1 in x): column 0 of each
    router weight becomes the offsets. Returns the offsets."""
    gen = torch.Generator().manual_seed(seed)
    E = next(p for n, p in layers[0].named_parameters() if n.endswith("wg.weight")).shape[0]
    rank = torch.randperm(E, generator=gen) + 1
    offsets = -s * torch.log(rank.double())
    x[:, 0] = 1.0
    for layer in layers:
        for n, p in layer.named_parameters():
            if n.endswith("wg.weight"):
                p.data[:, 0] = offsets.to(p.device, p.dtype)
    return offsets


def build(kind, H, Fh, E, k):
    if kind == "anchor":
        return GroupedMMMoE(H, Fh, E, k)
    if kind == "deepspeed":
        ds = deepspeed.moe.layer.MoE(H, expert=lrmoe_ds.SwiGLUExpert(H, Fh), num_experts=E, k=k, drop_tokens=False,
                                     use_rts=False, top2_2nd_expert_sampling=False)
        ds.set_deepspeed_parallelism()
        return ds
    return lrmoe_ds.LRMoE(H, num_experts=E, k=k, ffn_hidden_size=Fh)


def to_device_flat(layer, dev):
    """``layer.to(dev)`` with its parameters then laid out as DeepSpeed's bf16 and ZeRO-1/2 optimizers leave
    them: views of one flat buffer, in parameter order (the two stacked expert weights, then the rest:
    DeepSpeed keeps expert and shared parameters in separate groups, each one buffer)."""
    layer = layer.to(dev)
    params = list(layer.parameters())
    experts = [p for p in params if not getattr(p, "allreduce", True)]  # DeepSpeed's mark of expert parameters
    groups = [experts, [p for p in params if getattr(p, "allreduce", True)]]
    for group in groups:
        if not group:
            continue
        flat = torch.empty(sum(p.numel() for p in group), device=dev, dtype=group[0].dtype)
        off = 0
        for p in group:
            view = flat[off:off + p.numel()].view_as(p)
            view.copy_(p.data)
            p.data = view
            off += p.numel()
    return layer


def clear_grads(layer):
    """.grad set to None, as DeepSpeed's optimizers leave it after every backward (they take the gradients
    into their own buffers): autograd then keeps the new gradients instead of adding them. Not timed: it is
    the optimizer's work (a loop over the parameters), not the layer's."""
    layer.zero_grad(set_to_none=True)


def step(layer, x, grad, clear=False):
    if clear:  # back to back: each step's gradients replace the last's, as after an optimizer step
        clear_grads(layer)
    layer(x.detach().requires_grad_(True))[0].backward(grad)


def memory(layer, x, grad):
    """(GiB held for the backward after the forward, GiB at the peak of one forward + backward), both above
    what was allocated before the forward; after a warm-up step."""
    clear_grads(layer)
    step(layer, x, grad)  # warm-up
    clear_grads(layer)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = layer(x.detach().requires_grad_(True))[0]
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    out.backward(grad)
    del out
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    clear_grads(layer)
    return held / GIB, peak / GIB


def ratio(a, b, fmt="{:.2f}"):
    return "-" if a is None or b is None else fmt.format(a / b)


def render(name, ms, mem, failed, flops):
    """One table row, from the times (ms), memories (GiB held, GiB peak) and failures measured so far."""
    if name in failed:
        return f"| {name} | failed: {failed[name]} | | | | | | | |"
    variant = name[name.index(", gemm "):] if ", gemm " in name else \
        name[name.index(", granule "):] if ", granule " in name else ""  # against 1.0 with the same variant
    ref = mem.get(f"LRMoE retention {1.0:g}, stash{variant}", (None, None))
    held, peak = mem[name]
    return (f"| {name} | {ms[name]:.2f} | {flops / ms[name] / 1e9:.0f} | {ratio(ms.get(ANCHOR), ms[name])} | "
            f"{ratio(ms.get(DEEPSPEED), ms[name])} | {held:.2f} | {ratio(held, ref[0])} | {peak:.2f} | "
            f"{ratio(peak, ref[1])} |")


def init_one_process():
    """torch.distributed (and DeepSpeed's groups) for one process on a free local port: DeepSpeed's MoE
    layer and the EP groups need a process group even on one GPU."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed()


def main():
    args = parse_args()
    init_one_process()
    dev, dt = "cuda", torch.bfloat16
    cuda_ok, why = ops.cuda_ops_status()
    specs = row_specs(args)
    if args.back_to_back < 1:
        raise SystemExit("--back_to_back must be >= 1")
    back_to_back = args.back_to_back > 1
    cmd = " ".join(["python3 benchmarks/bench_layer.py"] + [shlex.quote(a) for a in sys.argv[1:]])
    lines = [f"# One MoE layer, forward + backward, {torch.cuda.get_device_name()}", "",
             f"Command: `{cmd}`", "",
             (f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, bf16; lrmoe_ds CUDA ops: "
             f"{'built with CUTLASS ' + cuda.load().cutlass_version() if cuda_ok else why}. Median of {args.reps} CUDA-event timings of forward + backward "
             + ("(.grad set to None before each, untimed; each timing one step from an idle GPU); "
                if args.back_to_back == 1 else
                f"(each timing the mean of {args.back_to_back} steps back to back, .grad set to None inside "
                "every step: the host's latency overlaps the GPU's work as it does in a model of many layers); ")
             + 
             f"retention rows: metric {args.metric}, router_grad {args.router_grad}, selection and the rest "
             "at their defaults."),
             ("speed vs X = X's time / this time (> 1: faster). held = activation memory: allocated after the "
             "forward minus before it (what the layer keeps for its backward, plus its [T, H] output); peak = "
             "peak allocated during one forward + backward minus before it (the layer and inputs are there, the "
             "weight gradients set to None before every step as DeepSpeed's optimizers leave them, so the peak "
             "includes the new weight gradients, the same bytes for every row); vs 1.0 stash "
             "= this / LRMoE retention 1, stash. TFLOP/s counts the exact layer's useful expert FLOPs (also for "
             "retention, which does less work)."),
             "One LRMoE layer serves every LRMoE row of a table, reconfigured with `layer.configure` per row. "
             "On the GPU every layer's parameters are views of one flat buffer per group (expert / shared), as "
             "DeepSpeed's bf16 and ZeRO-1/2 optimizers lay them out in training."]

    def write(table=()):
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(lines + list(table)) + "\n")

    def emit(*new):
        print(*new, sep="\n", flush=True)
        lines.extend(new)
        write()

    emit("")
    for shape in args.shapes:
        title, H, Fh, E, k = SHAPES[shape]
        layers = {}
        for kind in dict.fromkeys(kind for _, kind, _, _ in specs):  # built once per shape
            torch.manual_seed(0)
            layers[kind] = to_device_flat(build(kind, H, Fh, E, k).to(dt), dev)
        for T in args.tokens:
            torch.manual_seed(T)
            x = torch.randn(T, H, device=dev, dtype=dt)
            grad = torch.randn_like(x)
            if args.skew:
                skew_routing(list(layers.values()), x, args.skew)
            loads = ""
            if "lrmoe" in layers:
                with torch.no_grad():
                    counts = layers["lrmoe"](x)[2].float()
                loads = (f" Expert loads (LRMoE's router, skew {args.skew:g}): max / mean "
                         f"{counts.max() / counts.mean():.2f}, min / mean {counts.min() / counts.mean():.2f}.")
            emit(f"## {title} (H {H}, F {Fh} SwiGLU, {E} experts, top-{k}), {T} tokens", "", loads.strip(), "",
                 "| layer | ms | TFLOP/s | speed vs anchor | speed vs DeepSpeed | held GiB | held vs 1.0 stash | "
                 "peak GiB | peak vs 1.0 stash |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
            flops = 3 * 2 * T * k * 3 * H * Fh
            ms, mem, failed = {}, {}, {}

            def prepare(layer, block, env):
                def run():
                    if block is not None:
                        layer.configure(lrmoe_ds.LRMoEConfig(**block))
                    for var in ("LRMOE_GEMM_CONFIG", "LRMOE_QUOTA_GRANULE"):  # read at every call
                        if env is not None and var in env:
                            os.environ[var] = env[var]
                        elif env is not None:
                            os.environ.pop(var, None)
                    clear_grads(layer)
                return run

            fns, setups = {}, {}
            for name, kind, block, env in specs:  # memory, one row at a time; a row that fails is left out
                layer = layers[kind]
                try:
                    prepare(layer, block, env)()
                    mem[name] = memory(layer, x, grad)
                    fns[name], setups[name] = (lambda layer=layer: step(layer, x, grad, clear=back_to_back)), \
                        prepare(layer, block, env)
                except Exception as err:  # noqa: BLE001  (one failing row must not lose the others)
                    failed[name] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:120]}"
                torch.cuda.empty_cache()
            ms = median_ms_interleaved(fns, reps=args.reps, warmup=1, inner=args.back_to_back, setups=setups)
            for n in layers.values():
                clear_grads(n)
            del x, grad
            torch.cuda.empty_cache()
            table = [render(n, ms, mem, failed, flops) for n, _, _, _ in specs]  # now with every ratio
            lines.extend(table + [""])
            write()
            print("complete table:", *lines[-len(table) - 3:], sep="\n", flush=True)
        del layers
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
