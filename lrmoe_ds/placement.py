"""Expert replicas for the retained backward (DESIGN.md steps 8 and 11), host-side and the same on every rank.

Each expert-parallel rank has ``E_l`` home experts and ``S`` replica slots: G = E_l + S groups, group slot
``d * G + j`` on rank d (j < E_l: home expert d * E_l + j; j >= E_l: replica slot j - E_l). Planned in the
forward from the global counts, like the quotas, so the backward's exchange sizes need no communication:

1. :func:`place_replicas`: the retained rows of the most loaded rank's hottest expert are moved, in part,
   to a replica slot on the least loaded rank, until the ranks are level or the slots are used up; each
   instance gets a capacity (rows it will run), and the capacities of an expert add up to its quota.
2. :func:`route_counts`: each source rank's share of an expert goes to the expert's instance on the source
   rank first (no exchange), then to the instances with most spare capacity: the rule of
   ``ops.capacity_route``, applied to counts (the tests hold it to the op).
3. :meth:`ReplicaPlan.runs`: the order in which one source rank's retained rows of each expert fill those
   counts, for :meth:`ReplicaPlan.slot_of_rows` on the device.

The backward fetches the replicas' weights from their homes and sends their gradients back, where they are
summed into the home expert's before DeepSpeed reduces it (the weights cannot change in between).
"""
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from lrmoe_ds.dispatcher import to_device
from lrmoe_ds.quotas import ALLOCATIONS, floor_pairs, plan_quotas, rank_shares


def _replica_slots(replica_expert: torch.Tensor, num_local_experts: int) -> Dict[int, List[int]]:
    """{expert: the group slots of its replicas, in slot order} (group slot d * G + E_l + s for slot s of rank d)."""
    G = num_local_experts + replica_expert.shape[1]
    out: Dict[int, List[int]] = {}
    for d, experts in enumerate(replica_expert.tolist()):
        for s, e in enumerate(experts):
            if e >= 0:
                out.setdefault(e, []).append(d * G + num_local_experts + s)
    return out


@dataclass
class ReplicaPlan:
    """Where one layer call's retained rows run.

    replica_expert [R, S]: the global expert in each replica slot (-1: empty).
    counts [R, R * G]: retained rows from each source rank to each group slot (G = E_l + S).
    """
    replica_expert: torch.Tensor
    counts: torch.Tensor

    @property
    def ep_size(self) -> int:
        return self.replica_expert.shape[0]

    @property
    def groups_per_rank(self) -> int:
        return self.counts.shape[1] // self.ep_size

    @property
    def num_local_experts(self) -> int:
        return self.groups_per_rank - self.replica_expert.shape[1]

    def retained_per_rank(self) -> torch.Tensor:
        """[R] retained rows each rank runs (home experts and replicas)."""
        R = self.ep_size
        return self.counts.view(R, R, -1).sum((0, 2))

    def replica_rows(self) -> int:
        """Retained rows that run on replicas, over all ranks."""
        R, El = self.ep_size, self.num_local_experts
        return int(self.counts.view(R, R, -1)[:, :, El:].sum())

    def runs(self, rank: int) -> Tuple[List[int], List[int]]:
        """(group slot, rows) runs that source ``rank``'s retained rows fill, in their order (by expert; within
        an expert its instance on ``rank`` first, then the others by slot): what ``ops.capacity_route`` assigns."""
        R, G, El = self.ep_size, self.groups_per_rank, self.num_local_experts
        replicas_of = _replica_slots(self.replica_expert, El)
        mine = self.counts[rank].tolist()
        slots, rows = [], []
        for e in range(R * El):
            instances = sorted([(e // El) * G + e % El] + replicas_of.get(e, []))
            for slot in sorted(instances, key=lambda i: i // G != rank):  # stable: local first, then slot order
                if mine[slot]:
                    slots.append(slot)
                    rows.append(mine[slot])
        return slots, rows

    def slot_of_rows(self, rank: int, num_rows: int, device) -> torch.Tensor:
        """[num_rows] the group slot of each of source ``rank``'s retained rows (grouped by expert)."""
        slots, rows = self.runs(rank)
        # through pinned memory: a plain host-list tensor on the GPU would wait for the stream
        return torch.repeat_interleave(to_device(torch.tensor(slots), device), to_device(torch.tensor(rows), device),
                                       output_size=num_rows)

    def weight_exchange(self, rank: int) -> Tuple[List[int], List[int], List[int], List[int]]:
        """The replicas' weights, from homes to slots: (local experts this rank sends, in send order; rows it
        sends to each rank; rows it receives from each rank; its replica slot of each received row, in order)."""
        R, El = self.ep_size, self.num_local_experts
        rep = self.replica_expert.tolist()
        send = [(d, rep[d][s] - rank * El) for d in range(R) for s in range(len(rep[d]))
                if rep[d][s] >= 0 and rep[d][s] // El == rank]
        recv = [(rep[rank][s] // El, s) for s in range(len(rep[rank])) if rep[rank][s] >= 0]
        recv.sort()  # rows arrive by source rank, each source's in its send order (slot order)
        return ([e for _, e in send], [sum(d == r for d, _ in send) for r in range(R)],
                [sum(h == r for h, _ in recv) for r in range(R)], [s for _, s in recv])


def place_replicas(quotas: torch.Tensor, ep_size: int, slots: int,
                   min_rows: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """Greedy leveling of the retained rows per rank with replicas.

    quotas [E] (expert e's home is rank e // E_l). Repeatedly: the most loaded rank d_hi (ties: lowest), its
    expert with most rows still at home, the least loaded rank d_lo with a free slot that holds no instance
    of it; as many rows as take d_hi down to the level (the mean, rounded up) without taking d_lo above it,
    and no more than are at home, move to a replica on d_lo. Stops when that move is below ``min_rows``.
    Returns (replica_expert [R, S] (-1 empty), capacity [R, E_l + S]: rows each instance runs).
    """
    R, S = ep_size, slots
    q = quotas.detach().long().cpu()
    El = q.numel() // R
    home = q.tolist()
    load = q.view(R, El).sum(1).tolist()
    replica = [[-1] * S for _ in range(R)]
    replica_rows = [[0] * S for _ in range(R)]
    level = -(-sum(load) // R)
    for _ in range(R * S):
        hi = max(range(R), key=lambda d: (load[d], -d))
        e = max(range(hi * El, (hi + 1) * El), key=lambda i: (home[i], -i))
        free = [d for d in range(R) if d != hi and -1 in replica[d] and e not in replica[d]]
        if not free:
            break
        lo = min(free, key=lambda d: (load[d], d))
        move = min(home[e], load[hi] - level, level - load[lo])
        if move < max(1, min_rows):
            break
        s = replica[lo].index(-1)
        replica[lo][s], replica_rows[lo][s] = e, move
        home[e] -= move
        load[hi] -= move
        load[lo] += move
    capacity = torch.tensor([home[d * El:(d + 1) * El] + replica_rows[d] for d in range(R)], dtype=torch.long)
    return torch.tensor(replica, dtype=torch.long).view(R, S), capacity


def _fill(spare: List[int], rows: int) -> List[int]:
    """How many of ``rows`` each instance takes when each row goes to the instance with most spare capacity
    (ties: lowest index), one at a time; in closed form, level by level."""
    s, takes = list(spare), [0] * len(spare)
    while rows > 0 and max(s, default=0) > 0:
        top = max(s)
        at_top = [i for i, v in enumerate(s) if v == top]
        below = max([v for v in s if v < top], default=0)
        step = min(top - below, rows // len(at_top))
        if step == 0:  # fewer rows than instances at the top: one more each, lowest index first
            for i in at_top[:rows]:
                s[i] -= 1
                takes[i] += 1
            break
        for i in at_top:
            s[i] -= step
            takes[i] += step
        rows -= step * len(at_top)
    return takes


def route_counts(shares: torch.Tensor, replica_expert: torch.Tensor, capacity: torch.Tensor) -> torch.Tensor:
    """Count-level capacity routing: shares [R, E] (retained rows of each source rank per expert), the
    placement of :func:`place_replicas` -> counts [R, R * G] rows from each source rank to each group slot.

    Per expert, as ``ops.capacity_route`` routes its pairs (grouped by source rank): each source's rows go to
    its own rank's instance first, up to its capacity; the rest are spilled by the most-spare-capacity rule,
    each instance taking a contiguous run of the spilled rows in slot order. Rows that fit nowhere raise.
    """
    R, G = capacity.shape
    El = G - replica_expert.shape[1]
    shares = shares.detach().long().cpu()
    cap = capacity.reshape(-1).tolist()
    replicas_of = _replica_slots(replica_expert, El)
    # experts with one instance (most of them): every row at home, as whole columns
    home_slot = (torch.arange(R * El) // El) * G + torch.arange(R * El) % El
    over = [e for e in (shares.sum(0) > capacity.reshape(-1)[home_slot]).nonzero().flatten().tolist()
            if e not in replicas_of]
    if over:
        raise ValueError(f"route_counts: expert {over[0]} has more retained rows than its one instance's capacity")
    out = torch.zeros(R, R * G, dtype=torch.long)
    out[:, home_slot] = shares.index_fill(1, torch.tensor(sorted(replicas_of), dtype=torch.long), 0)
    sh = shares.tolist()
    counts = {}  # (source rank, slot) -> rows, for the experts with replicas
    for e in sorted(replicas_of):
        home = (e // El) * G + e % El
        insts = sorted([home] + replicas_of[e])
        local_of = {i // G: i for i in insts}  # at most one instance of an expert per rank
        spare = {i: cap[i] for i in insts}
        left = []
        for r in range(R):
            n, i = sh[r][e], local_of.get(r)
            take = 0 if i is None else min(spare[i], n)
            if take:
                counts[r, i] = counts.get((r, i), 0) + take
                spare[i] -= take
            left.append(n - take)
        takes = _fill([spare[i] for i in insts], sum(left))
        if sum(takes) < sum(left):
            raise ValueError(f"route_counts: expert {e} has {sum(left) - sum(takes)} retained rows that fit no "
                             "instance: its instances' capacities are below its quota")
        # the spilled rows, source rank by source rank, against the instances' runs in slot order
        r, r_left = 0, left[0]
        for i, t in zip(insts, takes):
            while t:
                while r_left == 0:
                    r += 1
                    r_left = left[r]
                n = min(t, r_left)
                counts[r, i] = counts.get((r, i), 0) + n
                t -= n
                r_left -= n
    if counts:
        (rows, slots), n = zip(*counts.keys()), list(counts.values())
        out.index_put_((torch.tensor(rows), torch.tensor(slots)), torch.tensor(n))
    return out


def plan_with_replicas(counts: torch.Tensor, all_counts: torch.Tensor, slots: int, retention_ratio: float = 1.0,
                       floor: float = 0.0, balance_factor: float = float("inf"), max_rows_per_rank=None,
                       allocation: str = "waterfill", min_rows: int = 1, generator: Optional[torch.Generator] = None):
    """Quotas, shares and placement together: (quotas [E], shares [R, E], ReplicaPlan or None).

    The target (``plan_quotas`` without its per-rank cuts) is placed first, so that replicas take over the
    rows that a rank over its cap would otherwise drop; a rank still over the cap (``max_rows_per_rank``, or
    ``balance_factor`` times the mean where anything is dropped) then has its instances cut by
    ``allocation``'s rule, and the floor is given back at the home instance. Where no replica helps, this is
    ``plan_quotas`` and ``rank_shares`` unchanged, and the plan is None. ``generator``: rank_shares' sampling.
    """
    R = all_counts.shape[0]
    n = counts.detach().long().cpu()
    start = None if generator is None else generator.get_state()  # the target draws as plan_quotas would alone
    target = plan_quotas(n, retention_ratio, R, floor, allocation=allocation, generator=generator)
    replica_expert, capacity = place_replicas(target, R, slots, min_rows)
    if bool((replica_expert < 0).all()):
        if generator is not None:
            generator.set_state(start)
        quotas = plan_quotas(n, retention_ratio, R, floor, balance_factor, max_rows_per_rank, allocation,
                             generator=generator)
        return quotas, rank_shares(quotas, all_counts, generator), None
    cap = float("inf") if max_rows_per_rank is None else max_rows_per_rank
    bound = balance_factor * float(target.sum()) / R  # (a finite factor can still overflow: no bound then)
    if not torch.equal(target, n) and math.isfinite(bound):
        cap = min(cap, math.floor(bound))
    cut = ALLOCATIONS[allocation]
    for d, rows in enumerate(capacity.sum(1).tolist()):
        if rows > cap:
            capacity[d] = cut(capacity[d], int(cap))
    El = n.numel() // R
    quotas = capacity[:, :El].reshape(-1).clone()
    placed = replica_expert >= 0
    quotas.index_add_(0, replica_expert[placed], capacity[:, El:][placed])
    if floor > 0:
        deficit = (torch.minimum(n, floor_pairs(floor, n)) - quotas).clamp_min(0)
        capacity[:, :El] += deficit.view(R, El)
        quotas += deficit
    shares = rank_shares(quotas, all_counts, generator)
    return quotas, shares, ReplicaPlan(replica_expert, route_counts(shares, replica_expert, capacity))
