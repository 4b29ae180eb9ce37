"""Quota-aware retention: which routed pairs the expert backward keeps, and with what weight.

Priority sampling (the default): key_p = m_p / u_p with u_p ~ U(0, 1] from a seeded generator; keep
the q_g largest keys of each group; weight each kept pair by max(1, tau_g / m_p), tau_g being the
(q_g+1)-th largest key (weight 1 for all where q_g >= n_g: exact). The weighted kept terms are an
unbiased estimate of the group's full gradient. Deterministic top-k by m_p is kept as an ablation
only: its gradient is biased and training with it collapsed (DESIGN.md).
"""
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from lrmoe_ds import ops

Metric = Literal["grad_norm", "gate", "uniform"]
Selection = Literal["priority_sampling", "topk"]


@dataclass
class RetentionSpec:
    """Per-call retention settings, made in the forward and read in the backward.

    quotas [G] int64: pairs of each local group whose backward runs.
    row_gate [M] or None: gate weight of each grouped row (the "gate" metric needs it).
    seed: the seed of this call's sampling (differs per layer, step and rank).
    """
    quotas: torch.Tensor
    metric: Metric
    selection: Selection
    seed: int
    row_gate: Optional[torch.Tensor] = None


def pair_metric(dy: torch.Tensor, x: torch.Tensor, spec: RetentionSpec) -> torch.Tensor:
    """m_p for each grouped row: ||dy_p|| ||x_p|| (the size of p's rank-1 term in the expert's weight
    gradient; dy_p already carries the gate weight), the gate weight, or 1."""
    if spec.metric == "grad_norm":
        return dy.float().norm(dim=1) * x.float().norm(dim=1)
    if spec.metric == "gate":
        if spec.row_gate is None:
            raise ValueError("the 'gate' retention metric needs the gate weight of every row")
        return spec.row_gate.float()
    return torch.ones(dy.shape[0], device=dy.device)


def select_retained(dy: torch.Tensor, x: torch.Tensor, group_sizes: torch.Tensor, spec: RetentionSpec):
    """Choose the retained rows of a grouped backward.

    dy [M, N], x [M, H] grouped rows; group_sizes [G].
    Returns kept [M'] (grouped positions, grouped order), scale [M'] fp32, kept_sizes [G].
    """
    metric = pair_metric(dy, x, spec)
    if spec.selection == "topk":
        kept, kept_sizes, _ = ops.topk_retention(metric, group_sizes, spec.quotas)
        return kept, torch.ones(kept.numel(), device=dy.device), kept_sizes
    gen = torch.Generator(device=dy.device).manual_seed(spec.seed)
    u = 1.0 - torch.rand(metric.shape, generator=gen, device=dy.device)  # (0, 1]
    keys = metric / u
    kept, kept_sizes, tau = ops.topk_retention(keys, group_sizes, spec.quotas)
    m = metric.index_select(0, kept)
    tau_row = torch.repeat_interleave(tau, kept_sizes, output_size=kept.numel())
    # tau = 0 means the whole group is kept: weight 1. Where tau > 0 a kept key is >= tau > 0, so m > 0.
    scale = torch.where(tau_row > 0, torch.clamp(tau_row / m.clamp_min(torch.finfo(m.dtype).tiny), min=1.0),
                        torch.ones_like(m))
    return kept, scale, kept_sizes


def water_fill_quotas(counts: torch.Tensor, retention_ratio: float) -> torch.Tensor:
    """Quotas from above: cold experts keep every pair, the hottest are capped first.

    counts [E] int64 (n_e, host-side). Returns Q_e = min(n_e, c) with the largest integer cap c
    such that sum_e Q_e <= retention_ratio * sum_e n_e (ratio 1: Q = n, exact).
    """
    if not 0.0 < retention_ratio <= 1.0:
        raise ValueError(f"retention_ratio must be in (0, 1], got {retention_ratio}")
    if retention_ratio >= 1.0:
        return counts.long().cpu().clone()
    n = counts.long().cpu()
    budget = int(retention_ratio * int(n.sum()))
    lo, hi = 0, int(n.max()) if n.numel() else 0
    while lo < hi:  # largest c with sum(min(n, c)) <= budget
        mid = (lo + hi + 1) // 2
        if int(torch.minimum(n, torch.tensor(mid)).sum()) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return torch.minimum(n, torch.tensor(lo))
