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
    names = list(ref_w)
    w1 = [ref_w[n] for n in names if "gate_up_proj" in n or "fc1" in n]
    w2 = [ref_w[n] for n in names if "down_proj" in n or "fc2" in n]
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
