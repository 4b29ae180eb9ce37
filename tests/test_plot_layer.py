"""benchmarks/plot_layer.py: bench_layer.py's markdown read back by column name, one line per policy, sorted by
ratio; failed cells left out; the figure written where matplotlib is installed."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import plot_layer  # noqa: E402

TABLE = """# One MoE layer, forward + backward, NVIDIA H200

## Qwen3-30B-A3B (H 2048, F 768 SwiGLU, 128 experts, top-8), 8192 tokens

| layer | ms | TFLOP/s | speed vs anchor | speed vs DeepSpeed | held GiB | held vs 1.0 stash | peak GiB | peak vs 1.0 stash |
| --- | --- | --- | --- | --- | --- | --- | --- | --- |
| grouped_mm dropless (anchor) | 8.32 | 223 | 1.00 | 6.94 | 1.23 | 2.58 | 1.91 | 1.02 |
| DeepSpeed MoE (drop_tokens=False) | 57.74 | 32 | 0.14 | 1.00 | 1.05 | 2.21 | 2.36 | 1.25 |
| LRMoE exact (enabled false) | 4.52 | 410 | 1.84 | 12.76 | 0.47 | 1.00 | 1.88 | 1.00 |
| LRMoE retention 0.5, stash | 4.14 | 449 | 2.01 | 13.96 | 0.47 | 1.00 | 1.82 | 0.97 |
| LRMoE retention 1, stash | 4.59 | 404 | 1.81 | 12.59 | 0.47 | 1.00 | 1.88 | 1.00 |
| LRMoE retention 0.5, recompute | failed | - | - | - | - | - | - | - |
| LRMoE retention 0.5, stash, dropped dots recomputed | 4.30 | 432 | 1.92 | 10.09 | 0.22 | 0.47 | 1.57 | 0.84 |

## GLM-4.5-Air (H 4096, F 1408 SwiGLU, 128 experts, top-8), 8192 tokens

| layer | ms | speed vs anchor |
| --- | --- | --- |
| LRMoE retention 0.25, recompute | 10.52 | 2.04 |
"""


def test_tables_read_by_column_name():
    tables = plot_layer.read_tables(TABLE)
    qwen, glm = tables.values()
    assert qwen["LRMoE exact (enabled false)"] == {"ms": 4.52, "held": 0.47}
    assert qwen["LRMoE retention 0.5, recompute"] == {"ms": None, "held": None}  # failed
    assert glm["LRMoE retention 0.25, recompute"] == {"ms": 10.52, "held": None}  # no memory columns


def test_one_line_per_policy_sorted_by_ratio():
    lines = plot_layer.retention_lines(next(iter(plot_layer.read_tables(TABLE).values())))
    assert lines == {"stash": [(0.5, 4.14, 0.47), (1.0, 4.59, 0.47)],
                     "stash, dropped dots recomputed": [(0.5, 4.30, 0.22)]}  # the failed row is no point


def test_figure_written(tmp_path):
    pytest.importorskip("matplotlib")
    table = tmp_path / "layer.md"
    table.write_text(TABLE)
    plot_layer.main([str(table)])
    assert (tmp_path / "layer.png").stat().st_size > 10_000


def test_a_file_without_tables_is_an_error(tmp_path):
    table = tmp_path / "empty.md"
    table.write_text("# nothing here\n")
    with pytest.raises(SystemExit, match="no bench_layer.py tables"):
        plot_layer.main([str(table)])
