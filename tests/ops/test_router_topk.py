"""router_topk / router_topk_backward on CUDA (fp32) against the torch reference in fp64 on the same logits."""
import itertools

import pytest
import torch

from lrmoe_ds import ops
from lrmoe_ds.ops import reference

pytestmark = pytest.mark.gpu

SCORE_FUNCS = ["softmax", "sigmoid"]
SHAPES = [(T, E, k) for T in (0, 1, 37, 1000) for E in (1, 8, 60, 128, 512, 1024)
          for k in sorted({1, 2, 8, E}) if k <= E and (E < 512 or T != 1000 or k < E)]  # T, E, K


def make_logits(T, E, seed, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(T, E, generator=gen)).cuda()


def make_bias(E, seed):
    return torch.randn(E, generator=torch.Generator().manual_seed(seed + 1)).cuda()


def run_poisoned(ext, logits, k, score_func, norm, bias):
    """The extension on outputs filled with -1 / NaN: every element must be overwritten."""
    T, E = logits.shape
    index = torch.full((T, k), -1, dtype=torch.long, device="cuda")
    weight = torch.full((T, k), float("nan"), device="cuda")
    counts = torch.full((E,), -1, dtype=torch.long, device="cuda")
    prob_sum = torch.full((E,), float("nan"), device="cuda")
    ext.router_topk(logits, k, score_func == "sigmoid", norm, bias, index, weight, counts, prob_sum)
    assert (index >= 0).all() and (index < E).all() and (counts >= 0).all()
    return index, weight, counts, prob_sum


def reference_fp64(logits, k, score_func, norm, bias):
    """The reference on the same fp32 logits in fp64, and every expert's selection score [T, E]."""
    l64 = logits.double().cpu()
    b64 = None if bias is None else bias.double().cpu()
    out = reference.router_topk(l64, k, score_func, norm, b64)
    order, scores_sorted, _, _ = reference.router_topk(l64, l64.shape[1], score_func, False, None)
    scores = torch.empty_like(l64).scatter_(1, order, scores_sorted)
    return out, scores if b64 is None else scores + b64


def assert_same_selection(index, ref_index, select, tol):
    """index picks k distinct experts whose selection scores, in order, are the reference's up to tol
    (fp32 and fp64 may order near-ties differently)."""
    index = index.cpu()
    T, k = index.shape
    if k > 1 and T:
        srt = index.sort(1).values
        assert (srt[:, 1:] != srt[:, :-1]).all(), "an expert chosen twice in a row"
    got, want = select.gather(1, index), select.gather(1, ref_index)
    assert T == 0 or float((got - want).abs().max()) <= tol


def check_forward(ext, rel_fro, logits, k, score_func, norm, bias):
    T, E = logits.shape
    index, weight, counts, prob_sum = run_poisoned(ext, logits, k, score_func, norm, bias)
    assert not weight.isnan().any() and not prob_sum.isnan().any()
    (ref_index, ref_weight, _, ref_prob_sum), select = reference_fp64(logits, k, score_func, norm, bias)
    tol = 1e-6 * (1 + (0 if bias is None else float(bias.abs().max())))
    assert_same_selection(index, ref_index, select, tol)
    assert torch.equal(counts.cpu(), torch.bincount(index.flatten().cpu(), minlength=E))
    same_rows = (index.cpu() == ref_index).all(1)  # where a near-tie did not swap experts
    assert rel_fro(weight[same_rows.cuda()], ref_weight[same_rows]) < 1e-5
    assert rel_fro(prob_sum, ref_prob_sum) < 1e-5 if T else not prob_sum.any()
    again = ops.router_topk(logits, k, score_func, norm, bias, backend="cuda")
    for a, b in zip(again, (index, weight, counts, prob_sum)):
        assert torch.equal(a, b)  # deterministic, and the op API returns the extension's results
    return index


def check_backward(ext, rel_fro, logits, index, score_func, norm, with_prob_grad, seed):
    T, E = logits.shape
    k = index.shape[1]
    gen = torch.Generator().manual_seed(seed)
    d_weight = torch.randn(T, k, generator=gen).cuda()
    d_prob_sum = torch.randn(E, generator=gen).cuda() if with_prob_grad else None
    d_logits = torch.full((T, E), float("nan"), device="cuda")
    ext.router_topk_backward(logits, index, d_weight, d_prob_sum, score_func == "sigmoid", norm, d_logits)
    assert not d_logits.isnan().any()
    expected = reference.router_topk_backward(logits.double().cpu(), index.cpu(), d_weight.double().cpu(),
                                              None if d_prob_sum is None else d_prob_sum.double().cpu(),
                                              score_func, norm)
    assert rel_fro(d_logits, expected) < 1e-5 if expected.any() else not d_logits.any()
    assert torch.equal(ops.router_topk_backward(logits, index, d_weight, d_prob_sum, score_func, norm,
                                                backend="cuda"), d_logits)
    return d_logits


@pytest.mark.parametrize("T,E,k", SHAPES)
@pytest.mark.parametrize("score_func,norm,with_bias", list(itertools.product(SCORE_FUNCS, [True, False], [False, True])))
def test_matches_fp64_reference(ext, rel_fro, T, E, k, score_func, norm, with_bias):
    seed = T + 7 * E + k
    logits = make_logits(T, E, seed)
    bias = make_bias(E, seed) if with_bias else None
    index = check_forward(ext, rel_fro, logits, k, score_func, norm, bias)
    check_backward(ext, rel_fro, logits, index, score_func, norm, with_prob_grad=with_bias, seed=seed)


@pytest.mark.parametrize("score_func", SCORE_FUNCS)
@pytest.mark.parametrize("E,k", [(8, 3), (60, 8), (512, 8), (33, 33)])
def test_ties_go_to_the_lower_expert(ext, rel_fro, score_func, E, k):
    """Equal logits give equal scores in fp32 and fp64 alike: the chosen experts must be exactly the
    reference's, each tie to the lower index (with a zero bias too)."""
    gen = torch.Generator().manual_seed(E + k)
    logits = torch.randint(0, 3, (200, E), generator=gen).float().cuda()
    logits[0] = 1.0  # a row of one value: experts 0..k-1
    for bias in (None, torch.zeros(E, device="cuda")):
        index = check_forward(ext, rel_fro, logits, k, score_func, True, bias)
        ref_index = reference.router_topk(logits.double().cpu(), k, score_func, True, None)[0]
        assert torch.equal(index.cpu(), ref_index)
        assert index[0].tolist() == list(range(k))


@pytest.mark.parametrize("score_func", SCORE_FUNCS)
@pytest.mark.parametrize("norm", [True, False])
def test_large_logits(ext, rel_fro, score_func, norm):
    """Logits of size 1e4: scores saturate to exactly 0 and 1 (ties) and nothing overflows to NaN."""
    T, E, k = 500, 60, 4
    logits = make_logits(T, E, 11, scale=1e4)
    logits[:, 0] = logits[:, 0].abs()  # a positive logit per row: sigmoid scores never all underflow
    index, weight, counts, prob_sum = run_poisoned(ext, logits, k, score_func, norm, None)
    assert torch.isfinite(weight).all() and torch.isfinite(prob_sum).all()
    (ref_index, ref_weight, _, ref_prob_sum), select = reference_fp64(logits, k, score_func, norm, None)
    assert_same_selection(index, ref_index, select, 1e-6)
    torch.testing.assert_close(weight.double().cpu(), ref_weight, rtol=1e-5, atol=1e-6)  # swaps are among ~0s
    torch.testing.assert_close(prob_sum.double().cpu(), ref_prob_sum, rtol=1e-5, atol=1e-6)
    d_weight = torch.randn(T, k, device="cuda")
    d_logits = ops.router_topk_backward(logits, index, d_weight, torch.ones(E, device="cuda"), score_func, norm,
                                        backend="cuda")
    expected = reference.router_topk_backward(logits.double().cpu(), index.cpu(), d_weight.double().cpu(),
                                              torch.ones(E, dtype=torch.float64), score_func, norm)
    assert torch.isfinite(d_logits).all()
    torch.testing.assert_close(d_logits.double().cpu(), expected, rtol=1e-5, atol=1e-5)


def test_no_tokens_and_blocks(ext, rel_fro):
    """T = 0 gives zero counts and sums; T past several blocks' rows sums their partials in order."""
    index, weight, counts, prob_sum = run_poisoned(ext, torch.zeros(0, 40, device="cuda"), 3, "softmax", True, None)
    assert index.shape == (0, 3) and not counts.any() and not prob_sum.any()
    d = ops.router_topk_backward(torch.zeros(0, 40, device="cuda"), index, weight, None, backend="cuda")
    assert d.shape == (0, 40)
    logits = make_logits(100_000, 128, 5)  # 512 blocks of 196 rows
    check_forward(ext, rel_fro, logits, 8, "softmax", True, None)


def test_backends_and_bad_input(ext):
    logits64 = torch.randn(5, 8, dtype=torch.float64, device="cuda")
    out = ops.router_topk(logits64, 2)  # "auto": float64 runs on the reference
    assert out[1].dtype == torch.float64 and out[0].is_cuda
    with pytest.raises(ValueError, match="float32 logits"):
        ops.router_topk(logits64, 2, backend="cuda")
    logits = logits64.float()
    with pytest.raises(ValueError, match=r"k must be in \[1, E=8\], got 9"):
        ops.router_topk(logits, 9, backend="cuda")
    with pytest.raises(ValueError, match=r"score_bias must be \[E\]"):
        ops.router_topk(logits, 2, score_bias=torch.zeros(7, device="cuda"), backend="cuda")
    with pytest.raises(RuntimeError, match="1 to 1024 experts"):
        ops.router_topk(torch.zeros(2, 1025, device="cuda"), 2, backend="cuda")
    assert ops.router_topk(torch.zeros(2, 1025, device="cuda"), 2)[1].shape == (2, 2)  # "auto": the reference
    index = ops.router_topk(logits, 2, backend="cuda")[0]
    with pytest.raises(ValueError, match=r"must both be \[T, K\]"):
        ops.router_topk_backward(logits, index, torch.zeros(5, 3, device="cuda"), None, backend="cuda")
