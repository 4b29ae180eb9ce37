"""Replica placement and count-level capacity routing (lrmoe_ds.placement), held to ops.capacity_route."""
import itertools

import pytest
import torch

from lrmoe_ds import ops
from lrmoe_ds.placement import ReplicaPlan, _fill, place_replicas, plan_with_replicas, route_counts
from lrmoe_ds.quotas import plan_quotas, rank_shares


def _instances(replica_expert, El):
    """(expert, rank) of every group slot in slot order, and its flat slot id; empty replica slots left out."""
    R, S = replica_expert.shape
    G = El + S
    out = []
    for d, j in itertools.product(range(R), range(G)):
        e = d * El + j if j < El else int(replica_expert[d, j - El])
        if e >= 0:
            out.append((e, d, d * G + j))
    return out


def _random_case(gen, R, El, S, skew):
    E = R * El
    weights = torch.rand(E, generator=gen) ** skew
    all_counts = torch.stack([torch.multinomial(weights, 200, replacement=True, generator=gen).bincount(minlength=E)
                              for _ in range(R)])
    return all_counts


@pytest.mark.parametrize("seed", range(6))
def test_placement_levels_the_ranks_and_keeps_every_quota(seed):
    gen = torch.Generator().manual_seed(seed)
    R, El, S = 4, 3, 2
    quotas = plan_quotas(_random_case(gen, R, El, S, skew=4).sum(0), 0.5)
    replica_expert, capacity = place_replicas(quotas, R, S)
    per_expert = capacity[:, :El].reshape(-1).clone()
    for d, s in itertools.product(range(R), range(S)):
        e = int(replica_expert[d, s])
        if e >= 0:
            assert e // El != d, "a replica at its own home"
            assert (replica_expert[d] == e).sum() == 1, "two instances of one expert on one rank"
            assert capacity[d, El + s] > 0
            per_expert[e] += capacity[d, El + s]
        else:
            assert capacity[d, El + s] == 0
    assert torch.equal(per_expert, quotas)                      # every retained row has an instance
    before, after = quotas.view(R, El).sum(1), capacity.sum(1)
    assert after.max() <= before.max() and after.sum() == before.sum()
    if (replica_expert >= 0).any():
        assert after.max() < before.max()


def test_placement_of_one_hot_expert():
    quotas = torch.tensor([90, 2, 4, 4, 3, 5, 1, 1])             # 4 ranks, 2 experts each; expert 0 is hot
    replica_expert, capacity = place_replicas(quotas, 4, 1)
    assert replica_expert.view(-1).tolist() == [-1, 0, 0, 0]     # a replica of the hot expert on every other rank
    loads = capacity.sum(1).tolist()
    assert max(loads) - min(loads) <= 2 and sum(loads) == 110, loads
    # a replica must take at least min_rows: the three moves were 26, 20 and 18 rows
    assert (place_replicas(quotas, 4, 1, min_rows=19)[0].view(-1) >= 0).sum() == 2
    assert (place_replicas(quotas, 4, 1, min_rows=27)[0] < 0).all()
    # no slots, or level loads: nothing moves
    assert (place_replicas(quotas, 4, 0)[0].numel() == 0)
    assert (place_replicas(torch.tensor([5, 5, 4, 6]), 2, 1)[0] < 0).all()


@pytest.mark.parametrize("seed", range(6))
def test_route_counts_is_capacity_route_on_counts(seed):
    """Expanded to pairs (grouped by expert, each expert's by source rank), the count-level routing is what
    ops.capacity_route assigns, pair for pair; and each source rank's runs give its own pairs' instances."""
    gen = torch.Generator().manual_seed(100 + seed)
    R, El, S = 3, 2, 2
    all_counts = _random_case(gen, R, El, S, skew=3)
    quotas = plan_quotas(all_counts.sum(0), 0.6)
    shares = rank_shares(quotas, all_counts)
    replica_expert, capacity = place_replicas(quotas, R, S)
    counts = route_counts(shares, replica_expert, capacity)
    assert torch.equal(counts.sum(0), capacity.view(-1))                # every instance filled exactly
    inst = _instances(replica_expert, El)
    inst_expert = torch.tensor([e for e, _, _ in inst])
    inst_rank = torch.tensor([d for _, d, _ in inst])
    inst_slot = torch.tensor([s for _, _, s in inst])
    inst_cap = capacity.view(-1)[inst_slot]
    pair_expert = torch.repeat_interleave(torch.arange(R * El).repeat_interleave(R), shares.t().reshape(-1))
    pair_rank = torch.repeat_interleave(torch.arange(R).repeat(R * El), shares.t().reshape(-1))
    assigned = ops.capacity_route(pair_expert, pair_rank, inst_expert, inst_rank, inst_cap, backend="torch")
    assert (assigned >= 0).all()
    slot_of_pair = inst_slot[assigned]
    expected = torch.zeros_like(counts)
    expected.index_put_((pair_rank, slot_of_pair), torch.ones_like(pair_rank), accumulate=True)
    assert torch.equal(counts, expected)
    plan = ReplicaPlan(replica_expert, counts)
    for r in range(R):
        mine = pair_rank == r       # this rank's pairs, in its grouped (by expert) order
        assert torch.equal(plan.slot_of_rows(r, int(mine.sum()), "cpu"), slot_of_pair[mine])


def test_route_counts_refuses_rows_that_fit_nowhere():
    shares = torch.tensor([[5, 1], [1, 0]])                      # 2 ranks, 1 expert each, 1 slot each
    capacity = torch.tensor([[4, 0], [1, 1]])                      # expert 0: 4 at home + 1 on rank 1
    with pytest.raises(ValueError, match="expert 0 has 1 retained rows that fit no instance"):
        route_counts(shares, torch.tensor([[-1], [0]]), capacity)
    with pytest.raises(ValueError, match="expert 0 has more retained rows than its one instance's capacity"):
        route_counts(shares, torch.tensor([[-1], [-1]]), capacity)


@pytest.mark.parametrize("seed", range(20))
def test_fill_is_the_one_at_a_time_rule(seed):
    gen = torch.Generator().manual_seed(seed)
    spare = torch.randint(0, 6, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
    rows = int(torch.randint(0, sum(spare) + 1, (1,), generator=gen))
    s, takes = list(spare), [0] * len(spare)
    for _ in range(rows):
        j = max(range(len(s)), key=lambda i: (s[i], -i))
        s[j] -= 1
        takes[j] += 1
    assert _fill(spare, rows) == takes


def test_weight_exchange_sends_each_replica_its_expert():
    replica_expert = torch.tensor([[3, -1], [0, 5], [1, 0]])    # 3 ranks, 2 experts each, 2 slots
    plan = ReplicaPlan(replica_expert, torch.zeros(3, 3 * 4, dtype=torch.long))
    ex = [plan.weight_exchange(r) for r in range(3)]
    for d in range(3):
        received = []   # what rank d receives: rank r's send list, its part for d, in rank order
        for r in range(3):
            send, send_splits, _, _ = ex[r]
            start = sum(send_splits[:d])
            received += [r * 2 + e for e in send[start:start + send_splits[d]]]
            assert ex[d][2][r] == send_splits[d]                 # receive splits match the sender's
        assert [int(replica_expert[d, s]) for s in ex[d][3]] == received


def test_plan_with_replicas():
    all_counts = torch.tensor([[40, 2, 3, 3], [30, 2, 3, 1]])    # expert 0 (rank 0) hot
    n = all_counts.sum(0)
    quotas, shares, placed = plan_with_replicas(n, all_counts, 1, 0.5, balance_factor=1.25)
    assert placed is not None and int(placed.replica_expert[1, 0]) == 0
    assert torch.equal(shares.sum(0), quotas) and int(quotas.sum()) == int(0.5 * int(n.sum()))
    loads = placed.retained_per_rank()
    assert int(loads.max() - loads.min()) <= 1 and placed.replica_rows() > 0
    # without replicas the balance factor drops the hot rank's rows instead
    plain = plan_quotas(n, 0.5, 2, balance_factor=1.25)
    assert int(plain.sum()) < int(quotas.sum())
    # a row cap below the level: each rank's instances are cut to it
    quotas, _, placed = plan_with_replicas(n, all_counts, 1, 0.5, max_rows_per_rank=10)
    assert placed.retained_per_rank().max() <= 10 and int(quotas.sum()) <= 20
    # the floor wins over the cap, at the home instance
    quotas, shares, placed = plan_with_replicas(n, all_counts, 1, 0.5, floor=0.5, max_rows_per_rank=10)
    assert (quotas >= torch.ceil(0.5 * n)).all() and torch.equal(shares.sum(0), quotas)
    assert torch.equal(placed.counts.view(2, 2, -1).sum((0, 2)), placed.retained_per_rank())
    # level counts: no replica, and plan_quotas' own result
    level = torch.tensor([[5, 5, 5, 5], [5, 5, 5, 5]])
    quotas, shares, placed = plan_with_replicas(level.sum(0), level, 2, 0.5)
    assert placed is None and torch.equal(quotas, plan_quotas(level.sum(0), 0.5, 2))
