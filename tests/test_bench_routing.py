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
    with pytest.raises(ValueError, match="routing must be uniform, zipf or zipf_shuffled"):
        sizes("skewed")
