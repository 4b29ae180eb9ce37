"""Quota-aware retention: which routed pairs the expert backward keeps, and with what weight.

Priority sampling (the default): key_p = m_p / u_p with u_p ~ U(0, 1] from a seeded generator; keep
the q_g largest keys of each group; weight each kept pair by max(1, tau_g / m_p), tau_g being the
(q_g+1)-th largest key (weight 1 for all where q_g >= n_g: exact). The weighted kept terms are an
unbiased estimate of the group's full gradient. Deterministic top-k by m_p is kept as an ablation
only: its gradient is biased and training with it collapsed (DESIGN.md).
"""
from dataclasses import dataclass
from typing import Callable, List, Literal, Optional

import torch

from lrmoe_ds import ops
from lrmoe_ds.ops import reference
from lrmoe_ds.placement import ReplicaPlan

Metric = Literal["grad_norm", "gate", "uniform"]
Selection = Literal["priority_sampling", "topk"]


@dataclass
class BackwardSpec:
    """How one layer call's expert backward runs; made in the forward, read in the backward.

    policy: "stash" or "recompute".  router_grad: "exact" or "retained".  dropped_router_dots: "saved" or
        "recomputed" (LRMoEConfig.dropped_router_dots).
    shares [R, E] int64 host or None: retained pairs from each source rank to each expert (None:
        every pair is kept, the exact backward). Set after the forward has queued its kernels.
    may_drop: whether the quotas can drop a pair (the forward then keeps ||x_t|| for the metric).
    metric, selection, rescale, seed: the sampling (the seed differs per layer, step and rank).
    record: a dict the backward fills with its selection (``kept``, ``scale``, ``pairs``), or None.
    replicas: where the retained rows run when some run on replicas (set with ``shares``), or None: at home.
    totals: per source rank, the pairs to keep over all experts ("threshold" allocation; ``shares`` are
        then per-expert caps), or None.  on_kept: called with the kept pairs per expert over the
        expert-parallel group [E] where the backward chose them (``totals``).
    share_weights [R, E] or None: the factor each kept pair's weight takes for its (rank, expert) share having been
        sampled (quotas.share_weights); None: 1 for all.  on_mass: called with every expert's metric mass over the
        group [E] (fp32, on the device) where the backward made it (the "metric_mass" allocation's next quotas).
    """
    policy: str = "stash"
    router_grad: str = "exact"
    shares: Optional[torch.Tensor] = None
    may_drop: bool = False
    metric: Metric = "grad_norm"
    selection: Selection = "priority_sampling"
    rescale: bool = True
    seed: int = 0
    record: Optional[dict] = None
    replicas: Optional[ReplicaPlan] = None
    totals: Optional[List[int]] = None
    on_kept: Optional[Callable[[torch.Tensor], None]] = None
    dropped_router_dots: str = "saved"
    share_weights: Optional[torch.Tensor] = None
    on_mass: Optional[Callable[[torch.Tensor], None]] = None


_generators = {}  # one per device, reseeded for every selection (cheaper than a new one each time)


def _generator(device: torch.device, seed: int) -> torch.Generator:
    gen = _generators.get(device)
    if gen is None:
        gen = _generators[device] = torch.Generator(device=device)
    return gen.manual_seed(seed)


def select_retained(metric: torch.Tensor, group_sizes: torch.Tensor, quotas: torch.Tensor,
                    selection: Selection = "priority_sampling", seed: int = 0, num_kept: Optional[int] = None,
                    total: Optional[int] = None):
    """Choose the retained pairs of each group.

    metric [P] (pairs in grouped order), group_sizes [G], quotas [G].
    Returns kept [P'] (grouped positions, grouped order), scale [P'] fp32 (the unbiased weights;
    ones for "topk"), kept_sizes [G] (device). num_kept: sum_g min(quota, size) where known (no host read on
    CUDA). The keys, the selection and the weights are one op (``ops.priority_sample``).

    total (the "threshold" allocation): keep ``total`` pairs over all groups, the largest keys among those
    within their group's quota (the quotas are then caps), so that a group keeps as many pairs as its
    metric mass earns. A kept pair's threshold is the larger of its group's and the overall one: each is
    the order statistic of the other pairs' keys that the pair had to beat, so the weights stay unbiased.
    """
    u = None if selection == "topk" else torch.rand(metric.shape, generator=_generator(metric.device, seed),
                                                    device=metric.device)
    kept, scale, kept_sizes, _ = ops.priority_sample(metric, group_sizes, quotas, u, num_kept)
    if total is not None and total < kept.numel():
        # the kept pairs' keys, as priority_sample made them
        keys = reference.priority_keys(metric.index_select(0, kept), None if u is None else u.index_select(0, kept))
        one_group = torch.full((1,), kept.numel(), dtype=torch.long, device=kept.device)  # a fill: no host copy
        among, _, tau_all = ops.topk_retention(keys, one_group, torch.full_like(one_group, total), total)
        kept, scale = kept.index_select(0, among), scale.index_select(0, among)
        if u is not None:  # max(1, tau_g / m, tau_all / m): the larger of the two thresholds the pair beat
            m = metric.index_select(0, kept)
            scale = torch.maximum(scale, tau_all / m.clamp_min(torch.finfo(m.dtype).tiny))
        ends = group_sizes.to(kept.device).cumsum(0)
        group = torch.bucketize(kept, ends, right=True)  # a scatter, not bincount: on CUDA that reads its max back
        kept_sizes = torch.zeros(group_sizes.numel(), dtype=torch.long, device=kept.device).scatter_add_(
            0, group, torch.ones_like(group))
    return kept, scale, kept_sizes
