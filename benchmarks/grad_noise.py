"""How much noise retention adds to the gradient, against the noise the minibatch already has.

One process on the CPU (ep_size 1), train.py's model and corpus. First a short exact pre-training
(torch AdamW, so that the gradients are those of a model that has learnt something), then, with the
weights frozen:
  - minibatch noise: exact gradients G_b of --batches different batches; noise_mb = mean_b ||G_b - mean G||^2;
  - retention noise, per variant (metric, selection, ratio): --samples gradients of batch 0 with
    different sampling seeds; noise_ret = mean_s ||G_s - G_0||^2, and the bias ||mean_s G_s - G_0||^2
    (an unbiased estimator's bias shrinks like noise_ret / samples);
per parameter group (expert gate_up, expert down, router, the rest). noise_ret / noise_mb = 1 means
retention adds as much variance as the minibatch has: for those parameters the step is as noisy as
one of half the batch.
  - which metric would sample best: the exact backward of batch 0 records, per routed row, the norms
    that make its expert weight-gradient terms (dy a^T for the down projection, dh x^T for gate_up, a the
    activation, dh its gradient); for each candidate metric m the variance of a Horvitz-Thompson estimate
    with inclusion probabilities min(1, m / tau) (sum = each expert's water-fill quota) is
    sum_p (1/pi_p - 1) ||term_p||^2. The "oracle" metric is the terms' own norm (the best possible).
  - which split of the same retained count over the experts would sample best, for the grad_norm metric:
    each expert's water-fill quota, the same fraction of every expert ("proportional"), or no per-expert
    quota at all: one threshold tau over all the layer's pairs (the variance-minimising split of the
    layer's retained count; measured too with ``--allocations waterfill threshold``, the pipeline's
    "threshold" allocation).

    python3 benchmarks/grad_noise.py --out benchmarks/results/grad_noise_cpu.md
"""
import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import lrmoe_ds  # noqa: E402
import train  # noqa: E402  (the model and corpus of train.py)
from lrmoe_ds import ops, pipeline  # noqa: E402
from lrmoe_ds.integration import configure_model  # noqa: E402
from lrmoe_ds.quotas import mass_weights, plan_quotas  # noqa: E402

GROUPS = ("expert gate_up", "expert down", "router", "rest")


def group_of(name):
    if ".experts.weight" in name:
        return "expert gate_up" if name.endswith("weight1") else "expert down"
    return "router" if ".gate.wg." in name else "rest"


def configure(model, **lrmoe):
    configure_model(model, lrmoe_ds.LRMoEConfig(**lrmoe))


def gradient(model, rows, aux_coef):
    """{group: flat gradient (float64)} of one batch."""
    model.zero_grad(set_to_none=True)
    lm, aux, _ = model(rows[:, :-1], rows[:, 1:])
    (lm + aux_coef * aux).backward()
    out = {g: [] for g in GROUPS}
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[group_of(name)].append(p.grad.detach().double().flatten())
    return {g: torch.cat(v) for g, v in out.items() if v}


def sq(a):
    return {g: float(v.square().sum()) for g, v in a.items()}


def sub(a, b):
    return {g: a[g] - b[g] for g in a}


def mean(gs):
    return {g: torch.stack([x[g] for x in gs]).mean(0) for g in gs[0]}


def record_row_norms(model, rows, aux_coef):
    """Per layer, from the exact backward of one batch: (group sizes [E], {name: [P] norms}) with dy, x,
    a (the activation) and dh (its gradient) per routed row, in grouped order."""
    records, original = [], pipeline.mlp_backward

    def recording(handed, w1, w2, expert_type, group_sizes, want_output_dot=False):
        x, h, dy = handed.x, handed.h, handed.dy
        h = ops.grouped_linear(x, w1, group_sizes) if h is None else h
        # act_backward may write dh over its h: a copy, so that the backward below still reads h
        dh, a, _ = expert_type.act_backward(h.clone(), ops.grouped_linear_dgrad(dy, w2, group_sizes))
        records.append((group_sizes.detach().cpu().long(), {n: t.detach().double().norm(dim=1) for n, t in
                                                            (("dy", dy), ("x", x), ("a", a), ("dh", dh))}))
        return original(handed, w1, w2, expert_type, group_sizes, want_output_dot)

    pipeline.mlp_backward = recording
    try:
        gradient(model, rows, aux_coef)
    finally:
        pipeline.mlp_backward = original
    return records[::-1]  # the backward runs the layers last to first


def inclusion(m, q):
    """Poisson PPS inclusion probabilities min(1, m / tau) with sum q (m > 0 [n], 0 <= q <= n)."""
    n = m.numel()
    if q >= n:
        return torch.ones_like(m)
    pi = torch.zeros_like(m)
    if q == 0:
        return pi
    order = torch.argsort(m, descending=True)
    ms = m[order]
    tail = ms.flip(0).cumsum(0).flip(0)  # tail[j] = sum of ms[j:]
    for j in range(q):  # the j largest are certain; the rest share q - j in proportion to m
        tau = tail[j] / (q - j)
        if ms[j] <= tau:
            pi[order[j:]] = ms[j:] / tau
            pi[order[:j]] = 1.0
            return pi.clamp(max=1.0)
    pi[order[:q]] = 1.0
    return pi


METRICS = {  # candidate pair metrics from the recorded row norms (g_p ||dout_t|| = ||dy_p||)
    "uniform": lambda r: torch.ones_like(r["dy"]),
    "grad_norm (||dy|| ||x||)": lambda r: r["dy"] * r["x"],
    "||dy|| ||a||": lambda r: r["dy"] * r["a"],
    "||dy|| sqrt(||a||^2 + ||x||^2)": lambda r: r["dy"] * (r["a"] ** 2 + r["x"] ** 2).sqrt(),
    "oracle (term norms)": lambda r: ((r["dy"] * r["a"]) ** 2 + (r["dh"] * r["x"]) ** 2).sqrt(),
}


def _ht_variance(m, w, q):
    """Summed Horvitz-Thompson variance of sampling q of the terms (squared norms w) by metric m."""
    pi = inclusion(m, q)
    keep = pi > 0
    return float(((1 / pi[keep] - 1) * w[keep]).sum()) + (float("inf") if bool((~keep & (w > 0)).any()) else 0.0)


def _term_norms_sq(r):
    return (r["dy"] * r["a"]) ** 2 + (r["dh"] * r["x"]) ** 2  # ||term_p||^2, both projections


def _per_expert_variance(sizes, m, w, quotas):
    bounds = [0] + sizes.cumsum(0).tolist()
    return sum(_ht_variance(m[lo:hi], w[lo:hi], int(q)) for lo, hi, q in zip(bounds, bounds[1:], quotas) if hi > lo)


def predicted_variance(records, ratio):
    """{metric: summed Horvitz-Thompson variance of the expert weight gradients} at one ratio."""
    out = {name: 0.0 for name in METRICS}
    for sizes, r in records:
        quotas, w = plan_quotas(sizes, ratio), _term_norms_sq(r)
        for name, fn in METRICS.items():
            out[name] += _per_expert_variance(sizes, fn(r).clamp_min(1e-30), w, quotas)
    return out


ALLOCATIONS = ("waterfill", "proportional", "one threshold per layer", "quotas from this batch's threshold (oracle)",
               "quotas from the previous batch's threshold", "quotas from the previous batch's metric mass")


def _earned_fractions(sizes, m, total):
    """Per expert, the fraction of its pairs that one threshold over the layer keeps in expectation (sum of its
    inclusion probabilities over its pairs)."""
    pi = inclusion(m, total)
    bounds = [0] + sizes.cumsum(0).tolist()
    return torch.tensor([float(pi[lo:hi].sum()) / max(1, hi - lo) for lo, hi in zip(bounds, bounds[1:])],
                        dtype=torch.float64)


def _quotas_from_fractions(sizes, fractions, total):
    """Planned quotas min(n_e, f_e n_e scaled so that they add up to about ``total``)."""
    want = fractions * sizes.double()
    q = torch.minimum(sizes.double(), want * total / max(float(want.sum()), 1e-30)).floor().long()
    return q


def predicted_variance_by_allocation(records, ratio, previous=None):
    """{allocation: the same summed variance for the grad_norm metric}, each layer keeping the water-fill's total.
    previous: the records of another batch, whose one-threshold fractions plan this batch's per-expert quotas (what a
    layer could plan in the forward from its last backward)."""
    out = {name: 0.0 for name in ALLOCATIONS}
    metric = METRICS["grad_norm (||dy|| ||x||)"]
    for i, (sizes, r) in enumerate(records):
        m, w = metric(r).clamp_min(1e-30), _term_norms_sq(r)
        waterfill = plan_quotas(sizes, ratio)
        total = int(waterfill.sum())
        out["waterfill"] += _per_expert_variance(sizes, m, w, waterfill)
        out["proportional"] += _per_expert_variance(sizes, m, w, plan_quotas(sizes, ratio, allocation="proportional"))
        out["one threshold per layer"] += _ht_variance(m, w, total)
        oracle = _quotas_from_fractions(sizes, _earned_fractions(sizes, m, total), total)
        out["quotas from this batch's threshold (oracle)"] += _per_expert_variance(sizes, m, w, oracle)
        if previous is not None:
            p_sizes, p_r = previous[i]
            p_m = metric(p_r).clamp_min(1e-30)
            fractions = _earned_fractions(p_sizes, p_m, int(plan_quotas(p_sizes, ratio).sum()))
            out["quotas from the previous batch's threshold"] += _per_expert_variance(
                sizes, m, w, _quotas_from_fractions(sizes, fractions, total))
            # the layer's own "metric_mass" plan: this batch's counts, the previous batch's mean metric per expert
            p_mass = torch.stack([seg.sum() for seg in p_m.split(p_sizes.tolist())])
            planned = plan_quotas(sizes, ratio, allocation="metric_mass", weights=mass_weights(p_mass, p_sizes))
            out["quotas from the previous batch's metric mass"] += _per_expert_variance(sizes, m, w, planned)
        else:
            out["quotas from the previous batch's threshold"] = float("nan")
            out["quotas from the previous batch's metric mass"] = float("nan")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--deepspeed_config", default=os.path.join(ROOT, "ds_configs", "cpu_ep2.json"),
                   help="train.py's model flags come from its train_py block and train.py's defaults")
    p.add_argument("--batch", type=int, default=32, help="windows per batch (cpu_ep2: 2 ranks x 16)")
    p.add_argument("--pretrain_steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batches", type=int, default=8, help="batches for the minibatch noise")
    p.add_argument("--samples", type=int, default=16, help="sampling seeds per retention variant")
    p.add_argument("--ratio", type=float, nargs="+", default=[0.5])
    p.add_argument("--metrics", nargs="+", default=["grad_norm", "gate", "uniform"])
    p.add_argument("--allocations", nargs="+", default=["waterfill"],
                   help="quota_allocation of each measured variant (with every metric), e.g. waterfill threshold")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None)
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="train.py model flags, last (e.g. --extra --experts 32 --top_k 8 --ffn 64)")
    args = p.parse_args(argv)
    targs = train.parse_args(["--deepspeed_config", args.deepspeed_config, "--ep_size", "1", "--seed", str(args.seed)]
                             + args.extra)
    torch.manual_seed(args.seed)
    model = train.ByteMoELM(targs)
    data, _, desc = train.load_corpus(targs.data, targs.train_bytes, targs.val_bytes, targs.val_every)
    sampler = train.WindowSampler(data, targs.seq_len, args.seed)
    configure(model)  # exact

    t0 = time.time()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    for step in range(args.pretrain_steps):
        rows = sampler.windows(step * args.batch, args.batch)
        lm, aux, _ = model(rows[:, :-1], rows[:, 1:])
        opt.zero_grad(set_to_none=True)
        (lm + targs.aux_loss_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    print(f"pre-trained {args.pretrain_steps} steps in {time.time() - t0:.0f} s, last train loss {lm.item():.3f}")

    first = args.pretrain_steps * args.batch
    batches = [sampler.windows(first + b * args.batch, args.batch) for b in range(args.batches)]
    exact = [gradient(model, rows, targs.aux_loss_coef) for rows in batches]
    g_mean, g0 = mean(exact), exact[0]
    noise_mb = {g: sum(sq(sub(e, g_mean))[g] for e in exact) / (len(exact) - 1) for g in g0}
    norm0 = sq(g0)
    rows_out = []
    for ratio in args.ratio:
        for metric in args.metrics:
            for allocation in args.allocations:
                samples = []
                for s in range(args.samples):
                    configure(model, enabled=True, retention_ratio=ratio, metric=metric, seed=1000 + s,
                              quota_allocation=allocation)
                    samples.append(gradient(model, batches[0], targs.aux_loss_coef))
                configure(model)
                noise = {g: sum(sq(sub(x, g0))[g] for x in samples) / len(samples) for g in g0}
                bias = sq(sub(mean(samples), g0))
                name = metric if args.allocations == ["waterfill"] else f"{metric}, {allocation}"
                rows_out.append((ratio, name, noise, bias))
                print(f"ratio {ratio} {name}: " + ", ".join(f"{g} {noise[g] / noise_mb[g]:.2f}" for g in g0))

    lines = ["# Gradient noise of retention against the minibatch's own noise (CPU)", "",
             f"Command: `python3 benchmarks/grad_noise.py {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
             f"train.py's model ({targs.layers} layers, hidden {targs.hidden}, {targs.experts} experts top-{targs.top_k}, "
             f"ffn {targs.ffn}), one process, ep_size 1; {desc}; pre-trained {args.pretrain_steps} exact steps of "
             f"{args.batch} x {targs.seq_len} bytes (AdamW lr {args.lr}); then frozen. Minibatch noise: over "
             f"{args.batches} batches, E||G_b - mean||^2 (unbiased). Retention noise: over {args.samples} seeds on "
             "batch 0, E||G_s - G_0||^2. Ratio = retention noise / minibatch noise (1.0: the step is as noisy as "
             "with half the batch, for these parameters). Bias = ||mean_s G_s - G_0||^2 / retention noise (about "
             f"1/{args.samples} for an unbiased estimator).", "",
             "| group | ||G_0||^2 | minibatch noise | " + " | ".join(
                 f"r={r} {m}: noise ratio (bias)" for r, m, _, _ in rows_out) + " |",
             "| --- " * (3 + len(rows_out)) + "|"]
    for g in g0:
        cells = [f"{n[g] / noise_mb[g]:.2f} ({b[g] / max(n[g], 1e-300):.3f})" for _, _, n, b in rows_out]
        lines.append(f"| {g} | {norm0[g]:.3e} | {noise_mb[g]:.3e} | " + " | ".join(cells) + " |")
    records = record_row_norms(model, batches[0], targs.aux_loss_coef)
    expert_mb = noise_mb["expert gate_up"] + noise_mb["expert down"]
    lines += ["", "Predicted variance of the expert weight gradients (both projections, all layers) per metric, "
              "from the row norms of batch 0's exact backward (Poisson sampling with probabilities "
              "min(1, m/tau) under each expert's water-fill quota), over the measured minibatch noise of the same "
              "parameters:", "", "| metric | " + " | ".join(f"r={r}" for r in args.ratio) + " |",
              "| --- " * (1 + len(args.ratio)) + "|"]
    predicted = {r: predicted_variance(records, r) for r in args.ratio}
    for name in METRICS:
        lines.append(f"| {name} | " + " | ".join(f"{predicted[r][name] / expert_mb:.2f}" for r in args.ratio) + " |")
    lines += ["", "Predicted variance of the same, for the grad_norm metric, by how each layer's retained count "
              "(the water-fill's) is split over its experts, over the same minibatch noise:", "",
              "| allocation | " + " | ".join(f"r={r}" for r in args.ratio) + " |", "| --- " * (1 + len(args.ratio)) + "|"]
    previous = record_row_norms(model, batches[1], targs.aux_loss_coef) if len(batches) > 1 else None
    by_allocation = {r: predicted_variance_by_allocation(records, r, previous) for r in args.ratio}
    for name in ALLOCATIONS:
        lines.append(f"| {name} | " + " | ".join(f"{by_allocation[r][name] / expert_mb:.2f}" for r in args.ratio) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
