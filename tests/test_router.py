"""The router on CPU: its logits keep the plain fp32 (or fp64) GEMM."""
import pytest
import torch
import torch.nn.functional as F

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
