"""topk_retention on CUDA vs the torch reference: exact kept set, sizes and thresholds."""
import itertools

import pytest
import torch
from _retention_cases import SPREADS, groups_and_quotas

from lrmoe_ds import ops
from lrmoe_ds.ops import reference

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("G,how,dtype,ties", list(itertools.product(
    [1, 8, 128], SPREADS, DTYPES, ["few", "many"])))
def test_matches_reference(ext, G, how, dtype, ties):
    gen = torch.Generator().manual_seed(G * 5 + len(how))
    sizes, q = groups_and_quotas(G, how, gen)
    P = int(sizes.sum())
    if ties == "many":  # a handful of distinct values, so every group has long runs of equal scores
        scores = torch.randint(0, 4, (P,), generator=gen).to(dtype)
    else:
        scores = torch.rand(P, generator=gen).to(dtype)
    s, sz, qq = scores.cuda(), sizes.cuda(), q.cuda()
    kept = torch.full((P,), -3, dtype=torch.long, device="cuda")
    kept_sizes = torch.full((G,), -3, dtype=torch.long, device="cuda")
    thr = torch.full((G,), float("nan"), dtype=dtype, device="cuda")
    summary = torch.full((3,), -3, dtype=torch.long, device="cuda")
    ext.topk_retention(s, sz, qq, kept, kept_sizes, thr, summary)
    ref = reference.topk_retention(scores, sizes, q)
    n = len(ref[0])
    assert summary.tolist() == [n, P, 0]
    assert torch.equal(kept[:n].cpu(), ref[0])
    assert torch.equal(kept_sizes.cpu(), ref[1])
    assert torch.equal(thr.cpu(), ref[2])
    api = ops.topk_retention(s, sz, qq, backend="cuda")
    for a, r in zip(api, ref):
        assert a.is_cuda and a.dtype == r.dtype and torch.equal(a.cpu(), r)


def test_signed_zero_ties_and_cpu_sizes(ext):
    scores = torch.tensor([0.0, -0.0, 1.0, -0.0, 0.0, -1.0], device="cuda")
    sizes, q = torch.tensor([6]), torch.tensor([3])  # sizes on the host are accepted too
    kept, ks, thr = ops.topk_retention(scores, sizes, q, backend="cuda")
    ref = reference.topk_retention(scores.cpu(), sizes, q)
    assert torch.equal(kept.cpu(), ref[0]) and torch.equal(ks.cpu(), ref[1]) and torch.equal(thr.cpu(), ref[2])


def test_bad_input(ext):
    s = torch.rand(10, device="cuda")
    with pytest.raises(ValueError, match="summing to 9"):
        ops.topk_retention(s, torch.tensor([4, 5], device="cuda"), torch.tensor([1, 1], device="cuda"), backend="cuda")
    with pytest.raises(ValueError, match=">= 0"):
        ops.topk_retention(s, torch.tensor([4, 6], device="cuda"), torch.tensor([1, -1], device="cuda"), backend="cuda")
    with pytest.raises(ValueError, match=r"\[P\]"):
        ops.topk_retention(s.view(2, 5), torch.tensor([10], device="cuda"), torch.tensor([1], device="cuda"),
                           backend="cuda")
