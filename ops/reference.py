"""Torch reference implementations of every op: the CPU path, and the oracle the CUDA ops are
tested against. One implementation per op; nothing else in the project re-implements them.

Shape letters: T tokens, H hidden, N/K a GEMM's output/reduction size, G groups (experts or expert
instances), P pairs (token-expert assignments), I expert instances.

The references may read sizes to the host (a CPU loop over groups needs them); the CUDA ops may not.
"""
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F


def routing_plan(group_of_pair: torch.Tensor, num_groups: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group pairs by destination.

    Args:
        group_of_pair: [P] int, destination group of each pair, in [0, num_groups).
    Returns:
        counts [G] int64, pairs per group;
        order [P] int64, a stable permutation: order[i] is the pair at grouped position i
            (pairs of group 0 first, each group in pair order);
        offsets [G+1] int64, group g occupies grouped positions offsets[g]:offsets[g+1].
    """
    group_of_pair = group_of_pair.reshape(-1).long()
    counts = torch.bincount(group_of_pair, minlength=num_groups)
    order = torch.argsort(group_of_pair, stable=True)
    offsets = torch.zeros(num_groups + 1, dtype=torch.long, device=group_of_pair.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return counts, order, offsets


def permute(x: torch.Tensor, row_index: torch.Tensor, row_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Row gather into grouped order: out[i] = x[row_index[i]] (* row_scale[i], rounded to x's dtype first).
    x [T, H], row_index [P], row_scale [P] or None -> [P, H]."""
    out = x.index_select(0, row_index.reshape(-1).long())
    return out if row_scale is None else out * row_scale.reshape(-1, 1).to(x.dtype)


def unpermute(rows: torch.Tensor, row_of_pair: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Weighted combine: out[t] = sum_k weight[t, k] * rows[row_of_pair[t, k]].

    A gather then a fixed-order sum over k, so it is deterministic (no scatter atomics).
    rows [P, H], row_of_pair [T, K] int, weight [T, K] -> [T, H] in rows' dtype; the sum runs in
    the wider of rows' and weight's dtypes. row_of_pair[t, k] = -1: the pair has no row and adds
    nothing (whatever its weight).
    """
    acc = torch.promote_types(rows.dtype, weight.dtype)
    gathered, missing = _pair_rows(rows, row_of_pair)
    weight = weight.masked_fill(missing, 0)  # a zero row with weight 0 for the pairs that have none
    return torch.einsum("tkh,tk->th", gathered.to(acc), weight.to(acc)).to(rows.dtype)


def _pair_rows(rows: torch.Tensor, row_of_pair: torch.Tensor):
    """(rows gathered per pair [T, K, H], missing [T, K]): a zero row where row_of_pair is -1."""
    T, K = row_of_pair.shape
    index = row_of_pair.reshape(-1).long()
    missing = index < 0
    if bool(missing.any()):
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[-1])])
        index = torch.where(missing, rows.shape[0] - 1, index)
    return rows.index_select(0, index).view(T, K, rows.shape[-1]), missing.view(T, K)


def unpermute_weight_grad(rows: torch.Tensor, row_of_pair: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`unpermute` with respect to its weights: out[t, k] = <rows[row_of_pair[t, k]], dout[t]>.

    rows [P, H], row_of_pair [T, K] int (-1: no row, gives 0), dout [T, H] -> [T, K] in the wider of
    rows' dtype and float32 (the sum runs in it)."""
    acc = torch.promote_types(rows.dtype, torch.float32)
    gathered, _ = _pair_rows(rows, row_of_pair)
    return torch.einsum("tkh,th->tk", gathered.to(acc), dout.to(acc))


def unpermute_backward(rows: torch.Tensor, row_of_pair: torch.Tensor, weight: torch.Tensor,
                       dout: torch.Tensor, d_row_of_pair: Optional[torch.Tensor] = None,
                       num_d_rows: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gradients of :func:`unpermute` with respect to its rows and its weights: (d_rows, d_weight [T, K]).

    d_rows[row_of_pair[t, k]] = weight[t, k] * dout[t] (rounded as :func:`permute` rounds its scaled rows),
    d_weight = :func:`unpermute_weight_grad`. Every row must be the row of exactly one pair (P = T K, row_of_pair
    a permutation of [0, P): the inverse of a routing plan's order), so that d_rows [P, H] is written whole.

    ``d_row_of_pair`` [T, K] (with ``num_d_rows``): d_rows [num_d_rows, H] goes by this map instead, a pair at -1
    getting no row (a backward that keeps only some pairs: their dy rows, compacted, from the same read of dout);
    its other entries must hold each of [0, num_d_rows) once. row_of_pair then only names the rows d_weight
    reads, -1 allowed (d_weight 0), as in :func:`unpermute_weight_grad`."""
    T, K = row_of_pair.shape
    if (d_row_of_pair is None) != (num_d_rows is None):
        raise ValueError("unpermute_backward: d_row_of_pair and num_d_rows come together")
    if d_row_of_pair is None:
        d_row_of_pair, num_d_rows = row_of_pair, rows.shape[0]
        what = f"every row must be the row of exactly one pair: row_of_pair {tuple(row_of_pair.shape)} must hold " \
               f"each of rows' indices [0, {rows.shape[0]}) once"
    else:
        if d_row_of_pair.shape != row_of_pair.shape:
            raise ValueError(f"unpermute_backward: d_row_of_pair must be [T, K] = {tuple(row_of_pair.shape)}, got "
                             f"{tuple(d_row_of_pair.shape)}")
        what = f"d_row_of_pair must hold each of [0, {num_d_rows}) once, and -1 elsewhere"
    index = d_row_of_pair.reshape(-1).long()
    given = index >= 0
    if bool((index < -1).any()) or bool((index >= num_d_rows).any()) or int(given.sum()) != num_d_rows or \
            not bool((torch.bincount(index[given], minlength=num_d_rows) == 1).all()):
        raise ValueError(f"unpermute_backward: {what}")
    pairs = torch.arange(T * K, device=index.device)[given]
    pair_of_row = torch.empty(num_d_rows, dtype=torch.long, device=index.device).index_copy_(0, index[given], pairs)
    d_rows = permute(dout, pair_of_row // K, weight.reshape(-1).index_select(0, pair_of_row))
    return d_rows, unpermute_weight_grad(rows, row_of_pair, dout)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """SwiGLU of the up-projection's output h [M, 2F] (gate columns first): silu(gate) * up -> [M, F].
    Plain torch, so it is also the differentiable version the expert modules use."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def row_dots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[M] <a_m, b_m> of two [M, N] tensors, summed in the wider of a's dtype and float32."""
    acc = torch.promote_types(a.dtype, torch.float32)
    return (a.to(acc) * b.to(acc)).sum(1)


def _indexed_rows(name: str, h: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """h's rows index[m] (an index out of h's rows raises in index_select)."""
    if index.dim() != 1 or index.dtype != torch.int64:
        raise ValueError(f"{name}: index must be int64 [M], got {index.dtype} {tuple(index.shape)}")
    return h.index_select(0, index)


def swiglu_backward(h: torch.Tensor, da: torch.Tensor, inplace: bool = False, with_activation: bool = False,
                    index: Optional[torch.Tensor] = None, with_dot: bool = False):
    """dh [M, 2F] of :func:`swiglu` from h and da [M, F]; computed in the wider of h's dtype and float32.

    ``inplace``: dh is written over h (h's values are read first) and h is returned: the backward's
    buffers need not hold both. ``with_activation``: returns (dh, a), a = swiglu(h) from the same h (the
    backward recomputes it for the down projection's weight gradient). ``index`` [M] (int64): the rows
    of h [Mh, 2F] to read, output row m from h[index[m]] (the retained rows of a stash, without a copy
    of them first); not with ``inplace``. ``with_dot`` (with ``with_activation``): returns (dh, a, dot), dot [M] =
    <a_m, da_m> of the rounded a, summed in the wider of h's dtype and float32 (the router gradient's <y_m, dy_m>,
    as y = a W2^T and da = dy W2)."""
    if index is not None:
        if inplace:
            raise ValueError("swiglu_backward: inplace writes over h's own rows; it takes no index")
        h = _indexed_rows("swiglu_backward", h, index)
    acc = torch.promote_types(h.dtype, torch.float32)
    gate, up = h.to(acc).chunk(2, dim=-1)
    da = da.to(acc)
    s = torch.sigmoid(gate)
    dh = torch.cat([da * up * s * (1 + gate * (1 - s)), da * gate * s], dim=-1).to(h.dtype)
    a = swiglu(h) if with_activation else None
    dot = row_dots(a, da) if with_dot else None
    if inplace:
        dh = h.copy_(dh)
    return (dh, a, dot) if with_dot else (dh, a) if with_activation else dh


def swiglu_dot(h: torch.Tensor, dz: torch.Tensor, index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[M] <swiglu(h)_m, dz_m>, a rounded to h's dtype and summed as :func:`row_dots` does: :func:`swiglu_backward`'s
    dot alone. ``index`` [M] int64: h's rows index[m] (h [Mh, 2F])."""
    if index is not None:
        h = _indexed_rows("swiglu_dot", h, index)
    if h.dim() != 2 or h.shape[1] % 2 or tuple(dz.shape) != (h.shape[0], h.shape[1] // 2):
        raise ValueError(f"swiglu_dot: h must be [M, 2F] and dz [M, F], got {tuple(h.shape)} and {tuple(dz.shape)}")
    return row_dots(swiglu(h), dz)


def _group_slices(group_sizes: torch.Tensor):
    start = 0
    for g, n in enumerate(group_sizes.tolist()):  # host read: the reference loops on the CPU
        yield g, start, start + n
        start += n


def grouped_linear(x: torch.Tensor, weights: Sequence[torch.Tensor], group_sizes: torch.Tensor) -> torch.Tensor:
    """Segmented GEMM forward, nn.Linear layout: out_g = x_g @ W_g^T.

    x [M, K] in grouped order, weights: G tensors [N, K], group_sizes [G] (sum = M) -> [M, N].
    """
    _check_groups(x, weights, group_sizes, dim=1)
    out = x.new_empty(x.shape[0], weights[0].shape[0])
    for g, a, b in _group_slices(group_sizes):
        torch.matmul(x[a:b], weights[g].t(), out=out[a:b])
    return out


def grouped_linear_dgrad(dy: torch.Tensor, weights: Sequence[torch.Tensor], group_sizes: torch.Tensor) -> torch.Tensor:
    """Segmented GEMM dgrad: dx_g = dy_g @ W_g.   dy [M, N], weights: G tensors [N, K] -> [M, K]."""
    _check_groups(dy, weights, group_sizes, dim=0)
    out = dy.new_empty(dy.shape[0], weights[0].shape[1])
    for g, a, b in _group_slices(group_sizes):
        torch.matmul(dy[a:b], weights[g], out=out[a:b])
    return out


def grouped_linear_wgrad(dy: torch.Tensor, x: torch.Tensor, group_sizes: torch.Tensor,
                         out: Optional[Sequence[torch.Tensor]] = None, accumulate: bool = False):
    """Segmented GEMM wgrad (variable reduction size): dW_g = dy_g^T @ x_g.

    dy [M, N], x [M, K], group_sizes [G]. Writes into ``out`` (G tensors [N, K], or one stacked [G, N, K])
    when given, adding to what is there when ``accumulate``; an empty group gives zeros (or leaves ``out``
    unchanged when accumulating). Returns the G gradients (``out`` itself when it is one stacked tensor).
    """
    if dy.shape[0] != x.shape[0]:
        raise ValueError(f"grouped_linear_wgrad: dy has {dy.shape[0]} rows but x has {x.shape[0]}")
    G = group_sizes.numel()
    if out is None:
        out = [dy.new_zeros(dy.shape[1], x.shape[1]) for _ in range(G)]
    elif len(out) != G:
        raise ValueError(f"grouped_linear_wgrad: {len(out)} output tensors for {G} groups")
    for g, a, b in _group_slices(group_sizes):
        grad = dy[a:b].t().to(out[g].dtype) @ x[a:b].to(out[g].dtype)
        if accumulate:
            out[g].add_(grad)
        else:
            out[g].copy_(grad)
    return out if isinstance(out, torch.Tensor) else list(out)


def split_groups(buffer: torch.Tensor):
    """G tensors viewing the groups of buffer [G, ...] (detached: no autograd)."""
    return list(buffer.detach().unbind(0))


def _check_groups(x, weights, group_sizes, dim):
    if len(weights) != group_sizes.numel():
        raise ValueError(f"{len(weights)} weights for {group_sizes.numel()} groups")
    if x.dim() != 2 or (len(weights) and x.shape[1] != weights[0].shape[dim]):
        raise ValueError(f"input of shape {tuple(x.shape)} does not match weights of shape "
                         f"{tuple(weights[0].shape) if len(weights) else ()}")


def topk_retention(scores: torch.Tensor, group_sizes: torch.Tensor, quotas: torch.Tensor,
                   num_kept: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quota-aware top-k: in each group keep the q_g pairs of highest score, ties by position.

    Args:
        scores: [P] float, pairs in grouped order.
        group_sizes: [G] int, n_g (sum = P).  quotas: [G] int >= 0.
    Returns:
        kept [P'] int64: grouped positions of the kept pairs, in grouped order (each group's kept
            pairs ascending by position), P' = sum_g min(q_g, n_g);
        kept_sizes [G] int64: min(q_g, n_g);
        threshold [G] float: the (q_g+1)-th largest score of group g, 0 where q_g >= n_g
            (priority sampling's tau).
    """
    if scores.dim() != 1 or scores.numel() != int(group_sizes.sum()):
        raise ValueError(f"topk_retention: {scores.numel()} scores for groups summing to {int(group_sizes.sum())}")
    if (quotas < 0).any():
        raise ValueError("topk_retention: quotas must be >= 0")
    kept, thresholds = [], []
    for g, a, b in _group_slices(group_sizes):
        q = min(int(quotas[g]), b - a)
        s = scores[a:b]
        # descending by score, ties by position: sort positions by (-score) stably
        rank = torch.sort(-s, stable=True).indices
        kept.append(torch.sort(rank[:q]).values + a)
        thresholds.append(s[rank[q]] if q < b - a else s.new_zeros(()))
    device = scores.device
    kept = torch.cat(kept) if kept else torch.zeros(0, dtype=torch.long, device=device)
    threshold = torch.stack(thresholds) if thresholds else scores.new_zeros(0)
    if num_kept is not None and num_kept != kept.numel():
        raise ValueError(f"topk_retention: num_kept {num_kept} but the quotas keep {kept.numel()}")
    return kept.long(), torch.minimum(quotas.long(), group_sizes.long()), threshold


def priority_keys(metric: torch.Tensor, u: Optional[torch.Tensor]) -> torch.Tensor:
    """Priority sampling's keys metric / (1 - u) for uniform draws u in [0, 1) (the metric itself without u)."""
    return metric if u is None else metric / (1.0 - u)


def priority_sample(metric: torch.Tensor, group_sizes: torch.Tensor, quotas: torch.Tensor,
                    u: Optional[torch.Tensor] = None, num_kept: Optional[int] = None):
    """Priority sampling within per-group quotas: key_p = metric_p / (1 - u_p), the q_g largest keys of
    each group kept (:func:`topk_retention`), each weighted max(1, tau_g / metric_p), tau_g the group's
    (q_g+1)-th largest key (0 where the whole group is kept, so weight 1): the weighted kept terms are an
    unbiased estimate of the group's sum. metric_p is clamped off 0 in the weight (no 0/0).

    Args:
        metric [P] float >= 0, pairs in grouped order; group_sizes, quotas [G] int; u [P] float in [0, 1)
            (uniform draws), or None: plain top-k by the metric, every weight 1.
    Returns:
        kept [P'] int64 (as topk_retention), scale [P'] float (metric's dtype), kept_sizes [G] int64,
        threshold [G] (the keys' dtype).
    """
    kept, kept_sizes, tau = topk_retention(priority_keys(metric, u), group_sizes, quotas, num_kept)
    if u is None:
        return kept, torch.ones(kept.numel(), dtype=metric.dtype, device=metric.device), kept_sizes, tau
    # kept positions are grouped: group g's run of kept_sizes[g] entries
    group = torch.repeat_interleave(torch.arange(kept_sizes.numel(), device=kept.device), kept_sizes.to(kept.device))
    m = metric.index_select(0, kept)
    scale = (tau.index_select(0, group) / m.clamp_min(torch.finfo(m.dtype).tiny)).clamp_min(1.0)
    return kept, scale, kept_sizes, tau


RETENTION_METRICS = ("grad_norm", "gate", "uniform")


def retention_metric(order: torch.Tensor, topk_weight: torch.Tensor, metric: str,
                     dout_norm: Optional[torch.Tensor] = None, x_norm: Optional[torch.Tensor] = None,
                     group_sizes: Optional[torch.Tensor] = None):
    """The send rows' gates and retention metric, and each group's metric mass, from the routing's order.

    Args:
        order [P] int64: send row -> pair (pair = token * K + slot); topk_weight [T, K]: the gates; metric:
        "grad_norm" (m_p = g_p ||dout_t|| ||x_t||, the size of p's rank-1 term in its expert's weight gradient),
        "gate" (g_p) or "uniform" (1); dout_norm, x_norm [T]: the tokens' row norms ("grad_norm" only);
        group_sizes [G] int64 or None: the send rows' groups (consecutive runs), for the mass.
    Returns:
        weight_of_row [P] (topk_weight's dtype, its entry at order); metric [P]
        (float32; for "grad_norm" (g_p ||dout_t||) ||x_t|| in the norms' promoted dtype); mass [G] float32 (each
        group's summed metric) or None without group_sizes.
    """
    if metric not in RETENTION_METRICS:
        raise ValueError(f"unknown retention metric {metric!r}; expected one of {', '.join(RETENTION_METRICS)}")
    if metric == "grad_norm" and (dout_norm is None or x_norm is None):
        raise ValueError('retention_metric: "grad_norm" needs dout_norm and x_norm')
    weight_of_row = topk_weight.reshape(-1).index_select(0, order)
    if metric == "grad_norm":
        src = torch.div(order, topk_weight.shape[1], rounding_mode="floor")
        m = weight_of_row.float() * dout_norm.index_select(0, src) * x_norm.index_select(0, src)
    elif metric == "gate":
        m = weight_of_row.float()
    else:
        m = torch.ones(order.numel(), dtype=torch.float32, device=order.device)
    mass = None
    if group_sizes is not None:
        # in a fixed order (a segmented sum), so the same inputs give the same mass bits
        mass = torch.segment_reduce(m.float(), "sum", lengths=group_sizes.to(m.device), unsafe=True)
    return weight_of_row, m, mass


def retained_pairs(kept: torch.Tensor, scale: torch.Tensor, order: torch.Tensor, weight_of_row: torch.Tensor,
                   k: int, rescale: bool = True):
    """The retained pairs' maps, from the kept send rows (grouped positions) and their weights.

    Args:
        kept [P'] int64: kept send rows; scale [P'] float: their unbiased weights; order [P] int64: send row ->
        pair (pair = token * k + slot); weight_of_row [P]: each send row's gate weight; k: the router's top-k.
    Returns:
        kept_pairs [P'] int64 (order[kept]); src [P'] int64 (their tokens); gate [P'] (weight_of_row's dtype);
        row_weight [P'] (gate * scale, in their promoted dtype; the gate itself if not ``rescale``);
        kept_row_of_pair [T, k] int64 (pair -> its index in kept, -1 if dropped); pair_weight [T, k]
        (row_weight by pair, 0 if dropped).
    """
    P = order.numel()
    if P % k:
        raise ValueError(f"retained_pairs: {P} send rows are not a multiple of k = {k}")
    kept_pairs = order.index_select(0, kept)
    gate = weight_of_row.index_select(0, kept)
    row_weight = gate * scale if rescale else gate
    kept_row_of_pair = torch.full((P,), -1, dtype=torch.long, device=kept.device).index_copy_(
        0, kept_pairs, torch.arange(kept.numel(), device=kept.device))
    pair_weight = row_weight.new_zeros(P).index_copy_(0, kept_pairs, row_weight)
    return (kept_pairs, torch.div(kept_pairs, k, rounding_mode="floor"), gate, row_weight,
            kept_row_of_pair.view(-1, k), pair_weight.view(-1, k))


def capacity_route(pair_group: torch.Tensor, pair_rank: torch.Tensor, instance_group: torch.Tensor,
                   instance_rank: torch.Tensor, instance_capacity: torch.Tensor) -> torch.Tensor:
    """Assign retained pairs to instances of their expert under per-instance capacities.

    Pairs are in grouped order (by expert). For each expert:
      1. local first: the pairs whose token lives on rank r go, in pair order, to the expert's
         instance on rank r (the first such instance), up to its capacity;
      2. spill: the remaining pairs are placed as if one at a time on the instance with the most
         spare capacity (ties: lowest instance index); equivalently, a water-fill of the spare
         capacities, each instance then taking a contiguous run of the spilled pairs in instance order;
      3. pairs that fit nowhere get -1.
    Deterministic. pair_group/pair_rank [P], instance_* [I] -> pair_instance [P] int64.
    """
    P = pair_group.numel()
    out = torch.full((P,), -1, dtype=torch.long)
    pg, pr = pair_group.long().cpu(), pair_rank.long().cpu()
    ig, ir, cap = instance_group.long().cpu(), instance_rank.long().cpu(), instance_capacity.long().cpu()
    if (cap < 0).any():
        raise ValueError("capacity_route: capacities must be >= 0")
    spare = cap.clone()
    for e in torch.unique(pg).tolist():
        pairs = (pg == e).nonzero().flatten()
        insts = (ig == e).nonzero().flatten()
        spilled = []
        for r in torch.unique(pr[pairs]).tolist():
            mine = pairs[pr[pairs] == r]
            local = insts[ir[insts] == r]
            take = 0
            if local.numel():
                i = int(local[0])
                take = min(int(spare[i]), mine.numel())
                out[mine[:take]] = i
                spare[i] -= take
            spilled.append(mine[take:])
        spilled = torch.sort(torch.cat(spilled)).values if spilled else pairs[:0]
        left = spilled.numel()
        # water-fill: greedy one-at-a-time to the most spare instance gives these counts
        takes = torch.zeros(insts.numel(), dtype=torch.long)
        s = spare[insts].clone()
        while left and s.numel() and int(s.max()) > 0:  # no instance of e: all its pairs stay -1
            j = int(torch.argmax(s))  # first maximum: lowest instance index
            takes[j] += 1
            s[j] -= 1
            left -= 1
        start = 0
        for j, i in enumerate(insts.tolist()):
            n = int(takes[j])
            out[spilled[start:start + n]] = i
            spare[i] -= n
            start += n
    return out.to(pair_group.device)


def check_groups(E: int, k: int, num_groups: int, topk_groups: Optional[int]) -> None:
    """Group-limited selection's arguments (router_topk's, and the Router's at construction)."""
    if num_groups < 1 or E % num_groups:
        raise ValueError(f"router_topk: num_groups must be >= 1 and divide E = {E}, got {num_groups}")
    topk_groups = num_groups if topk_groups is None else topk_groups
    if not 1 <= topk_groups <= num_groups or k > topk_groups * (E // num_groups):
        raise ValueError(f"router_topk: topk_groups must be in [1, num_groups = {num_groups}] and leave k = {k} "
                         f"experts to choose from ({E // num_groups} per group), got {topk_groups}")


def _check_router(logits: torch.Tensor, k: int, score_func: str, score_bias: Optional[torch.Tensor] = None,
                  topk_index: Optional[torch.Tensor] = None, d_topk_weight: Optional[torch.Tensor] = None,
                  d_prob_sum: Optional[torch.Tensor] = None, num_groups: int = 1, topk_groups: Optional[int] = None):
    """The argument checks of router_topk and router_topk_backward (the CUDA wrappers run them too)."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"router_topk: logits must be a float [T, E] tensor, got {logits.dtype} of shape "
                         f"{tuple(logits.shape)}")
    T, E = logits.shape
    if not 1 <= k <= E:
        raise ValueError(f"router_topk: k must be in [1, E={E}], got {k}")
    if score_func not in ("softmax", "sigmoid"):
        raise ValueError(f"router_topk: score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
    if score_bias is not None and tuple(score_bias.shape) != (E,):
        raise ValueError(f"router_topk: score_bias must be [E] = [{E}], got shape {tuple(score_bias.shape)}")
    check_groups(E, k, num_groups, topk_groups)
    if topk_index is not None and (tuple(topk_index.shape) != (T, k) or tuple(d_topk_weight.shape) != (T, k)):
        raise ValueError(f"router_topk_backward: topk_index and d_topk_weight must both be [T, K] = [{T}, {k}]; "
                         f"got {tuple(topk_index.shape)} and {tuple(d_topk_weight.shape)}")
    if d_prob_sum is not None and tuple(d_prob_sum.shape) != (E,):
        raise ValueError(f"router_topk_backward: d_prob_sum must be [E] = [{E}], got shape {tuple(d_prob_sum.shape)}")


def _router_scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    return torch.softmax(logits, dim=-1) if score_func == "softmax" else torch.sigmoid(logits)


def router_topk(logits: torch.Tensor, k: int, score_func: str = "softmax", norm_topk_prob: bool = True,
                score_bias: Optional[torch.Tensor] = None, num_groups: int = 1, topk_groups: Optional[int] = None):
    """The router's top-k math, from logits [T, E] (float32 or float64; the math runs in their dtype).

    scores = softmax(logits) over the experts, or sigmoid(logits) per expert. Each token takes the k
    experts of highest selection score, scores + score_bias [E] when given (the bias changes only
    which experts are chosen), ties to the lower expert index. Group-limited selection (DeepSeek-V3's):
    with ``topk_groups`` < ``num_groups``, the experts form num_groups consecutive groups, each scored by
    the sum of its two highest selection scores, and a token chooses only among the experts of its
    topk_groups best groups.
    Returns:
        topk_index [T, K] int64: the chosen experts, in descending order of selection score;
        topk_weight [T, K]: their scores, renormalised to sum to 1 when norm_topk_prob and k > 1
            (the sum clamped to the dtype's smallest normal number);
        counts [E] int64: pairs routed to each expert;
        prob_sum [E]: sum over tokens of probs[t, e], probs = scores (softmax) or scores / scores.sum(-1)
            (sigmoid): the load-balancing loss's mean probability times T.
    Differentiable through plain autograd (the oracle of :func:`router_topk_backward`).
    """
    _check_router(logits, k, score_func, score_bias, num_groups=num_groups, topk_groups=topk_groups)
    T, E = logits.shape
    scores = _router_scores(logits, score_func)
    probs = scores if score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
    select = scores.detach() if score_bias is None else scores.detach() + score_bias.to(logits.dtype)
    if topk_groups is not None and topk_groups < num_groups:
        per_group = E // num_groups
        group_score = select.view(T, num_groups, per_group).topk(min(2, per_group), dim=-1).values.sum(-1)
        best = group_score.topk(topk_groups, dim=-1).indices
        in_best = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
        select = select.masked_fill(~in_best.repeat_interleave(per_group, dim=1), float("-inf"))
    # a stable descending sort: equal selection scores keep the lower expert index first (topk does not promise it)
    topk_index = torch.sort(select, dim=-1, descending=True, stable=True).indices[:, :k]
    topk_weight = scores.gather(1, topk_index)
    if norm_topk_prob and k > 1:
        topk_weight = topk_weight / topk_weight.sum(-1, keepdim=True).clamp_min(torch.finfo(logits.dtype).tiny)
    # not torch.bincount: on CUDA it reads the largest index back to the host (a synchronisation)
    flat = topk_index.flatten()
    counts = torch.zeros(E, dtype=torch.long, device=logits.device).scatter_add_(0, flat, torch.ones_like(flat))
    return topk_index, topk_weight, counts, probs.sum(0)


def router_topk_backward(logits: torch.Tensor, topk_index: torch.Tensor, d_topk_weight: torch.Tensor,
                         d_prob_sum: Optional[torch.Tensor], score_func: str = "softmax",
                         norm_topk_prob: bool = True) -> torch.Tensor:
    """d_logits [T, E] of :func:`router_topk`'s differentiable outputs (topk_weight and prob_sum), in
    closed form, from logits [T, E], topk_index [T, K], d_topk_weight [T, K] and d_prob_sum [E] (or
    None: prob_sum unused).

    With s the scores, w_j = s[i_j] the chosen ones, S = sum_j w_j and D = max(S, tiny):
      renormalisation (norm_topk_prob, K > 1): dw_j = (g_j - sum_m g_m w_m / D) / D where S >= tiny,
          else g_j / D (the clamp passes no gradient to S);
      ds[t, i_j] += dw_j;  prob_sum: ds += d_prob_sum (softmax), or
          ds += (d_prob_sum - sum_e d_prob_sum[e] p[t, e]) / Z with Z = sum_e s[t, e], p = s / Z (sigmoid);
      d_logits = s * (ds - sum_e ds[t, e] s[t, e]) (softmax), or ds * s * (1 - s) (sigmoid, with 1 - s
          computed as exp(-x) s where x >= 0).
    """
    K = topk_index.shape[-1] if topk_index.dim() else 0
    _check_router(logits, K, score_func, None, topk_index, d_topk_weight, d_prob_sum)
    dtype = logits.dtype
    scores = _router_scores(logits, score_func)
    topk_index = topk_index.long()
    dw = d_topk_weight.to(dtype)
    if norm_topk_prob and topk_index.shape[1] > 1:
        tiny = torch.finfo(dtype).tiny
        w = scores.gather(1, topk_index)
        total = w.sum(-1, keepdim=True)
        denom = total.clamp_min(tiny)
        dw = torch.where(total >= tiny, (dw - (dw * w).sum(-1, keepdim=True) / denom) / denom, dw / denom)
    d_scores = torch.zeros_like(scores).scatter_(1, topk_index, dw)  # a row's experts are distinct
    if d_prob_sum is not None:
        g = d_prob_sum.to(dtype).unsqueeze(0)
        if score_func == "softmax":
            d_scores += g
        else:
            z = scores.sum(-1, keepdim=True)
            d_scores += (g - (g * scores).sum(-1, keepdim=True) / z) / z
    if score_func == "softmax":
        return scores * (d_scores - (d_scores * scores).sum(-1, keepdim=True))
    # 1 - s as exp(-x) s where x >= 0: no cancellation where s is near 1 (in fp32, 1 - s would keep
    # few bits of a saturated expert's derivative)
    one_minus_scores = torch.where(logits >= 0, torch.exp(-logits) * scores, 1 - scores)
    return d_scores * scores * one_minus_scores
