"""unpermute_weight_grad (the combine's gate gradient) on CUDA vs an fp64 reference, deterministic."""
import itertools

import pytest
import torch

from lrmoe_ds import ops
from lrmoe_ds.ops import reference

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("T,K,H,dtype", list(itertools.product([1, 513], [1, 2, 8, 10], [8, 5, 2048], DTYPES)))
def test_matches_fp64_reference(ext, rel_fro, tol, T, K, H, dtype):
    gen = torch.Generator().manual_seed(T + 3 * K + 11 * H)
    P = T * K + 5
    rows = torch.randn(P, H, generator=gen).to(dtype).cuda()
    rop = torch.randperm(P, generator=gen)[: T * K].view(T, K)
    rop[0, 0] = -1                                       # a pair with no row: 0
    rop = rop.cuda()
    dout = torch.randn(T, H, generator=gen).to(dtype).cuda()
    out = torch.full((T, K), float("nan"), device="cuda")
    ext.unpermute_weight_grad(rows, rop, dout, out)
    ref64 = reference.unpermute_weight_grad(rows.cpu().double(), rop.cpu(), dout.cpu().double())
    assert out[0, 0] == 0
    assert rel_fro(out, ref64) < tol[torch.float32]      # fp32 accumulation of exact products
    api = ops.unpermute_weight_grad(rows, rop, dout, backend="cuda")
    assert api.dtype == torch.float32 and torch.equal(api, out)
    assert torch.equal(api, ops.unpermute_weight_grad(rows, rop, dout, backend="cuda"))  # run-to-run identical


def test_unaligned_and_empty(ext, rel_fro, tol):
    base = torch.randn(40 * 64 + 1, device="cuda")
    rows = base[1:].view(40, 64)                          # not 16-byte aligned: the scalar path
    rop = torch.randint(0, 40, (9, 4), device="cuda")
    dout = torch.randn(9, 64, device="cuda")
    ref64 = reference.unpermute_weight_grad(rows.double().cpu(), rop.cpu(), dout.double().cpu())
    assert rel_fro(ops.unpermute_weight_grad(rows, rop, dout, backend="cuda"), ref64) < tol[torch.float32]
    none = ops.unpermute_weight_grad(rows[:0], torch.full((3, 2), -1, device="cuda"), dout[:3], backend="cuda")
    assert torch.equal(none, torch.zeros(3, 2, device="cuda"))
    assert ops.unpermute_weight_grad(rows, rop[:0], dout[:0], backend="cuda").shape == (0, 4)


def test_bad_input(ext):
    rows = torch.randn(4, 8, device="cuda")
    with pytest.raises(RuntimeError, match=r"dout must be \[T, H\]"):
        ops.unpermute_weight_grad(rows, torch.zeros(2, 2, dtype=torch.long, device="cuda"),
                                  torch.ones(3, 8, device="cuda"), backend="cuda")
    with pytest.raises(RuntimeError, match="dout must have rows' dtype"):
        ops.unpermute_weight_grad(rows, torch.zeros(2, 2, dtype=torch.long, device="cuda"),
                                  torch.ones(2, 8, device="cuda", dtype=torch.bfloat16), backend="cuda")
