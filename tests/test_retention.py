"""Retention: quotas and shares, priority sampling (unbiased), the topk ablation, and the layer's
retained backward (exact at ratio 1, equal to a reference over exactly the selected pairs, both
activation policies, both router gradients, what the forward keeps and what the backward allocates)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint
from torch.utils._pytree import tree_leaves

import lrmoe_ds
from lrmoe_ds.quotas import MemoryPlan, plan_quotas, rank_shares
from lrmoe_ds.retention import BackwardSpec, select_retained
from moe_reference import expert_forward
from saved_bytes import counting_saved_bytes

H, F, E, T, K = 8, 6, 4, 64, 2


# ---- quotas -------------------------------------------------------------------------------------

def test_water_fill_caps_hottest_first():
    counts = torch.tensor([100, 10, 40, 0, 50])
    q = plan_quotas(counts, 0.5)
    assert 100 - len(counts) <= int(q.sum()) <= 100   # the target, up to rounding
    assert q[1] == 10 and q[3] == 0                  # cold experts keep every pair
    assert q[0] == q[4] == q[2] == q.max()           # the hot ones share one cap
    assert torch.equal(plan_quotas(counts, 1.0), counts)
    with pytest.raises(ValueError, match="retention_ratio"):
        plan_quotas(counts, 0.0)


@pytest.mark.parametrize("seed", range(6))
def test_water_fill_level_is_the_largest_cap_within_the_budget(seed):
    """The cap, checked against its definition by brute force over every integer cap."""
    from lrmoe_ds.quotas import _level
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(0, 50, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)
    n[0] = 0 if seed % 2 else n[0]
    for budget in sorted({0, 1, int(n.sum()) // 3, int(n.sum()) // 2, int(n.sum()) - 1, int(n.sum()), -1}):
        best = max([c for c in range(int(n.max()) + 1) if int(n.clamp(max=c).sum()) <= budget], default=0)
        assert torch.equal(_level(n, budget), n.clamp(max=best)), (n.tolist(), budget)


@pytest.mark.parametrize("seed", range(8))
def test_water_fill_in_whole_tiles(seed):
    """With a granule g the capped experts keep whole multiples of g (or all their pairs), within g of the plain
    cap; the cold experts keep every pair; the sum stays within the budget and within g of the plain water-fill's;
    the freed pairs go back in whole tiles to the hottest first. g = 1, or a cap below g, is the plain water-fill."""
    from lrmoe_ds.quotas import _level
    g = torch.Generator().manual_seed(seed)
    E = int(torch.randint(1, 40, (1,), generator=g))
    n = torch.randint(0, 900, (E,), generator=g)
    n[int(torch.randint(0, E, (1,), generator=g))] = 3000                   # one hot expert
    for granule in (8, 64):
        for budget in sorted({1, int(n.sum()) // 4, int(n.sum()) // 2, int(n.sum()) - 1, int(n.sum())}):
            plain, q = _level(n, budget), _level(n, budget, granule)
            assert torch.equal(_level(n, budget, 1), plain)
            cap = int(plain.max())
            if cap < granule or torch.equal(plain, n):
                assert torch.equal(q, plain), (n.tolist(), budget, granule)
                continue
            capped = n > cap
            assert torch.equal(q[~capped], n[~capped])                       # the cold keep every pair
            assert torch.all(q <= n) and torch.all((q[capped] % granule == 0) | (q[capped] == n[capped]))
            assert torch.all((q[capped] - cap).abs() < granule)
            assert budget - granule < int(q.sum()) <= budget and int(q.sum()) > int(plain.sum()) - granule
            full = [e for e in sorted(range(E), key=lambda e: (-int(n[e]), e))
                    if capped[e] and int(n[e]) >= cap // granule * granule + granule]
            extra = [int(q[e]) > cap // granule * granule for e in full]
            assert extra == sorted(extra, reverse=True), (n.tolist(), budget, q.tolist())  # a prefix, hottest first


def test_targets_are_exact_for_the_ratio_as_written():
    """0.7 * 90 is 62.99999999999999 in floats, 0.07 * 100 is 7.000000000000001: neither loses nor gains a pair;
    a balance factor whose product overflows bounds nothing instead of failing."""
    assert int(plan_quotas(torch.tensor([90]), 0.7).sum()) == 63
    assert int(plan_quotas(torch.tensor([100]), 0.58).sum()) == 58
    assert plan_quotas(torch.tensor([100]), 0.01, floor=0.07).tolist() == [7]
    n = torch.tensor([40, 10, 30, 20])
    assert torch.equal(plan_quotas(n, 0.5, ep_size=2, balance_factor=1e308), plan_quotas(n, 0.5))


@pytest.mark.parametrize("seed", range(6))
def test_metric_mass_split(seed):
    """Q_e = min(n_e, n_e w_e / tau) rounded down, at least 1 for an expert with pairs, the rounding's pairs to the
    largest remainders: within the budget and within the number of experts of it; an expert of larger weight keeps no
    smaller a fraction of its pairs (up to the rounding); equal weights give the proportional split (every pair
    alike: one threshold keeps the same fraction of every expert)."""
    from lrmoe_ds.quotas import _level, _mass_fill
    g = torch.Generator().manual_seed(seed)
    E = int(torch.randint(2, 30, (1,), generator=g))
    n = torch.randint(0, 300, (E,), generator=g)
    w = torch.rand(E, generator=g, dtype=torch.float64) * 3
    busy = int((n > 0).sum())
    for budget in sorted({busy, int(n.sum()) // 3, int(n.sum()) // 2, int(n.sum()) - 1}):
        if budget < busy or budget >= int(n.sum()):
            continue
        q = _mass_fill(n, budget, w)
        assert int(q.sum()) == budget and torch.all(q <= n) and torch.all(q[n > 0] >= 1) and torch.all(q[n == 0] == 0)
        frac = q.double() / n.clamp_min(1)
        for i in range(E):
            for j in range(E):
                if n[i] > 1 and n[j] > 1 and w[i] > w[j] and q[j] > 1:
                    assert frac[i] >= frac[j] - 1.0 / float(n[i]) - 1.0 / float(n[j]), (n.tolist(), w.tolist(), q.tolist())
    w[: E // 2] = 0.0  # experts whose every metric was 0: they keep a pair each, and share what is left
    budget = int(n.sum()) // 2
    if budget >= busy:
        q = _mass_fill(n, budget, w)
        assert budget - E < int(q.sum()) <= budget and torch.all(q <= n) and torch.all(q[n > 0] >= 1)
    alike = plan_quotas(n, 0.5, allocation="proportional")
    same = _mass_fill(n, int(0.5 * int(n.sum())), torch.ones(E, dtype=torch.float64))
    assert int((same - alike).abs().max()) <= 1, (same.tolist(), alike.tolist())


@pytest.mark.parametrize("n, w, budget, expected", [
    ([1, 3, 1, 2, 1], [0.2, 0.2, 0.3, 0.1, 0.0], 7, [1, 2, 1, 2, 1]),
    ([4, 1, 1, 4, 3], [0.2, 0.3, 0.0, 0.3, 0.1], 12, [3, 1, 1, 4, 3]),
    ([1, 1, 3, 4, 1], [0.2, 0.1, 0.7, 0.2, 0.0], 9, [1, 1, 3, 3, 1]),
])
def test_metric_mass_split_where_weighted_experts_hold_the_budget(n, w, budget, expected):
    """The experts of nonzero weight hold exactly the budget (their masses' rounding once let the last of them
    saturate past it, and the next step divided by 0): each keeps its pairs but for the pair that every weightless
    expert with pairs gets, taken back from the largest quota (ties: lower index)."""
    from lrmoe_ds.quotas import _mass_fill
    q = _mass_fill(torch.tensor(n), budget, torch.tensor(w, dtype=torch.float64))
    assert q.tolist() == expected


@pytest.mark.parametrize("seed", range(6))
def test_metric_mass_split_in_whole_tiles(seed):
    """With a granule g every quota is n_e, a multiple of g, or under one tile; the sum is within the budget and
    equals it where some expert under a tile could still take pairs; each quota is within a tile of the
    untiled split's; the tiles freed go to the experts that lost the most of their share."""
    from lrmoe_ds.quotas import _mass_fill
    g = torch.Generator().manual_seed(100 + seed)
    E = int(torch.randint(4, 40, (1,), generator=g))
    n = torch.randint(0, 900, (E,), generator=g)
    n[: E // 4] = torch.randint(0, 40, (E // 4,), generator=g)  # some experts under one tile
    w = torch.rand(E, generator=g, dtype=torch.float64) * 3 + 0.1
    for granule in (8, 64):
        for budget in (int(n.sum()) // 4, int(n.sum()) // 2, int(n.sum()) * 4 // 5):
            plain, q = _mass_fill(n, budget, w), _mass_fill(n, budget, w, granule)
            assert torch.all(q <= n) and torch.all(q[n > 0] >= 1) and int(q.sum()) <= budget
            assert torch.all((q == n) | (q % granule == 0) | (q < granule)), (n.tolist(), q.tolist(), granule)
            assert torch.all((q - plain).abs() <= granule), (plain.tolist(), q.tolist())
            room = bool(((q < torch.minimum(n, torch.tensor(granule))) & (n > 0)).any())
            if room:  # the pairs left fill the experts under one tile: nothing is left over
                assert int(q.sum()) == budget, (budget, int(q.sum()))
            assert int(q.sum()) > budget - granule * E
    n = torch.tensor([1000, 1000, 0, 10])
    q = _mass_fill(n, 1010, torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float64), 64)
    assert q.tolist() == [512, 448, 0, 10]  # 448 each, one tile back (ties: lower index), the cold expert whole
    assert torch.equal(plan_quotas(n, 0.5, allocation="metric_mass", granule=64,
                                   weights=torch.ones(4, dtype=torch.float64)), q)


def test_metric_mass_plans_from_the_last_backward(monkeypatch):
    """The first step plans by the water-fill; its backward sums the metric per expert, and the next step's quotas
    follow those masses (the expert with the heavier pairs keeps more of them)."""
    layer, x = make_layer()
    configure(layer, retention_ratio=0.5, quota_allocation="metric_mass")
    layer_grads(layer, x, step=0)
    n = layer.last_stats.counts
    assert torch.equal(layer.last_stats.quotas, plan_quotas(n, 0.5))
    weights = layer._mass_weights()
    assert weights is not None and bool((weights > 0).all())
    layer_grads(layer, x, step=1)
    q = layer.last_stats.quotas
    assert torch.equal(q, plan_quotas(n, 0.5, allocation="metric_mass", weights=weights))
    assert not torch.equal(q, plan_quotas(n, 0.5))
    with pytest.raises(ValueError, match="needs the experts' weights"):
        plan_quotas(n, 0.5, allocation="metric_mass")


def test_mass_weights_are_the_mean_metric_per_pair():
    """metric_mass's weights: an expert's summed metric divided by its pairs; an expert without pairs takes the
    layer's mean pair (so a cold expert is neither starved nor favoured when its pairs come back); none where the mass
    is all 0."""
    from lrmoe_ds.quotas import mass_weights
    w = mass_weights(torch.tensor([2.0, 0.0, 3.0, 1.0]), torch.tensor([4, 0, 1, 5]))
    assert w.dtype == torch.float64 and w.tolist() == [0.5, 0.6, 3.0, 0.2]
    assert mass_weights(torch.zeros(3), torch.tensor([1, 2, 3])) is None


def test_quota_granule_by_device(monkeypatch):
    """Whole tiles only where the GEMMs tile (CUDA); the environment overrides it there."""
    from lrmoe_ds.quotas import quota_granule
    monkeypatch.delenv("LRMOE_QUOTA_GRANULE", raising=False)
    assert quota_granule(torch.device("cpu")) == 1 and quota_granule(torch.device("cuda")) == 64
    monkeypatch.setenv("LRMOE_QUOTA_GRANULE", "1")
    assert quota_granule(torch.device("cuda")) == 1
    n = torch.tensor([700, 650, 600, 90, 0, 515])
    q = plan_quotas(n, 0.5, granule=64)
    assert q.tolist() == [320, 320, 256, 90, 0, 256] and int(q.sum()) <= int(0.5 * int(n.sum()))
    assert plan_quotas(n, 0.5, allocation="proportional", granule=64).tolist() == \
        plan_quotas(n, 0.5, allocation="proportional").tolist()  # the granule is the water-fill's


@pytest.mark.parametrize("seed", range(6))
def test_proportional_allocation_keeps_one_fraction_to_the_pair(seed):
    """Every expert keeps floor or ceil of ratio * n_e, the quotas sum to the target exactly, and the
    leftover pairs go to the largest remainders (ties: lower index)."""
    from fractions import Fraction
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(0, 50, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)
    for ratio in (0.1, 0.37, 0.5, 0.99):
        q = plan_quotas(n, ratio, allocation="proportional")
        budget = int(ratio * int(n.sum()))
        assert int(q.sum()) == budget and torch.all(q <= n) and torch.all(q >= 0)
        exact = [Fraction(int(v) * budget, max(1, int(n.sum()))) for v in n]
        assert all(int(qi) in (f.numerator // f.denominator, -(-f.numerator // f.denominator))
                   for qi, f in zip(q, exact)), (n.tolist(), ratio, q.tolist())
        up = {i for i, (qi, f) in enumerate(zip(q.tolist(), exact)) if qi > f}
        down = [i for i in range(len(exact)) if i not in up and exact[i] != int(q[i])]
        assert all(exact[i] - int(exact[i]) >= exact[j] - int(exact[j]) for i in up for j in down)
    assert torch.equal(plan_quotas(n, 1.0, allocation="proportional"), n)
    with pytest.raises(ValueError, match="quota allocation"):
        plan_quotas(n, 0.5, allocation="top")


def test_proportional_allocation_cuts_ranks_proportionally():
    counts = torch.tensor([90, 30, 6, 6, 60, 12])    # 2 ranks: experts 0-2 and 3-5
    # rank 0: 63/126 of each; rank 1: 63/78 of [6, 60, 12] = [4.85, 48.46, 9.69] -> remainders 0.85, 0.69 rounded up
    capped = plan_quotas(counts, 1.0, ep_size=2, max_rows_per_rank=63, allocation="proportional")
    assert capped.tolist() == [45, 15, 3, 5, 48, 10]
    # 0.5 of each: [45, 15, 3 | 3, 30, 6]; rank 0 (63) over the mean (51): 51/63 of its quotas, the tie
    # of remainders between experts 0 and 2 going to the lower index
    balanced = plan_quotas(counts, 0.5, ep_size=2, balance_factor=1.0, allocation="proportional")
    assert balanced.tolist() == [37, 12, 2, 3, 30, 6]


def test_floor_budget_and_balance():
    counts = torch.tensor([90, 30, 5, 5, 60, 10])    # 2 ranks: experts 0-2 and 3-5
    assert plan_quotas(counts, 0.5, floor=0.5)[0] == 45                      # the floor wins over the target
    capped = plan_quotas(counts, 1.0, ep_size=2, max_rows_per_rank=40)
    per_rank = capped.view(2, 3).sum(1)
    assert torch.all(per_rank <= 40) and torch.all(per_rank >= 40 - 3) and capped[2] == 5  # cold expert kept
    balanced = plan_quotas(counts, 0.6, ep_size=2, balance_factor=1.0)
    per_rank = balanced.view(2, 3).sum(1)
    assert int(per_rank.max()) <= float(plan_quotas(counts, 0.6).sum()) / 2    # no rank above the mean
    assert torch.all(balanced <= plan_quotas(counts, 0.6))


@pytest.mark.parametrize("seed", range(5))
def test_rank_shares_add_up(seed):
    g = torch.Generator().manual_seed(seed)
    all_counts = torch.randint(0, 20, (3, 7), generator=g)
    all_counts[:, 0] = 0                              # an expert with no pair at all
    quotas = plan_quotas(all_counts.sum(0), 0.4)
    shares = rank_shares(quotas, all_counts)
    assert torch.equal(shares.sum(0), quotas) and torch.all(shares <= all_counts) and torch.all(shares >= 0)
    assert torch.all((shares - quotas * all_counts / all_counts.sum(0).clamp_min(1)).abs() < 1)  # proportional
    one = all_counts[:1]                              # one rank: its share is the quota, within its counts
    assert torch.equal(rank_shares(quotas, one), torch.minimum(quotas, one[0]).view(1, -1))


# ---- selection ----------------------------------------------------------------------------------

@pytest.mark.parametrize("sampled", [True, False])
def test_sampled_shares_keep_small_groups_unbiased(sampled):
    """Shares whose whole part is 0 (a rank with 1-3 pairs of an expert whose quota keeps ~40%): sampled with
    probability equal to their fractional part and weighted by its inverse (rank_shares with a generator,
    share_weights), every expert's estimate averages to its exact sum; in the fixed order (no generator) the same
    small groups are left out at every step, and the mean misses them (the check fails, as it should)."""
    from lrmoe_ds.quotas import share_weights
    all_counts = torch.tensor([[1, 30, 2, 1], [3, 30, 0, 1], [1, 2, 3, 1]])  # [R, E]
    quotas = torch.tensor([2, 25, 2, 1])
    R, E = all_counts.shape
    gen = torch.Generator().manual_seed(0)
    vals = [torch.rand(int(all_counts[r].sum()), generator=gen) + 0.5 for r in range(R)]   # a term per pair
    groups = [torch.repeat_interleave(torch.arange(E), all_counts[r]) for r in range(R)]
    truth = sum(torch.zeros(E, dtype=torch.float64).index_add_(0, g, v.double()) for g, v in zip(groups, vals))
    draws, mean = 2000, torch.zeros(E, dtype=torch.float64)
    for step in range(draws):
        shares = rank_shares(quotas, all_counts, gen if sampled else None)
        assert torch.equal(shares.sum(0), quotas) and torch.all(shares <= all_counts)
        weights = share_weights(quotas, all_counts, shares) if sampled else None
        for r in range(R):
            kept, scale, _ = select_retained(vals[r], all_counts[r], shares[r], seed=step * R + r)
            if weights is not None:
                scale = scale * weights[r][groups[r][kept]]
            mean.index_add_(0, groups[r][kept], (scale * vals[r][kept]).double() / draws)
    err = ((mean - truth).abs() / truth).max()
    assert (err < 0.06) == sampled, (mean.tolist(), truth.tolist())


@pytest.mark.parametrize("sampled", [True, False])
def test_sampled_proportional_quotas_keep_small_experts_unbiased(sampled):
    """The "proportional" allocation's rounding, as the shares' (above): an expert with one pair at ratio 0.5 keeps
    it half of the time, weighted 2; in the fixed order the same experts keep none at every step."""
    from lrmoe_ds.quotas import quota_weights
    n = torch.tensor([1, 1, 1, 1, 7, 0, 3])
    gen = torch.Generator().manual_seed(0)
    vals = torch.rand(int(n.sum()), generator=gen) + 0.5
    group = torch.repeat_interleave(torch.arange(n.numel()), n)
    truth = torch.zeros(n.numel(), dtype=torch.float64).index_add_(0, group, vals.double())
    draws, mean = 2000, torch.zeros(n.numel(), dtype=torch.float64)
    for step in range(draws):
        q = plan_quotas(n, 0.5, allocation="proportional", generator=gen if sampled else None)
        assert int(q.sum()) == 7 and torch.all(q <= n)
        kept, scale, _ = select_retained(vals, n, q, seed=step)
        weights = quota_weights(n, q, 0.5) if sampled else None
        if weights is not None:
            scale = scale * weights[group[kept]]
        mean.index_add_(0, group[kept], (scale * vals[kept]).double() / draws)
    err = ((mean - truth).abs() / truth.clamp_min(1e-9))[n > 0].max()
    assert (err < 0.1) == sampled, (mean.tolist(), truth.tolist())
    assert quota_weights(n, torch.tensor([1, 0, 1, 0, 3, 0, 2]), 0.5, floor=0.5) is None  # the floor's pairs are sure


def test_priority_sampling_keeps_quota_and_is_deterministic():
    metric = torch.rand(12, generator=torch.Generator().manual_seed(0))
    sizes, quotas = torch.tensor([5, 0, 7]), torch.tensor([2, 3, 7])
    kept, scale, kept_sizes = select_retained(metric, sizes, quotas)
    assert kept_sizes.tolist() == [2, 0, 7] and kept.numel() == 9
    assert torch.all(scale[:2] >= 1) and torch.all(scale[2:] == 1)  # a fully kept group is exact
    again = select_retained(metric, sizes, quotas)
    assert torch.equal(kept, again[0]) and torch.equal(scale, again[1])
    other = select_retained(metric, sizes, quotas, seed=1)
    assert not torch.equal(kept, other[0]) or not torch.equal(scale, other[1])


def test_zero_metrics_get_finite_weights():
    """A kept pair of metric 0 (its weight-gradient term is 0) weighs 1 where its group's threshold is 0:
    a fully kept group, or one with fewer non-zero metrics than its quota. No 0/0."""
    metric = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.3, 0.0, 0.0, 0.2, 0.0, 0.9, 0.4])
    sizes, quotas = torch.tensor([3, 4, 4]), torch.tensor([3, 2, 2])
    kept, scale, kept_sizes = select_retained(metric, sizes, quotas)
    assert kept_sizes.tolist() == [3, 2, 2] and torch.all(torch.isfinite(scale))
    assert torch.all(scale[:5] == 1) and 4 in kept[3:5].tolist()   # groups 0 and 1: threshold 0
    assert torch.all(metric[kept[5:]] > 0) and torch.all(scale[5:] >= 1)  # group 2: a positive threshold


@pytest.mark.parametrize("quotas,total", [([5, 3], None), ([20, 4], 9)])
def test_priority_sampling_is_unbiased(quotas, total):
    # E[sum_kept scale_p * v_p] = sum_p v_p for each group, whatever the metric; also with one threshold over
    # both groups (total) and a binding cap (group 1's 4 of 10) together
    g = torch.Generator().manual_seed(1)
    metric = torch.rand(30, generator=g, dtype=torch.float64)
    sizes, v = torch.tensor([20, 10]), torch.randn(30, generator=g, dtype=torch.float64)
    exact = torch.stack([v[:20].sum(), v[20:].sum()])
    samples = []
    for seed in range(1000):
        kept, scale, ks = select_retained(metric, sizes, torch.tensor(quotas), seed=seed, total=total)
        contrib = v[kept] * scale.double()
        samples.append(torch.stack([contrib[:int(ks[0])].sum(), contrib[int(ks[0]):].sum()]))
    samples = torch.stack(samples)
    stderr = samples.std(0) / len(samples) ** 0.5
    assert torch.all((samples.mean(0) - exact).abs() < 4 * stderr), (samples.mean(0), exact, stderr)
    assert torch.all(samples.std(0) > 0)  # it really samples


def test_one_threshold_keeps_the_total_within_the_caps():
    g = torch.Generator().manual_seed(3)
    metric = torch.rand(30, generator=g) * torch.tensor([1.0] * 10 + [10.0] * 20)  # group 1 carries the mass
    sizes, caps = torch.tensor([10, 15, 5]), torch.tensor([10, 15, 2])
    kept, scale, kept_sizes = select_retained(metric, sizes, caps, num_kept=27, total=12)
    assert kept.numel() == 12 and int(kept_sizes.sum()) == 12 and torch.all(kept_sizes <= caps)
    assert torch.equal(kept, torch.sort(kept).values)                     # still in grouped order
    assert torch.equal(kept_sizes, torch.bincount(torch.bucketize(kept, sizes.cumsum(0), right=True), minlength=3))
    assert int(kept_sizes[1]) > int(kept_sizes[0])                        # the group of large metrics keeps more
    again = select_retained(metric, sizes, caps, num_kept=27, total=12)
    assert torch.equal(kept, again[0]) and torch.equal(scale, again[1])
    # a total above what the caps let through changes nothing
    capped = select_retained(metric, sizes, caps, num_kept=27)
    for a, b in zip(select_retained(metric, sizes, caps, num_kept=27, total=28), capped):
        assert torch.equal(a, b)
    # topk: the 12 largest metrics among each group's 2..15 largest
    kept, scale, _ = select_retained(metric, sizes, caps, selection="topk", total=12)
    allowed = torch.cat([torch.arange(25), 25 + torch.sort(-metric[25:], stable=True).indices[:2]])
    top = allowed[torch.sort(-metric[allowed], stable=True).indices[:12]]
    assert torch.equal(kept, torch.sort(top).values) and torch.all(scale == 1)


def test_topk_ablation_keeps_largest_metric_unweighted():
    kept, scale, _ = select_retained(torch.tensor([1.0, 3.0, 2.0, 5.0]), torch.tensor([4]), torch.tensor([2]),
                                     selection="topk")
    assert kept.tolist() == [1, 3] and torch.all(scale == 1)


# ---- the layer ----------------------------------------------------------------------------------

def make_layer(seed=0, **kw):
    torch.manual_seed(seed)
    layer = lrmoe_ds.LRMoE(H, num_experts=E, k=K, ffn_hidden_size=F, **kw).double()
    x = torch.randn(T, H, dtype=torch.float64)
    return layer, x


def probe_loss(out):
    """A fixed linear functional of the layer output: its gradient is a known, non-uniform dout."""
    return (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()


def layer_grads(layer, x, step=0, checkpointed=False):
    """(dx, parameter gradients) of probe_loss at sampling step ``step``; ``checkpointed`` runs the layer
    under reentrant activation checkpointing."""
    layer.zero_grad()
    layer.retention_step.fill_(step)
    layer._retention_step_host = None
    xi = x.clone().requires_grad_(True)
    out = checkpoint(lambda t: layer(t)[0], xi, use_reentrant=True) if checkpointed else layer(xi)[0]
    probe_loss(out).backward()
    return xi.grad, [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in layer.parameters()]


def replayed_grads(layer, x, masses, **kw):
    """layer_grads from the default split's planning state ``masses`` (the layer's last training backward's metric
    masses, "metric_mass"): runs that must plan alike start from the same state, not from each other's backward."""
    layer._metric_mass = masses
    return layer_grads(layer, x, **kw)


def configure(layer, **kw):
    layer.configure(lrmoe_ds.LRMoEConfig(enabled=True, **kw))


def test_layer_plans_whole_tiles_where_the_gemms_tile(monkeypatch):
    """The layer asks quota_granule for its device (1 on CPU: the plain water-fill); with a granule its capped
    experts keep whole tiles, and the backward keeps exactly those quotas."""
    layer, x = make_layer()
    configure(layer, retention_ratio=0.3)
    layer.keep_last_selection = True
    layer_grads(layer, x)
    n = layer.last_stats.counts
    assert torch.equal(layer.last_stats.quotas, plan_quotas(n, 0.3))
    monkeypatch.setattr(lrmoe_ds.layer, "quota_granule", lambda device: 8)
    layer_grads(layer, x)
    q = layer.last_stats.quotas
    assert torch.equal(q, plan_quotas(n, 0.3, granule=8)) and not torch.equal(q, plan_quotas(n, 0.3))
    capped = q < n
    assert capped.any() and torch.all(q[capped] % 8 == 0)
    assert layer.last_selection["pairs"].numel() == int(q.sum())


def test_retention_schedule_sets_each_steps_target():
    """The quotas follow the schedule: by the training forwards, or by the optimizer step once the
    memory planner has set it; where the schedule reaches 1 the backward is exact again."""
    layer, x = make_layer()
    configure(layer, retention_schedule=[[0, 0.25], [2, 0.25], [4, 1.0]])
    pairs = T * K
    for step, ratio in enumerate([0.25, 0.25, 0.25, 0.625, 1.0, 1.0]):
        layer_grads(layer, x, step=step)
        kept = int(layer.last_stats.quotas.sum())
        assert int(ratio * pairs) - E <= kept <= int(ratio * pairs), (step, kept)
    dx_exact, grads_exact = layer_grads(lrmoe_ds_exact(layer), x)
    dx, grads = layer_grads(layer, x, step=4)
    assert torch.equal(dx, dx_exact) and all(torch.equal(a, b) for a, b in zip(grads, grads_exact))
    layer.optimizer_step = 3                     # the planner's clock wins over the forward count
    layer_grads(layer, x, step=0)
    assert int(0.625 * pairs) - E <= int(layer.last_stats.quotas.sum()) <= int(0.625 * pairs)


def lrmoe_ds_exact(layer):
    """``layer`` reconfigured as the exact layer (retention off)."""
    import copy
    exact = copy.deepcopy(layer)
    exact.configure(lrmoe_ds.LRMoEConfig())
    return exact


@pytest.mark.parametrize("policy", ["stash", "recompute"])
def test_ratio_one_is_bit_exact(policy):
    layer, x = make_layer()
    dx_exact, grads_exact = layer_grads(layer, x)
    configure(layer, retention_ratio=1.0, policy=policy)
    dx_one, grads_one = layer_grads(layer, x)
    assert torch.equal(dx_one, dx_exact) and all(torch.equal(a, b) for a, b in zip(grads_one, grads_exact))


def test_counts_are_read_after_the_forward_kernels_are_queued(monkeypatch):
    # On one rank nothing in the forward waits for the expert counts: the host reads them (for the
    # backward's quotas) only once the experts' GEMMs are queued, so on a GPU the read waits for the
    # router alone and the quota planning overlaps the forward's GEMMs.
    from lrmoe_ds import experts as experts_module
    from lrmoe_ds.dispatcher import HostCopy
    events = []
    real_get, real_linear = HostCopy.get, experts_module.ops.grouped_linear
    monkeypatch.setattr(HostCopy, "get", lambda self: events.append("read") or real_get(self))
    monkeypatch.setattr(experts_module.ops, "grouped_linear",
                        lambda *a, **k: events.append("gemm") or real_linear(*a, **k))
    layer, x = make_layer()
    configure(layer, retention_ratio=0.5)
    out = layer(x.clone().requires_grad_(True))[0]
    assert events[:2] == ["gemm", "gemm"] and "read" in events
    assert layer.last_stats is not None and int(layer.last_stats.quotas.sum()) < T * K
    probe_loss(out).backward()


@pytest.mark.parametrize("allocation", ["waterfill", "threshold"])
def test_ratio_one_never_waits_for_the_counts(monkeypatch, allocation):
    # Ratio 1 without a row cap keeps every pair whatever the counts: its forward and backward read nothing
    # back (on a GPU a read would stop the host from running ahead); the statistics read the counts when asked.
    from lrmoe_ds.dispatcher import HostCopy
    reads = []
    real_get = HostCopy.get
    monkeypatch.setattr(HostCopy, "get", lambda self: reads.append(1) or real_get(self))
    layer, x = make_layer()
    configure(layer, retention_ratio=1.0, quota_allocation=allocation, **({"floor": 0.5} if allocation == "waterfill" else {}))
    counts = layer(x)[2]
    probe_loss(layer(x.clone().requires_grad_(True))[0]).backward()
    stats = layer.last_stats
    assert not reads
    assert torch.equal(stats.counts, counts) and reads and torch.equal(stats.quotas, counts)
    assert stats.retained_per_rank.tolist() == stats.rows_per_rank.tolist() == [T * K]
    layer.memory_plan.max_rows_per_rank = T * K  # a row cap may drop: the forward plans its quotas again
    before = len(reads)
    layer(x)
    assert len(reads) > before and int(layer.last_stats.quotas.sum()) == T * K


def select_with_full_quotas(monkeypatch, layer):
    """Makes ``layer``'s backward take the whole selection path with every quota = count (nothing dropped)."""
    real = layer._backward_spec

    def forced(plan, dtype):
        spec, _ = real(plan, dtype)
        spec.may_drop = True
        return spec, lambda spec: setattr(spec, "shares", plan.all_counts.clone())
    monkeypatch.setattr(layer, "_backward_spec", forced)


def test_full_quota_selection_is_bit_exact(monkeypatch):
    # the whole selection path with every quota >= count keeps all pairs with weight 1 (the router's dots both
    # from the saved outputs: where nothing may drop they come from the rows instead, with rounding of their own)
    from lrmoe_ds import pipeline
    monkeypatch.setattr(pipeline, "router_dots_from_rows", lambda *args: False)
    layer, x = make_layer()
    dx_exact, grads_exact = layer_grads(layer, x)
    configure(layer, retention_ratio=1.0)
    select_with_full_quotas(monkeypatch, layer)
    dx_one, grads_one = layer_grads(layer, x)
    assert torch.equal(dx_one, dx_exact) and all(torch.equal(a, b) for a, b in zip(grads_one, grads_exact))


def reference_retained_grads(layer, x, proj, pairs, scale, router_grad="exact", activation="swiglu"):
    """fp64 loop over pairs: expert weights and dx's expert path from the selected pairs alone, each
    weighted by its scale; the router's gradient from every pair ("exact") or the selected ones."""
    xr = x.clone().requires_grad_(True)
    wg = layer.deepspeed_moe.gate.wg.weight.detach().clone().requires_grad_(True)
    experts = layer.deepspeed_moe.experts
    w1s = [w.detach().clone().requires_grad_(True) for w in experts.weight1]
    w2s = [w.detach().clone().requires_grad_(True) for w in experts.weight2]
    probs = (xr @ wg.t()).softmax(-1)
    idx = probs.detach().topk(K, -1).indices
    gates = probs.gather(1, idx)
    gates = gates / gates.sum(-1, keepdim=True)
    weight = dict(zip(pairs.tolist(), scale.double().tolist()))
    loss = 0
    for t in range(T):
        for j in range(K):
            e, p = int(idx[t, j]), t * K + j
            y = expert_forward(activation, w1s[e], w2s[e], xr[t])
            if p in weight:   # the expert's own gradient: retained pairs only, weighted
                loss = loss + weight[p] * gates[t, j].detach() * (y * proj[t]).sum()
            if router_grad == "exact" or p in weight:
                w = 1.0 if router_grad == "exact" else weight[p]
                loss = loss + w * gates[t, j] * (y.detach() * proj[t]).sum()
    loss.backward()
    stacked = [torch.stack([w.grad if w.grad is not None else torch.zeros_like(w) for w in ws]) for ws in (w1s, w2s)]
    return xr.grad, [wg.grad] + stacked   # layer.parameters() order


@pytest.mark.parametrize("policy,router_grad,selection,allocation,activation,dots",
                         [("stash", "exact", "priority_sampling", "waterfill", "swiglu", "saved"),
                          ("recompute", "exact", "priority_sampling", "waterfill", "swiglu", "saved"),
                          ("stash", "retained", "priority_sampling", "waterfill", "swiglu", "saved"),
                          ("recompute", "retained", "topk", "waterfill", "swiglu", "saved"),
                          ("stash", "exact", "priority_sampling", "threshold", "swiglu", "saved"),
                          ("recompute", "retained", "priority_sampling", "threshold", "swiglu", "saved"),
                          ("stash", "exact", "priority_sampling", "waterfill", "gelu", "saved"),
                          ("stash", "exact", "priority_sampling", "waterfill", "swiglu", "recomputed"),
                          ("stash", "exact", "topk", "threshold", "swiglu", "recomputed"),
                          ("stash", "exact", "priority_sampling", "proportional", "gelu", "recomputed")])
def test_gradients_are_those_of_the_selected_pairs(policy, router_grad, selection, allocation, activation, dots):
    layer, x = make_layer(1, activation=activation)
    x[:, 0] = 3.0                      # a hot expert, so that its quota binds
    layer.keep_last_selection = True
    configure(layer, retention_ratio=0.5, policy=policy, router_grad=router_grad, selection=selection,
              quota_allocation=allocation, dropped_router_dots=dots)
    dx, grads = layer_grads(layer, x, step=3)
    sel = layer.last_selection
    pairs, scale = sel["pairs"], sel["scale"]
    stats = layer.last_stats
    assert pairs.numel() == int(stats.retained().sum()) < T * K
    if allocation == "threshold":  # one threshold: half of the pairs, each expert's count chosen by the sample
        assert pairs.numel() == T * K // 2 and torch.equal(stats.quotas, stats.counts)
    proj = torch.linspace(-1, 1, T * H, dtype=torch.float64).view(T, H)
    ref_dx, ref_grads = reference_retained_grads(layer, x, proj, pairs, scale, router_grad, activation)
    for name, a, b in [("dx", dx, ref_dx)] + [(f"param {i}", a, b) for i, (a, b) in enumerate(zip(grads, ref_grads))]:
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12), name
    # the selected pairs are, per expert, the quota's largest keys: recompute them from the metric
    idx = layer.deepspeed_moe.gate(x).topk_index.reshape(-1)
    kept_per_expert = torch.bincount(idx[pairs], minlength=E)
    assert torch.equal(kept_per_expert, stats.retained())
    if selection == "topk":
        assert torch.all(scale == 1)


def test_topk_selection_keeps_the_largest_metric():
    layer, x = make_layer(2)
    layer.keep_last_selection = True
    configure(layer, retention_ratio=0.5, selection="topk", metric="gate")
    layer_grads(layer, x)
    routing = layer.deepspeed_moe.gate(x)
    gate, idx = routing.topk_weight.detach().reshape(-1), routing.topk_index.reshape(-1)
    kept = set(layer.last_selection["pairs"].tolist())
    for e in range(E):
        mine = (idx == e).nonzero().squeeze(1)
        q = int(layer.last_stats.quotas[e])
        top = mine[torch.sort(-gate[mine], stable=True).indices[:q]]
        assert set(top.tolist()) == kept & set(mine.tolist()), e


@pytest.mark.parametrize("allocation,ratio,n", [("waterfill", 0.5, 100), ("threshold", 0.5, 100),
                                                 ("proportional", 0.025, 400), ("metric_mass", 0.5, 100)])
def test_ratio_half_is_unbiased_and_router_stays_exact(allocation, ratio, n):
    """(proportional at 0.025, 3 of 128 pairs: every expert's quota has a whole part of 0, so which experts keep a pair is sampled,
    weighted through the layer's backward by quota_weights)"""
    layer, x = make_layer()
    dx_exact, grads_exact = layer_grads(layer, x)
    configure(layer, retention_ratio=ratio, quota_allocation=allocation)
    mean, errs = [torch.zeros_like(g) for g in grads_exact], []
    for step in range(n):
        _, grads = layer_grads(layer, x, step)
        mean = [m + g / n for m, g in zip(mean, grads)]
        if step == 0:
            router_grad = grads[0]
            errs = [float((g - e).norm() / e.norm()) for g, e in zip(grads[1:], grads_exact[1:])]
    assert torch.allclose(router_grad, grads_exact[0], rtol=1e-10)  # the router's gradient stays exact
    assert max(errs) > 0.05  # one sample really drops pairs...
    for m, e in zip(mean[1:], grads_exact[1:]):
        assert float((m - e).norm() / e.norm()) < 0.25 * max(errs)  # ...and the average converges


def saved_bytes(layer, x):
    """Bytes the forward keeps for the backward (packed by saved-tensor hooks)."""
    with counting_saved_bytes() as saved:
        layer(x.clone().requires_grad_(True))
    return saved["bytes"]


class _AllocatedBytes(TorchDispatchMode):
    """Sums the bytes of the new tensors every op makes under it (views and in-place results, which
    share an input's storage, count nothing): how much the backward allocates."""
    total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.total += t.untyped_storage().nbytes()
        return out


def backward_bytes(layer, x):
    out, _, _ = layer(x.clone().requires_grad_(True))
    loss = probe_loss(out)
    with _AllocatedBytes() as mode:
        loss.backward()
    return mode.total


def test_memory_recompute_keeps_less_and_the_backward_falls_with_retention():
    layer, x = make_layer(3)
    held, made = {}, {}
    for policy in ("stash", "recompute"):
        for ratio in (1.0, 0.5, 0.25):
            configure(layer, retention_ratio=ratio, policy=policy, router_grad="retained")
            held[policy, ratio], made[policy, ratio] = saved_bytes(layer, x), backward_bytes(layer, x)
    # what the forward keeps cannot depend on the selection (it needs dout): the policy sets it
    P, fp64 = T * K, 8
    assert held["stash", 1.0] - held["recompute", 1.0] == (P * H + P * 2 * F - T * H) * fp64  # rows + h, not x
    # below 1.0 ||x_t|| joins (the grad_norm metric's factor), and on one rank the stash keeps x, not its P rows
    assert held["recompute", 0.25] == held["recompute", 0.5] == held["recompute", 1.0] + T * fp64
    assert held["stash", 0.25] == held["stash", 0.5] == held["stash", 1.0] + T * fp64 - (P - T) * H * fp64
    # the backward's buffers are sized by the retained rows
    for policy in ("stash", "recompute"):
        assert made[policy, 0.25] < made[policy, 0.5] < made[policy, 1.0], (policy, made)
    assert made["recompute", 1.0] > made["stash", 1.0]  # it recomputes h


HELD_CASES = [  # (policy, router_grad, retention ratio, dropped_router_dots)
    ("stash", "exact", 1.0, "saved"), ("stash", "exact", 0.5, "saved"), ("stash", "exact", 0.5, "recomputed"),
    ("stash", "retained", 0.5, "saved"), ("recompute", "exact", 1.0, "saved"), ("recompute", "exact", 0.5, "saved"),
    ("recompute", "exact", 0.5, "recomputed"), ("recompute", "retained", 0.5, "saved")]


def test_the_planners_held_estimate_is_what_the_forward_keeps():
    """The bytes per routed row the planner counts for each policy are what the forward saves: against the 1.0 stash
    with the retained router gradient, each case's saved bytes differ by T K times its estimate's difference (plus
    ||x_t||, T floats, where pairs may drop). The expert outputs [H] count where the exact router gradient keeps
    them (may drop, and not recomputed from the stash); recompute keeps each token's x once."""
    layer, x = make_layer(5)
    fp64 = 8

    def measure(policy, router_grad, ratio, dots):
        configure(layer, retention_ratio=ratio, policy=policy, router_grad=router_grad, dropped_router_dots=dots)
        held = saved_bytes(layer, x)
        layer_grads(layer, x)
        assert layer.last_stats.policy == policy
        return held, layer.last_stats.held_bytes_per_row(policy)

    base_held, base_row = measure("stash", "retained", 1.0, "saved")
    assert base_row == (H + 2 * F) * fp64
    expected_row = {("stash", "retained", 0.5, "saved"): -(-H * fp64 // K) + 2 * F * fp64,  # h, a k-th of x
                    ("stash", "exact", 0.5, "saved"): (H // K + 2 * F + H) * fp64,
                    ("stash", "exact", 0.5, "recomputed"): (H // K + 2 * F) * fp64,
                    ("recompute", "exact", 0.5, "saved"): (H // K + H) * fp64,
                    ("recompute", "exact", 0.5, "recomputed"): (H // K + H) * fp64,  # recompute has no stash of h
                    ("recompute", "exact", 1.0, "saved"): H // K * fp64}
    for case in HELD_CASES:
        held, row = measure(*case)
        assert held - base_held == T * K * (row - base_row) + (T * fp64 if case[2] < 1 else 0), case
        assert case not in expected_row or row == expected_row[case], (case, row)


def test_auto_router_dots_follow_the_memory_plan():
    """"dropped_router_dots": "auto" (the default) saves the expert outputs until the memory plan says otherwise; then
    the layer is the "recomputed" one, bit for bit and byte for byte; its statistics give the planner both stashes."""
    layer, x = make_layer(6)
    configure(layer, retention_ratio=0.5, policy="stash")
    layer_grads(layer, x, step=1)  # a backward first: the default split then plans from its metric masses
    masses, results = layer._metric_mass, {}
    assert masses is not None
    for dots, planned in (("saved", "saved"), ("recomputed", "saved"), ("auto", "saved"), ("auto", "recomputed")):
        configure(layer, retention_ratio=0.5, policy="stash", dropped_router_dots=dots)
        layer.memory_plan = MemoryPlan("stash", None, planned)
        layer._metric_mass = masses  # saved_bytes runs a step of its own: from the same state
        held = saved_bytes(layer, x)
        results[dots, planned] = held, replayed_grads(layer, x, masses, step=2), layer.last_stats
    for auto, fixed in ((("auto", "saved"), ("saved", "saved")), (("auto", "recomputed"), ("recomputed", "saved"))):
        assert results[auto][0] == results[fixed][0], (auto, fixed)
        dx, grads = results[auto][1]
        assert torch.equal(dx, results[fixed][1][0]) and all(map(torch.equal, grads, results[fixed][1][1]))
        assert results[auto][2].dropped_router_dots == fixed[0]
    assert results["auto", "saved"][0] - results["recomputed", "saved"][0] == T * K * H * 8  # the outputs [P, H]
    stats = results["auto", "saved"][2]
    assert stats.held_bytes_per_row("stash", "saved") == results["saved", "saved"][2].stash_bytes_per_row
    assert stats.held_bytes_per_row("stash", "recomputed") == results["recomputed", "saved"][2].stash_bytes_per_row
    assert results["saved", "saved"][2].lean_stash_bytes_per_row is None  # fixed by the config: no choice left


@pytest.mark.parametrize("ratio", [0.5, 1.0])
def test_stash_of_x_gives_the_gradients_of_the_stash_of_rows(monkeypatch, ratio):
    """On one rank a stash that may drop pairs keeps x, not its rows at the experts; the backward's rows gathered
    from x are the stashed rows bit for bit, so every gradient is the same (a row cap makes 1.0 one that may drop)."""
    from lrmoe_ds import pipeline
    layer, x = make_layer(4)
    configure(layer, retention_ratio=ratio, policy="stash")
    if ratio == 1.0:
        layer.memory_plan = MemoryPlan("stash", T * K)  # a cap that keeps every pair: may drop, drops nothing
    layer_grads(layer, x, step=2)  # a backward first: the default split then plans from its metric masses
    masses = getattr(layer, "_metric_mass", None)  # none at 1.0: nothing was planned from masses
    dx_x, g_x = replayed_grads(layer, x, masses, step=3)
    monkeypatch.setattr(pipeline, "stash_keeps_rows", lambda may_drop, ep_size: True)
    dx_rows, g_rows = replayed_grads(layer, x, masses, step=3)
    assert torch.equal(dx_x, dx_rows) and all(torch.equal(a, b) for a, b in zip(g_x, g_rows))


@pytest.mark.parametrize("policy", ["stash", "recompute"])
def test_exact_router_gradient_from_the_rows_saves_no_outputs(monkeypatch, policy):
    """Where no pair drops, <y_p, dout_t> = <a_p, da_p> / w_p from the rows the backward runs: the forward keeps no
    expert outputs [P, H], and every gradient is the one from the saved outputs up to rounding."""
    from lrmoe_ds import pipeline
    from_rows = pipeline.router_dots_from_rows  # (policy, may_drop, dropped_router_dots, dtype, ep_size)
    assert from_rows("stash", False, "saved", torch.bfloat16, 1)
    assert not from_rows("stash", False, "saved", torch.float16, 1)  # its range would flush w_p dout_t
    assert not from_rows("stash", True, "saved", torch.bfloat16, 1)  # a dropped pair's dot needs y...
    assert from_rows("stash", True, "recomputed", torch.bfloat16, 1)  # ...or the stash's h
    assert not from_rows("recompute", True, "recomputed", torch.bfloat16, 1)  # (no h kept)
    assert not from_rows("stash", False, "saved", torch.bfloat16, 2)  # across ranks, an all-to-all of their own...
    assert from_rows("recompute", False, "recomputed", torch.bfloat16, 2)  # ...only where asked for
    assert not from_rows("stash", True, "recomputed", torch.bfloat16, 2)  # (a dropped pair's dout stays home)
    layer, x = make_layer(5)
    configure(layer, retention_ratio=1.0, policy=policy)
    held_rows = saved_bytes(layer, x)
    dx_rows, g_rows = layer_grads(layer, x)
    monkeypatch.setattr(pipeline, "router_dots_from_rows", lambda *args: False)
    held_y = saved_bytes(layer, x)
    dx_y, g_y = layer_grads(layer, x)
    assert held_y - held_rows == T * K * H * 8
    router = [n for n, _ in layer.named_parameters()].index("deepspeed_moe.gate.wg.weight")
    assert not torch.equal(g_rows[router], g_y[router])  # another route...
    for a, b in zip([dx_rows] + g_rows, [dx_y] + g_y):    # ...to the same gradients
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("allocation", ["waterfill", "threshold"])
def test_recomputed_dropped_dots_keep_no_outputs(monkeypatch, allocation):
    """dropped_router_dots "recomputed": at 0.5 the stash keeps no expert outputs [P, H], and every gradient is the
    saved route's up to rounding (the same selection: its seed and metric do not depend on the route)."""
    layer, x = make_layer(6)
    x[:, 0] = 3.0
    grads, held = {}, {}
    for dots in ("saved", "recomputed"):
        configure(layer, retention_ratio=0.5, policy="stash", quota_allocation=allocation, dropped_router_dots=dots)
        held[dots] = saved_bytes(layer, x)
        grads[dots] = layer_grads(layer, x, step=2)
    assert held["saved"] - held["recomputed"] == T * K * H * 8
    (dx_s, g_s), (dx_r, g_r) = grads["saved"], grads["recomputed"]
    assert not torch.equal(g_s[0], g_r[0])            # the router's gradient by another route...
    for a, b in zip([dx_s] + g_s, [dx_r] + g_r):      # ...to the same gradients
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-15)
    held_recompute = []
    for dots in ("saved", "recomputed"):  # under recompute no h is kept to remake y from: y is kept either way
        configure(layer, retention_ratio=0.5, policy="recompute", dropped_router_dots=dots)
        held_recompute.append(saved_bytes(layer, x))
    assert held_recompute[0] == held_recompute[1]


def test_recomputed_dropped_dots_with_nothing_dropped(monkeypatch):
    """The selection path with every quota >= count and dropped_router_dots "recomputed": no dropped rows (empty
    groups, an empty dgrad), and the exact layer's gradients up to rounding."""
    layer, x = make_layer()
    dx_exact, grads_exact = layer_grads(layer, x)
    configure(layer, retention_ratio=1.0, dropped_router_dots="recomputed")
    select_with_full_quotas(monkeypatch, layer)
    layer.keep_last_selection = True
    dx, grads = layer_grads(layer, x)
    assert layer.last_selection["pairs"].numel() == T * K
    for a, b in zip([dx] + grads, [dx_exact] + grads_exact):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-15)


def test_eval_and_disabled_run_exact():
    layer, x = make_layer()
    configure(layer, retention_ratio=0.25)
    layer.eval()
    assert layer._backward_spec(layer.deepspeed_moe.dispatcher.plan(*_routing(layer, x)), x.dtype) == (BackwardSpec(), None)


def _routing(layer, x):
    r = layer.deepspeed_moe.gate(x)
    return r.topk_index, r.counts


def test_reentrant_checkpointing_samples_as_without_it():
    """Activation checkpointing's no-grad forward must not advance the sampling step: the recomputed
    forward then selects the same pairs, and the gradients are those of the plain run, bit for bit."""
    layer, x = make_layer(5)
    configure(layer, retention_ratio=0.5)
    layer_grads(layer, x, step=6)  # a backward first: the default split then plans from its metric masses
    masses = layer._metric_mass
    assert masses is not None
    dx_plain, g_plain = replayed_grads(layer, x, masses, step=7)
    step_plain = int(layer.retention_step)
    dx_ckpt, g_ckpt = replayed_grads(layer, x, masses, step=7, checkpointed=True)
    assert step_plain == int(layer.retention_step) == 8
    assert torch.equal(dx_plain, dx_ckpt) and all(torch.equal(a, b) for a, b in zip(g_plain, g_ckpt))
