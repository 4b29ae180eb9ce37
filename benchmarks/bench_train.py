"""End-to-end training throughput: train.py on one ds_config and model, its MoE layers as DeepSpeed's MoE
(``--moe_impl deepspeed``, drop_tokens off), as LRMoE exact (``"enabled": false``) and as LRMoE at each
retention ratio (the "lrmoe" block's defaults otherwise), same data, seed and steps.

    python3 benchmarks/bench_train.py --base_config ds_configs/h200.json --num_gpus 1 --steps 24 \\
        --grad_accum 4 --extra --layers 4 --hidden 2048 --heads 16 --experts 128 --ffn 768 --top_k 8 --seq_len 2048

What one layer's benchmark (bench_layer.py) leaves out is here: attention, embeddings, the optimizer step,
DeepSpeed's engine, several layers in a row (one layer's host work overlapping the next one's GPU work).
The steady rate is the median of train.py's logged ``Train/tokens_per_s`` intervals that start after
``--warmup_steps`` (the first steps hold the ops' JIT build, allocator growth and CUDA's lazy start). Peak memory
is the GPU's peak allocated over the run (train.py's summary). The held-out loss is a check that every run trained,
not a convergence claim (benchmarks/convergence.py is that). Launches go through benchmarks/convergence.py's
``launch``; configs, logs and csv files stay in --work_dir.
"""
import argparse
import json
import os
import shlex
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from convergence import ROOT, launch  # noqa: E402

RUNS = ("deepspeed", "exact", "retention")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base_config", required=True, help="the ds_config to start from (its train_py block is kept)")
    p.add_argument("--num_gpus", type=int, default=1, help="ranks per run (CPU ranks on a machine without GPUs)")
    p.add_argument("--steps", type=int, default=24, help="optimizer steps per run")
    p.add_argument("--warmup_steps", type=int, default=6, help="steps left out of the steady rate")
    p.add_argument("--log_every", type=int, default=3, help="train.py's logging interval: the rate's resolution")
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    p.add_argument("--ratios", type=float, nargs="+", default=[0.75, 0.5], help="retention_ratio of the retention runs")
    p.add_argument("--lrmoe", default="{}", help='more "lrmoe" keys for the retention runs, as JSON')
    p.add_argument("--micro_batch", type=int, default=None, help="train_micro_batch_size_per_gpu (default: the config's)")
    p.add_argument("--grad_accum", type=int, default=None,
                   help="gradient_accumulation_steps (default: the config's): more micro-steps per optimizer step, "
                        "as a data-parallel job's per-GPU share of the optimizer is small")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--name", default=None, help="results are train_throughput_<name>.md (default: the config's name)")
    p.add_argument("--out_dir", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--work_dir", default=None, help="configs, logs, summaries, csv (default: runs/bench_train_<name>)")
    p.add_argument("--reuse", action="store_true", help="collect a run whose summary is already in --work_dir")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="the rest goes to train.py as it is")
    args = p.parse_args(argv)
    if not 0 <= args.warmup_steps < args.steps - args.log_every:
        p.error(f"--warmup_steps {args.warmup_steps} leaves no logged interval of --log_every {args.log_every} "
                f"steps before step {args.steps}")
    if any(not 0.0 < r <= 1.0 for r in args.ratios):
        p.error(f"--ratios must be in (0, 1], got {args.ratios}")
    try:
        args.lrmoe_keys = json.loads(args.lrmoe)
    except json.JSONDecodeError as err:
        p.error(f"--lrmoe is not JSON: {err}")
    if not isinstance(args.lrmoe_keys, dict):
        p.error(f"--lrmoe must be a JSON object, got {args.lrmoe!r}")
    args.name = args.name or os.path.splitext(os.path.basename(args.base_config))[0]
    args.work_dir = os.path.abspath(args.work_dir or os.path.join(ROOT, "runs", f"bench_train_{args.name}"))
    args.seeds = [args.seed]  # what convergence.launch reads
    return args


def run_list(args):
    """[(run name, label, "lrmoe" keys, train.py flags of the run)] in the order they run."""
    runs = []
    if "deepspeed" in args.runs:
        runs.append(("deepspeed", "DeepSpeed MoE (drop_tokens=False)", {"enabled": False}, ["--moe_impl", "deepspeed"]))
    if "exact" in args.runs:
        runs.append(("exact", "LRMoE exact (enabled false)", {"enabled": False, "retention_ratio": 1.0}, []))
    if "retention" in args.runs:
        for r in args.ratios:
            block = {"enabled": True, "retention_ratio": r, **args.lrmoe_keys}
            runs.append((f"r{r:g}", f"LRMoE retention {r:g}" + "".join(f", {k} {v}" for k, v in args.lrmoe_keys.items()),
                         block, []))
    return runs


def steady_rate(points, warmup_steps, log_every):
    """Median tokens/s of the logged intervals that start at or after ``warmup_steps`` (an interval logged at step s
    covers steps s - log_every .. s), or None where there is none."""
    rates = [v for step, v in points if step - log_every >= warmup_steps]
    return statistics.median(rates) if rates else None


def report(args, runs, results, cmd):
    rates = {run: steady_rate(r["tokens_per_s"], args.warmup_steps, args.log_every) if r["summary"] else None
             for (run, *_), r in zip(runs, results)}
    lines = [f"# Training throughput, end to end: {args.name}", "", f"Command: `{cmd}`", "",
             (f"Base config `{os.path.relpath(os.path.abspath(args.base_config), ROOT)}`, {args.num_gpus} rank(s), "
              f"{args.steps} steps, seed {args.seed}, train.py extra flags: `{shlex.join(args.extra) or 'none'}`. "
              f"Steady tokens/s = median of the `Train/tokens_per_s` intervals ({args.log_every} steps each) after step "
              f"{args.warmup_steps}, over all ranks; ms per step from it; vs X = this rate / X's (> 1: faster); peak = "
              "the GPU's peak allocated memory on rank 0; held-out loss at the last step (a check that the run "
              "trained)."), "",
             "| run | lrmoe block, flags | steady tokens/s | ms per step | vs DeepSpeed MoE | vs LRMoE exact | peak GiB | "
             "held-out loss |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (run, label, block, extra), r in zip(runs, results):
        s, rate = r["summary"], rates[run]
        what = f"`{json.dumps(block)}`" + (f" `{shlex.join(extra)}`" if extra else "")
        if s is None or rate is None:
            why = f"failed (rc {r['rc']}, `{r['log']}`)" if s is None else "no steady interval logged"
            lines.append(f"| {label} | {what} | {why} | | | | | |")
            continue
        tokens_per_step = s["tokens"] / max(1, s["end_step"] - s["start_step"])
        vs = [f"{rate / rates[ref]:.2f}" if rates.get(ref) else "-" for ref in ("deepspeed", "exact")]
        peak = f"{s['peak_memory_gib']:.1f}" if s.get("peak_memory_gib") is not None else "-"
        lines.append(f"| {label} | {what} | {rate:,.0f} | {1e3 * tokens_per_step / rate:.1f} | {vs[0]} | {vs[1]} | "
                     f"{peak} | {s['end_loss']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    cmd = " ".join(["python3 benchmarks/bench_train.py"] + [shlex.quote(a) for a in (argv or sys.argv[1:])])
    with open(args.base_config) as f:
        base = json.load(f)
    if args.grad_accum:
        base["gradient_accumulation_steps"] = args.grad_accum
        base.pop("train_batch_size", None)  # derived again by DeepSpeed
    args.extra = ["--log_every", str(args.log_every), "--eval_every", "0"] + args.extra  # flags given later win
    runs = run_list(args)
    results = [launch(args, run, base, args.seed, block, extra) for run, _, block, extra in runs]
    text = report(args, runs, results, cmd)
    os.makedirs(args.out_dir, exist_ok=True)
    out = os.path.join(args.out_dir, f"train_throughput_{args.name}.md")
    with open(out, "w") as f:
        f.write(text)
    print(text + f"\nwritten: {out}", flush=True)
    return 0 if all(r["summary"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
