"""Retention quotas (host-side): how many pairs of each expert run their backward, and each rank's share.

Made in the forward from the global counts n_e (known on every rank after the dispatcher's one
all-gather), so every rank computes the same quotas and shares without more communication; the
backward's compacted all-to-all sizes follow from them.
"""
import functools
import math
import os
from fractions import Fraction
from dataclasses import dataclass
from typing import Literal, Optional, Tuple

import numpy as np
import torch

from lrmoe_ds.dispatcher import HostCopy


@dataclass
class MemoryPlan:
    """What the memory planner tells one layer.

    policy: what the forward keeps for the expert backward ("stash" or "recompute").
    max_rows_per_rank: retained backward rows that each expert-parallel rank may hold for this
        layer (its compacted backward buffers are sized by them); None: unbounded.
    dropped_router_dots: where the exact router gradient's dots of dropped pairs come from under
        ``"dropped_router_dots": "auto"`` ("saved" or "recomputed"; see LRMoEConfig).
    """
    policy: Literal["stash", "recompute"] = "stash"
    max_rows_per_rank: Optional[int] = None
    dropped_router_dots: Literal["saved", "recomputed"] = "saved"


def _counts_np(t) -> np.ndarray:
    """int64 numpy form of host counts (a CPU tensor's memory is shared: callers do not write to it)."""
    return t.astype(np.int64, copy=False) if isinstance(t, np.ndarray) else \
        t.detach().cpu().numpy().astype(np.int64, copy=False)


def _level(n: torch.Tensor, budget: int, granule: int = 1) -> torch.Tensor:
    """min(n, c) for the largest integer cap c with sum(min(n, c)) <= budget (water-fill from above).

    For c between the i-th and the (i+1)-th smallest count, sum(min(n, c)) = (sum of the i smallest) + c (E - i),
    linear in c: the cap comes from the first i where that reaches the budget at c = the i-th count.

    granule g > 1 (where c >= g): the capped experts (n_e > c) keep whole multiples of g instead, since the
    backward's GEMMs tile a group's rows by 64 and compute a partial last tile in full: each keeps floor(c / g) g,
    and the pairs that frees go back in whole tiles to the hottest capped experts (ties: lower index), each at
    most its n_e. The sum stays within the budget and within g of the plain water-fill's; the cold experts
    (n_e <= c) keep every pair, as before."""
    if int(n.sum()) <= budget:
        return n.clone()
    return torch.from_numpy(_level_np(_counts_np(n), budget, granule)).to(n.dtype)


def _level_np(nv: np.ndarray, budget: int, granule: int = 1) -> np.ndarray:
    """:func:`_level` on int64 numpy counts (it runs in every training forward: few numpy calls, no tensor ops)."""
    if int(nv.sum()) <= budget:
        return nv.copy()
    E, s = nv.size, np.sort(nv)
    before = np.cumsum(s) - s                                   # the sum of the i smallest, per i
    i = int(np.argmax(before + s * (E - np.arange(E)) > budget))  # exists: at i = E - 1 it is the total
    cap = max(0, (budget - int(before[i])) // (E - i))
    if granule <= 1 or cap < granule:
        return np.minimum(nv, cap)
    base = cap // granule * granule
    capped = nv > cap
    q = np.where(capped, base, nv)
    left = budget - int(q.sum())
    hot = np.flatnonzero(capped)
    hot = hot[np.argsort(-nv[hot], kind="stable")]             # hottest first, ties: lower index
    # each a whole tile while one is left; those with fewer than a tile above base (the coldest of the capped, last
    # in this order) take what they have where it still fits
    full = int(np.count_nonzero(nv[hot] >= base + granule))
    tiles = min(full, left // granule)
    q[hot[:tiles]] += granule
    left -= tiles * granule
    for e in hot[full:].tolist():
        v = int(nv[e])
        if v - base <= left:
            left -= v - base
            q[e] = v
    return q


@functools.lru_cache(maxsize=64)
def _as_written(ratio: float) -> Tuple[int, int]:
    """(numerator, denominator) of the ratio as written: its shortest decimal repr, exactly (0.7 is 7 / 10)."""
    return Fraction(repr(float(ratio))).as_integer_ratio()


def target_pairs(ratio: float, pairs: int) -> int:
    """floor(ratio * pairs) for the ratio as written (0.7 of 90 is 63, where 0.7 * 90 is 62.99999999999999 in floats)."""
    x = ratio * pairs
    if math.ceil(x) - x > 1e-9 * max(1.0, x):  # clear of an integer: the float product decides (per forward: fast)
        return math.floor(x)
    num, den = _as_written(ratio)  # near or at one (0.5 of an even count, every step): exactly, in integers
    return num * pairs // den


def floor_pairs(fraction: float, n: torch.Tensor) -> torch.Tensor:
    """ceil(fraction * n_e) per expert, exactly for the fraction as written (0.07 of 100 is 7, not 8)."""
    num, den = _as_written(fraction)
    return torch.tensor([(num * v + den - 1) // den for v in n.tolist()], dtype=torch.long)


def _scale(n: torch.Tensor, budget: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """floor(n_e budget / sum n) plus one for as many experts as the remainders add up to, summing to ``budget``
    (every expert keeps the same fraction, to the pair); n itself if it is within budget. The extra ones go to the
    largest remainders (ties: lower index), or with ``generator`` by systematic sampling, each expert with
    probability exactly its fractional part (see rank_shares; :func:`quota_weights` then weights the pairs of an
    expert sampled up from 0)."""
    vals = n.tolist()
    total = sum(vals)
    if total <= budget:
        return n.clone()
    q = [v * budget // total for v in vals]
    if generator is not None:
        frac = n.long() * budget % total
        offset = (torch.rand((), generator=generator, dtype=torch.float64) * total).long().clamp_max(total - 1)
        return torch.tensor(q, dtype=n.dtype) + _sampled_extras(frac, total, offset).to(n.dtype)
    rest = sorted(range(len(vals)), key=lambda i: (-(vals[i] * budget % total), i))[:budget - sum(q)]
    for i in rest:
        q[i] += 1
    return torch.tensor(q, dtype=n.dtype)


def quota_weights(counts: torch.Tensor, quotas: torch.Tensor, retention_ratio: float,
                  floor: float = 0.0) -> Optional[torch.Tensor]:
    """[E] fp32: for the "proportional" allocation sampled with a generator, 1 / f_e for an expert whose quota's
    whole part is 0 and whose sampled quota is 1 (it got it with probability f_e = n_e ratio; not where the floor
    gives it a pair anyway), 1 elsewhere; None where no expert is such."""
    n = counts.detach().long().cpu()
    total, budget = int(n.sum()), target_pairs(retention_ratio, int(n.sum()))
    if total <= budget:
        return None
    scaled = n * budget
    return _inverse_inclusion(scaled, total, (scaled < total) & (quotas.cpu() > 0) & (floor_pairs(floor, n) == 0))


def _mass_fill(n: torch.Tensor, budget: int, weights: torch.Tensor, granule: int = 1) -> torch.Tensor:
    """The "metric_mass" split: Q_e = min(n_e, n_e w_e / tau) with tau the smallest that fits ``budget`` (w_e: a
    pair's mean metric at expert e in the last backward, so each expert keeps about the share one priority-sampling
    threshold over the layer would give it), rounded down, at least 1 for every expert with pairs (so that none is
    left out of its gradient: any fixed quota >= 1 keeps it unbiased), the pairs left by the rounding to the largest
    remainders (ties: lower index), and what is still left (experts of weight 0 only) by the water-fill. n itself if it
    is within budget; the plain water-fill where the budget has fewer pairs than experts with pairs. granule g > 1:
    the capped quotas in whole tiles (:func:`_whole_tiles`)."""
    if int(n.sum()) <= budget:
        return n.clone()
    w = np.asarray(weights.detach().cpu(), dtype=np.float64)
    return torch.from_numpy(_mass_fill_np(_counts_np(n), budget, w, granule)).to(n.dtype)


def _mass_fill_np(nv: np.ndarray, budget: int, w: np.ndarray, granule: int = 1) -> np.ndarray:
    """:func:`_mass_fill` on int64 numpy counts and float64 weights (it runs in every training forward)."""
    total, busy = int(nv.sum()), int(np.count_nonzero(nv))
    if total <= budget:
        return nv.copy()
    if budget < busy:
        return _level_np(nv, budget, granule)
    mass = nv * np.maximum(w, 0.0)
    if not (mass > 0).any():
        return _level_np(nv, budget, granule)
    # experts saturate (keep all n_e) in order of falling w_e; tau from the rest (a short loop: it stops at the first
    # expert left unsaturated, which exists as total > budget; tau 0: only weightless experts left)
    with_pairs = np.flatnonzero(nv > 0)
    vals, masses = nv.tolist(), mass.tolist()
    kept_whole, rest_mass, tau = 0, sum(masses), 0.0
    for e in with_pairs[np.argsort(-(mass[with_pairs] / nv[with_pairs]), kind="stable")].tolist():
        # rest_mass >= masses[e] but for rounding, which could otherwise saturate e past the budget (and divide by 0
        # next) where the experts of nonzero weight hold exactly the budget
        tau = max(rest_mass, masses[e]) / (budget - kept_whole)
        if masses[e] / vals[e] <= tau:
            break
        kept_whole += vals[e]
        rest_mass -= masses[e]
    saturated = (nv > 0) & (mass / np.maximum(nv, 1) > tau)
    exact = np.where(saturated, nv.astype(np.float64), mass / tau if tau > 0 else 0.0)
    q = np.where(nv > 0, np.minimum(nv, np.maximum(1, np.floor(exact).astype(np.int64))), 0)
    for _ in range(int(q.sum()) - budget):  # the minimum of 1 overshot: take back from the largest (ties: lower index)
        q[np.argmax(q)] -= 1
    short = np.flatnonzero(q < nv)
    rest = short[np.argsort(-(exact - np.floor(exact))[short], kind="stable")]  # largest remainders, ties: lower index
    q[rest[:max(0, budget - int(q.sum()))]] += 1
    left = budget - int(q.sum())
    # more left than one pair each: experts without weight (every metric 0 there) share it by the water-fill
    q = q + _level_np(nv - q, left) if left > 0 else q
    return _whole_tiles(nv, q, budget, granule, exact) if granule > 1 else q


def _whole_tiles(nv: np.ndarray, qv: np.ndarray, budget: int, granule: int, exact: np.ndarray) -> np.ndarray:
    """"metric_mass"'s quotas in whole GEMM tiles (as :func:`_level`'s with a granule): each capped expert
    (q_e < n_e) of at least one tile keeps floor(q_e / g) g; the pairs that frees go back, a whole tile each (or all
    of an expert's pairs, if fewer), to the experts that lost the most of their ``exact`` share, while they fit; what
    is still left fills the experts under one tile (whose one partial tile is paid anyway) up to a tile or their
    n_e. Within the budget; a fixed quota >= 1 per expert with pairs, so the gradient stays unbiased."""
    base = np.where((qv >= granule) & (qv < nv), qv - qv % granule, qv)
    left = budget - int(base.sum())
    cut = np.flatnonzero(base != qv)
    cut = cut[np.argsort(-(exact - base)[cut], kind="stable")]  # most lost first, ties: lower index
    step = np.minimum(granule, nv[cut] - base[cut])
    # each in turn takes its step where it still fits: the leading run that fits at once, then (the rest being
    # over what is left, which is under a tile) only the partial steps of experts near their n_e can
    fits = int(np.searchsorted(np.cumsum(step), left, side="right"))
    base[cut[:fits]] += step[:fits]
    left -= int(step[:fits].sum())
    for e, s in zip(cut[fits:].tolist(), step[fits:].tolist()):
        if s <= left:
            base[e] += s
            left -= s
    under = np.flatnonzero(base < np.minimum(nv, granule))
    for e in under[np.argsort((base - exact)[under], kind="stable")].tolist():
        if left <= 0:
            break
        s = min(left, min(int(nv[e]), granule) - int(base[e]))
        base[e] += s
        left -= s
    return base


def mass_weights(mass: torch.Tensor, counts: torch.Tensor) -> Optional[torch.Tensor]:
    """[E] fp64: "metric_mass"'s weights, a pair's mean metric per expert (summed metric ``mass`` over ``counts``
    pairs, one backward's); an expert without pairs there takes the layer's mean; None where the mass is all 0."""
    mass = mass.detach().double().cpu()
    total = float(mass.sum())
    if total <= 0:
        return None
    m, n = mass.numpy(), counts.detach().cpu().numpy().astype(np.float64)
    return torch.from_numpy(np.where(n > 0, m / np.maximum(n, 1.0), total / n.sum()))


ALLOCATIONS = {"waterfill": _level, "proportional": _scale, "metric_mass": _mass_fill}


def quota_granule(device: torch.device) -> int:
    """Rows per tile of the backward's grouped GEMMs on ``device``: 64 on CUDA (the H200's 64-row forward/dgrad
    tiles, the wgrad's 64-deep K step), where the water-fill and "metric_mass" keep whole tiles of each capped
    expert; 1 (any count) elsewhere, where nothing is tiled. LRMOE_QUOTA_GRANULE overrides it on CUDA (1: off, for
    A/B timings)."""
    return int(os.environ.get("LRMOE_QUOTA_GRANULE", "64")) if device.type == "cuda" else 1


def plan_quotas(counts: torch.Tensor, retention_ratio: float = 1.0, ep_size: int = 1, floor: float = 0.0,
                balance_factor: float = float("inf"), max_rows_per_rank: Optional[int] = None,
                allocation: Literal["waterfill", "proportional", "metric_mass"] = "waterfill", granule: int = 1,
                generator: Optional[torch.Generator] = None, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Q_e, the pairs of each expert whose backward runs.

    counts [E] int (n_e over the expert-parallel group; expert e lives on rank e // (E / ep_size)).
    1. target, by ``allocation``: "waterfill" gives one cap c for all experts, the largest with
       sum_e min(n_e, c) <= ratio * sum_e n_e (cold experts keep every pair, the hottest are capped
       first); "proportional" keeps the same fraction of every expert's pairs;
    2. per rank, if its retained rows exceed max_rows_per_rank, or (when anything was dropped)
       balance_factor times the mean over ranks, its own experts' quotas are cut the same way;
    3. floor: Q_e >= ceil(floor * n_e), whatever the caps.
    Ratio 1 with no budget gives Q = n (exact). granule: the water-fill's and "metric_mass"'s capped quotas in whole
    GEMM tiles (:func:`_level`, :func:`_whole_tiles`; the layer passes :func:`quota_granule`); "proportional"
    ignores it. generator: "proportional"'s target rounded by sampling (:func:`_scale`, :func:`quota_weights`); its
    per-rank cuts under a memory cap stay in the fixed order (a hard limit, where an expert rounded down to 0 stays
    out). weights [E]: "metric_mass"'s mean metric per pair of each expert (:func:`_mass_fill`); its per-rank cuts
    are the water-fill's.
    """
    if allocation not in ALLOCATIONS:
        raise ValueError(f"unknown quota allocation {allocation!r}; accepted: {', '.join(ALLOCATIONS)}")
    if allocation == "metric_mass" and weights is None:
        raise ValueError('quota allocation "metric_mass" needs the experts\' weights (a pair\'s mean metric)')
    if not 0.0 < retention_ratio <= 1.0:
        raise ValueError(f"retention_ratio must be in (0, 1], got {retention_ratio}")
    n = counts.detach().long().cpu()
    if n.numel() % ep_size:
        raise ValueError(f"{n.numel()} experts cannot be split over ep_size {ep_size}")
    # in numpy, once converted: this runs in every training forward, on the host's critical path
    nv = _counts_np(n)
    budget = target_pairs(retention_ratio, int(nv.sum()))
    if allocation == "proportional":
        q = _counts_np(_scale(n, budget, generator))
    elif allocation == "metric_mass":
        q = _mass_fill_np(nv, budget, np.asarray(weights.detach().cpu(), dtype=np.float64), granule)
    else:
        q = _level_np(nv, budget, granule)
    per_rank = q.reshape(ep_size, -1)
    caps = [float("inf")] * ep_size
    if max_rows_per_rank is not None:
        caps = [max_rows_per_rank] * ep_size
    if ep_size > 1 and not np.array_equal(q, nv):
        mean = float(per_rank.sum()) / ep_size
        bound = balance_factor * mean  # (a finite factor can still overflow: no bound then)
        caps = [min(c, math.floor(bound)) if math.isfinite(bound) else c for c in caps]
    for r, cap in enumerate(caps):
        if math.isfinite(cap) and int(per_rank[r].sum()) > cap:
            # a rank over its cap is cut by the water-fill ("proportional": the same fraction, in the fixed order)
            per_rank[r] = _counts_np(_scale(torch.from_numpy(per_rank[r]), int(cap))) \
                if allocation == "proportional" else _level_np(per_rank[r], int(cap), granule)
    if floor > 0:
        q = np.maximum(q, np.minimum(nv, _counts_np(floor_pairs(floor, n))))
    return torch.from_numpy(q).view_as(n)


def rank_shares(quotas: torch.Tensor, all_counts: torch.Tensor,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Each source rank's share of every expert's quota, in proportion to its pairs of that expert.

    quotas [E], all_counts [R, E] (pairs from rank r to expert e) -> shares [R, E] with
    sum_r shares[r, e] = Q_e and shares <= all_counts: floor(Q_e c_re / n_e) plus one for some ranks, as many
    as the fractional parts add up to. Host-side. Without ``generator``: to the ranks of largest fractional part
    (ties: lower rank). With it (the same generator state on every rank): by systematic sampling, one offset per
    expert, so that rank r gets its extra pair with probability exactly its fractional part f_re. A rank whose
    whole part is 0 then still has its pairs in the backward in expectation: :func:`share_weights` gives the
    1 / f_re its kept pair is weighted by, keeping the gradient unbiased (the fixed order would leave the same
    small groups out step after step).
    """
    if all_counts.shape[0] == 1:  # one rank holds every pair: its share is the whole quota
        return torch.minimum(quotas.detach().long().cpu(), all_counts[0].detach().long().cpu()).view(1, -1)
    c = all_counts.detach().long().cpu()
    q = torch.minimum(quotas.detach().long().cpu(), c.sum(0))
    n = c.sum(0).clamp_min(1)
    scaled = q.unsqueeze(0) * c                                  # [R, E]
    base, frac = scaled // n, scaled % n
    if generator is not None:
        # integer points k n + U (U uniform in [0, n_e)) falling in rank r's stretch [A_{r-1}, A_r) of the fractions
        offset = (torch.rand(n.shape, generator=generator, dtype=torch.float64) * n).long().clamp_max(n - 1)
        return base + _sampled_extras(frac, n, offset)
    remainder = q - base.sum(0)                                  # [E], < number of ranks with frac > 0
    R = c.shape[0]
    # order ranks by fractional part, descending, ties by rank: a stable sort of -frac
    order = torch.sort(-frac, dim=0, stable=True).indices        # [R, E]
    bonus = (torch.arange(R).unsqueeze(1) < remainder.unsqueeze(0)).long()
    return base + torch.zeros_like(base).scatter_(0, order, bonus)


def _sampled_extras(frac: torch.Tensor, den, offset) -> torch.Tensor:
    """Systematic sampling along dim 0: entry i gets 1 where a point k den + offset (k integer) falls in its stretch
    [F_{i-1}, F_i) of the cumulated fractions frac (integers in [0, den)), else 0: with offset uniform in [0, den),
    probability exactly frac_i / den, and as many ones as the fractions add up to (a whole number of den)."""
    ends = frac.cumsum(0)
    return _ceil_div(ends - offset, den) - _ceil_div(ends - frac - offset, den)


def _ceil_div(a: torch.Tensor, b) -> torch.Tensor:
    return -torch.div(-a, b, rounding_mode="floor")


def share_weights(quotas: torch.Tensor, all_counts: torch.Tensor, shares: torch.Tensor) -> Optional[torch.Tensor]:
    """[R, E] fp32: 1 / f_re for a (rank, expert) whose share's whole part is 0 and whose sampled share is 1
    (:func:`rank_shares` with a generator: it got that pair with probability f_re), 1 elsewhere; None where no
    group is such (then every kept pair's own weight is already unbiased)."""
    if all_counts.shape[0] == 1:
        return None
    c = all_counts.detach().long().cpu()
    q = torch.minimum(quotas.detach().long().cpu(), c.sum(0))
    n = c.sum(0).clamp_min(1)
    scaled = q.unsqueeze(0) * c
    return _inverse_inclusion(scaled, n, (scaled < n) & (shares.cpu() > 0))


def _inverse_inclusion(scaled: torch.Tensor, den, lucky: torch.Tensor) -> Optional[torch.Tensor]:
    """den / scaled where ``lucky`` (a count sampled up to 1 from a whole part of 0, with probability scaled / den),
    1 elsewhere, fp32; None where nothing is lucky."""
    if not bool(lucky.any()):
        return None
    return torch.where(lucky, den / scaled.clamp_min(1).double(), torch.ones((), dtype=torch.float64)).float()


class RetentionStats:
    """One training forward of one layer, as the planner and the monitor see it (host tensors).

    counts [E]: n_e over the expert-parallel group, or the HostCopy of the counts from each rank [R, E]
        (summed when first read: a forward that keeps every pair passes the copy it started, so that nothing
        waits for it until the planner or the monitor asks).  quotas [E]: Q_e, or None: every pair kept.
    rows_per_rank / retained_per_rank [R]: routed / retained rows at each expert-parallel rank.
    policy, dropped_router_dots: the activation policy and the dropped pairs' router dots used.
    stash_bytes_per_row / recompute_bytes_per_row: what the forward keeps per routed row under "stash" / "recompute"
    (quotas.expert_row_bytes), the expert outputs included where the configured router gradient keeps them;
    lean_stash_bytes_per_row: under "stash" with the dots recomputed instead, where "auto" may choose that (else None).
    capped_bytes_per_row: (stash, lean stash or None, recompute) per row in a step under a row cap, where this step
    had none (pairs may drop under one, which changes what is kept); None: this step's own.
    backward_bytes_per_row: the expert backward's buffers per retained row (under this policy).
    replica_rows: retained rows that run on replicas (``replica_slots``), over all ranks.
    Under the "threshold" allocation the quotas are caps and the backward counts what it keeps
    (:meth:`set_kept`); :meth:`retained` is then that count.
    """

    def __init__(self, counts, quotas, rows_per_rank: torch.Tensor, retained_per_rank: torch.Tensor, policy: str,
                 stash_bytes_per_row: int, backward_bytes_per_row: int, replica_rows: int = 0,
                 recompute_bytes_per_row: int = 0, lean_stash_bytes_per_row: Optional[int] = None,
                 dropped_router_dots: str = "saved",
                 capped_bytes_per_row: Optional[Tuple[int, Optional[int], int]] = None):
        self._counts, self._quotas = counts, quotas
        self.rows_per_rank, self._retained_per_rank = rows_per_rank, retained_per_rank
        self.policy, self.stash_bytes_per_row, self.backward_bytes_per_row = policy, stash_bytes_per_row, \
            backward_bytes_per_row
        self.recompute_bytes_per_row, self.lean_stash_bytes_per_row = recompute_bytes_per_row, lean_stash_bytes_per_row
        self.dropped_router_dots, self.capped_bytes_per_row = dropped_router_dots, capped_bytes_per_row
        self.replica_rows = replica_rows
        self.kept: Optional[HostCopy] = None

    def held_bytes_per_row(self, policy: str, dropped_router_dots: str = "saved", capped: bool = False) -> int:
        """What the forward keeps per routed row under ``policy``, with the dots ``dropped_router_dots`` where
        "auto" leaves that open: in this step, or (``capped``) in a step under a row cap."""
        stash, lean, recompute = self.stash_bytes_per_row, self.lean_stash_bytes_per_row, self.recompute_bytes_per_row
        if capped and self.capped_bytes_per_row is not None:
            stash, lean, recompute = self.capped_bytes_per_row
        if policy != "stash":
            return recompute
        return lean if dropped_router_dots == "recomputed" and lean is not None else stash

    @property
    def counts(self) -> torch.Tensor:
        if isinstance(self._counts, HostCopy):
            self._counts = self._counts.get().sum(0)
        return self._counts

    @property
    def quotas(self) -> torch.Tensor:
        if self._quotas is None:
            self._quotas = self.counts.clone()
        return self._quotas

    @property
    def retained_per_rank(self) -> torch.Tensor:
        """[R] retained rows at each expert-parallel rank: the backward's count where it chose them (the "threshold"
        allocation, whose quotas are only caps), else the planned one."""
        if self.kept is None:
            return self._retained_per_rank
        return self.kept.get().view(len(self._retained_per_rank), -1).sum(1)

    def set_kept(self, kept: torch.Tensor) -> None:
        """The backward's kept pairs per expert [E]; copied to the host without waiting (read when asked for)."""
        self.kept = HostCopy(kept)

    def retained(self) -> torch.Tensor:
        """[E] retained pairs per expert: the backward's count where it chose them, else the quotas."""
        return self.quotas if self.kept is None else self.kept.get()


def expert_row_bytes(hidden: int, ffn: int, activation: str, element_size: int, k: int, stash_x_per_token: bool,
                     outputs_kept: Tuple[bool, bool]):
    """(bytes the forward keeps per routed row under "stash", the same under "recompute", the backward's buffer
    bytes per retained row) of a grouped expert MLP with top-``k`` routing.

    stash keeps x [H] and the pre-activation h [F1] (F1 = 2F for SwiGLU) per row, or each token's x once for its k
    rows (``stash_x_per_token``: one rank, pairs may drop; see RoutedMLP); recompute keeps each token's x once. Where
    ``outputs_kept`` (for stash, for recompute) the forward also keeps each row's expert output y [H], which the exact
    router gradient reads (pipeline.router_dots_from_rows says where it does not). The backward holds per retained row
    dy [H], x and h (gathered or recomputed), a [F], da [F], dh [F1] and dx [H].
    """
    f1 = 2 * ffn if activation == "swiglu" else ffn
    x_row, x_share = hidden * element_size, -(-hidden * element_size // k)  # ceil: never below what is kept
    y_row = hidden * element_size
    stash = (x_share if stash_x_per_token else x_row) + f1 * element_size + (y_row if outputs_kept[0] else 0)
    recompute = x_share + (y_row if outputs_kept[1] else 0)
    return stash, recompute, (3 * hidden + 2 * f1 + 2 * ffn) * element_size
