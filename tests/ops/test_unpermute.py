"""unpermute (weighted combine) on CUDA vs an fp64 reference, per-dtype tolerance, deterministic."""
import itertools

import pytest
import torch

from lrmoe_ds import ops
from lrmoe_ds.ops import reference

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("T,K,H,dtype,wdtype", list(itertools.product(
    [1, 513], [1, 2, 8], [8, 5, 2048], DTYPES, [torch.float32, torch.bfloat16])))
def test_matches_fp64_reference(ext, rel_fro, tol, T, K, H, dtype, wdtype):
    gen = torch.Generator().manual_seed(T + 3 * K + 11 * H)
    P = T * K + 5
    rows = torch.randn(P, H, generator=gen).to(dtype).cuda()
    rop = torch.randperm(P, generator=gen)[: T * K].view(T, K).cuda()
    w = torch.rand(T, K, generator=gen).to(wdtype).cuda()
    out = torch.full((T, H), float("nan"), dtype=dtype, device="cuda")
    ext.unpermute(rows, rop, w, out)
    ref64 = reference.unpermute(rows.cpu().double(), rop.cpu(), w.cpu().double())
    tol = tol[dtype]
    assert rel_fro(out, ref64) < tol
    api = ops.unpermute(rows, rop, w, backend="cuda")
    assert rel_fro(api, ref64) < tol
    assert torch.equal(api, ops.unpermute(rows, rop, w, backend="cuda"))  # run-to-run identical
    assert rel_fro(api, reference.unpermute(rows.cpu(), rop.cpu(), w.cpu())) < 2 * tol


def test_repeated_rows_and_k0(ext):
    rows = torch.randn(3, 16, device="cuda")
    rop = torch.zeros(4, 2, dtype=torch.int32, device="cuda")
    w = torch.ones(4, 2, device="cuda")
    torch.testing.assert_close(ops.unpermute(rows, rop, w, backend="cuda"), (2 * rows[0]).expand(4, 16))
    out = ops.unpermute(rows, rop[:, :0].contiguous(), w[:, :0].contiguous(), backend="cuda")
    assert torch.equal(out, torch.zeros(4, 16, device="cuda"))


@pytest.mark.parametrize("K,itype", [(8, torch.int64), (8, torch.int32), (40, torch.int64), (70, torch.int32)])
def test_missing_rows_add_nothing(ext, rel_fro, tol, K, itype):
    """row index -1: the pair adds nothing, even with a NaN weight; a token with no rows gets zeros; the sum over
    the others in k order, the reference's bits (K > 32: the kernel lists a token's pairs in several rounds)."""
    gen = torch.Generator().manual_seed(7 + K)
    T, H = 257, 264
    rows = torch.randn(T * K // 2, H, generator=gen).bfloat16().cuda()
    rop = torch.randint(0, rows.shape[0], (T, K), generator=gen, dtype=itype)
    missing = torch.rand(T, K, generator=gen) < 0.5
    missing[3] = True                                   # a token with no rows at all
    w = torch.rand(T, K, generator=gen)
    rop, w_nan = rop.masked_fill(missing, -1).cuda(), w.masked_fill(missing, float("nan")).cuda()
    out = ops.unpermute(rows, rop, w_nan, backend="cuda")
    ref64 = reference.unpermute(rows.cpu().double(), rop.cpu().clamp_min(0), w.masked_fill(missing, 0).double())
    assert rel_fro(out, ref64) < tol[torch.bfloat16]
    assert torch.equal(out[3], torch.zeros(H, dtype=out.dtype, device="cuda"))
    assert torch.equal(out.cpu(), reference.unpermute(rows.cpu(), rop.cpu(), w_nan.cpu()))
    empty = ops.unpermute(rows[:0], torch.full((4, 2), -1, device="cuda"), torch.ones(4, 2, device="cuda"),
                          backend="cuda")
    assert torch.equal(empty, torch.zeros(4, H, dtype=rows.dtype, device="cuda"))


def test_bad_input(ext):
    rows = torch.randn(4, 8, device="cuda")
    with pytest.raises(RuntimeError, match=r"\[T, K\]"):
        ops.unpermute(rows, torch.zeros(2, 2, dtype=torch.long, device="cuda"), torch.ones(2, 3, device="cuda"),
                      backend="cuda")
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        ops.unpermute(rows, torch.zeros(2, 2, dtype=torch.long, device="cuda"),
                      torch.ones(2, 2, dtype=torch.float64, device="cuda"), backend="cuda")
