"""Retention: quotas, priority sampling (unbiased), the topk ablation, and the layer's retained backward."""
import pytest
import torch

import lrmoe_ds
from lrmoe_ds.retention import RetentionSpec, select_retained, water_fill_quotas

H, F, E, T = 8, 6, 4, 64


def test_water_fill_caps_hottest_first():
    counts = torch.tensor([100, 10, 40, 0, 50])
    q = water_fill_quotas(counts, 0.5)
    assert int(q.sum()) <= 100 and int(q.sum()) >= 100 - len(counts)  # the budget, up to rounding
    assert q[1] == 10 and q[3] == 0                  # cold experts keep every pair
    assert q[0] == q[4] == q[2] == q.max()           # the hot ones share one cap
    assert torch.equal(water_fill_quotas(counts, 1.0), counts)
    with pytest.raises(ValueError, match="retention_ratio"):
        water_fill_quotas(counts, 0.0)


def _spec(quotas, selection="priority_sampling", seed=0):
    return RetentionSpec(torch.tensor(quotas), "grad_norm", selection, seed)


def test_priority_sampling_keeps_quota_and_is_deterministic():
    g = torch.Generator().manual_seed(0)
    dy, x = torch.randn(12, 3, generator=g), torch.randn(12, 5, generator=g)
    sizes = torch.tensor([5, 0, 7])
    kept, scale, kept_sizes = select_retained(dy, x, sizes, _spec([2, 3, 7]))
    assert kept_sizes.tolist() == [2, 0, 7] and kept.numel() == 9
    assert torch.all(scale[:2] >= 1) and torch.all(scale[2:] == 1)  # a fully kept group is exact
    again = select_retained(dy, x, sizes, _spec([2, 3, 7]))
    assert torch.equal(kept, again[0]) and torch.equal(scale, again[1])
    other = select_retained(dy, x, sizes, _spec([2, 3, 7], seed=1))
    assert not torch.equal(kept, other[0]) or not torch.equal(scale, other[1])


def test_priority_sampling_is_unbiased():
    # E[sum_kept scale_p * v_p] = sum_p v_p for each group, whatever the metric
    g = torch.Generator().manual_seed(1)
    dy, x = torch.randn(30, 3, generator=g, dtype=torch.float64), torch.randn(30, 4, generator=g, dtype=torch.float64)
    sizes, v = torch.tensor([20, 10]), torch.randn(30, generator=g, dtype=torch.float64)
    exact = torch.stack([v[:20].sum(), v[20:].sum()])
    samples = []
    for seed in range(1000):
        kept, scale, ks = select_retained(dy, x, sizes, _spec([5, 3], seed=seed))
        contrib = v[kept] * scale.double()
        samples.append(torch.stack([contrib[:int(ks[0])].sum(), contrib[int(ks[0]):].sum()]))
    samples = torch.stack(samples)
    stderr = samples.std(0) / len(samples) ** 0.5
    assert torch.all((samples.mean(0) - exact).abs() < 4 * stderr), (samples.mean(0), exact, stderr)
    assert torch.all(samples.std(0) > 0)  # it really samples


def test_topk_ablation_keeps_largest_metric_unweighted():
    dy = torch.tensor([[1.0], [3.0], [2.0], [5.0]])
    x = torch.ones(4, 2)
    kept, scale, _ = select_retained(dy, x, torch.tensor([4]), _spec([2], selection="topk"))
    assert kept.tolist() == [1, 3] and torch.all(scale == 1)


def _layer_grads(layer, x, seed_step=None):
    layer.zero_grad()
    if seed_step is not None:
        layer.retention_step.fill_(seed_step)
    xi = x.clone().requires_grad_(True)
    out, _, _ = layer(xi)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return xi.grad, [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in layer.parameters()]


def test_layer_ratio_one_is_exact_and_ratio_half_is_unbiased():
    torch.manual_seed(0)
    layer = lrmoe_ds.LRMoE(H, num_experts=E, k=2, ffn_hidden_size=F).double()
    x = torch.randn(T, H, dtype=torch.float64)
    dx_exact, grads_exact = _layer_grads(layer, x)
    layer.configure(lrmoe_ds.LRMoEConfig(enabled=True, retention_ratio=1.0))
    dx_one, grads_one = _layer_grads(layer, x)
    assert torch.equal(dx_one, dx_exact) and all(torch.equal(a, b) for a, b in zip(grads_one, grads_exact))

    layer.configure(lrmoe_ds.LRMoEConfig(enabled=True, retention_ratio=0.5))
    n, mean, errs = 100, [torch.zeros_like(g) for g in grads_exact], []
    for step in range(n):
        _, grads = _layer_grads(layer, x, seed_step=step)
        mean = [m + g / n for m, g in zip(mean, grads)]
        if step == 0:
            router_grad = grads[0]
            errs = [float((g - e).norm() / e.norm()) for g, e in zip(grads[1:], grads_exact[1:])]
    assert torch.allclose(router_grad, grads_exact[0], rtol=1e-10)  # the router's gradient stays exact
    assert max(errs) > 0.05  # one sample really drops pairs...
    for m, e in zip(mean[1:], grads_exact[1:]):
        assert float((m - e).norm() / e.norm()) < 0.25 * max(errs)  # ...and the average converges
