"""benchmarks/bench_train.py: the runs it launches, the steady rate (the logged intervals after the warm-up,
their median), the table's ratios to DeepSpeed's MoE and to the exact layer, a failed run, and bad arguments."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_train  # noqa: E402


def args_for(*more):
    return bench_train.parse_args(["--base_config", "ds_configs/cpu_ep2.json", "--steps", "12", "--warmup_steps", "3",
                                   "--log_every", "3", "--name", "t", *more])


def result(rates, tokens=1200, rc=0, peak=None):
    summary = None if rc else {"tokens": tokens, "start_step": 0, "end_step": 12, "end_loss": 2.5,
                               "peak_memory_gib": peak}
    return {"rc": rc, "log": "x.log", "summary": summary, "tokens_per_s": rates}


def test_runs_deepspeed_exact_then_each_ratio_with_the_extra_keys():
    runs = bench_train.run_list(args_for("--ratios", "0.75", "0.5", "--lrmoe", '{"policy": "recompute"}'))
    assert [r[0] for r in runs] == ["deepspeed", "exact", "r0.75", "r0.5"]
    assert runs[0][2] == {"enabled": False} and runs[0][3] == ["--moe_impl", "deepspeed"]
    assert runs[1][2] == {"enabled": False, "retention_ratio": 1.0} and runs[1][3] == []
    assert runs[3][2] == {"enabled": True, "retention_ratio": 0.5, "policy": "recompute"}
    assert runs[3][1] == "LRMoE retention 0.5, policy recompute"


def test_steady_rate_is_the_median_of_the_intervals_after_the_warmup():
    # intervals logged at steps 3 (covers 0-3), 6, 9, 12: with warm-up 3 the first is left out
    assert bench_train.steady_rate([(3, 1.0), (6, 10.0), (9, 30.0), (12, 20.0)], 3, 3) == 20.0
    assert bench_train.steady_rate([(3, 1.0), (6, 10.0)], 6, 3) is None


def test_report_ratios_to_deepspeed_and_exact_and_a_failed_run():
    args = args_for("--ratios", "0.5", "0.25")
    runs = bench_train.run_list(args)
    results = [result([(3, 1.0), (6, 100.0), (9, 100.0), (12, 100.0)], peak=30.0),
               result([(3, 1.0), (6, 400.0), (9, 400.0), (12, 400.0)], peak=20.0),
               result([(3, 1.0), (6, 500.0), (9, 500.0), (12, 500.0)]),
               result([], rc=1)]
    text = bench_train.report(args, runs, results, "cmd")
    # 1200 tokens over 12 steps: 100 a step; at 400 tokens/s that is 250 ms
    assert "| DeepSpeed MoE (drop_tokens=False) | `{\"enabled\": false}` `--moe_impl deepspeed` | 100 | 1000.0 | 1.00 | " \
           "0.25 | 30.0 | 2.5000 |" in text
    assert "| LRMoE exact (enabled false) | `{\"enabled\": false, \"retention_ratio\": 1.0}` | 400 | 250.0 | 4.00 | " \
           "1.00 | 20.0 | 2.5000 |" in text
    assert "| 500 | 200.0 | 5.00 | 1.25 | - | 2.5000 |" in text
    assert "| LRMoE retention 0.25 | `{\"enabled\": true, \"retention_ratio\": 0.25}` | failed (rc 1, `x.log`) |" in text


@pytest.mark.parametrize("flags,message", [
    (["--warmup_steps", "10"], "leaves no logged interval"),
    (["--ratios", "0"], "--ratios must be in (0, 1]"),
    (["--lrmoe", "{policy}"], "--lrmoe is not JSON"),
    (["--lrmoe", "[1]"], "--lrmoe must be a JSON object"),
])
def test_bad_arguments_name_the_problem(flags, message, capsys):
    with pytest.raises(SystemExit):
        args_for(*flags)
    assert message in capsys.readouterr().err
