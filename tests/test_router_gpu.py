"""The router's logits GEMM from bf16/fp16 operands on CUDA (lrmoe_ds.router_gemm) against fp64 of the
same rounded values: logits, and dx, dW before and after their final rounding (GPU only)."""
import pytest
import torch
import torch.nn.functional as F

from lrmoe_ds import router_gemm

pytestmark = pytest.mark.gpu
SHAPES = [(1, 64, 8), (300, 256, 60), (4096, 2048, 128)]  # T, H, E


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def make(T, H, E, dtype, grad_scale):
    gen = torch.Generator().manual_seed(T + 7 * E)
    x = torch.randn(T, H, generator=gen).to(dtype).cuda()
    w = (torch.randn(E, H, generator=gen) / H ** 0.5).to(dtype).cuda()
    d = grad_scale * torch.randn(T, E, generator=gen).cuda()  # fp32, as the top-k math hands it back
    return x, w, d


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,H,E", SHAPES)
@pytest.mark.parametrize("grad_scale", [1.0, 1e-7])  # 1e-7: below fp16's normal range without the scale
def test_logits_and_gradients_match_fp64(dtype, T, H, E, grad_scale):
    x, w, d = make(T, H, E, dtype, grad_scale)
    x64, w64, d64 = x.double().cpu(), w.double().cpu(), d.double().cpu()
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    logits = router_gemm.router_logits(xg, wg)
    assert type(logits.grad_fn).__name__ == "RouterLogitsBackward", "the bf16/fp16 path was not taken"
    assert logits.dtype == torch.float32 and logits.shape == (T, E)
    assert rel(logits, x64 @ w64.t()) < 1e-5

    # the fp32 internals, before the final rounding to x's and w's dtypes
    d2, scale = router_gemm.split_hi_lo(d, dtype)
    dx32 = router_gemm.logits_dgrad_fp32(d2, w, scale)
    dw32 = router_gemm.logits_wgrad_fp32(d2, x, scale)
    assert dx32.dtype == dw32.dtype == torch.float32
    assert rel(dx32, d64 @ w64) < 1e-4 and rel(dw32, d64.t() @ x64) < 1e-4
    # the bound tells the split from one rounding of d (8 bits in bf16; flushed toward 0 at 1e-7 in fp16)
    if T * E >= 1000 and (dtype == torch.bfloat16 or grad_scale < 1e-4):
        assert rel(torch.mm(d.to(dtype), w).float(), d64 @ w64) > 1e-4

    logits.backward(d)
    assert xg.grad.dtype == wg.grad.dtype == dtype
    # the gradients are those internals rounded once, element by element
    u, half_subnormal = torch.finfo(dtype).eps / 2, torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps / 2
    for grad, exact in ((xg.grad, dx32), (wg.grad, dw32)):
        assert torch.allclose(grad.float(), exact, rtol=1.01 * u + 1e-6, atol=half_subnormal)
    if dtype == torch.bfloat16 or grad_scale == 1.0:  # fp16 cannot hold gradients of 1e-7 (nor can the fp32 path's)
        assert rel(xg.grad, d64 @ w64) < 1e-2 and rel(wg.grad, d64.t() @ x64) < 1e-2


def test_split_keeps_sixteen_bits():
    d = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * torch.logspace(-30, 30, 32)
    d = d.cuda()  # from 1e-30 to 1e30: bf16 has fp32's exponent range
    d2, scale = router_gemm.split_hi_lo(d, torch.bfloat16)
    assert scale == 1.0
    back = d2[:, :32].double() + d2[:, 32:].double()
    assert float(((back - d.double()).abs() / d.double().abs()).max()) < 2 ** -15


def test_other_dtypes_keep_the_plain_path():
    x, w, _ = make(37, 64, 8, torch.float32, 1.0)
    logits = router_gemm.router_logits(x, w)
    assert torch.equal(logits, F.linear(x, w)) and type(logits.grad_fn).__name__ != "RouterLogitsBackward"
    mixed = router_gemm.router_logits(x.bfloat16(), w)  # bf16 x, fp32 weight: fp32 copies, as before
    assert torch.equal(mixed, F.linear(x.bfloat16().float(), w))
    empty = router_gemm.router_logits(x[:0].bfloat16(), w.bfloat16())
    assert empty.shape == (0, 8) and empty.dtype == torch.float32


@pytest.mark.parametrize("score_func,k,bias", [("softmax", 8, False), ("sigmoid", 4, True)])
def test_bf16_router_matches_its_fp64_math(score_func, k, bias):
    """The whole router on CUDA in bf16 (the logits GEMM above, the fused top-k op where the CUDA ops
    build) against the router's previous torch math in fp64 on the same rounded weights and inputs."""
    from lrmoe_ds.router import Router
    from test_router import previous_router_forward

    torch.manual_seed(0)
    router = Router(256, 64, k, score_func, expert_bias=bias, z_loss_coef=0.01)
    if bias:
        router.score_bias.normal_()
    router = router.cuda().bfloat16()
    ref = Router(256, 64, k, score_func, expert_bias=bias, z_loss_coef=0.01).double()
    ref.load_state_dict({n: t.double().cpu() for n, t in router.state_dict().items()})
    x = torch.randn(2000, 256, device="cuda").bfloat16().requires_grad_(True)
    x_ref = x.detach().double().cpu().requires_grad_(True)
    out = router(x)
    index, weight, counts, aux, z = previous_router_forward(ref, x_ref)
    same = (out.topk_index.cpu() == index).all(1)  # fp32 and fp64 logits may swap near-ties
    assert float(same.double().mean()) > 0.98
    assert int(out.counts.sum()) == 2000 * k
    assert rel(out.topk_weight[same.cuda()], weight[same]) < 1e-5
    assert abs(float(out.aux_loss.detach()) - float(aux.detach())) < 1e-2 * float(aux.detach())
    d_weight = torch.randn(2000, k, dtype=torch.float64)
    ((out.topk_weight.double() * d_weight.cuda()).sum() + out.aux_loss).backward()
    ((weight * d_weight).sum() + aux + 0.01 * z).backward()
    assert rel(x.grad, x_ref.grad) < 2e-2 and rel(router.wg.weight.grad, ref.wg.weight.grad) < 2e-2
