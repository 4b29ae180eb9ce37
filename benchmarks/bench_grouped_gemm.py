"""Segmented GEMM (forward, dgrad, wgrad) of lrmoe_ds against torch._grouped_mm and a per-expert
cuBLAS loop, at the Qwen3-30B-A3B and GLM-4.5-Air expert shapes, 8k and 16k tokens, uniform and
skewed (Zipf-like, hottest expert first) routing; `--routing ...,zipf_shuffled` adds the same skew with the hot
experts at random places, `skew0.2` bench_layer.py --skew 0.2's routing, and a suffix `>metric_mass@0.5` the
rows a backward keeps at retention 0.5 (see routed_sizes). Median of CUDA-event timings; bf16; TFLOP/s = 2 M N K /
time.

    python3 benchmarks/bench_grouped_gemm.py [--out benchmarks/results/grouped_gemm_h200.md]

The up-projection is W1 [2F, H] (gate and up fused), the down-projection W2 [H, F]. ratio = torch
time / our time (>= 1: at least as fast as torch._grouped_mm).
"""
import argparse
import os
import re
import sys

import torch

from lrmoe_ds import ops
from lrmoe_ds.ops import cuda
from lrmoe_ds.quotas import plan_quotas
from timing import median_ms, median_ms_interleaved

SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "glm-4.5-air": (4096, 1408, 128, 8)}


# Variants by name (variant_env: "cfg-rz" sets LRMOE_GEMM_CONFIG, _RASTER and _SWIZZLE; "+rows" LRMOE_GEMM_ORDER);
# the first is the default (see gemm.cu): "coop" runs the cooperative 128x256x64 kernel in every pass,
# "pingpong" it for forward and dgrad only (wgrad ping-pong 128x128x64); "m64" ping-pong 64x256x64 for forward
# and dgrad, 128x128x64 for wgrad. "auto" is m64 or coop by the device's memory bandwidth. "default" sets
# none of them (auto, and the tile order by pass: along M for forward and dgrad, along N with swizzle 2 for wgrad).
GEMM_VARS = ("LRMOE_GEMM_CONFIG", "LRMOE_GEMM_RASTER", "LRMOE_GEMM_SWIZZLE", "LRMOE_GEMM_ORDER")
VARIANTS = ["default", "coop-m1", "coop-n2", "pingpong-m1", "m64-m1", "m64-n2"]


def variant_env(name):
    """The variables a variant sets: "cfg-rz" sets the kernels, raster and swizzle; a "+rows" suffix (or "rows"
    alone, the default kernels) lists the grouped problems by their rows, most first; "default" sets none."""
    name, by_rows = (name[:-len("+rows")], True) if name.endswith("+rows") else (name, name == "rows")
    env = {}
    if name not in ("default", "rows"):
        cfg, tiles = name.rsplit("-", 1)
        env = {"LRMOE_GEMM_CONFIG": cfg, "LRMOE_GEMM_RASTER": tiles[0], "LRMOE_GEMM_SWIZZLE": tiles[1:]}
    if by_rows:
        env["LRMOE_GEMM_ORDER"] = "rows"
    return env


def parse_variants(text):
    """'auto-m1,pingpong-n2,rows' -> ["default", "auto-m1", "pingpong-n2", "rows"]: the default first."""
    out = ["default"]
    for name in text.split(","):
        variant_env(name)  # a malformed name fails here, before any timing
        if name not in out:
            out.append(name)
    return out


def with_variant(fn, name):
    """fn run under one scheduler variant (the extension reads the variables on every call)."""
    env = variant_env(name)

    def run():
        clear_variant()
        os.environ.update(env)
        fn()
    return run


def clear_variant():
    for var in GEMM_VARS:
        os.environ.pop(var, None)


LAYER_LOGIT_STD = 0.577  # bench_layer.py's router logits: N(0, 1) inputs on nn.Linear's U(+-1/sqrt(H)) init


def routed_sizes(T, k, E, skew, gen):
    """Rows per expert of T tokens routed top-k over E experts. "zipf": expert i gets a share ~ 1/(i+1), so the
    groups come hottest first; "zipf_shuffled": the same shares over the experts in a random order, as a trained
    router's hot experts fall (the persistent GEMM scheduler hands out tiles in group order, so the two differ);
    "skew<s>": bench_layer.py --skew s's routing (a top-k of Gaussian logits, std LAYER_LOGIT_STD, offset by
    -s ln(rank_e) at shuffled ranks: at s = 0.2 the hottest expert has 6.2x the mean, as the layer printed).
    A suffix ">ALLOCATION@RATIO" (e.g. "skew0.2>metric_mass@0.5") gives the rows one backward keeps instead:
    lrmoe_ds.quotas.plan_quotas of those counts with that allocation (metric_mass: equal weights), granule 64 as
    on CUDA, one rank."""
    skew, _, retained = skew.partition(">")
    if re.fullmatch(r"skew\d+(\.\d*)?", skew):
        s = float(skew[len("skew"):])
        rank = torch.randperm(E, generator=gen) + 1
        logits = LAYER_LOGIT_STD * torch.randn(T, E, generator=gen, dtype=torch.float64) - s * torch.log(rank.double())
        sizes = torch.bincount(logits.topk(k, -1).indices.flatten(), minlength=E)
    elif skew not in ("uniform", "zipf", "zipf_shuffled"):
        raise ValueError(f"routing must be uniform, zipf, zipf_shuffled or skew<s>, not {skew!r}")
    else:
        if skew == "uniform":
            p = torch.ones(E, dtype=torch.float64)
        else:
            p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64)
            if skew == "zipf_shuffled":
                p = p[torch.randperm(E, generator=gen)]
        draws = torch.multinomial(p, T * k, replacement=True, generator=gen)
        sizes = torch.bincount(draws, minlength=E)
    if not retained:
        return sizes
    allocation, _, ratio = retained.partition("@")
    return plan_quotas(sizes, float(ratio), allocation=allocation, granule=64,
                       weights=torch.ones(E, dtype=torch.float64))


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def weight_layouts(E, shapes):
    """The expert weights of both projections three ways: separately allocated (each expert its own
    tensor, as after module.to(device)); views of one flat buffer in DeepSpeed ZeRO's order (expert 0's
    up and down weights, then expert 1's, ...: what ZeRO-1/2 and the bf16 optimizer make of the
    parameters); views of one stacked [E, N, K] tensor per projection (what torch._grouped_mm reads).
    shapes: [(N, K)] per projection -> ({layout: [list of E tensors per projection]}, [stacked [E, N, K]
    tensor per projection], the one that torch._grouped_mm is given too)."""
    separate = [[torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(E)]
                for N, K in shapes]
    per_expert = sum(N * K for N, K in shapes)
    flat = torch.empty(E * per_expert, device="cuda", dtype=torch.bfloat16)
    flat_views = [[None] * E for _ in shapes]
    for e in range(E):
        off = e * per_expert
        for j, (N, K) in enumerate(shapes):
            flat_views[j][e] = flat[off:off + N * K].view(N, K)
            flat_views[j][e].copy_(separate[j][e])
            off += N * K
    stacked = [torch.stack(ws) for ws in separate]
    return {"separate": separate, "flat": flat_views, "stacked": [list(W.unbind(0)) for W in stacked]}, stacked


def pass_inputs(sizes, N, K):
    """One projection's GEMM inputs for routed group sizes [E] (host): (sizes on the device, torch's int32 end
    offsets, x [M, K], dy [M, N]), bf16 on the GPU."""
    M = int(sizes.sum())
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    return sizes.cuda(), torch.cumsum(sizes, 0).to(torch.int32).cuda(), x, dy


def ours_call(pname, x, dy, ws, sizes_d, grads):
    """One pass of our segmented GEMM as a callable: fwd x @ ws^T, dgrad dy @ ws, wgrad dy^T @ x into grads."""
    if pname == "fwd":
        return lambda: ops.grouped_linear(x, ws, sizes_d, backend="cuda")
    if pname == "dgrad":
        return lambda: ops.grouped_linear_dgrad(dy, ws, sizes_d, backend="cuda")
    return lambda: ops.grouped_linear_wgrad(dy, x, sizes_d, out=grads, backend="cuda")


def torch_call(pname, x, dy, W, offs):
    """The same pass on torch._grouped_mm, W the stacked [E, N, K] weights, offs the int32 group ends."""
    if pname == "fwd":
        return lambda: torch._grouped_mm(x, W.transpose(-2, -1), offs=offs)
    if pname == "dgrad":
        return lambda: torch._grouped_mm(dy, W, offs=offs)
    return lambda: torch._grouped_mm(dy.t(), x, offs=offs)


def bench_case(name, H, F, E, k, T, skew, gen, variants=VARIANTS, passes=("fwd", "dgrad", "wgrad")):
    sizes = routed_sizes(T, k, E, skew, gen)
    M = int(sizes.sum())
    bounds = [0] + torch.cumsum(sizes, 0).tolist()
    rows = []
    shapes = [(2 * F, H), (H, F)]  # up, down
    layouts, stacked = weight_layouts(E, shapes)
    for j, (proj, (N, K)) in enumerate(zip(("up", "down"), shapes)):
        ws, W = layouts["separate"][j], stacked[j]  # W [E, N, K] for torch._grouped_mm
        sizes_d, offs, x, dy = pass_inputs(sizes, N, K)
        grads = {"separate": [torch.empty(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(E)],
                 "stacked": list(torch.empty(E, N, K, device="cuda", dtype=torch.bfloat16).unbind(0))}
        grads["flat"] = grads["stacked"]  # our own output buffer: one allocation either way
        flops = 2.0 * M * N * K

        def loop_fwd():
            out = x.new_empty(M, N)
            for g in range(E):
                torch.matmul(x[bounds[g]:bounds[g + 1]], ws[g].t(), out=out[bounds[g]:bounds[g + 1]])
            return out

        def loop_dgrad():
            out = x.new_empty(M, K)
            for g in range(E):
                torch.matmul(dy[bounds[g]:bounds[g + 1]], ws[g], out=out[bounds[g]:bounds[g + 1]])
            return out

        def loop_wgrad():
            for g in range(E):
                torch.matmul(dy[bounds[g]:bounds[g + 1]].t(), x[bounds[g]:bounds[g + 1]], out=grads["separate"][g])
            return grads["separate"]

        def ours(pname, layout="separate"):
            return ours_call(pname, x, dy, layouts[layout][j], sizes_d, grads[layout])

        loops = {"fwd": loop_fwd, "dgrad": loop_dgrad, "wgrad": loop_wgrad}
        for pname, loop in loops.items():
            if pname not in passes:
                continue
            theirs = torch_call(pname, x, dy, W, offs)
            a = ours(pname)()
            a = torch.stack(a) if isinstance(a, list) else a
            try:
                err = rel(a, theirs())
            except Exception as exc:  # noqa: BLE001 - a layout torch does not take is recorded, not fatal
                err, theirs = float("nan"), None
                print(f"torch._grouped_mm failed on {name} {proj} {pname}: {exc}")
            # torch and every column of ours timed in turns (timing.median_ms_interleaved), so that a
            # drift of the clocks during the cell favours none of them
            fns = {"torch": theirs} if theirs is not None else {}
            fns.update({lay: with_variant(ours(pname, lay), "default") for lay in ("flat", "stacked")})
            for v in variants:
                fns[v] = with_variant(ours(pname), v)
            timed = median_ms_interleaved(fns)
            clear_variant()
            t_torch = timed.pop("torch", float("nan"))
            t_flat, t_stacked = timed.pop("flat"), timed.pop("stacked")
            t_ours = timed["default"]
            best = min(timed, key=timed.get)
            t_loop = median_ms(loop, reps=5, warmup=1, inner=1)
            rows.append((name, T, skew, proj, pname, M, N, K, t_ours, flops / t_ours / 1e9, t_torch,
                         flops / t_torch / 1e9, t_loop, flops / t_loop / 1e9, t_torch / t_ours, err,
                         best, t_torch / timed[best], t_flat, t_torch / t_flat, t_stacked, t_torch / t_stacked,
                         {vn: t_torch / t for vn, t in timed.items()}))
        del W, x, dy, grads
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--tokens", default="8192,16384")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--routing", default="uniform,zipf",
                   help="comma-separated: uniform, zipf, zipf_shuffled, skew<s>; a suffix >ALLOCATION@RATIO: "
                   "the rows one backward keeps (e.g. skew0.2>metric_mass@0.5)")
    p.add_argument("--no_variants", action="store_true", help="time the default scheduler only")
    p.add_argument("--variants", default=None,
                   help="kernel-scheduler variants to time, e.g. pingpong-n2,coop-m1 (default: " +
                   ",".join(VARIANTS) + "; a '+rows' suffix, or 'rows' alone, lists the problems by rows)")
    p.add_argument("--passes", default="fwd,dgrad,wgrad")
    args = p.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    dense = 2 * 8192 ** 3 / median_ms(lambda: a @ b) / 1e9
    del a, b
    variants = [VARIANTS[0]] if args.no_variants else parse_variants(args.variants) if args.variants else VARIANTS
    rows = []
    for name in args.shapes.split(","):
        H, F, E, k = SHAPES[name]
        for T in [int(t) for t in args.tokens.split(",")]:
            for skew in args.routing.split(","):
                rows.extend(bench_case(name, H, F, E, k, T, skew, gen, variants=variants,
                                       passes=args.passes.split(",")))
                text = report(rows, dense)
                if args.out:  # rewritten after every case, so that a timeout keeps what ran
                    open(args.out, "w").write(text + "\n")
    print(text)


def report(rows, dense):
    ext = cuda.load()
    default_cfg, tbps = ext.gemm_default_config(), ext.peak_memory_tbps()
    lines = [f"# Segmented GEMM on {torch.cuda.get_device_name()} (torch {torch.__version__}, "
             f"our kernels built with CUTLASS {ext.cutlass_version()})", "",
             f"Command: `python3 benchmarks/bench_grouped_gemm.py {' '.join(sys.argv[1:])}` (bf16, fp32 accumulation; "
             "median of 15 CUDA-event "
             "timings of 5 back-to-back calls each, torch._grouped_mm and every column of ours timed in turns with "
             "the order shuffled per timing, so that clock drift favours none; 5 single calls for the loop). Variants: kernel coop "
             "(cooperative 128x256x64, torch._grouped_mm's, in every pass), pingpong (cooperative for forward and "
             "dgrad, ping-pong 128x128x64 for wgrad) (LRMOE_GEMM_CONFIG), raster "
             "order m|n and swizzle 1|2|4 (LRMOE_GEMM_RASTER, LRMOE_GEMM_SWIZZLE), m64 (ping-pong 64x256x64 for "
             "forward and dgrad, ping-pong 128x128x64 for wgrad), '+rows' or 'rows' (the default kernels): the grouped "
             "problems listed by their rows, most first (LRMOE_GEMM_ORDER=rows); the ratio column is the default ('default': "
             f"LRMOE_GEMM_CONFIG auto, which on this device is {default_cfg} (m64 at >= 4.5 TB/s of peak memory "
             f"bandwidth, coop below; this device: {tbps:.2f} TB/s), tiles along M for forward and dgrad, along "
             "N with swizzle 2 for wgrad), with each expert's weights allocated separately "
             "(as after module.to(device)), and for wgrad a separate output tensor per expert. 'flat W': the "
             "weights as views of one buffer in DeepSpeed ZeRO's order (expert 0's up and down weights, then expert "
             "1's...), as ZeRO-1/2 and the bf16 optimizer leave the parameters; 'stacked W': views of one [E, N, K] "
             "tensor per projection, as torch._grouped_mm reads them. For wgrad both mean the gradients are views "
             "of one [E, N, K] output buffer.", "",
             f"Dense bf16 ceiling measured in the same run (8192^3 matmul): {dense:.0f} TFLOP/s.", "",
             "| shape | tokens | routing | proj | pass | M | N | K | ours ms | ours TFLOP/s | _grouped_mm ms | "
             "_grouped_mm TFLOP/s | cuBLAS loop ms | loop TFLOP/s | ratio (torch/ours) | rel. diff vs torch | "
             "best variant | its ratio | flat W ms | flat ratio | stacked W ms | stacked ratio |",
             "| --- " * 22 + "|"]
    for r in rows:
        lines.append("| " + " | ".join([r[0], str(r[1]), r[2], r[3], r[4], str(r[5]), str(r[6]), str(r[7]),
                                        f"{r[8]:.3f}", f"{r[9]:.0f}", f"{r[10]:.3f}", f"{r[11]:.0f}", f"{r[12]:.3f}",
                                        f"{r[13]:.0f}", f"{r[14]:.2f}", f"{r[15]:.1e}", r[16], f"{r[17]:.2f}",
                                        f"{r[18]:.3f}", f"{r[19]:.2f}", f"{r[20]:.3f}", f"{r[21]:.2f}"]) + " |")
    ratios = sorted(r[14] for r in rows)
    lines += ["", f"Ratio: worst {ratios[0]:.2f}, median {ratios[len(ratios) // 2]:.2f}, "
              f"{sum(x >= 1.0 for x in ratios)} of {len(ratios)} cells >= 1.0 (flat W: worst "
              f"{min(r[19] for r in rows):.2f}, stacked W: worst {min(r[21] for r in rows):.2f})."]
    up = [r[9] for r in rows if r[3] == "up" and r[4] == "fwd"]
    if up:
        lines[-1] += (f" Up-projection forward: {min(up):.0f}-{max(up):.0f} TFLOP/s "
                      f"({100 * min(up) / dense:.0f}-{100 * max(up) / dense:.0f}% of the measured dense rate).")
    names = list(rows[0][22])
    lines += ["", "Ratio (torch time / ours) of every variant timed:", "",
              "| shape | tokens | routing | proj | pass | " + " | ".join(names) + " |", "| --- " * (5 + len(names)) + "|"]
    for r in rows:
        lines.append("| " + " | ".join([r[0], str(r[1]), r[2], r[3], r[4]] + [f"{r[22][n]:.2f}" for n in names]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
