"""benchmarks/bench_grouped_gemm.py's routings: Zipf-like shares hottest first, or the same shares over the
experts in a random order (as a trained router's hot experts fall); an unknown routing is an error."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_grouped_gemm  # noqa: E402


def sizes(skew, seed=0):
    return bench_grouped_gemm.routed_sizes(8192, 8, 128, skew, torch.Generator().manual_seed(seed))


def test_zipf_comes_hottest_first_and_shuffled_does_not():
    zipf, shuffled = sizes("zipf"), sizes("zipf_shuffled")
    assert int(zipf.sum()) == int(shuffled.sum()) == 8192 * 8
    assert int(zipf.argmax()) == 0 and zipf[0] > 5 * zipf.float().mean()
    assert int(shuffled.argmax()) != 0 and shuffled.max() > 5 * shuffled.float().mean()  # as skewed, elsewhere
    hot = torch.sort(zipf, descending=True).values[:4].float()  # the same shares: the hottest few agree within noise
    assert torch.allclose(torch.sort(shuffled, descending=True).values[:4].float(), hot, rtol=0.1)


def test_unknown_routing_is_an_error():
    with pytest.raises(ValueError, match="routing must be uniform, zipf, zipf_shuffled or skew<s>"):
        sizes("skewed")


def test_layer_skew_and_retained_rows():
    """skew0.2: bench_layer.py --skew 0.2's loads (the layer printed max / mean 6.2, min / mean 0.37-0.39);
    ">ALLOCATION@RATIO": the quotas the library plans for those counts, so the water-fill flattens the hot
    experts and metric_mass (equal weights) keeps about half of each."""
    routed = sizes("skew0.2")
    assert int(routed.sum()) == 8192 * 8 and int(routed.argmax()) != 0
    assert 5.5 < routed.max() / routed.float().mean() < 7.0 and 0.3 < routed.min() / routed.float().mean() < 0.45
    water, mass = sizes("skew0.2>waterfill@0.5"), sizes("skew0.2>metric_mass@0.5")
    assert int(water.sum()) <= 8192 * 4 and int(mass.sum()) <= 8192 * 4 and int(water.sum()) > 8192 * 4 - 64
    assert bool((water <= routed).all()) and bool((mass <= routed).all())
    assert int(water.max()) == 320 and int(mass.max()) > 4 * int(water.max())
    assert torch.equal(mass, bench_grouped_gemm.routed_sizes(8192, 8, 128, "skew0.2>metric_mass@0.5",
                                                             torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match="unknown quota allocation"):
        sizes("skew0.2>topk@0.5")


def test_layer_bench_skew_and_row_variants():
    """bench_layer.py --skew: every router gets the same per-expert logit offsets through input feature 0 (the
    hottest expert far above the mean, at a shuffled index); --quota_granules: each LRMoE row once per granule,
    its environment set for that row only."""
    import bench_layer
    import lrmoe_ds
    layers = []
    for _ in range(2):
        torch.manual_seed(0)
        layers.append(bench_layer.build("lrmoe", 32, 8, 16, 2))
    torch.manual_seed(1)
    x = torch.randn(4096, 32)
    offsets = bench_layer.skew_routing(layers, x, 0.5)
    assert torch.all(x[:, 0] == 1.0) and int(offsets.argmax()) != 0
    for layer in layers:
        assert torch.equal(layer.deepspeed_moe.gate.wg.weight[:, 0], offsets.float())
    counts = torch.bincount(layers[0].deepspeed_moe.gate.wg(x).topk(2, -1).indices.flatten(), minlength=16).float()
    assert int(counts.argmax()) == int(offsets.argmax()) and counts.max() > 2 * counts.mean()
    args = bench_layer.parse_args(["--ratios", "0.5", "--policies", "stash", "--quota_granules", "64", "1"])
    rows = bench_layer.row_specs(args)
    names = [name for name, *_ in rows]
    assert "LRMoE retention 0.5, stash, granule 64" in names and "LRMoE retention 0.5, stash, granule 1" in names
    envs = {name: env for name, _, _, env in rows}
    assert envs["LRMoE retention 0.5, stash, granule 1"]["LRMOE_QUOTA_GRANULE"] == "1"
    assert envs[bench_layer.ANCHOR] is None
    assert isinstance(layers[0], lrmoe_ds.LRMoE)
    rows = bench_layer.row_specs(bench_layer.parse_args(["--ratios", "0.5", "--policies", "stash",
                                                         "--allocations", "waterfill", "metric_mass"]))
    blocks = {name: block for name, _, block, _ in rows}
    assert blocks["LRMoE retention 0.5, stash, metric_mass"]["quota_allocation"] == "metric_mass"
    assert blocks["LRMoE retention 0.5, stash"]["quota_allocation"] == "waterfill"
