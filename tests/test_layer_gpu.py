"""LRMoE on CUDA in bf16, each ops backend, against the fp64 loop reference (GPU only)."""
import pytest
import torch

import lrmoe_ds
from lrmoe_ds import ops
from moe_reference import reference_moe

pytestmark = pytest.mark.gpu
H, F, E, T, K = 64, 96, 8, 300, 2


def rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


@pytest.mark.parametrize("backend", ["torch", "cuda"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_bf16_layer_matches_fp64_reference(backend, activation):
    if backend == "cuda" and not ops.cuda_ops_status()[0]:
        pytest.skip(f"CUDA ops unavailable: {ops.cuda_ops_status()[1]}")
    torch.manual_seed(0)
    layer = lrmoe_ds.LRMoE(H, num_experts=E, k=K, ffn_hidden_size=F, activation=activation)
    layer.configure(lrmoe_ds.LRMoEConfig(ops_backend=backend))
    layer = layer.cuda().bfloat16()
    # the reference uses the same (bf16-rounded) weights, so both route identically
    ref_w = {n: p.detach().double().cpu().requires_grad_(True) for n, p in layer.named_parameters()}
    x = torch.randn(T, H, device="cuda")
    xb = x.bfloat16().requires_grad_(True)
    out, aux, _ = layer(xb)
    w1, w2 = ref_w["deepspeed_moe.experts.weight1"], ref_w["deepspeed_moe.experts.weight2"]  # [E, N, K] each
    xr = xb.detach().double().cpu().requires_grad_(True)
    ref_out, _, _, _ = reference_moe(xr, ref_w["deepspeed_moe.gate.wg.weight"], w1, w2, K, activation)
    assert rel(out.cpu(), ref_out) < 1e-2
    proj = torch.randn(T, H, dtype=torch.float64)
    (out.double() * proj.cuda()).sum().backward()
    (ref_out * proj).sum().backward()
    assert rel(xb.grad.cpu(), xr.grad) < 2e-2
    for n, p in layer.named_parameters():
        assert rel(p.grad.cpu(), ref_w[n].grad) < 2e-2, n
    ops.set_default_backend("auto")


@pytest.mark.parametrize("policy,router_grad,allocation,dots", [("stash", "exact", "waterfill", "saved"),
                                                                 ("recompute", "retained", "waterfill", "saved"),
                                                                 ("stash", "exact", "threshold", "saved"),
                                                                 ("stash", "exact", "waterfill", "recomputed"),
                                                                 ("stash", "exact", "threshold", "recomputed")])
def test_bf16_retention_matches_reference_over_selected_pairs(policy, router_grad, allocation, dots):
    """Retention 0.5 on CUDA (CUDA ops where they build): the gradients are those of exactly the
    selected pairs (the fp64 reference of test_retention, fed with the CUDA run's selection)."""
    import copy

    import test_retention as tr
    layer, x = tr.make_layer(1)
    x[:, 0] = 3.0
    ref_layer = copy.deepcopy(layer)
    layer = layer.cuda().bfloat16()
    ref_layer.load_state_dict({k: v.double().cpu() for k, v in layer.state_dict().items()})
    layer.keep_last_selection = True
    tr.configure(layer, retention_ratio=0.5, policy=policy, router_grad=router_grad, quota_allocation=allocation,
                 dropped_router_dots=dots)
    xb = x.cuda().bfloat16().requires_grad_(True)
    out, _, _ = layer(xb)
    proj = torch.linspace(-1, 1, tr.T * tr.H, dtype=torch.float64).view(tr.T, tr.H)
    (out.double() * proj.cuda()).sum().backward()
    sel = layer.last_selection
    assert 0 < sel["pairs"].numel() < tr.T * tr.K
    ref_dx, ref_grads = tr.reference_retained_grads(ref_layer, xb.detach().double().cpu(), proj,
                                                    sel["pairs"].cpu(), sel["scale"].cpu(), router_grad)
    assert rel(xb.grad.cpu(), ref_dx) < 3e-2
    for (n, p), g in zip(layer.named_parameters(), ref_grads):
        assert rel(p.grad.cpu(), g) < 3e-2, n


@pytest.mark.parametrize("retention,allocation,dots", [(None, "waterfill", "saved"), (1.0, "waterfill", "saved"),
                                                        (0.5, "waterfill", "saved"), (0.5, "threshold", "saved"),
                                                        (0.5, "waterfill", "recomputed"), (0.5, "metric_mass", "saved")])
def test_no_host_synchronisation_on_one_gpu(retention, allocation, dots):
    """On one GPU with the CUDA ops no step of the layer waits for the GPU's stream: the exact layer
    reads nothing back; with retention the forward waits once, on an event, for the early copy of the
    expert counts (after the experts' GEMMs are queued), which set_sync_debug_mode does not flag; at
    retention 1.0 not even that (checked on the event)."""
    if not ops.cuda_ops_status()[0]:
        pytest.skip(f"CUDA ops unavailable: {ops.cuda_ops_status()[1]}")
    torch.manual_seed(0)
    layer = lrmoe_ds.LRMoE(H, num_experts=E, k=K, ffn_hidden_size=F).cuda().bfloat16()
    if retention is not None:
        layer.configure(lrmoe_ds.LRMoEConfig(enabled=True, retention_ratio=retention, quota_allocation=allocation,
                                             dropped_router_dots=dots))
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x)[0].sum().backward()  # warm-up: the first training forward reads its step counter once
    torch.cuda.synchronize()
    plans = []
    disp = layer.deepspeed_moe.dispatcher
    make_plan = disp.plan
    disp.plan = lambda *a, **kw: plans.append(make_plan(*a, **kw)) or plans[-1]
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _, counts = layer(x)
        out.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    # the counts' early host copy is started only where retention will read it
    started = plans[0].host_counts._event is not None or plans[0].host_counts._device is None
    assert started == (retention is not None)
    assert (plans[0].host_counts._event is not None) == (retention == 1.0)  # started, not waited for
    assert torch.equal(plans[0].all_counts.view(-1), counts.cpu())  # copied when read, lazy or not
    if retention is not None:  # (threshold: the backward's kept counts, copied without a wait, read here)
        assert int(layer.last_stats.retained().sum()) == T * K // 2 if allocation == "threshold" else \
            int(layer.last_stats.quotas.sum()) <= int(retention * T * K)
    ops.set_default_backend("auto")


def test_capped_quotas_in_whole_tiles_on_cuda(monkeypatch):
    """On CUDA the water-fill keeps whole 64-row tiles of each capped expert (quota_granule), and the backward
    keeps exactly those quotas; LRMOE_QUOTA_GRANULE=1 gives the plain water-fill."""
    from lrmoe_ds.quotas import plan_quotas
    torch.manual_seed(0)
    layer = lrmoe_ds.LRMoE(H, num_experts=E, k=K, ffn_hidden_size=F).cuda().bfloat16()
    layer.configure(lrmoe_ds.LRMoEConfig(enabled=True, retention_ratio=0.3, quota_allocation="waterfill"))
    layer.keep_last_selection = True
    x = torch.randn(4096, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for granule in (None, "1"):
        if granule is None:
            monkeypatch.delenv("LRMOE_QUOTA_GRANULE", raising=False)
        else:
            monkeypatch.setenv("LRMOE_QUOTA_GRANULE", granule)
        layer(x)[0].float().square().sum().backward()
        q, n = layer.last_stats.quotas, layer.last_stats.counts
        assert torch.equal(q, plan_quotas(n, 0.3, granule=int(granule or 64)))
        assert layer.last_selection["pairs"].numel() == int(q.sum())
    assert not torch.equal(plan_quotas(n, 0.3, granule=64), plan_quotas(n, 0.3))  # the case tests something
    capped = plan_quotas(n, 0.3, granule=64) < n
    assert capped.any() and torch.all(plan_quotas(n, 0.3, granule=64)[capped] % 64 == 0)


def test_metric_mass_quotas_in_whole_tiles_on_cuda():
    """"metric_mass" on CUDA: from the second step the quotas are the masses' split in whole 64-row tiles (each
    expert all its pairs, a multiple of 64, or under one tile), and the backward keeps exactly those."""
    from lrmoe_ds.quotas import plan_quotas
    torch.manual_seed(0)
    layer = lrmoe_ds.LRMoE(H, num_experts=E, k=K, ffn_hidden_size=F).cuda().bfloat16()
    layer.configure(lrmoe_ds.LRMoEConfig(enabled=True, retention_ratio=0.3, quota_allocation="metric_mass"))
    layer.keep_last_selection = True
    x = torch.randn(4096, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x)[0].float().square().sum().backward()
    weights = layer._mass_weights()
    layer(x)[0].float().square().sum().backward()
    q, n = layer.last_stats.quotas, layer.last_stats.counts
    assert torch.equal(q, plan_quotas(n, 0.3, allocation="metric_mass", weights=weights, granule=64))
    assert not torch.equal(q, plan_quotas(n, 0.3, allocation="metric_mass", weights=weights))
    assert torch.all((q == n) | (q % 64 == 0) | (q < 64)) and bool((q < n).any())
    assert layer.last_selection["pairs"].numel() == int(q.sum())


def test_metric_mass_is_each_experts_summed_metric_bit_for_bit_again():
    """"metric_mass"'s per-expert mass, from which the next step's quotas come, is each expert's summed pair metric
    g_p ||dout_t|| ||x_t|| (against fp64), and the same bit for bit when the same step runs again (a segmented sum:
    index_add_'s atomics summed in a varying order on CUDA, and a last-bit change in a mass can move a quota)."""
    torch.manual_seed(0)
    layer = lrmoe_ds.LRMoE(H, num_experts=E, k=K, ffn_hidden_size=F).cuda().bfloat16()
    layer.configure(lrmoe_ds.LRMoEConfig(enabled=True, retention_ratio=0.5, quota_allocation="metric_mass"))
    x = torch.randn(8192, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    masses = []
    for _ in range(3):  # the weights do not change: every step routes and weighs the same pairs
        out = layer(x)[0]
        out.float().square().sum().backward()
        masses.append(layer._metric_mass[0].get().clone())
    assert torch.equal(masses[1], masses[2]) and torch.equal(masses[0], masses[1])
    routing = layer.deepspeed_moe.gate(x.detach())
    dout_norm = (2 * out.detach().float()).to(torch.bfloat16).double().norm(dim=1)  # dout as the backward got it
    metric = routing.topk_weight.double() * (dout_norm * x.detach().double().norm(dim=1)).unsqueeze(1)
    ref = torch.zeros(E, dtype=torch.float64, device="cuda").index_add_(0, routing.topk_index.reshape(-1),
                                                                        metric.reshape(-1)).cpu()
    assert (masses[0].double() - ref).abs().max() <= 2e-3 * ref.abs().max()
