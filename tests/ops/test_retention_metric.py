"""retention_metric on CUDA vs the torch reference: the send rows' gates and metric bit for bit (the same fp32 products
in the same order), each group's metric mass against a float64 sum and the same bits on a second run, with poisoned
outputs; every metric and gate dtype, empty groups, one hot group, no pairs at all."""
import itertools

import pytest
import torch
from _retention_cases import SPREADS, groups_and_quotas

from lrmoe_ds import ops
from lrmoe_ds.ops import reference

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _case(G, how, K, dtype, gen):
    """(order [P], topk_weight [T, K], dout_norm [T], x_norm [T], group_sizes [G]) with P = T K."""
    sizes, _ = groups_and_quotas(G, how, gen)
    T = (int(sizes.sum()) + K - 1) // K
    sizes[-1] += T * K - int(sizes.sum())  # the pairs of whole tokens
    order = torch.randperm(T * K, generator=gen)
    topk_weight = torch.rand(T, K, generator=gen).to(dtype)
    topk_weight.view(-1)[::7] = 0  # an underflowed gate
    dout_norm = torch.rand(T, generator=gen) * 3
    x_norm = torch.rand(T, generator=gen) * torch.rand(T, generator=gen).lt(0.95)  # a few zero rows
    return order, topk_weight, dout_norm, x_norm, sizes


@pytest.mark.parametrize("G,how,metric,dtype,K", list(itertools.product(
    [1, 8, 128], SPREADS, reference.RETENTION_METRICS, DTYPES, [1, 8])))
def test_matches_reference(ext, G, how, metric, dtype, K):
    gen = torch.Generator().manual_seed(G * 31 + len(how) * 7 + len(metric) + K)
    order, topk_weight, dout_norm, x_norm, sizes = _case(G, how, K, dtype, gen)
    P = order.numel()
    ref_w, ref_m, ref_mass = reference.retention_metric(order, topk_weight, metric, dout_norm, x_norm, sizes)
    cuda = [t.cuda() for t in (order, topk_weight, dout_norm, x_norm, sizes)]
    w = torch.full((P,), -7, dtype=dtype, device="cuda")  # poisoned: each entry must be written
    m = torch.full((P,), float("nan"), device="cuda")
    mass = torch.full((G,), float("nan"), device="cuda")
    norms = cuda[2:4] if metric == "grad_norm" else (None, None)
    ext.retention_metric(cuda[0], cuda[1], reference.RETENTION_METRICS.index(metric), *norms, cuda[4], w, m, mass)
    assert torch.equal(w.cpu(), ref_w) and torch.equal(m.cpu(), ref_m)
    exact = torch.zeros(G, dtype=torch.float64).index_add_(
        0, torch.repeat_interleave(torch.arange(G), sizes), ref_m.double())
    assert torch.allclose(mass.cpu().double(), exact, rtol=1e-5, atol=1e-30)
    api_w, api_m, api_mass = ops.retention_metric(*cuda[:2], metric, *cuda[2:], backend="cuda")
    assert torch.equal(api_w.cpu(), ref_w) and torch.equal(api_m.cpu(), ref_m)
    assert torch.equal(api_mass, mass)  # a fixed summation order: the same bits again
    _, _, no_mass = ops.retention_metric(*cuda[:2], metric, *cuda[2:4], backend="cuda")
    assert no_mass is None


def test_mass_sums_a_hot_group_in_a_fixed_order(ext):
    """One group of 2^20 rows among empty ones: a float32 sum long enough that a varying order would show."""
    gen = torch.Generator().manual_seed(5)
    T, K = 1 << 17, 8
    sizes = torch.zeros(64, dtype=torch.long)
    sizes[17] = T * K
    order = torch.randperm(T * K, generator=gen).cuda()
    args = (torch.rand(T, K, generator=gen).cuda(), "grad_norm", torch.rand(T, generator=gen).cuda() * 1e3,
            torch.rand(T, generator=gen).cuda())
    masses = [ops.retention_metric(order, *args, sizes.cuda(), backend="cuda")[2] for _ in range(3)]
    assert all(torch.equal(masses[0], m) for m in masses[1:])
    _, metric, _ = ops.retention_metric(order, *args, backend="cuda")
    assert masses[0][17].item() == pytest.approx(metric.double().sum().item(), rel=1e-5)
    assert torch.count_nonzero(masses[0]).item() == 1


def test_bad_input(ext):
    order = torch.arange(6, device="cuda")
    w, n = torch.rand(3, 2, device="cuda"), torch.rand(3, device="cuda")
    with pytest.raises(ValueError, match="unknown retention metric 'norm'"):
        ops.retention_metric(order, w, "norm", backend="cuda")
    with pytest.raises(ValueError, match="needs dout_norm and x_norm"):
        ops.retention_metric(order, w, "grad_norm", n, None, backend="cuda")
    with pytest.raises(RuntimeError, match="x_norm must be float32 with one entry per token"):
        ops.retention_metric(order, w, "grad_norm", n, n[:2], backend="cuda")
    with pytest.raises(RuntimeError, match="5 send rows for 3 x 2 pairs"):
        ops.retention_metric(order[:5], w, "gate", backend="cuda")
    with pytest.raises(RuntimeError, match="order must be 1-d int64"):
        ops.retention_metric(order.int(), w, "gate", backend="cuda")
    with pytest.raises(RuntimeError, match="give group_sizes and mass together"):
        ext.retention_metric(order, w, 1, None, None, torch.tensor([6], device="cuda"), torch.empty(6, device="cuda"),
                             torch.empty(6, device="cuda"), None)
