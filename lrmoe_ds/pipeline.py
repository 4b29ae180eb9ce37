"""The grouped experts' path through the layer as one autograd function, so that its backward can
keep only the retained pairs from the first step on.

forward:  permute pairs by expert -> all-to-all -> grouped MLP -> all-to-all back -> weighted combine.
backward, at each token's own rank: the metric of its pairs, the quota-aware selection (this rank's
share of each expert's quota, known from the forward's counts); then only the retained rows travel
(dy, plus x under "recompute", or their stash positions under "stash"); the experts run the grouped
backward over the compacted groups; dx comes back for the retained rows and is summed per token.
With replicas (lrmoe_ds.placement) the retained rows go to the group slot that runs them instead, and
the replicas' weights and gradients travel to and from their homes.
Dropped pairs give no expert weight gradient and no expert-path term in dx; the router's gradient is
exact (from the saved expert outputs, or where no pair drops from the rows the backward runs) or from the
retained pairs alone.
"""
import torch

from lrmoe_ds import ops
from lrmoe_ds.dispatcher import AllToAllDispatcher, DispatchPlan, to_device
from lrmoe_ds.experts import BackwardRows, mlp_backward, mlp_forward
from lrmoe_ds.retention import BackwardSpec, select_retained


def _rank(dispatcher: AllToAllDispatcher) -> int:
    return 0 if dispatcher.ep_size == 1 else torch.distributed.get_rank(dispatcher.ep_group)


def _row_norms(t: torch.Tensor) -> torch.Tensor:
    """||t_i|| accumulated in fp32 or wider, without a widened copy of t."""
    return t.norm(dim=1, dtype=torch.promote_types(t.dtype, torch.float32))


def _graph_kept() -> bool:
    """Whether the running backward keeps its graph (``retain_graph=True``), so that its saved tensors are read
    again. Torch's own AOT autograd asks the same private function; where it is missing, assume kept."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep is None else bool(keep())


def stash_keeps_rows(may_drop: bool, ep_size: int) -> bool:
    """Whether a stash keeps x's rows at the experts [P, H], or x itself [T, H]. On one rank a retained backward's
    rows are x's own (x[src] = rows[kept]): a stash that may drop pairs keeps x, k times smaller, and the backward
    gathers the kept rows from it as cheaply as from the rows. Across ranks the rows stay (x's would travel again)."""
    return not (may_drop and ep_size == 1)


def router_dots_from_rows(policy: str, may_drop: bool, dropped_router_dots: str, dtype: torch.dtype,
                          ep_size: int) -> bool:
    """Whether the exact router gradient <y_p, dout_t> comes from rows the backward makes, so that the expert outputs
    y [P, H] are not saved. A retained pair's is <a_p, da_p> / (dy_p's weight) (y = a W2^T, da = dy W2): where no
    pair drops, every pair's a and da are made anyway. A dropped pair's is <act(h_p), dout_t W2_e>, from the stash's
    h (``dropped_router_dots: "recomputed"``, see _dropped_pair_dots). Not in fp16, whose narrow range would flush
    w_p dout_t of a small gate to zero (and its gate gradient with it); where w_p is 0 the dot is 0, as is the
    softmax's derivative. Across ranks the dots come back from the experts in an all-to-all of their own (4 bytes a
    pair, against the 2-4 H bytes a pair of y kept): only where asked for ("recomputed"), and only where no pair
    drops (a dropped pair's dout row never reaches its expert)."""
    if dtype == torch.float16:
        return False
    if ep_size != 1:
        return not may_drop and dropped_router_dots == "recomputed"
    return not may_drop or (dropped_router_dots == "recomputed" and policy == "stash")


def _dropped_pair_dots(kept: torch.Tensor, kept_sizes: torch.Tensor, plan: DispatchPlan, h: torch.Tensor,
                       dout: torch.Tensor, w2, expert_type):
    """(the dropped pairs [Pd], their <y_p, dout_t> [Pd]) on one rank under the stash: y_p = a_p W2_e^T, so the dot
    is <a_p, dout_t W2_e>, a down-projection dgrad over the dropped rows and their activations from the stashed h.
    On one rank the send rows are the rows at the experts, grouped by expert: the dropped ones, in order, are
    grouped too, (count - kept) to an expert."""
    P, K = plan.order.numel(), plan.row_of_pair.shape[1]
    is_kept = torch.zeros(P, dtype=torch.long, device=kept.device).index_fill_(0, kept, 1)
    _, by_kept, _ = ops.routing_plan(is_kept, 2)   # a stable grouping: the dropped rows first, in order
    dropped = by_kept[:P - kept.numel()]
    dropped_pairs = plan.order.index_select(0, dropped)
    dout_w2 = ops.grouped_linear_dgrad(ops.permute(dout, dropped_pairs // K), w2, plan.group_sizes - kept_sizes)
    return dropped_pairs, expert_type.act_dot(h, dout_w2, dropped)


def _version_sum(tensors) -> int:
    return sum(t._version for t in tensors)


def _with_replicas(weights, fetched, replica_slots, num_slots: int):
    """The local experts' weights followed by one per replica slot: ``fetched`` in ``replica_slots``, an
    empty slot filled with any weight (its group has no rows)."""
    slots = list(weights) + [weights[0]] * num_slots
    for w, s in zip(fetched, replica_slots):
        slots[len(weights) + s] = w
    return slots


class WeightGrads:
    """Where RoutedMLP's backward leaves the stacked expert weights' gradients for :class:`ExpertWeights`."""
    __slots__ = ("grads",)

    def __init__(self):
        self.grads = None


class ExpertWeights(torch.autograd.Function):
    """The expert weights' one way into the autograd graph: a token made from the stacked weights, which
    RoutedMLP takes in their place; RoutedMLP's backward leaves their gradients in ``handoff`` and this
    node hands them to autograd.

    Why: autograd runs a leaf's AccumulateGrad as soon as its gradient exists, before any other ready
    node, and DeepSpeed's optimizers hook it (ZeRO-2's reduction, for one). Made before the router, this
    node runs after the router's backward is queued, so that this host work overlaps GPU work.
    """

    @staticmethod
    def forward(ctx, handoff: WeightGrads, *weights):
        ctx.handoff, ctx.num_weights = handoff, len(weights)
        return weights[0].new_empty(0)

    @staticmethod
    def backward(ctx, _):
        grads, ctx.handoff.grads = ctx.handoff.grads, None
        return (None, *(grads if grads is not None else (None,) * ctx.num_weights))


class RoutedMLP(torch.autograd.Function):
    """out [T, H] = sum_k topk_weight[t, k] * MLP_{e(t,k)}(x_t), over an expert-parallel group.

    The expert weights come as plain arguments: w1, w2 the stacked weights (detached) for the GEMMs, and
    ``stacked`` (W1, W2), the parameters they view, not as autograd inputs: the stacked gradients go
    through ``handoff`` to the :class:`ExpertWeights` node that made ``weights_token`` (None where no
    expert weight needs a gradient)."""

    @staticmethod
    def forward(ctx, x, topk_weight, weights_token, plan: DispatchPlan, dispatcher: AllToAllDispatcher,
                expert_type, spec: BackwardSpec, w1, w2, stacked, handoff: WeightGrads):
        K = plan.row_of_pair.shape[1]
        rows = dispatcher.to_experts(ops.permute(x, plan.order // K), plan)
        h, y = mlp_forward(rows, w1, w2, expert_type, plan.group_sizes)
        y_src = dispatcher.from_experts(y, plan)
        del y
        out = ops.unpermute(y_src, plan.row_of_pair, topk_weight)
        stash = spec.policy == "stash"
        stash_rows = stash and stash_keeps_rows(spec.may_drop, dispatcher.ep_size)
        x_norm = _row_norms(x) if spec.may_drop and spec.metric == "grad_norm" else None
        keep_y = spec.router_grad == "exact" and not router_dots_from_rows(
            spec.policy, spec.may_drop, spec.dropped_router_dots, x.dtype, dispatcher.ep_size)
        ctx.save_for_backward(None if stash_rows else x, rows if stash_rows else None, h if stash else None,
                              y_src if keep_y else None, topk_weight, x_norm)
        # The weights are leaf parameters: kept on ctx, not saved, which keeps saved-tensor hooks (offload) to
        # the activations. The stacked parameters' versions are summed instead (the per-expert views have
        # counters of their own), so that a weight changed in place before the backward is still an error.
        ctx.w1, ctx.w2, ctx.stacked, ctx.handoff = w1, w2, stacked, handoff
        ctx.weights_version = _version_sum(stacked)
        ctx.plan, ctx.dispatcher, ctx.expert_type, ctx.spec = plan, dispatcher, expert_type, spec
        return out

    @staticmethod
    def backward(ctx, dout):
        x, rows, h, y_src, topk_weight, x_norm = ctx.saved_tensors
        plan, disp, spec, w1, w2 = ctx.plan, ctx.dispatcher, ctx.spec, ctx.w1, ctx.w2
        if _version_sum(ctx.stacked) != ctx.weights_version:
            raise RuntimeError("an expert weight of an LRMoE layer was modified by an inplace operation between "
                               "the forward and its backward (e.g. an optimizer step before the backward)")
        T, K = plan.row_of_pair.shape
        dout = dout.contiguous()
        want_router = ctx.needs_input_grad[1]
        exact_router = want_router and y_src is not None                # else <y, dy> from the rows, below
        shares, replicas = spec.shares, spec.replicas
        d_weight = dy = dropped_dots = None
        if replicas is not None and spec.policy != "recompute":
            raise RuntimeError("replicas run retained rows under the recompute policy only (a stash stays at home)")
        kept = kept_pairs = None
        splits = plan
        if shares is None:
            src = plan.order // K                                       # send row -> token
            weight_of_row = topk_weight.reshape(-1).index_select(0, plan.order)
            gate = row_weight = weight_of_row                           # g_p and dy's weight, per send row
            if exact_router:  # the combine's two gradients (dy_p = w_p dout_t) from one read of dout
                dy, d_weight = ops.unpermute_backward(y_src, plan.row_of_pair, topk_weight, dout)
                d_weight = d_weight.to(topk_weight.dtype)
        else:
            rank = _rank(disp)
            if disp.ep_size == 1:  # this rank's counts and quotas are on the device already: no more copies
                splits = disp.compact(shares, dout.device)
                sizes, quotas = plan.group_sizes, splits.group_sizes
            else:
                sizes, quotas = to_device(plan.all_counts[rank], dout.device), to_device(shares[rank], dout.device)
            # the send rows' gates, the metric m_p, and with "metric_mass" each expert's summed metric (in a fixed
            # order: a last-bit change in a mass can move a quota), which plans the next step's quotas
            weight_of_row, metric, mass = ops.retention_metric(
                plan.order, topk_weight, spec.metric, _row_norms(dout) if spec.metric == "grad_norm" else None,
                x_norm, sizes if spec.on_mass is not None else None)
            if mass is not None:
                spec.on_mass(disp.sum_over_group(mass))
            total = None if spec.totals is None else spec.totals[rank]
            kept, scale, kept_sizes = select_retained(metric, sizes, quotas, spec.selection, spec.seed,
                                                      num_kept=int(shares[rank].sum()), total=total)
            if spec.share_weights is not None and spec.rescale:  # a share of 1 sampled with probability f: 1 / f
                factor = to_device(spec.share_weights[rank], dout.device)
                scale = scale * torch.repeat_interleave(factor, kept_sizes, output_size=kept.numel())
            if total is not None:  # the counts were chosen here: the exchange sizes follow from them
                splits, kept_counts = disp.compact_kept(kept_sizes)
                if spec.on_kept is not None:
                    spec.on_kept(kept_counts)
            elif replicas is not None:
                # retained rows by the group slot (home expert or replica) that runs them, in send order
                slot = replicas.slot_of_rows(rank, kept.numel(), dout.device)
                _, by_slot, _ = ops.routing_plan(slot, replicas.counts.shape[1])
                kept, scale = kept.index_select(0, by_slot), scale.index_select(0, by_slot)
                splits = disp.compact(replicas.counts, dout.device)
            elif disp.ep_size > 1:
                splits = disp.compact(shares, dout.device)
            # the kept pairs, their tokens, gates and dy weights; pair -> its retained send row (-1: dropped; dy's
            # rows and dx's combine go by it), and the dy weight by pair (0: dropped)
            kept_pairs, src, gate, row_weight, kept_row_of_pair, pair_weight = ops.retained_pairs(
                kept, scale, plan.order, weight_of_row, K, spec.rescale)
            if spec.record is not None:
                spec.record.update(kept=kept, scale=scale, pairs=kept_pairs)
            if exact_router:  # the kept pairs' dy and every pair's gate gradient from one read of dout
                dy, d_weight = ops.unpermute_backward(y_src, plan.row_of_pair, pair_weight, dout, kept_row_of_pair,
                                                      kept.numel())
                d_weight = d_weight.to(topk_weight.dtype)
            elif want_router and spec.router_grad == "exact":  # y not saved: the dropped pairs' dots from h
                dropped_dots = _dropped_pair_dots(kept, kept_sizes, plan, h, dout, w2, ctx.expert_type)

        if dy is None:
            dy = ops.permute(dout, src, row_weight)                      # dy_p = w_p dout_t, one pass
        h_index = None
        if spec.policy == "stash":
            if kept is not None:  # the retained rows: x's copied for the GEMMs, h's read in place by the activation
                h_index = disp.positions_at_experts(kept, plan, splits).long()
            elif _graph_kept():  # mlp_backward writes over h, which a kept graph's next backward reads again
                h = h.clone()
            if rows is None:  # the stash kept x (one rank): the rows this backward runs, from their tokens
                rows = ops.permute(x, src)
            elif kept is not None:
                rows = ops.permute(rows, h_index)
        else:
            rows = disp.to_experts(ops.permute(x, src), splits)
        want_y = want_router and y_src is None
        handed = BackwardRows(disp.to_experts(dy, splits), rows, h, h_index)
        del dy, rows, h                                                 # mlp_backward frees them as it goes
        if replicas is not None:  # the replica slots' weights from their homes
            exchange, El, S = replicas.weight_exchange(rank), len(w1), replicas.replica_expert.shape[1]
            fetched1, fetched2 = disp.fetch_replicas(ctx.stacked, exchange)
            w1, w2 = _with_replicas(w1, fetched1, exchange[3], S), _with_replicas(w2, fetched2, exchange[3], S)
        dx_rows, dw1, dw2, y_dot_dy = mlp_backward(handed, w1, w2, ctx.expert_type, splits.group_sizes, want_y)
        if replicas is not None:  # their gradients summed into the home experts'
            slots = [El + s for s in exchange[3]]
            dw1, dw2, replica_grads = dw1[:El], dw2[:El], (dw1[slots], dw2[slots])
            disp.return_replica_grads(replica_grads, exchange, (dw1, dw2))

        if want_y:
            # <y_p, dy_p> = r_p <y_p, dout_t>, r_p dy's weight (g_p, or g_p s_p with the sampling weight s_p): the
            # exact gradient divides by r_p; the retained one by g_p alone, weighted like the pair's other terms
            # (g_p = 0 only where the gate underflowed, and then the router's own derivative vanishes too)
            dot = disp.from_experts(y_dot_dy.unsqueeze(1), splits).squeeze(1).to(topk_weight.dtype)
            pairs = plan.order if kept is None else kept_pairs
            by = row_weight if spec.router_grad == "exact" else gate
            d_flat = torch.zeros(T * K, dtype=topk_weight.dtype, device=dout.device)
            d_flat.index_copy_(0, pairs, dot / by.clamp_min(torch.finfo(by.dtype).tiny))
            if dropped_dots is not None:
                d_flat.index_copy_(0, dropped_dots[0], dropped_dots[1].to(topk_weight.dtype))
            d_weight = d_flat.view(T, K)

        dx_src = disp.from_experts(dx_rows, splits)
        del dx_rows
        row_of_pair = plan.row_of_pair if kept is None else kept_row_of_pair  # a dropped pair adds nothing to dx
        ones = torch.ones((T, K), dtype=dout.dtype, device=dout.device)
        dx = ops.unpermute(dx_src, row_of_pair, ones)
        if ctx.needs_input_grad[2]:
            ctx.handoff.grads = (dw1, dw2)
        return dx, d_weight, None, None, None, None, None, None, None, None, None
