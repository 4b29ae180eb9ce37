"""Convergence of retention: train.py three times on one ds_config, same seed and steps, with the "lrmoe" block
set to exact (enabled false), retention 0.5 (or --ratio) by grad_norm, and the same ratio by uniform sampling.

    python3 benchmarks/convergence.py --base_config ds_configs/h200.json --num_gpus 1
    python3 benchmarks/convergence.py --base_config ds_configs/cpu_ep2.json --num_gpus 2 --steps 20 \\
        --extra --eval_every 10 --layers 2

Each run gets a copy of the base config with its "lrmoe" block updated (the base's other lrmoe keys kept) and
its own csv_monitor job, and is launched as ``deepspeed --num_gpus N train.py --deepspeed_config <copy>
--summary_json <f> --seed S [--steps N] --save_dir '' [--extra ...]`` (a --save_dir in --extra wins). Writes
<out_dir>/convergence_<name>.md (final held-out loss, gap to exact, times, held-out loss at every eval) and
convergence_<name>.png (smoothed Train/loss and the Eval/loss points, one colour per run). Configs, logs,
summaries and csv files stay in --work_dir.

With --seeds S1 S2 ... every run is launched once per seed (--parallel N at once: one GPU hosts several
small runs) and the report pairs the runs by seed: each seed's gaps, then the mean gap to exact with its
standard error, which is what a claim about a 1% difference needs (single runs differ by more).
"""
import argparse
import csv
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_NAMES = ("exact", "grad_norm", "uniform", "proportional", "threshold", "metric_mass", "ramp", "retained_router",
             "warm")


def run_spec(run, args):
    """(label, keys set in the "lrmoe" block) of a --runs name at retention ``args.ratio``.

    "grad_norm", "uniform", "gate", "ramp" and "retained_router" plan by the water-fill (the default split until
    metric_mass replaced it, so the recorded commands still mean what they did); "metric_mass", "proportional" and
    "threshold" name their split. "ramp": grad_norm sampling at ``args.ratio`` until ``args.ramp_start`` of the
    steps, then a linear rise to exact (1.0) at the last step (``retention_schedule``). "warm": the default split
    (metric_mass), exact for the first ``args.warm_steps`` steps, then ``args.warm_after``, by default the ratio that
    keeps the run's mean retention at ``args.ratio`` (the same expert backward work as a flat ``args.ratio``)."""
    label, block = _run_spec(run, args)
    if block.get("enabled") and "quota_allocation" not in block:
        block["quota_allocation"] = "waterfill"
    return label, block


def _run_spec(run, args):
    ratio = args.ratio
    if run == "exact":
        return "exact (enabled false)", {"enabled": False, "retention_ratio": 1.0}
    if run == "proportional":  # grad_norm sampling, every expert keeping the same fraction
        return f"retention {ratio:g}, grad_norm, proportional quotas", {
            "enabled": True, "retention_ratio": ratio, "metric": "grad_norm", "quota_allocation": "proportional"}
    if run == "metric_mass":  # grad_norm sampling, quotas planned from the last backward's per-expert metric mass
        return f"retention {ratio:g}, grad_norm, metric-mass quotas", {
            "enabled": True, "retention_ratio": ratio, "metric": "grad_norm", "quota_allocation": "metric_mass"}
    if run == "threshold":  # grad_norm sampling, one threshold over each rank's pairs instead of planned quotas
        return f"retention {ratio:g}, grad_norm, one threshold", {
            "enabled": True, "retention_ratio": ratio, "metric": "grad_norm", "quota_allocation": "threshold"}
    if run == "retained_router":  # grad_norm sampling, the router's gradient from the retained pairs alone
        return f"retention {ratio:g}, grad_norm, router gradient from the retained pairs", {
            "enabled": True, "retention_ratio": ratio, "metric": "grad_norm", "router_grad": "retained"}
    if run == "ramp":
        if not args.steps:
            raise SystemExit("--runs ramp needs --steps")
        start = int(args.ramp_start * args.steps)
        mean = (ratio * start + (ratio + 1.0) / 2 * (args.steps - start)) / args.steps
        return (f"retention {ratio:g} to step {start}, then up to 1 (mean {mean:.2f})",
                {"enabled": True, "metric": "grad_norm",
                 "retention_schedule": [[0, ratio], [start, ratio], [args.steps, 1.0]]})
    if run == "warm":
        if not args.steps:
            raise SystemExit("--runs warm needs --steps")
        n = args.warm_steps  # steps 0 .. n-1 exact
        after = args.warm_after if args.warm_after is not None else (ratio * args.steps - n) / (args.steps - n)
        if n < 1 or not 0.0 < after <= 1.0:
            raise SystemExit(f"--warm_steps {n} of {args.steps} leaves no ratio in (0, 1] for the mean {ratio:g}")
        mean = (n + (args.steps - n) * after) / args.steps
        return (f"exact for {n} steps, then {after:.3f} (mean {mean:.3g})",
                {"enabled": True, "metric": "grad_norm", "quota_allocation": "metric_mass",
                 "retention_schedule": [[0, 1.0]] + ([[n - 1, 1.0]] if n > 1 else []) + [[n, after]]})
    return f"retention {ratio:g}, {run}", {"enabled": True, "retention_ratio": ratio, "metric": run}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base_config", required=True, help="the ds_config to start from (its train_py block is kept)")
    p.add_argument("--num_gpus", type=int, default=1, help="ranks per run (CPU ranks on a machine without GPUs)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the config's / train.py's)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="several seeds, each run once per seed; the report pairs the runs by seed and gives the "
                        "mean gap to exact with its standard error (default: --seed alone)")
    p.add_argument("--parallel", type=int, default=1,
                   help="launches at once (one GPU hosts several small runs; on CPU ranks they share the cores)")
    p.add_argument("--micro_batch", type=int, default=None,
                   help="train_micro_batch_size_per_gpu for every run (default: the base config's)")
    p.add_argument("--runs", nargs="+", choices=RUN_NAMES, default=list(RUN_NAMES[:3]))
    p.add_argument("--ratio", type=float, default=0.5, help="retention_ratio of the grad_norm and uniform runs")
    p.add_argument("--ramp_start", type=float, default=0.6,
                   help="the ramp run: fraction of the steps at --ratio before its linear rise to exact")
    p.add_argument("--warm_steps", type=int, default=50,
                   help="the warm run: exact steps before the sampling starts")
    p.add_argument("--warm_after", type=float, default=None,
                   help="the warm run's ratio after its exact steps (default: the one that keeps the mean at --ratio)")
    p.add_argument("--name", default=None, help="results are convergence_<name>.md/.png (default: the config's name)")
    p.add_argument("--out_dir", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--work_dir", default=None, help="configs, logs, summaries, csv (default: runs/convergence_<name>)")
    p.add_argument("--reuse", action="store_true",
                   help="collect a run whose summary is already in --work_dir (pair only runs of one CPU model: "
                        "the exact CPU run of one seed ended 1.3%% apart on two machines, same code)")
    p.add_argument("--smooth", type=float, default=None,
                   help="EMA factor of the plotted Train/loss (default: 1 - 50 / number of logged points, >= 0)")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="the rest goes to train.py as it is")
    args = p.parse_args(argv)
    args.name = args.name or os.path.splitext(os.path.basename(args.base_config))[0]
    args.work_dir = os.path.abspath(args.work_dir or os.path.join(ROOT, "runs", f"convergence_{args.name}"))
    args.seeds = args.seeds or [args.seed]
    if len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds repeats a seed: {args.seeds}")
    if args.parallel < 1:
        p.error("--parallel must be >= 1")
    return args


def read_csv(path):
    """[(step, value)] of a csv_monitor file, [] when missing."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [(int(float(r[0])), float(r[1])) for r in list(csv.reader(f))[1:] if r]


def launch(args, run, base, seed, block=None, extra=()):
    """Run train.py for one run and seed; returns its result dict (summary, curves, rc, wall seconds).
    block: the keys set in the "lrmoe" block (default: ``run_spec``'s for ``run``); extra: train.py flags of this
    run alone, before ``args.extra`` (benchmarks/bench_train.py launches DeepSpeed's MoE this way)."""
    config = json.loads(json.dumps(base))
    config["lrmoe"] = {**(config.get("lrmoe") or {}), **(run_spec(run, args)[1] if block is None else block)}
    if args.micro_batch:
        config["train_micro_batch_size_per_gpu"] = args.micro_batch
        config.pop("train_batch_size", None)  # derived again by DeepSpeed from the micro batch
    several = len(args.seeds) > 1
    work = os.path.join(args.work_dir, f"seed{seed}") if several else args.work_dir
    os.makedirs(work, exist_ok=True)
    job = f"{args.name}_{run}" + (f"_seed{seed}" if several else "")
    config["csv_monitor"] = {"enabled": True, "output_path": os.path.join(work, "csv"), "job_name": job}
    cfg_path, summary = (os.path.join(work, f"{run}{ext}") for ext in (".json", ".summary.json"))
    log_path, csv_dir = os.path.join(work, f"{run}.log"), os.path.join(work, "csv", job)
    rc, wall, wall_path = 0, None, os.path.join(work, f"{run}.wall.json")
    if not (args.reuse and os.path.exists(summary)):
        shutil.rmtree(csv_dir, ignore_errors=True)  # the csv monitor appends: start its files afresh
        if os.path.exists(summary):
            os.remove(summary)
        with open(cfg_path, "w") as f:
            json.dump(config, f, indent=1)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        launcher = [shutil.which("deepspeed")] if shutil.which("deepspeed") else [sys.executable, "-m",
                                                                                  "deepspeed.launcher.runner"]
        cmd = launcher + ["--num_gpus", str(args.num_gpus), "--master_port", str(port), os.path.join(ROOT, "train.py"),
                          "--deepspeed_config", cfg_path, "--summary_json", summary, "--seed", str(seed),
                          "--save_dir", ""] + (["--steps", str(args.steps)] if args.steps else []) + list(extra) + \
            args.extra
        print(f"[{run} seed {seed}] {shlex.join(cmd)}\n[{run} seed {seed}] log: {log_path}", flush=True)
        t0 = time.time()
        with open(log_path, "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
        wall = time.time() - t0
        with open(wall_path, "w") as f:
            json.dump({"wall": wall}, f)
    elif os.path.exists(wall_path):
        with open(wall_path) as f:
            wall = json.load(f)["wall"]
    result = {"run": run, "seed": seed, "rc": rc, "wall": wall, "log": log_path, "summary": None,
              "train": read_csv(os.path.join(csv_dir, "Train_loss.csv")),
              "eval": read_csv(os.path.join(csv_dir, "Eval_loss.csv")),
              "grad_norm": read_csv(os.path.join(csv_dir, "Train_grad_norm.csv")),
              "tokens_per_s": read_csv(os.path.join(csv_dir, "Train_tokens_per_s.csv"))}
    if rc == 0 and os.path.exists(summary):
        with open(summary) as f:
            result["summary"] = json.load(f)
        result["eval"] = result["eval"] or [tuple(e) for e in result["summary"]["evals"]]
        print(f"[{run} seed {seed}] held-out loss {result['summary']['end_loss']:.4f}, wall {wall or 0:.0f} s",
              flush=True)
    else:
        with open(log_path) as f:
            tail = f.readlines()[-15:]
        print(f"[{run} seed {seed}] FAILED (rc {rc}), last lines of {log_path}:\n" + "".join(tail), flush=True)
    return result


def _norm_fifths(points):
    """'first / last' means of a [(step, norm)] curve over its first and last fifth, or '-'."""
    if not points:
        return "-"
    n = max(1, len(points) // 5)
    mean = lambda pts: sum(v for _, v in pts) / len(pts)
    return f"{mean(points[:n]):.3f} / {mean(points[-n:]):.3f}"


def report(args, results, cmd, base_micro):
    exact = next((r["summary"]["end_loss"] for r in results if r["run"] == "exact" and r["summary"]), None)
    lines = [f"# Convergence with retention: {args.name}", "", f"Command: `{cmd}`", "",
             (f"Base config `{os.path.relpath(os.path.abspath(args.base_config), ROOT)}`, {args.num_gpus} rank(s), "
             f"micro batch {args.micro_batch or base_micro}, seed {args.seeds[0]}, steps {args.steps or 'from the config / train.py'}, train.py extra flags: "
             f"`{shlex.join(args.extra) or 'none'}`. Held-out loss in nats/byte (train.py's summary `end_loss`); "
             "gap = (loss - exact) / exact; grad norm = mean of `Train/grad_norm` (DeepSpeed's global norm before "
             "clipping) over the first and the last fifth of the logged steps; train s excludes evals; wall s is the "
             "whole launch."), "",
             "| run | lrmoe block | final held-out loss | gap to exact | grad norm, first / last fifth | train s | wall s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        label, block = run_spec(r["run"], args)
        block = json.dumps(block)
        s = r["summary"]
        if s is None:
            lines.append(f"| {label} | `{block}` | failed (rc {r['rc']}, `{r['log']}`) | | | | |")
            continue
        gap = f"{(s['end_loss'] - exact) / exact * 100:+.2f}%" if exact else "-"
        wall = f"{r['wall']:.0f}" if r["wall"] is not None else "(reused)"
        lines.append(f"| {label} | `{block}` | {s['end_loss']:.4f} | {gap} | {_norm_fifths(r['grad_norm'])} | "
                     f"{s['train_seconds']:.0f} | {wall} |")
    steps = sorted({st for r in results for st, _ in r["eval"]})
    lines += ["", "Held-out loss at every eval:", "", "| step | " + " | ".join(run_spec(r["run"], args)[0] for r in results) + " |",
              "| --- |" + " --- |" * len(results)]
    for st in steps:
        vals = [dict(r["eval"]).get(st) for r in results]
        lines.append(f"| {st} | " + " | ".join("-" if v is None else f"{v:.4f}" for v in vals) + " |")
    return "\n".join(lines) + "\n"


def plot(args, results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, r in enumerate(results):
        color, label = f"C{i}", run_spec(r["run"], args)[0]
        if r["train"]:
            steps, raw = zip(*r["train"])
            a = args.smooth if args.smooth is not None else max(0.0, 1 - 50 / len(raw))  # ~len/50 points of memory
            smoothed, ema = [], raw[0]
            for v in raw:
                ema = a * ema + (1 - a) * v
                smoothed.append(ema)
            ax.plot(steps, raw, color=color, alpha=0.15, linewidth=0.8)
            ax.plot(steps, smoothed, color=color, alpha=0.9, label=f"{label}: train (EMA {a:.2f})")
        if r["eval"]:
            ax.plot(*zip(*r["eval"]), "o--", color=color, markersize=5, linewidth=0.8, label=f"{label}: held-out")
    ax.set(xlabel="step", ylabel="loss (nats/byte)", title=f"train.py, {args.name}: exact vs retention {args.ratio:g}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _mean_sd(values):
    n = len(values)
    mean = sum(values) / n
    sd = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5 if n > 1 else float("nan")
    return mean, sd


def report_seeds(args, results, cmd, base_micro):
    """The report of several seeds: each seed's final losses and gaps (each run against the exact run of
    its own seed), then per run the mean gap, its standard error and range, and the mean eval curve."""
    by = {(r["seed"], r["run"]): r for r in results}
    done = [s for s in args.seeds if all(by[(s, run)]["summary"] for run in args.runs)]
    end = lambda s, run: by[(s, run)]["summary"]["end_loss"]
    lines = [f"# Convergence with retention over {len(args.seeds)} seeds: {args.name}", "", f"Command: `{cmd}`", "",
             (f"Base config `{os.path.relpath(os.path.abspath(args.base_config), ROOT)}`, {args.num_gpus} rank(s), "
              f"micro batch {args.micro_batch or base_micro}, seeds {' '.join(map(str, args.seeds))} (a seed sets the "
              f"initial weights, the data order and the retention sampling), steps {args.steps or 'from the config'}, "
              f"{args.parallel} launch(es) at once, train.py extra flags: `{shlex.join(args.extra) or 'none'}`. Held-out "
              "loss in nats/byte (train.py's summary `end_loss`); a run's gap = (its loss - the exact run's loss of "
              "the same seed) / the latter."), "",
             "| seed | " + " | ".join(run_spec(run, args)[0] for run in args.runs) + " |",
             "| --- |" + " --- |" * len(args.runs)]
    for seed in args.seeds:
        cells = []
        for run in args.runs:
            r = by[(seed, run)]
            if not r["summary"]:
                cells.append(f"failed (rc {r['rc']})")
                continue
            gap = ""
            if run != "exact" and "exact" in args.runs and by[(seed, "exact")]["summary"]:
                gap = f" ({(end(seed, run) - end(seed, 'exact')) / end(seed, 'exact') * 100:+.2f}%)"
            cells.append(f"{end(seed, run):.4f}{gap}")
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    lines += ["", f"Over the {len(done)} seed(s) where every run finished (s.e. = sd / sqrt(n)):", "",
              "| run | mean final loss (sd) | mean gap to exact | s.e. of the gap | gap range |",
              "| --- | --- | --- | --- | --- |"]
    for run in args.runs:
        if not done:
            break
        mean, sd = _mean_sd([end(s, run) for s in done])
        row = f"| {run_spec(run, args)[0]} | {mean:.4f} ({sd:.4f}) |"
        if run == "exact" or "exact" not in args.runs:
            lines.append(row + " - | - | - |")
            continue
        gaps = [(end(s, run) - end(s, "exact")) / end(s, "exact") * 100 for s in done]
        g_mean, g_sd = _mean_sd(gaps)
        lines.append(row + f" {g_mean:+.2f}% | {g_sd / len(gaps) ** 0.5:.2f}% | {min(gaps):+.2f}% .. {max(gaps):+.2f}% |")
    if {"grad_norm", "uniform"} <= set(args.runs) and done:
        wins = sum(end(s, "grad_norm") < end(s, "uniform") for s in done)
        lines += ["", f"grad_norm ends below uniform in {wins} of {len(done)} seeds."]
    steps = sorted({st for r in results for st, _ in r["eval"]})
    lines += ["", "Mean held-out loss at every eval, over the same seeds:", "",
              "| step | " + " | ".join(run_spec(run, args)[0] for run in args.runs) + " |",
              "| --- |" + " --- |" * len(args.runs)]
    for st in steps:
        cells = []
        for run in args.runs:
            vals = [dict(by[(s, run)]["eval"]).get(st) for s in done]
            cells.append("-" if not vals or None in vals else f"{sum(vals) / len(vals):.4f}")
        lines.append(f"| {st} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _mean_curve(curves):
    """(the steps every {step: value} curve has, the mean value at each), ([], []) for no curves."""
    curves = list(curves)
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    return steps, [sum(c[st] for c in curves) / len(curves) for st in steps]


def plot_seeds(args, results, path):
    """Left: each seed's held-out points, faint, and each run's mean held-out curve. Right: each run's
    gap to the exact run of its own seed at every eval, per seed (faint) and averaged."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, ax_gap) = plt.subplots(1, 2, figsize=(13, 5))
    exact = {r["seed"]: dict(r["eval"]) for r in results if r["run"] == "exact" and r["eval"]}
    for i, run in enumerate(args.runs):
        label = run_spec(run, args)[0]
        curves = {r["seed"]: dict(r["eval"]) for r in results if r["run"] == run and r["eval"]}
        for c in curves.values():
            ax.plot(sorted(c), [c[k] for k in sorted(c)], "o", color=f"C{i}", alpha=0.25, markersize=3)
        steps, mean = _mean_curve(curves.values())
        if steps:
            ax.plot(steps, mean, "-", color=f"C{i}", label=f"{label}: mean over {len(curves)} seeds")
        if run == "exact":
            continue
        gaps = {s: {st: (c[st] - exact[s][st]) / exact[s][st] * 100 for st in c if st in exact.get(s, {})}
                for s, c in curves.items()}
        gaps = {s: g for s, g in gaps.items() if g}
        for g in gaps.values():
            ax_gap.plot(sorted(g), [g[k] for k in sorted(g)], "-", color=f"C{i}", alpha=0.2, linewidth=0.8)
        steps, mean = _mean_curve(gaps.values())
        if steps:
            ax_gap.plot(steps, mean, "o-", color=f"C{i}", label=f"{label}: mean over {len(gaps)} seeds")
    ax.set(xlabel="step", ylabel="held-out loss (nats/byte)",
           title=f"{args.name}: exact vs retention {args.ratio:g}, {len(args.seeds)} seeds")
    ax_gap.axhline(0, color="C0", linewidth=0.8)
    ax_gap.axhline(1, color="grey", linestyle=":", linewidth=0.8, label="+1% (the target's bound)")
    ax_gap.set(xlabel="step", ylabel="held-out loss gap to exact, same seed (%)", title="gap to exact, per seed and mean")
    for a in (ax, ax_gap):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    args = parse_args()
    cmd = shlex.join(["python3", "benchmarks/convergence.py"] + sys.argv[1:])
    with open(args.base_config) as f:
        base = json.load(f)
    os.makedirs(args.work_dir, exist_ok=True)
    os.makedirs(args.out_dir, exist_ok=True)
    jobs = [(seed, run) for seed in args.seeds for run in args.runs]
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:  # each thread waits on its own launch
        results = list(pool.map(lambda job: launch(args, job[1], base, job[0]), jobs))
    md, png = (os.path.join(args.out_dir, f"convergence_{args.name}{ext}") for ext in (".md", ".png"))
    several = len(args.seeds) > 1
    text = (report_seeds if several else report)(args, results, cmd, base.get("train_micro_batch_size_per_gpu"))
    with open(md, "w") as f:  # before the plot: a failed plot leaves the report
        f.write(text)
    wrote = md
    if write_plot(args, results, png, several) is not None:
        link = f"\n![curves]({os.path.basename(png)})\n"
        with open(md, "a") as f:
            f.write(link)
        text, wrote = text + link, f"{md} and {png}"
    print(text, f"wrote {wrote}", sep="\n")
    return 0 if all(r["summary"] for r in results) else 1


def write_plot(args, results, png, several):
    """The plot, where matplotlib is installed (the "bench" extra); else a note on stderr and None, so that
    runs that took an hour still end with their report instead of an ImportError."""
    try:
        (plot_seeds if several else plot)(args, results, png)  # each imports matplotlib first
    except ImportError as e:
        print(f"no plot ({e}; pip install 'lrmoe_ds[bench]'): the report only", file=sys.stderr)
        return None
    return png


if __name__ == "__main__":
    sys.exit(main())
