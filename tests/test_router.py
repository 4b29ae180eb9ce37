"""The router on CPU: its logits keep the plain fp32 (or fp64) GEMM; the fused top-k op reproduces the
router's previous torch math, outputs and gradients."""
import pytest
import torch
import torch.nn.functional as F

from lrmoe_ds.router import Router
from lrmoe_ds.router_gemm import router_logits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_logits_on_cpu_are_the_plain_gemm(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(13, 16, generator=gen).to(dtype).requires_grad_(True)
    w = torch.randn(6, 16, generator=gen).to(dtype).requires_grad_(True)
    logits = router_logits(x, w)
    assert type(logits.grad_fn).__name__ != "RouterLogitsBackward"  # the CUDA-only path is not taken
    acc = torch.promote_types(dtype, torch.float32)
    x_ref, w_ref = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    expected = F.linear(x_ref.to(acc), w_ref.to(acc))
    assert logits.dtype == acc and torch.equal(logits, expected)
    d = torch.randn(13, 6, generator=gen, dtype=acc)
    logits.backward(d)
    expected.backward(d)
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(w.grad, w_ref.grad)


def previous_router_forward(router, x):
    """The router's math before the fused op (torch operators, autograd through them): the oracle that the
    fused path must reproduce. Returns (topk_index, topk_weight, counts, aux_loss, z_loss)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    logits = F.linear(x.to(dtype), router.wg.weight.to(dtype))
    scores = torch.softmax(logits, -1) if router.score_func == "softmax" else torch.sigmoid(logits)
    probs = scores if router.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
    select = scores.detach() + (0 if router.score_bias is None else router.score_bias.to(dtype))
    G, E = router.num_groups, router.num_experts
    if router.topk_groups < G:  # DeepSeek-V3's group-limited selection, as Hugging Face's DeepseekV3TopkRouter has it
        group_scores = select.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
        group_mask = torch.zeros_like(group_scores).scatter_(1, torch.topk(group_scores, router.topk_groups)[1], 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
        select = select.masked_fill(~score_mask.bool(), float("-inf"))
    topk_index = torch.topk(select, router.k, dim=-1).indices
    topk_weight = scores.gather(1, topk_index)
    if router.norm_topk_prob and router.k > 1:
        topk_weight = topk_weight / topk_weight.sum(-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)
    counts = torch.bincount(topk_index.flatten(), minlength=router.num_experts)
    aux = router.num_experts * torch.sum(probs.sum(0) / x.shape[0] * counts.to(dtype) / topk_index.numel())
    return topk_index, topk_weight, counts, aux, torch.logsumexp(logits, -1).square().mean()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("score_func,k,norm,bias,groups", [
    ("softmax", 2, True, False, (1, 1)), ("softmax", 1, True, True, (1, 1)), ("sigmoid", 4, True, True, (1, 1)),
    ("sigmoid", 3, False, False, (1, 1)), ("sigmoid", 4, True, True, (4, 2)), ("softmax", 2, True, False, (6, 1)),
    ("sigmoid", 3, True, True, (3, 3))])
def test_router_matches_its_previous_math(dtype, tol, score_func, k, norm, bias, groups):
    torch.manual_seed(k)
    router = Router(16, 12, k, score_func, norm, expert_bias=bias, z_loss_coef=0.01, num_groups=groups[0],
                    topk_groups=groups[1]).to(dtype)
    if bias:
        router.score_bias.copy_(torch.randn(12))
    x = torch.randn(50, 16, dtype=dtype, requires_grad=True)
    d_weight = torch.randn(50, k, dtype=dtype)
    got = router(x)
    ((got.topk_weight * d_weight).sum() + 0.3 * got.aux_loss).backward()
    grads = x.grad.clone(), router.wg.weight.grad.clone()
    x.grad, router.wg.weight.grad = None, None
    index, weight, counts, aux, z = previous_router_forward(router, x)
    ((weight * d_weight).sum() + 0.3 * aux + 0.01 * z).backward()  # the z-loss reaches the router in the backward
    assert torch.equal(got.topk_index, index) and torch.equal(got.counts, counts)
    torch.testing.assert_close(got.topk_weight, weight, rtol=tol, atol=tol)
    torch.testing.assert_close(got.aux_loss, aux, rtol=tol, atol=tol)
    torch.testing.assert_close(grads[0], x.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(grads[1], router.wg.weight.grad, rtol=tol, atol=tol)


def test_router_is_two_autograd_nodes_and_aux_only_backward():
    router = Router(16, 8, 2, "softmax")
    x = torch.randn(10, 16, requires_grad=True)
    out = router(x)
    assert type(out.topk_weight.grad_fn).__name__ == "RouterTopKBackward"
    out.aux_loss.backward()  # prob_sum alone reaches the op's backward
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.any()


def test_group_limited_selection_chooses_within_the_best_groups_only():
    torch.manual_seed(0)
    router = Router(16, 12, 4, "sigmoid", expert_bias=True, num_groups=4, topk_groups=2)
    router.score_bias.copy_(torch.randn(12))
    x = torch.randn(64, 16)
    out = router(x)
    groups_used = [set((row // 3).tolist()) for row in out.topk_index]  # groups of 3 consecutive experts
    assert all(len(g) <= 2 for g in groups_used) and any(len(g) == 2 for g in groups_used)
    free = Router(16, 12, 4, "sigmoid", expert_bias=True)
    free.load_state_dict(router.state_dict())
    assert not torch.equal(free(x).topk_index, out.topk_index)  # the limit changed some choices


def test_bad_groups_are_refused():
    with pytest.raises(ValueError, match="num_groups must be >= 1 and divide"):
        Router(16, 12, 2, num_groups=5)
    with pytest.raises(ValueError, match="topk_groups"):
        Router(16, 12, 4, num_groups=6, topk_groups=1)  # 2 experts to choose 4 from
    from lrmoe_ds import ops
    with pytest.raises(RuntimeError, match="group-limited selection .* has no CUDA kernel"):
        ops.router_topk(torch.randn(4, 12), 2, "sigmoid", num_groups=4, topk_groups=2, backend="cuda")
