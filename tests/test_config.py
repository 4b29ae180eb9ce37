"""The "lrmoe" config block: parsing, clear errors, and the README's table of keys."""
import json
import pathlib
import re

import pytest

from lrmoe_ds import LRMoEConfig, parse_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_defaults_are_exact():
    assert parse_config(None).enabled is False
    assert parse_config({"train_batch_size": 8}) == LRMoEConfig()
    cfg = parse_config({"lrmoe": {"enabled": True, "retention_ratio": 0.5, "metric": "gate"}})
    assert cfg.enabled and cfg.retention_ratio == 0.5 and cfg.metric == "gate"


@pytest.mark.parametrize("block,message", [
    ({"retention_ratoi": 0.5}, r'unknown key "retention_ratoi"; accepted keys: enabled, retention_ratio'),
    ({"retention_ratio": 0.0}, r'"retention_ratio": Input should be greater than 0'),
    ({"retention_ratio": 1.5}, r'"retention_ratio": Input should be less than or equal to 1'),
    ({"metric": "norm"}, r"\"metric\": Input should be 'grad_norm', 'gate' or 'uniform'"),
    ({"enabled": "sometimes"}, r'"enabled": Input should be a valid boolean'),
    ({"seed": -1}, r'"seed": Input should be greater than or equal to 0'),
    # DeepSpeed's config models drop "auto" values; here it would have meant "no budget"
    ({"enabled": True, "budget_gib": "auto"}, r'"budget_gib": Input should be a valid number'),
    ({"enabled": "yes"}, r'"enabled": Input should be a valid boolean'),
    ({"retention_ratio": "0.5"}, r'"retention_ratio": Input should be a valid number'),
    ({"warmup_steps": 2.5}, r'"warmup_steps": Input should be a valid integer'),
    ({"budget_gib": float("inf")}, r'"budget_gib": Input should be a finite number'),
    ({"balance_factor": float("nan")}, r'"balance_factor": Input should be a finite number'),
    ({"budget_gib": 0.5}, r"budget_gib \(0.5\) leaves nothing above reserve_gib \(1\)"),
    ({"strict": True}, r'unknown key "strict"'),
])
def test_bad_block_names_the_key(block, message):
    with pytest.raises(ValueError, match=message):
        parse_config({"lrmoe": block})


@pytest.mark.parametrize("block,message", [
    ({"retention_ratio": 0.5, "retention_schedule": [[0, 0.5]]}, "give retention_ratio or retention_schedule"),
    ({"retention_schedule": []}, "at least one"),
    ({"retention_schedule": [[0, 0.5], [0, 1.0]]}, r"increasing, got \[0, 0\]"),
    ({"retention_schedule": [[-1, 0.5]]}, "must be >= 0"),
    ({"retention_schedule": [[0, 0.5], [10, 1.5]]}, r"ratios must be in \(0, 1\], got \[0.5, 1.5\]"),
    ({"retention_schedule": [[0, 0.0]]}, r"ratios must be in \(0, 1\]"),
    ({"retention_schedule": [[0]]}, '"retention_schedule.0.1"'),
    ({"quota_allocation": "threshold", "floor": 0.1}, 'quota_allocation "threshold" .*; floor need planned quotas'),
    ({"quota_allocation": "threshold", "replica_slots": 1}, "replica_slots need planned quotas"),
    ({"quota_allocation": "metric_mass", "replica_slots": 1}, '"metric_mass" does not place replicas'),
    ({"replica_slots": -1}, '"replica_slots": Input should be greater than or equal to 0'),
])
def test_bad_retention_schedule(block, message):
    with pytest.raises(ValueError, match=message):
        parse_config({"lrmoe": block})


def test_default_split_is_metric_mass_but_replicas_plan_by_the_waterfill():
    """The default quota_allocation is "metric_mass", which places no replicas: with replica_slots and no split named,
    the water-fill plans instead (no error for a block that names neither); a named split stays as named."""
    assert parse_config({"lrmoe": {"enabled": True}}).quota_allocation == "metric_mass"
    assert parse_config({"lrmoe": {"replica_slots": 2}}).quota_allocation == "waterfill"
    assert parse_config({"lrmoe": {"replica_slots": 0}}).quota_allocation == "metric_mass"
    assert parse_config({"lrmoe": {"replica_slots": 2, "quota_allocation": "proportional"}}).quota_allocation == \
        "proportional"


def test_retention_schedule_is_linear_between_points_and_flat_outside():
    cfg = parse_config({"lrmoe": {"retention_schedule": [[10, 0.4], [30, 0.4], [50, 1.0]]}})
    assert [cfg.retention_at(s) for s in (0, 10, 30)] == [0.4, 0.4, 0.4]
    assert cfg.retention_at(40) == pytest.approx(0.7) and cfg.retention_at(45) == pytest.approx(0.85)
    assert cfg.retention_at(50) == 1.0 and cfg.retention_at(10 ** 6) == 1.0
    # 0.3 + 0.7 is 0.9999999999999999 in floats: a point's step must give its ratio exactly
    assert parse_config({"lrmoe": {"retention_schedule": [[0, 0.3], [3, 1.0], [6, 0.5]]}}).retention_at(3) == 1.0
    assert parse_config({"lrmoe": {"retention_ratio": 0.3}}).retention_at(123) == 0.3
    assert parse_config({"lrmoe": {"retention_schedule": [[5, 0.6]]}}).retention_at(0) == 0.6


def test_path_and_non_object(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"lrmoe": {"enabled": True}}))
    assert parse_config(str(path)).enabled
    with pytest.raises(ValueError, match='"lrmoe" must be an object'):
        parse_config({"lrmoe": [1]})
    for not_an_object in ([], False, 0, ""):
        with pytest.raises(ValueError, match='"lrmoe" must be an object'):
            parse_config({"lrmoe": not_an_object})
    assert parse_config({"lrmoe": {"policy": "auto", "dropped_router_dots": "auto"}}).policy == "auto"
    assert parse_config({"lrmoe": {"retention_ratio": 1, "budget_gib": 8}}).retention_ratio == 1.0  # ints are numbers


def test_configs_deepspeed_reads_are_read_alike(tmp_path):
    """What DeepSpeed's own loader reads: hjson (comments) from a path, and a base64 string."""
    import base64
    path = tmp_path / "ds.json"
    path.write_text('{\n  // a comment, as DeepSpeed (hjson) allows\n  "lrmoe": {"enabled": true, "retention_ratio": 0.5}\n}\n')
    assert parse_config(str(path)).retention_ratio == 0.5
    encoded = base64.urlsafe_b64encode(json.dumps({"lrmoe": {"enabled": True}}).encode()).decode()
    assert parse_config(encoded).enabled


def test_shipped_configs_parse():
    configs = sorted((ROOT / "ds_configs").glob("*.json"))
    assert configs, "ds_configs/ has no config"
    for path in configs:
        parse_config(str(path))


def test_readme_documents_every_key():
    readme = (ROOT / "README.md").read_text()
    table_keys = set(re.findall(r"^\| `([a-z_]+)` \|", readme, flags=re.M))
    assert table_keys == set(LRMoEConfig.model_fields), "README's key table and LRMoEConfig differ"


@pytest.mark.parametrize("where", ["config", "config_params", "args.deepspeed_config", "args.deepscale_config"])
def test_initialize_reads_the_block_from_where_deepspeed_does(where, monkeypatch, tmp_path):
    """lrmoe_ds.initialize takes the "lrmoe" block from the config deepspeed.initialize will use (stubbed here)."""
    import argparse

    import lrmoe_ds
    from lrmoe_ds import integration
    seen = {}
    monkeypatch.setattr(integration.deepspeed, "initialize",
                        lambda **kw: seen.update(kw) or (argparse.Namespace(module=kw["model"], global_steps=0), None,
                                                         None, None))
    config = {"train_micro_batch_size_per_gpu": 1, "lrmoe": {"enabled": True, "retention_ratio": 0.5}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    model = lrmoe_ds.LRMoE(8, num_experts=2, k=1, ffn_hidden_size=4)
    if where.startswith("args."):
        kw = {"args": argparse.Namespace(**{where[5:]: str(path)})}
    else:
        kw = {where: config}
    lrmoe_ds.initialize(model=model, model_parameters=list(model.parameters()), **kw)
    assert model.lrmoe_config.enabled and model.lrmoe_config.retention_ratio == 0.5
