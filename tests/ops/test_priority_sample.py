"""priority_sample on CUDA vs the torch reference, bit for bit: the kept set, sizes, thresholds and weights, with the
keys made on the device from the uniform draws (and without them: plain top-k, weights 1)."""
import itertools

import pytest
import torch
from _retention_cases import SPREADS, groups_and_quotas

from lrmoe_ds import ops
from lrmoe_ds.ops import reference

pytestmark = pytest.mark.gpu


def _metric(P, how, gen):
    if how == "ties":  # a handful of values, zeros among them: long runs of equal keys without u, zero weights' clamp
        return torch.randint(0, 4, (P,), generator=gen).float() * 0.5
    return torch.rand(P, generator=gen) * torch.rand(P, generator=gen).lt(0.9)  # a tenth exactly 0


@pytest.mark.parametrize("G,how,metric_how,sampled", list(itertools.product(
    [1, 8, 128], SPREADS, ["ties", "spread"], [True, False])))
def test_matches_reference(ext, G, how, metric_how, sampled):
    gen = torch.Generator().manual_seed(G * 7 + len(how) + len(metric_how))
    sizes, q = groups_and_quotas(G, how, gen)
    P = int(sizes.sum())
    metric = _metric(P, metric_how, gen)
    u = torch.rand(P, generator=gen) if sampled else None
    ref = reference.priority_sample(metric, sizes, q, u)
    m, sz, qq = metric.cuda(), sizes.cuda(), q.cuda()
    uu = None if u is None else u.cuda()
    outs = [torch.full((P,), -3, dtype=torch.long, device="cuda"), torch.full((G,), -3, dtype=torch.long, device="cuda"),
            torch.full((G,), float("nan"), device="cuda"), torch.full((P,), float("nan"), device="cuda"),
            torch.full((3,), -3, dtype=torch.long, device="cuda")]
    ext.priority_sample(m, uu, sz, qq, *outs)
    kept, kept_sizes, thr, scale, summary = outs
    n = ref[0].numel()
    assert summary.tolist() == [n, P, 0]
    assert torch.equal(kept[:n].cpu(), ref[0]) and torch.equal(scale[:n].cpu(), ref[1])
    assert torch.equal(kept_sizes.cpu(), ref[2]) and torch.equal(thr.cpu(), ref[3])
    assert torch.isnan(scale[n:]).all()  # nothing written past the kept count
    for num_kept in (None, n):  # the API, with the host read of the count and without it
        api = ops.priority_sample(m, sz, qq, uu, num_kept, backend="cuda")
        for a, r in zip(api, ref):
            assert a.is_cuda and a.dtype == r.dtype and torch.equal(a.cpu(), r)


def test_quota_zero_and_whole_groups(ext):
    """Quota 0 keeps nothing; a quota >= the group's size keeps it whole, each weight 1 (threshold 0)."""
    metric = torch.tensor([0.5, 2.0, 0.0, 1.0, 3.0, 0.25], device="cuda")
    u = torch.tensor([0.1, 0.9, 0.5, 0.0, 0.3, 0.7], device="cuda")
    kept, scale, sizes, thr = ops.priority_sample(metric, torch.tensor([2, 3, 1]), torch.tensor([0, 3, 7]), u,
                                                  backend="cuda")
    assert kept.tolist() == [2, 3, 4, 5] and scale.tolist() == [1.0] * 4
    assert sizes.tolist() == [0, 3, 1] and thr.tolist()[1:] == [0.0, 0.0]


def test_bad_input(ext):
    m = torch.rand(10, device="cuda")
    with pytest.raises(ValueError, match="summing to 9"):
        ops.priority_sample(m, torch.tensor([4, 5]), torch.tensor([1, 1]), backend="cuda")
    with pytest.raises(ValueError, match=">= 0"):
        ops.priority_sample(m, torch.tensor([4, 6]), torch.tensor([1, -1]), torch.rand(10, device="cuda"),
                            backend="cuda")
    with pytest.raises(RuntimeError, match="u must be float32 of metric's shape"):
        ops.priority_sample(m, torch.tensor([10]), torch.tensor([3]), torch.rand(9, device="cuda"), backend="cuda")
    with pytest.raises(RuntimeError, match="float32"):
        ops.priority_sample(m.double(), torch.tensor([10]), torch.tensor([3]), backend="cuda")
    # under "auto" a float64 metric runs on the reference
    kept, scale, _, _ = ops.priority_sample(m.double(), torch.tensor([10]), torch.tensor([3]),
                                            torch.rand(10, device="cuda", dtype=torch.float64))
    assert kept.numel() == 3 and scale.dtype == torch.float64
