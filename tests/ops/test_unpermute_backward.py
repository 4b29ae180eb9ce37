"""unpermute_backward (the combine's rows and weight gradients from one read of dout) on CUDA: against an
fp64 reference, and bit for bit against the two ops it fuses (permute's scaled gather, unpermute_weight_grad)."""
import itertools

import pytest
import torch

from lrmoe_ds import ops
from lrmoe_ds.ops import reference

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _case(T, K, H, dtype, seed, index_dtype=torch.long):
    gen = torch.Generator().manual_seed(seed)
    rop = torch.randperm(T * K, generator=gen).view(T, K).to(index_dtype)   # a plan's inverse: each row once
    rows = torch.randn(T * K, H, generator=gen).to(dtype)
    weight = torch.rand(T, K, generator=gen)
    dout = torch.randn(T, H, generator=gen).to(dtype)
    return [t.cuda() for t in (rows, rop, weight, dout)]


@pytest.mark.parametrize("T,K,H,dtype", list(itertools.product([1, 513], [1, 2, 8, 10], [8, 5, 2048], DTYPES)))
def test_matches_reference_and_the_ops_it_fuses(ext, rel_fro, tol, T, K, H, dtype):
    rows, rop, weight, dout = _case(T, K, H, dtype, T + 3 * K + 11 * H)
    d_rows = torch.full_like(rows, float("nan"))
    d_weight = torch.full((T, K), float("nan"), device="cuda")
    ext.unpermute_backward(rows, rop, weight, dout, d_rows, d_weight)
    ref_rows, ref_weight = reference.unpermute_backward(rows.cpu().double(), rop.cpu(), weight.cpu().double(),
                                                        dout.cpu().double())
    assert rel_fro(d_rows, ref_rows) < tol[dtype] and rel_fro(d_weight, ref_weight) < tol[torch.float32]
    order = torch.argsort(rop.reshape(-1))
    assert torch.equal(d_rows, ops.permute(dout, order // K, weight.reshape(-1)[order], backend="cuda"))
    assert torch.equal(d_weight, ops.unpermute_weight_grad(rows, rop, dout, backend="cuda"))
    api_rows, api_weight = ops.unpermute_backward(rows, rop, weight, dout, backend="cuda")
    assert torch.equal(api_rows, d_rows) and torch.equal(api_weight, d_weight)


def test_int32_index_bf16_weight_unaligned_and_empty(ext, rel_fro, tol):
    rows, rop, weight, dout = _case(9, 4, 64, torch.float32, 1, torch.int32)
    shifted = torch.empty(rows.numel() + 1, device="cuda")[1:].view_as(rows).copy_(rows)  # the scalar path
    d_rows, d_weight = ops.unpermute_backward(shifted, rop, weight.bfloat16(), dout, backend="cuda")
    ref_rows, ref_weight = reference.unpermute_backward(rows.cpu().double(), rop.cpu(),
                                                        weight.bfloat16().cpu().double(), dout.cpu().double())
    assert rel_fro(d_rows, ref_rows) < tol[torch.float32] and rel_fro(d_weight, ref_weight) < tol[torch.float32]
    empty_rows, empty_weight = ops.unpermute_backward(rows[:0], rop[:0], weight[:0], dout[:0], backend="cuda")
    assert empty_rows.shape == (0, 64) and empty_weight.shape == (0, 4)


def test_bad_input(ext):
    rows, rop, weight, dout = _case(3, 2, 8, torch.float32, 2)
    with pytest.raises(RuntimeError, match="every row must be the row of exactly one pair"):
        ops.unpermute_backward(torch.cat([rows, rows[:1]]), rop, weight, dout, backend="cuda")
    with pytest.raises(RuntimeError, match=r"dout must be \[T, H\]"):
        ops.unpermute_backward(rows, rop, weight, dout[:2], backend="cuda")
    with pytest.raises(RuntimeError, match="weight must be a float32 \\[T, K\\]"):
        ext.unpermute_backward(rows, rop, weight.double(), dout, torch.empty_like(rows), torch.empty_like(weight))
    with pytest.raises(RuntimeError, match="weight must be a float32 \\[T, K\\]"):
        ops.unpermute_backward(rows, rop, weight[:, :1], dout, backend="cuda")


@pytest.mark.parametrize("T,K,H,dtype,kept_fraction", list(itertools.product(
    [1, 513], [2, 8], [8, 2048], DTYPES, [0.0, 0.5, 1.0])))
def test_kept_rows_by_their_own_map(ext, rel_fro, tol, T, K, H, dtype, kept_fraction):
    """d_row_of_pair (a retained backward's dy rows, compacted, in any order): against the fp64 reference, and
    bit for bit against permute's scaled gather of the kept pairs; poisoned outputs, every row written once."""
    rows, rop, weight, dout = _case(T, K, H, dtype, T + 5 * K + H + int(10 * kept_fraction))
    gen = torch.Generator().manual_seed(T * K)
    kept = torch.randperm(T * K, generator=gen)[:int(kept_fraction * T * K)].cuda()
    drp = torch.full((T * K,), -1, dtype=torch.long, device="cuda").index_copy_(
        0, kept, torch.arange(kept.numel(), device="cuda")).view(T, K)
    d_rows = torch.full((kept.numel(), H), float("nan"), device="cuda", dtype=dtype)
    d_weight = torch.full((T, K), float("nan"), device="cuda")
    ext.unpermute_backward(rows, rop, weight, dout, d_rows, d_weight, drp)
    ref_rows, ref_weight = reference.unpermute_backward(rows.cpu().double(), rop.cpu(), weight.cpu().double(),
                                                        dout.cpu().double(), drp.cpu(), kept.numel())
    assert rel_fro(d_rows, ref_rows) < tol[dtype] and rel_fro(d_weight, ref_weight) < tol[torch.float32]
    assert torch.equal(d_rows, ops.permute(dout, kept // K, weight.reshape(-1)[kept], backend="cuda"))
    assert torch.equal(d_weight, ops.unpermute_weight_grad(rows, rop, dout, backend="cuda"))
    api_rows, api_weight = ops.unpermute_backward(rows, rop, weight, dout, drp, kept.numel(), backend="cuda")
    assert torch.equal(api_rows, d_rows) and torch.equal(api_weight, d_weight)


def test_kept_rows_bad_input(ext):
    rows, rop, weight, dout = _case(3, 2, 8, torch.float32, 4)
    drp = torch.tensor([[0, -1], [-1, 1], [2, -1]], device="cuda")
    with pytest.raises(RuntimeError, match="d_row_of_pair must be a"):
        ops.unpermute_backward(rows, rop, weight, dout, drp.int(), 3, backend="cuda")
    with pytest.raises(RuntimeError, match="d_row_of_pair must be a"):
        ops.unpermute_backward(rows, rop, weight, dout, drp[:2], 3, backend="cuda")
    with pytest.raises(ValueError, match="come together"):
        ops.unpermute_backward(rows, rop, weight, dout, drp, backend="cuda")
    with pytest.raises(RuntimeError, match="d_rows must be"):
        ext.unpermute_backward(rows, rop, weight, dout, torch.empty(3, 4, device="cuda"), torch.empty_like(weight), drp)
    # a pair without a y row (-1 in row_of_pair) is allowed with a map of its own: its d_weight is 0
    rop_missing = rop.clone()
    rop_missing[1, 0] = -1
    d_rows, d_weight = ops.unpermute_backward(rows, rop_missing, weight, dout, drp, 3, backend="cuda")
    assert d_weight[1, 0] == 0 and torch.equal(d_rows[1], dout[1] * weight[1, 1])
