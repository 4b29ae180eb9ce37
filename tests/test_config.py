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
    ({"replica_slots": -1}, '"replica_slots": Input should be greater than or equal to 0'),
])
def test_bad_retention_schedule(block, message):
    with pytest.raises(ValueError, match=message):
        parse_config({"lrmoe": block})


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


def test_shipped_configs_parse():
    configs = sorted((ROOT / "ds_configs").glob("*.json"))
    assert configs, "ds_configs/ has no config"
    for path in configs:
        parse_config(str(path))


def test_readme_documents_every_key():
    readme = (ROOT / "README.md").read_text()
    table_keys = set(re.findall(r"^\| `([a-z_]+)` \|", readme, flags=re.M))
    assert table_keys == set(LRMoEConfig.model_fields), "README's key table and LRMoEConfig differ"
