"""The torch reference ops against plain Python loops (they are the oracle of the CUDA ops)."""
import itertools
import math
import random

import pytest
import torch

from lrmoe_ds import ops
from lrmoe_ds.ops import reference as ref


@pytest.mark.parametrize("seed", range(5))
def test_routing_plan_permute_unpermute(seed):
    g = torch.Generator().manual_seed(seed)
    T, K, G, H = 17, 3, 5, 4
    groups = torch.randint(0, G - 1, (T * K,), generator=g)  # group G-1 stays empty
    counts, order, offsets = ref.routing_plan(groups, G)
    expected = [p for grp in range(G) for p in range(T * K) if groups[p] == grp]
    assert order.tolist() == expected and counts[G - 1] == 0
    assert offsets.tolist() == [0] + torch.cumsum(counts, 0).tolist()
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    rows = ref.permute(x, order // K)
    row_of_pair = torch.empty_like(order).scatter_(0, order, torch.arange(T * K)).view(T, K)
    w = torch.rand(T, K, generator=g, dtype=torch.float64)
    out = ref.unpermute(rows, row_of_pair, w)
    assert torch.allclose(out, x * w.sum(1, keepdim=True))  # dispatch then combine gives the input back


def test_grouped_linear_and_grads_against_loops():
    g = torch.Generator().manual_seed(0)
    sizes = torch.tensor([3, 0, 5, 1])
    x = torch.randn(9, 4, generator=g, dtype=torch.float64)
    ws = [torch.randn(6, 4, generator=g, dtype=torch.float64) for _ in range(4)]
    dy = torch.randn(9, 6, generator=g, dtype=torch.float64)
    y, dx = ref.grouped_linear(x, ws, sizes), ref.grouped_linear_dgrad(dy, ws, sizes)
    old = [torch.ones(6, 4, dtype=torch.float64) for _ in range(4)]
    dws = ref.grouped_linear_wgrad(dy, x, sizes, out=[o.clone() for o in old], accumulate=True)
    owner = [0, 0, 0, 2, 2, 2, 2, 2, 3]
    for i, e in enumerate(owner):
        assert torch.allclose(y[i], ws[e] @ x[i]) and torch.allclose(dx[i], dy[i] @ ws[e])
    for e in range(4):
        rows = [i for i, o in enumerate(owner) if o == e]
        exact = sum((torch.outer(dy[i], x[i]) for i in rows), torch.zeros(6, 4, dtype=torch.float64))
        assert torch.allclose(dws[e], old[e] + exact)
    with pytest.raises(ValueError, match="3 weights for 4 groups"):
        ref.grouped_linear(x, ws[:3], sizes)


@pytest.mark.parametrize("seed", range(5))
def test_topk_retention_against_loop(seed):
    rnd = random.Random(seed)
    sizes = [rnd.choice([0, 1, 4, 7]) for _ in range(6)]
    quotas = [rnd.choice([0, 2, 100]) for _ in range(6)]
    scores = [float(rnd.choice([0.1, 0.5, 0.9])) for _ in range(sum(sizes))]  # many ties
    kept, kept_sizes, tau = ref.topk_retention(torch.tensor(scores), torch.tensor(sizes), torch.tensor(quotas))
    expect, start = [], 0
    for n, q in zip(sizes, quotas):
        idx = sorted(range(start, start + n), key=lambda p: (-scores[p], p))
        expect += sorted(idx[:q])
        start += n
    assert kept.tolist() == expect
    assert kept_sizes.tolist() == [min(n, q) for n, q in zip(sizes, quotas)]
    start = 0
    for g, (n, q) in enumerate(zip(sizes, quotas)):
        ranked = sorted(scores[start:start + n], reverse=True)
        assert float(tau[g]) == pytest.approx(ranked[q] if q < n else 0.0)
        start += n


@pytest.mark.parametrize("seed", range(4))
def test_priority_sample_against_loop(seed):
    """Keys metric / (1 - u), the quota's largest kept (ties by position), weights max(1, tau / metric) with tau
    the group's (q+1)-th largest key (0, so weight 1, where the group is kept whole); u None: top-k, weights 1."""
    rnd = random.Random(seed)
    sizes = [rnd.choice([0, 1, 4, 7]) for _ in range(6)]
    quotas = [rnd.choice([0, 2, 3, 100]) for _ in range(6)]
    P = sum(sizes)
    metric = [rnd.choice([0.0, 0.25, 0.5, 2.0]) for _ in range(P)]      # ties and zero metrics
    u = [rnd.random() for _ in range(P)]
    m_t, u_t = torch.tensor(metric, dtype=torch.float64), torch.tensor(u, dtype=torch.float64)
    kept, scale, kept_sizes, tau = ref.priority_sample(m_t, torch.tensor(sizes), torch.tensor(quotas), u_t)
    keys = [m / (1.0 - v) for m, v in zip(metric, u)]
    expect_kept, expect_scale, start = [], [], 0
    for n, q in zip(sizes, quotas):
        ranked = sorted(range(start, start + n), key=lambda p: (-keys[p], p))
        t = keys[ranked[q]] if q < n else 0.0
        for p in sorted(ranked[:q]):
            expect_kept.append(p)
            expect_scale.append(max(1.0, t / max(metric[p], torch.finfo(torch.float64).tiny)))
        start += n
    assert kept.tolist() == expect_kept and kept_sizes.tolist() == [min(n, q) for n, q in zip(sizes, quotas)]
    assert scale.tolist() == pytest.approx(expect_scale, rel=1e-12)
    assert all(math.isfinite(w) and w >= 1.0 for w in scale.tolist())
    top, ones, _, _ = ref.priority_sample(m_t, torch.tensor(sizes), torch.tensor(quotas))
    assert top.tolist() == ref.topk_retention(m_t, torch.tensor(sizes), torch.tensor(quotas))[0].tolist()
    assert ones.tolist() == [1.0] * top.numel()


@pytest.mark.parametrize("rescale", [True, False])
def test_retained_pairs_against_loop(rescale):
    gen = torch.Generator().manual_seed(3)
    T, K = 5, 3
    order = torch.randperm(T * K, generator=gen)                       # send row -> pair
    weight_of_row = torch.rand(T * K, generator=gen).to(torch.bfloat16)
    kept = torch.tensor([1, 4, 5, 9, 14])
    scale = torch.tensor([1.0, 2.5, 1.25, 3.0, 1.0])
    kept_pairs, src, gate, row_weight, kept_row_of_pair, pair_weight = ref.retained_pairs(
        kept, scale, order, weight_of_row, K, rescale)
    assert kept_pairs.tolist() == [int(order[r]) for r in kept] and src.tolist() == [int(order[r]) // K for r in kept]
    assert gate.dtype == torch.bfloat16 and gate.tolist() == [float(weight_of_row[r]) for r in kept]
    expected_w = [float(weight_of_row[r]) * (float(s) if rescale else 1.0) for r, s in zip(kept, scale)]
    assert row_weight.dtype == (torch.float32 if rescale else torch.bfloat16)
    assert row_weight.tolist() == pytest.approx(expected_w, rel=1e-6)
    assert kept_row_of_pair.shape == (T, K) and pair_weight.shape == (T, K)
    for p in range(T * K):
        i = kept_pairs.tolist().index(p) if p in kept_pairs.tolist() else -1
        assert kept_row_of_pair.view(-1)[p] == i
        assert float(pair_weight.view(-1)[p]) == (float(row_weight[i]) if i >= 0 else 0.0)
    with pytest.raises(ValueError, match="not a multiple of k = 4"):
        ref.retained_pairs(kept, scale, order, weight_of_row, 4)


@pytest.mark.parametrize("metric", ["grad_norm", "gate", "uniform"])
def test_retention_metric_against_loop(metric):
    gen = torch.Generator().manual_seed(4)
    T, K = 6, 2
    order = torch.randperm(T * K, generator=gen)
    topk_weight = torch.rand(T, K, generator=gen).to(torch.bfloat16)
    dout_norm, x_norm = torch.rand(T, generator=gen), torch.rand(T, generator=gen)
    sizes = torch.tensor([0, 5, 0, 7])
    w, m, mass = ref.retention_metric(order, topk_weight, metric, dout_norm, x_norm, sizes)
    pairs = order.tolist()
    assert w.dtype == torch.bfloat16 and w.tolist() == [float(topk_weight.view(-1)[p]) for p in pairs]
    expected = {"grad_norm": [float(topk_weight.view(-1)[p]) * float(dout_norm[p // K]) * float(x_norm[p // K])
                              for p in pairs],
                "gate": [float(topk_weight.view(-1)[p]) for p in pairs], "uniform": [1.0] * (T * K)}[metric]
    assert m.dtype == torch.float32 and m.tolist() == pytest.approx(expected, rel=1e-6)
    assert mass.dtype == torch.float32 and mass.tolist() == pytest.approx(
        [0.0, sum(expected[:5]), 0.0, sum(expected[5:])], rel=1e-6)
    assert ref.retention_metric(order, topk_weight, metric, dout_norm, x_norm)[2] is None
    with pytest.raises(ValueError, match="unknown retention metric 'norm'"):
        ref.retention_metric(order, topk_weight, "norm")
    with pytest.raises(ValueError, match="needs dout_norm and x_norm"):
        ref.retention_metric(order, topk_weight, "grad_norm", dout_norm)


def test_capacity_route():
    # expert 0: instance 0 on rank 0 (cap 3), instance 1 on rank 1 (cap 1); expert 1: instance 2, cap 0
    out = ref.capacity_route(torch.tensor([0, 0, 0, 0, 1]), torch.tensor([0, 1, 1, 1, 0]),
                             torch.tensor([0, 0, 1]), torch.tensor([0, 1, 1]), torch.tensor([3, 1, 0]))
    assert out.tolist() == [0, 1, 0, 0, -1]
    # spill goes to the most spare capacity: instances 0 (cap 1) and 1 (cap 3) on ranks with no tokens
    out = ref.capacity_route(torch.zeros(4, dtype=torch.long), torch.full((4,), 2),
                             torch.tensor([0, 0]), torch.tensor([0, 1]), torch.tensor([1, 3]))
    assert sorted(out.tolist()) == [0, 1, 1, 1]


def test_unpermute_missing_rows():
    rows = torch.randn(3, 4, dtype=torch.float64)
    rop = torch.tensor([[2, -1], [-1, -1], [0, 1]])
    w = torch.tensor([[0.5, float("nan")], [float("nan"), 1.0], [1.0, 2.0]], dtype=torch.float64)
    out = ref.unpermute(rows, rop, w)
    assert torch.equal(out, torch.stack([0.5 * rows[2], torch.zeros(4, dtype=torch.float64), rows[0] + 2 * rows[1]]))
    assert torch.equal(ref.unpermute(rows[:0], rop[1:2], w[1:2]), torch.zeros(1, 4, dtype=torch.float64))


def test_empty_inputs():
    assert ref.unpermute(torch.zeros(0, 4), torch.zeros(0, 1, dtype=torch.long), torch.ones(0, 1)).shape == (0, 4)
    assert ref.permute(torch.zeros(3, 4), torch.zeros(0, dtype=torch.long)).shape == (0, 4)
    assert ref.grouped_linear(torch.zeros(0, 4), [torch.ones(2, 4)] * 3, torch.zeros(3, dtype=torch.long)).shape == (0, 2)
    dws = ref.grouped_linear_wgrad(torch.zeros(0, 2), torch.zeros(0, 4), torch.zeros(3, dtype=torch.long))
    assert all(d.shape == (2, 4) and not d.any() for d in dws)


def test_unpermute_weight_grad_is_autograds():
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(10, 6, generator=gen, dtype=torch.float64)
    rop = torch.randint(0, 10, (7, 3), generator=gen)
    rop[2, 1] = -1                                              # a pair with no row
    w = torch.rand(7, 3, generator=gen, dtype=torch.float64).requires_grad_(True)
    dout = torch.randn(7, 6, generator=gen, dtype=torch.float64)
    (ref.unpermute(rows, rop, w) * dout).sum().backward()
    got = ref.unpermute_weight_grad(rows, rop, dout)
    torch.testing.assert_close(got, w.grad, rtol=1e-12, atol=1e-12)
    assert got[2, 1] == 0
    assert ref.unpermute_weight_grad(rows.float(), rop, dout.float()).dtype == torch.float32


def test_unpermute_backward_is_autograds():
    gen = torch.Generator().manual_seed(5)
    T, K, H = 7, 3, 6
    rop = torch.randperm(T * K, generator=gen).view(T, K)     # each row some pair's, as a plan's inverse
    rows = torch.randn(T * K, H, generator=gen, dtype=torch.float64).requires_grad_(True)
    w = torch.rand(T, K, generator=gen, dtype=torch.float64).requires_grad_(True)
    dout = torch.randn(T, H, generator=gen, dtype=torch.float64)
    (ref.unpermute(rows, rop, w) * dout).sum().backward()
    d_rows, d_weight = ref.unpermute_backward(rows.detach(), rop, w.detach(), dout)
    torch.testing.assert_close(d_rows, rows.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(d_weight, w.grad, rtol=1e-12, atol=1e-12)
    # bf16: the rows' gradient rounds as permute's scaled gather, the weights' as unpermute_weight_grad
    order = torch.argsort(rop.reshape(-1))
    b_rows, b_dout = rows.detach().bfloat16(), dout.bfloat16()
    d_rows, d_weight = ref.unpermute_backward(b_rows, rop, w.detach().float(), b_dout)
    assert torch.equal(d_rows, ref.permute(b_dout, order // K, w.detach().float().reshape(-1)[order]))
    assert torch.equal(d_weight, ref.unpermute_weight_grad(b_rows, rop, b_dout))


@pytest.mark.parametrize("bad", ["missing", "twice", "rows"])
def test_unpermute_backward_needs_every_row_once(bad):
    rop = torch.arange(6).view(3, 2)
    rows = torch.zeros(6, 4)
    if bad == "missing":
        rop[1, 1] = -1
    elif bad == "twice":
        rop[1, 1] = 0
    else:
        rows = torch.zeros(7, 4)
    with pytest.raises(ValueError, match="every row must be the row of exactly one pair"):
        ref.unpermute_backward(rows, rop, torch.ones(3, 2), torch.ones(3, 4))


def test_unpermute_backward_writes_the_kept_pairs_rows_by_their_own_map():
    """d_row_of_pair: the rows of the kept pairs only, in the map's order (a retained backward's dy), each
    weight[t, k] dout[t]; dropped pairs get none; d_weight is still every pair's (-1 rows give 0)."""
    gen = torch.Generator().manual_seed(7)
    T, K, H = 6, 3, 5
    rop = torch.randperm(T * K, generator=gen).view(T, K)
    rop[2, 0] = -1                                            # a pair without a y row: its d_weight is 0
    rows = torch.randn(T * K, H, generator=gen, dtype=torch.float64)
    w = torch.rand(T, K, generator=gen, dtype=torch.float64)
    dout = torch.randn(T, H, generator=gen, dtype=torch.float64)
    kept = torch.tensor([16, 2, 9, 0, 6])                     # flat pairs t * K + k, in their d rows' order
    drp = torch.full((T * K,), -1).index_copy_(0, kept, torch.arange(kept.numel())).view(T, K)
    d_rows, d_weight = ref.unpermute_backward(rows, rop, w, dout, drp, kept.numel())
    expected = torch.stack([w.reshape(-1)[p] * dout[p // K] for p in kept.tolist()])
    torch.testing.assert_close(d_rows, expected, rtol=1e-12, atol=1e-12)
    assert d_weight[2, 0] == 0
    torch.testing.assert_close(d_weight, ref.unpermute_weight_grad(rows, rop, dout), rtol=0, atol=0)
    none_kept, _ = ref.unpermute_backward(rows, rop, w, dout, torch.full((T, K), -1), 0)
    assert none_kept.shape == (0, H)
    for bad, count in ((drp.clone().index_fill_(1, torch.tensor([0]), 0), 5), (drp, 6), (drp - 2, 5)):
        with pytest.raises(ValueError, match="d_row_of_pair must hold each of"):
            ref.unpermute_backward(rows, rop, w, dout, bad, count)
    with pytest.raises(ValueError, match="come together"):
        ref.unpermute_backward(rows, rop, w, dout, drp)
    with pytest.raises(ValueError, match="come together"):
        ref.unpermute_backward(rows, rop, w, dout, num_d_rows=5)
    with pytest.raises(ValueError, match=r"d_row_of_pair must be \[T, K\]"):
        ref.unpermute_backward(rows, rop, w, dout, drp[:2], 5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_swiglu_backward_in_place_with_activation(dtype):
    gen = torch.Generator().manual_seed(6)
    h = (3 * torch.randn(9, 10, generator=gen, dtype=torch.float64)).to(dtype)
    da = torch.randn(9, 5, generator=gen, dtype=torch.float64).to(dtype)
    dh_ref, a_ref = ref.swiglu_backward(h, da), ref.swiglu(h)
    dh, a = ref.swiglu_backward(h.clone(), da, with_activation=True)
    assert torch.equal(dh, dh_ref) and torch.equal(a, a_ref)
    buffer = h.clone()
    dh, a = ref.swiglu_backward(buffer, da, inplace=True, with_activation=True)
    assert dh.data_ptr() == buffer.data_ptr() and torch.equal(buffer, dh_ref) and torch.equal(a, a_ref)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_swiglu_backward_dot_is_the_rows_dot_of_a_and_da(dtype):
    """with_dot: dot[m] = <a_m, da_m> of the rounded a (a loop in fp64 over the same values), with dh and a as
    without it, in place and from indexed rows; it needs the activation."""
    gen = torch.Generator().manual_seed(9)
    h = (3 * torch.randn(7, 12, generator=gen, dtype=torch.float64)).to(dtype)
    da = torch.randn(7, 6, generator=gen, dtype=torch.float64).to(dtype)
    dh_ref, a_ref = ref.swiglu_backward(h, da, with_activation=True)
    dh, a, dot = ref.swiglu_backward(h.clone(), da, inplace=True, with_activation=True, with_dot=True)
    assert torch.equal(dh, dh_ref) and torch.equal(a, a_ref)
    assert dot.dtype == torch.promote_types(dtype, torch.float32)
    loops = [math.fsum(float(a_ref[m, f]) * float(da[m, f]) for f in range(6)) for m in range(7)]
    assert torch.allclose(dot.double(), torch.tensor(loops, dtype=torch.float64), rtol=1e-6 if dtype != torch.float64
                          else 1e-13, atol=0)
    index = torch.tensor([3, 3, 0, 6, 1, 2, 5])
    _, _, dot_indexed = ref.swiglu_backward(h, da, with_activation=True, index=index, with_dot=True)
    assert torch.equal(dot_indexed, ref.swiglu_backward(h[index], da, with_activation=True, with_dot=True)[2])
    with pytest.raises(ValueError, match="with_activation"):
        ops.swiglu_backward(h, da, with_dot=True, backend="torch")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_swiglu_dot_is_the_backward_dot_alone(dtype):
    """swiglu_dot: swiglu_backward's dot without its dh and a, bit for bit, from h's rows or indexed ones; a bad
    index or a dz of the wrong shape is an error that names it."""
    gen = torch.Generator().manual_seed(10)
    h = (3 * torch.randn(7, 12, generator=gen, dtype=torch.float64)).to(dtype)
    dz = torch.randn(7, 6, generator=gen, dtype=torch.float64).to(dtype)
    index = torch.tensor([3, 3, 0, 6, 1, 2, 5])
    for idx in (None, index):
        expected = ref.swiglu_backward(h, dz, with_activation=True, index=idx, with_dot=True)[2]
        assert torch.equal(ops.swiglu_dot(h, dz, idx, backend="torch"), expected)
    assert not torch.equal(ops.swiglu_dot(h, dz, index, backend="torch"), ops.swiglu_dot(h, dz, backend="torch"))
    with pytest.raises(ValueError, match="swiglu_dot: index must be int64"):
        ops.swiglu_dot(h, dz, index.int(), backend="torch")
    with pytest.raises(ValueError, match="swiglu_dot: h must be"):
        ops.swiglu_dot(h, dz[:, :5], backend="torch")


def test_swiglu_backward_reads_the_indexed_rows():
    """index: output row m from h[index[m]] (repeats and any order), the bits of a gather first; bad index errors."""
    gen = torch.Generator().manual_seed(8)
    h = (3 * torch.randn(9, 10, generator=gen)).to(torch.bfloat16)
    index = torch.tensor([4, 0, 8, 4, 2])
    da = torch.randn(5, 5, generator=gen).to(torch.bfloat16)
    before = h.clone()
    dh, a = ref.swiglu_backward(h, da, with_activation=True, index=index)
    assert torch.equal(dh, ref.swiglu_backward(h[index], da)) and torch.equal(a, ref.swiglu(h[index]))
    assert torch.equal(h, before)
    assert ref.swiglu_backward(h, da[:0], index=index[:0]).shape == (0, 10)
    with pytest.raises(ValueError, match="inplace"):
        ref.swiglu_backward(h, da, inplace=True, index=index)
    with pytest.raises(ValueError, match="int64"):
        ref.swiglu_backward(h, da, index=index.int())
    with pytest.raises(IndexError):
        ref.swiglu_backward(h, da, index=torch.tensor([0, 1, 2, 3, 9]))


def test_swiglu_backward_is_autograds():
    gen = torch.Generator().manual_seed(4)
    h = (3 * torch.randn(9, 10, generator=gen, dtype=torch.float64)).requires_grad_(True)
    da = torch.randn(9, 5, generator=gen, dtype=torch.float64)
    a = ref.swiglu(h)
    gate, up = h.detach().chunk(2, -1)
    torch.testing.assert_close(a, gate * torch.sigmoid(gate) * up)
    a.backward(da)
    torch.testing.assert_close(ref.swiglu_backward(h.detach(), da), h.grad, rtol=1e-12, atol=1e-12)


ROUTER_GRID = list(itertools.product(["softmax", "sigmoid"], [True, False], [1, 2, 7], [False, True], [0, 1, 11]))


@pytest.mark.parametrize("score_func,norm,k,bias,T", ROUTER_GRID)
def test_router_topk_against_loop(score_func, norm, k, bias, T):
    """Forward against a per-token loop that ranks experts by (-selection score, index)."""
    gen = torch.Generator().manual_seed(T + 3 * k)
    E = 7
    logits = torch.randn(T, E, generator=gen, dtype=torch.float64)
    if T > 1:
        logits[1] = torch.tensor([0.5, 2.0, 0.5, 2.0, -1.0, 0.5, 2.0])   # ties: the lower expert wins
    score_bias = torch.randn(E, generator=gen, dtype=torch.float64) if bias else None
    index, weight, counts, prob_sum = ref.router_topk(logits, k, score_func, norm, score_bias)
    assert index.dtype == counts.dtype == torch.long and weight.dtype == prob_sum.dtype == torch.float64
    assert index.shape == weight.shape == (T, k) and counts.shape == prob_sum.shape == (E,)
    expect_counts = [0] * E
    expect_prob_sum = torch.zeros(E, dtype=torch.float64)
    for t in range(T):
        row = logits[t].tolist()
        s = [math.exp(v - max(row)) for v in row] if score_func == "softmax" else [1 / (1 + math.exp(-v)) for v in row]
        if score_func == "softmax":
            s = [v / sum(s) for v in s]
        sel = [v + (float(score_bias[e]) if bias else 0.0) for e, v in enumerate(s)]
        chosen = sorted(range(E), key=lambda e: (-sel[e], e))[:k]
        w = [s[e] for e in chosen]
        if norm and k > 1:
            w = [v / sum(w) for v in w]
        assert index[t].tolist() == chosen
        torch.testing.assert_close(weight[t], torch.tensor(w, dtype=torch.float64), rtol=1e-12, atol=0)
        for e in chosen:
            expect_counts[e] += 1
        expect_prob_sum += torch.tensor(s if score_func == "softmax" else [v / sum(s) for v in s], dtype=torch.float64)
    assert counts.tolist() == expect_counts
    torch.testing.assert_close(prob_sum, expect_prob_sum, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("score_func,norm,k,bias,T", ROUTER_GRID)
@pytest.mark.parametrize("with_prob_grad", [True, False])
def test_router_topk_backward_is_autograds(score_func, norm, k, bias, T, with_prob_grad):
    gen = torch.Generator().manual_seed(T + 5 * k)
    E = 7
    logits = (2 * torch.randn(T, E, generator=gen, dtype=torch.float64)).requires_grad_(True)
    score_bias = torch.randn(E, generator=gen, dtype=torch.float64) if bias else None
    index, weight, _, prob_sum = ref.router_topk(logits, k, score_func, norm, score_bias)
    d_weight = torch.randn(T, k, generator=gen, dtype=torch.float64)
    d_prob_sum = torch.randn(E, generator=gen, dtype=torch.float64) if with_prob_grad else None
    loss = (weight * d_weight).sum() + ((prob_sum * d_prob_sum).sum() if with_prob_grad else 0)
    if T:
        loss.backward()
    expected = logits.grad if T else torch.zeros(0, E, dtype=torch.float64)
    got = ref.router_topk_backward(logits.detach(), index, d_weight, d_prob_sum, score_func, norm)
    assert got.shape == (T, E) and got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_router_topk_bad_input():
    logits = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"k must be in \[1, E=4\], got 5"):
        ref.router_topk(logits, 5)
    with pytest.raises(ValueError, match=r"logits must be a float \[T, E\]"):
        ref.router_topk(logits[0], 1)
    with pytest.raises(ValueError, match="score_func"):
        ref.router_topk(logits, 1, "relu")
    with pytest.raises(ValueError, match=r"score_bias must be \[E\] = \[4\]"):
        ref.router_topk(logits, 1, score_bias=torch.zeros(3))
    index = torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"must both be \[T, K\] = \[3, 2\]"):
        ref.router_topk_backward(logits, index, torch.zeros(3, 1), None)
    with pytest.raises(ValueError, match=r"d_prob_sum must be \[E\] = \[4\]"):
        ref.router_topk_backward(logits, index, torch.zeros(3, 2), torch.zeros(5))


def test_split_groups_views_each_group_without_autograd():
    W = torch.randn(3, 4, 5, requires_grad=True)
    parts = ops.split_groups(W, backend="torch")
    assert len(parts) == 3 and all(not p.requires_grad for p in parts)
    assert all(p.data_ptr() == W[i].data_ptr() and p.shape == (4, 5) for i, p in enumerate(parts))
    with torch.no_grad():
        W[1].fill_(7.0)
    assert bool((parts[1] == 7.0).all()) and ops.split_groups(torch.empty(0, 2), backend="torch") == []
