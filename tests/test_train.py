"""train.py end to end: 2 CPU ranks through the deepspeed launcher, ep_size 2, a tiny model.

One run is interrupted at step 20 (``--stop_at``) and resumed to step 30; an uninterrupted run to
step 30 must give the same losses, which checks that the checkpoint restores the model, the
optimizer, the LR schedule, the step and the data position.
"""
import csv
import json
import os
import subprocess

import pytest
from launcher import launch_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--layers", "2", "--hidden", "64", "--ffn", "128", "--heads", "2", "--experts", "4", "--top_k", "2",
        "--seq_len", "64", "--train_bytes", str(256 << 10), "--val_bytes", str(32 << 10),
        "--eval_bytes", str(16 << 10), "--log_every", "5", "--eval_every", "10", "--steps", "30"]

pytestmark = pytest.mark.multiproc


def launch(tmp_path, name, *extra, timeout=300, config_changes=None):
    """Run train.py on 2 ranks with cpu_ep2.json (its monitor redirected under tmp_path, ``config_changes``
    applied: None values delete keys); returns the summary."""
    with open(os.path.join(ROOT, "ds_configs", "cpu_ep2.json")) as f:
        config = json.load(f)
    for key, value in (config_changes or {}).items():
        config.pop(key) if value is None else config.__setitem__(key, value)
    config["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "monitor"), "job_name": name}
    config_path = tmp_path / f"{name}.json"
    config_path.write_text(json.dumps(config))
    summary = tmp_path / f"{name}.summary.json"
    args = ["train.py", "--deepspeed_config", config_path, "--summary_json", summary, *TINY, *extra]
    try:
        proc, log = launch_ranks(args, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"train.py {' '.join(map(str, args))}\ntimed out after {timeout} s\n{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, log[-16000:]
    assert "final: held-out loss" in proc.stdout, log[-16000:]
    with open(summary) as f:
        return json.load(f)


def read_csv(path):
    """{step: value} from a csv_monitor file (a resumed run appends a second header line)."""
    with open(path) as f:
        return {int(row[0]): float(row[1]) for row in csv.reader(f) if row and row[0] != "step"}


def test_train_end_to_end_and_resume(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = launch(tmp_path, "interrupted", "--save_dir", ckpt, "--stop_at", "20")
    assert first["ep_size"] == 2 and first["world"] == 2
    assert first["end_step"] == 20
    assert first["end_loss"] < first["start_loss"] - 1.0, first["evals"]  # ~5.5 -> ~3.3 nats/byte

    monitor = tmp_path / "monitor" / "interrupted"
    for name in ["Train_loss", "Train_lr", "Train_tokens_per_s", "Eval_loss", "Load_layer0_max_over_mean",
                 "Load_layer1_expert3"]:
        assert (monitor / f"{name}.csv").is_file(), sorted(os.listdir(monitor))
    load = [read_csv(monitor / f"Load_layer0_expert{e}.csv") for e in range(4)]
    assert sorted(load[0]) == [5, 10, 15, 20]
    assert all(abs(sum(l[s] for l in load) - 1) < 1e-5 for s in load[0])  # fractions of the routed pairs

    resumed = launch(tmp_path, "interrupted", "--save_dir", ckpt, "--resume")
    assert resumed["start_step"] == 20 and resumed["end_step"] == 30
    assert resumed["start_loss"] == pytest.approx(first["end_loss"], rel=1e-6)  # the saved model is back
    assert sorted(read_csv(monitor / "Train_loss.csv")) == [5, 10, 15, 20, 25, 30]

    straight = launch(tmp_path, "straight", "--save_dir", str(tmp_path / "ckpt2"))
    assert straight["end_loss"] == pytest.approx(resumed["end_loss"], rel=1e-5)
    losses = read_csv(tmp_path / "monitor" / "straight" / "Train_loss.csv")
    resumed_losses = read_csv(monitor / "Train_loss.csv")
    assert [losses[s] for s in (25, 30)] == pytest.approx([resumed_losses[s] for s in (25, 30)], rel=1e-5)


def test_train_hf_qwen3_moe_converted(tmp_path):
    """--arch hf_qwen3_moe: a Hugging Face Qwen3-MoE, its MoE blocks converted to LRMoE, trains on 2 ranks with
    ep_size 2 and saves a DeepSpeed checkpoint with one file per expert of each MoE layer."""
    pytest.importorskip("transformers")
    ckpt = tmp_path / "ckpt"
    # also: gradient accumulation, and a config that does not clip
    summary = launch(tmp_path, "hf", "--arch", "hf_qwen3_moe", "--steps", "20", "--save_dir", str(ckpt),
                     config_changes={"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
                                     "gradient_clipping": None})
    assert summary["arch"] == "hf_qwen3_moe" and summary["ep_size"] == 2 and summary["end_step"] == 20
    assert summary["end_loss"] < summary["start_loss"] - 1.0, summary["evals"]
    monitor = tmp_path / "monitor" / "hf"
    train_loss = read_csv(monitor / "Train_loss.csv")
    # the mean over micro-steps, not their sum: close to the held-out loss of the same model
    assert train_loss[20] == pytest.approx(summary["end_loss"], rel=0.25), (train_loss, summary["evals"])
    load = [read_csv(monitor / f"Load_layer0_expert{e}.csv") for e in range(4)]
    assert all(abs(sum(l[s] for l in load) - 1) < 1e-5 for s in load[0])
    files = [p.name for p in ckpt.rglob("*expert*")]
    assert sorted({(n.split("_")[1], n.split("_")[3]) for n in files}) == [(str(l), str(e)) for l in range(2)
                                                                             for e in range(4)], files


def test_train_sigmoid_router_with_bias_updates(tmp_path):
    """--router sigmoid_bias without a balance loss: expert_bias_update_rate moves each layer's selection bias
    in steps of the rate, and the checkpoint keeps it."""
    import torch
    rate, ckpt = 0.01, tmp_path / "ckpt"
    summary = launch(tmp_path, "bias", "--router", "sigmoid_bias", "--aux_loss_coef", "0", "--steps", "10",
                     "--save_dir", str(ckpt), config_changes={"lrmoe": {"expert_bias_update_rate": rate}})
    assert summary["end_step"] == 10
    states = [torch.load(p, map_location="cpu", weights_only=False)["module"]
              for p in sorted(ckpt.rglob("mp_rank_*_model_states.pt"))]
    biases = {k: v for k, v in states[0].items() if k.endswith("score_bias")}
    assert len(biases) == 2, sorted(states[0])  # one per layer
    for bias in biases.values():
        steps = bias / rate  # 9 updates (before steps 1..9): each entry a sum of 9 signs
        assert bias.abs().max() > 0 and torch.allclose(steps, steps.round(), atol=1e-4), bias
        assert steps.abs().max() <= 9
