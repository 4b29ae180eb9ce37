"""benchmarks/convergence.py's report over several seeds: gaps paired by seed, their mean, standard error
and range, the win count against uniform, the mean eval curve; failed runs left out of the statistics."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import convergence  # noqa: E402


def result(run, seed, end, evals, rc=0):
    summary = {"end_loss": end, "train_seconds": 1.0} if rc == 0 else None
    return {"run": run, "seed": seed, "rc": rc, "wall": 1.0, "log": "x.log", "summary": summary,
            "train": [], "eval": evals, "grad_norm": []}


def args_for(seeds, runs=("exact", "grad_norm", "uniform")):
    return convergence.parse_args(["--base_config", "ds_configs/cpu_ep2.json", "--seeds", *map(str, seeds),
                                   "--runs", *runs, "--name", "t"])


def test_paired_gaps_mean_and_standard_error():
    args = args_for([1, 2, 3])
    ends = {(1, "exact"): 2.0, (1, "grad_norm"): 2.02, (1, "uniform"): 2.10,
            (2, "exact"): 1.0, (2, "grad_norm"): 1.03, (2, "uniform"): 1.01,
            (3, "exact"): 4.0, (3, "grad_norm"): 4.16, (3, "uniform"): 4.40}
    results = [result(run, seed, v, [(0, 5.0), (10, v)]) for (seed, run), v in ends.items()]
    text = convergence.report_seeds(args, results, "cmd", 16)
    # grad_norm gaps +1%, +3%, +4%: mean 2.67%, sd 1.53%, s.e. 0.88%; uniform +5%, +1%, +10%: mean 5.33%,
    # sd 4.51%, s.e. 2.60%; final losses of grad_norm 2.02, 1.03, 4.16: mean 2.4033, sd 1.5998
    assert "| 1 | 2.0000 | 2.0200 (+1.00%) | 2.1000 (+5.00%) |" in text
    assert "| retention 0.5, grad_norm | 2.4033 (1.5998) | +2.67% | 0.88% | +1.00% .. +4.00% |" in text
    assert "| retention 0.5, uniform | 2.5033 (1.7306) | +5.33% | 2.60% | +1.00% .. +10.00% |" in text
    assert "grad_norm ends below uniform in 2 of 3 seeds." in text
    assert "| 10 | 2.3333 | 2.4033 | 2.5033 |" in text


def test_a_failed_run_leaves_its_seed_out_of_the_statistics():
    args = args_for([1, 2], runs=("exact", "grad_norm"))
    results = [result("exact", 1, 2.0, [(10, 2.0)]), result("grad_norm", 1, 2.1, [(10, 2.1)]),
               result("exact", 2, 1.0, [(10, 1.0)]), result("grad_norm", 2, None, [], rc=1)]
    text = convergence.report_seeds(args, results, "cmd", 16)
    assert "| 2 | 1.0000 | failed (rc 1) |" in text
    assert "Over the 1 seed(s) where every run finished" in text
    assert "| retention 0.5, grad_norm | 2.1000 (nan) | +5.00% | nan% | +5.00% .. +5.00% |" in text


def test_repeated_seed_is_an_error(capsys):
    with pytest.raises(SystemExit):
        args_for([1, 1])
    assert "repeats a seed" in capsys.readouterr().err


def test_without_matplotlib_the_report_stands_and_the_plot_is_skipped(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)        # import matplotlib now raises ImportError
    args = args_for([1], runs=("exact",))
    png = tmp_path / "c.png"
    assert convergence.write_plot(args, [result("exact", 1, 2.0, [(0, 5.0)])], str(png), False) is None
    assert not png.exists() and "no plot" in capsys.readouterr().err


@pytest.mark.parametrize("warm_steps", [1, 50])
def test_warm_run_is_exact_then_keeps_the_mean_retention(warm_steps):
    from lrmoe_ds import LRMoEConfig
    args = convergence.parse_args(["--base_config", "x.json", "--steps", "500", "--warm_steps", str(warm_steps)])
    label, block = convergence.run_spec("warm", args)
    cfg = LRMoEConfig(**block)  # a schedule the config accepts
    ratios = [cfg.retention_at(step) for step in range(500)]
    assert ratios[:warm_steps] == [1.0] * warm_steps and len(set(ratios[warm_steps:])) == 1
    assert sum(ratios) / 500 == pytest.approx(0.5) and "mean 0.5" in label
    after = convergence.parse_args(["--base_config", "x.json", "--steps", "500", "--warm_after", "0.5"])
    assert convergence.run_spec("warm", after)[1]["retention_schedule"][-1] == [50, 0.5]
