"""Multi-process DeepSpeed tests on CPU: 2 ranks through the deepspeed launcher, ep_size 2."""
import json
import pathlib

import pytest
from launcher import launch_ranks

WORKER = pathlib.Path(__file__).with_name("dist_worker.py")
pytestmark = pytest.mark.multiproc


def launch(tmp_path, *args, timeout=600):
    return launch_ranks([WORKER, *args], cwd=tmp_path, timeout=timeout)


def test_multi_rank_matches_single_process(tmp_path):
    out = tmp_path / "train.json"
    proc, log = launch(tmp_path, "--mode", "train", "--out", str(out))
    assert proc.returncode == 0, log[-6000:]
    result = json.loads(out.read_text())
    for run in ("zero0_ep2", "zero1_ep2", "zero2_ep2", "zero2_ep1"):
        assert result[run]["loss_abs_diff"] < 1e-6, (run, result[run])
        assert result[run]["grad_rel_diff"] < 1e-5, (run, result[run])
    for run in ("zero0_ep2", "zero1_ep2", "zero2_ep2"):
        # forward: one all-gather of counts, two all-to-alls; backward: two all-to-alls
        assert result[run]["collectives_per_step"] == {"all_gather": 1, "all_to_all": 4}, result[run]
    assert result["zero2_ep1"]["collectives_per_step"] == {}  # ep_size 1: the layer communicates not at all
    assert result["retention"]["repeat_equal"], result["retention"]
    assert all(l == l for l in result["retention"]["losses"])  # finite, not NaN
    ep2 = result["retention_ep2"]
    assert ep2["ratio1_stash_bit_exact"] and ep2["ratio1_recompute_bit_exact"], ep2
    dots = ep2["dots_from_rows"]  # across ranks, the router's dots from the rows: y not kept, one small all-to-all more
    assert dots["loss_equal"] and dots["grad_rel_diff"] < 1e-5 and dots["recompute_grad_rel_diff"] < 1e-5, dots
    assert dots["held_saved"] == dots["pairs_here"] * dots["hidden"] * 4, dots  # y [P, H] fp32 of this rank's pairs
    assert dots["backward_all_to_alls"] == [2, 3], dots
    assert 0 < dots["backward_bytes"][1] - dots["backward_bytes"][0] <= dots["backward_bytes"][0] / dots["hidden"], dots
    assert ep2["kept_equals_quotas"], ep2                    # each rank kept its share; shares add up
    assert ep2["grads_stash_vs_recompute"] < 1e-6, ep2
    sizes = ep2["a2a_bytes"]                                 # only retained rows travel in the backward
    assert sizes["half_stash_backward"] < 0.75 * sizes["exact_backward"], sizes
    assert sizes["exact_forward"] == sizes["exact_backward"], sizes
    for ratio, err in ep2["unbiased"].items():  # over 2 ranks the sampled gradient averages to the exact one
        assert err["one_sample"] > 0.02, (ratio, err)                  # one sample really drops pairs...
        assert err["mean"] < 0.35 * err["one_sample"], (ratio, err)     # ...and the mean converges (1/sqrt(32) = 0.18)
    mass = ep2["metric_mass"]              # quota_allocation "metric_mass": quotas from the masses, ranks agree
    assert all(mass.values()), mass
    threshold = ep2["threshold"]           # quota_allocation "threshold": half of each rank's pairs, counts exchanged
    assert threshold["kept_half_of_mine"] and threshold["counts_exchanged"], threshold
    err = threshold["unbiased"]
    assert err["one_sample"] > 0.02 and err["mean"] < 0.35 * err["one_sample"], threshold
    steps = ep2["replicas"].pop("zero2_steps")                  # ZeRO-2 training with replicas: the same losses
    assert steps["loss_abs_diff"] < 1e-6 and sum(steps["replica_rows"]) > 0, steps
    for run, rep in ep2["replicas"].items():  # replica_slots 1: the retained rows leveled over the ranks
        assert rep["quotas_equal"] and rep["replica_rows"] > 0, (run, rep)
        home, spread = rep["retained_per_rank_home"], rep["retained_per_rank"]
        assert sum(spread) == sum(home) and max(spread) - min(spread) <= 1 < max(home) - min(home), (run, rep)
        assert rep["grad_rel_diff"] < 1e-5, (run, rep)       # the same selection's gradients, summed elsewhere
    assert ep2["replicas"]["1.0_exact"]["vs_exact"] < 1e-5, ep2["replicas"]
    assert result["empty_rank"] == {"loss_finite": True, "experts_idle_per_rank": [0.0, 1.0]}, result["empty_rank"]


def test_checkpoint_round_trip_is_bit_exact(tmp_path):
    out = tmp_path / "ckpt.json"
    proc, log = launch(tmp_path, "--mode", "checkpoint", "--out", str(out), "--ckpt", str(tmp_path / "ckpt"))
    assert proc.returncode == 0, log[-6000:]
    result = json.loads(out.read_text())
    assert result["params_equal"] and result["losses_equal"], result
    files = sorted(p.name for p in (tmp_path / "ckpt" / "t2").iterdir())
    # DeepSpeed's per-expert files: one per global expert of the layer
    assert sum(name.startswith("layer_0_expert_") for name in files) == 4, files


def test_bad_lrmoe_key_fails_clearly(tmp_path):
    proc, log = launch(tmp_path, "--mode", "badkey", "--out", str(tmp_path / "x.json"), timeout=300)
    assert proc.returncode != 0
    assert 'unknown key "retention_ratoi"; accepted keys: enabled, retention_ratio' in log, log[-3000:]


def test_hf_model_converted_with_ep2_matches_the_original(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "hf.json"
    proc, log = launch(tmp_path, "--mode", "hf", "--out", str(out), timeout=300)
    assert proc.returncode == 0, log[-6000:]
    result = json.loads(out.read_text())
    assert result["local_experts"] == [2, 2], result                  # 4 experts over 2 EP ranks
    assert result["logits_max_diff"] < 1e-4 and result["embed_grad_rel_diff"] < 1e-4, result
    assert result["hf_state_dict_equal"], result                      # exported: the original model's entries


def test_expert_parallel_layer_benchmark_runs(tmp_path):
    """benchmarks/bench_layer_ep.py (issue 5's layer table) at a toy shape on 2 CPU ranks: every row runs,
    compaction shrinks the backward's exchange, and the replicas level the skewed ranks."""
    out = tmp_path / "layer_ep.md"
    bench = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_layer_ep.py"
    proc, log = launch_ranks([bench, "--hidden", "32", "--ffn", "48", "--experts", "8", "--top_k", "2",
                              "--tokens", "128", "--reps", "1", "--routing", "zipf", "--skew", "3",
                              "--replica_slots", "1", "--replica_min_rows", "1", "--out", out], cwd=tmp_path,
                             timeout=300)
    assert proc.returncode == 0, log[-6000:]
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in out.read_text().splitlines()
            if line.startswith("| LRMoE") or line.startswith("| DeepSpeed")}
    assert len(rows) == 7, rows
    exact, stash = rows["LRMoE exact (enabled false)"], rows["LRMoE retention 0.5, stash"]
    assert float(stash[6]) < float(exact[6]), (stash, exact)          # backward a2a MB: retained rows only
    home, spread = rows["LRMoE retention 1, recompute"], rows["LRMoE retention 1, recompute, 1 replica slots"]
    assert float(spread[7]) < float(home[7]) and int(spread[8].rstrip(" |")) > 0, (home, spread)


def test_expert_bias_updates_from_the_counts_of_every_rank(tmp_path):
    out = tmp_path / "balance.json"
    proc, log = launch(tmp_path, "--mode", "balance", "--out", str(out), timeout=300)
    assert proc.returncode == 0, log[-6000:]
    result = json.loads(out.read_text())
    assert result["bias_max_diff"] < 1e-7 and result["ranks_agree"], result
    assert result["moved"] > 0, result


SHUTDOWN_SCRIPT = """
import os, json, sys
import deepspeed
import lrmoe_ds.integration as integration
deepspeed.init_distributed(dist_backend="gloo")
port, rank = os.environ["MASTER_PORT"], int(os.environ["RANK"])
before = len(integration.cpu_allreduce_segments(port, rank=rank))
integration.shutdown()
after = len(integration.cpu_allreduce_segments(port, rank=rank))
json.dump({"before": before, "after": after}, open(sys.argv[-1] + f".{rank}", "w"))  # argv[1] is --local_rank
"""


def test_shutdown_removes_deepspeeds_cpu_allreduce_segment(tmp_path):
    """DeepSpeed leaves a 69 MB /dev/shm segment per CPU rank; lrmoe_ds.integration.shutdown (train.py's exit)
    removes this rank's own, so that runs do not fill the machine's memory one launch at a time."""
    script = tmp_path / "shutdown.py"
    script.write_text(SHUTDOWN_SCRIPT)
    proc, log = launch_ranks([script, tmp_path / "seg"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, log[-4000:]
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"seg.{rank}").read_text())
        assert seen == {"before": 1, "after": 0}, (rank, seen)
