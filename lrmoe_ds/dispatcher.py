"""Token dispatcher: every collective of the layer lives here.

Forward: plan (one all-gather of per-expert counts; the one host read, for the all-to-all split
sizes), dispatch (permute pairs by destination, variable-split all-to-all, regroup by local expert),
combine (the reverse, then the weighted sum over each token's k pairs). The backward of each step is
the reverse step. On one rank there is no collective and no regroup.

T tokens, K top-k, H hidden, E experts, E_l local experts, R expert-parallel ranks, P = T*K pairs,
M rows received by this rank.
"""
from collections import Counter
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from lrmoe_ds import ops

#: collective calls made by dispatchers in this process, and the bytes each rank sent, by name
COLLECTIVE_CALLS: Counter = Counter()
COLLECTIVE_BYTES: Counter = Counter()


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor to ``device``; to a GPU through pinned memory, so the copy does not wait for the stream."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


class HostCopy:
    """The host copy of a small device tensor, started at once (pinned memory, non-blocking, right after
    the kernel that makes it) and waited for only where it is first read: work queued in between is
    not waited for, and a caller that never reads it never synchronises. ``early=False`` starts nothing
    (no pinned buffer, no event: host time where nothing is expected to read it); a read then copies
    synchronously."""

    def __init__(self, t: torch.Tensor, early: bool = True):
        self._event = self._device = None
        if t.is_cuda and not early:
            self._device = t
        elif t.is_cuda:
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = t

    def get(self) -> torch.Tensor:
        if self._device is not None:
            self._host, self._device = self._device.cpu(), None
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host


@dataclass
class DispatchPlan:
    """Where every pair goes; made once in the forward and used by dispatch, combine and backward.

    order [P]: send row -> pair (pairs grouped by expert, hence by destination rank).
    row_of_pair [T, K]: pair -> send row.
    send_splits / recv_splits: rows to / from each EP rank (host ints; R > 1 only).
    regroup [M] / regroup_inverse [M]: received row order -> grouped by local expert (None if R == 1).
    group_sizes [E_l] (device): rows per local expert.
    host_counts: HostCopy of all_counts [R, E], the pairs from each EP rank to each expert
        (n_e = all_counts.sum(0)). With R > 1 it was read at once (the all-to-all needs it); on one rank
        it is read only where :attr:`all_counts` or :attr:`group_sizes_host` is asked for.
    local_sizes_host: rows per local expert, host ints (R > 1; on one rank they are all_counts[0]).
    """
    order: torch.Tensor
    row_of_pair: torch.Tensor
    send_splits: Optional[List[int]]
    recv_splits: Optional[List[int]]
    regroup: Optional[torch.Tensor]
    regroup_inverse: Optional[torch.Tensor]
    group_sizes: torch.Tensor
    host_counts: HostCopy
    local_sizes_host: Optional[List[int]] = None

    @property
    def all_counts(self) -> torch.Tensor:
        return self.host_counts.get()

    @property
    def group_sizes_host(self) -> List[int]:
        """Rows per local expert, host ints (a host read on one rank)."""
        return self.all_counts[0].tolist() if self.local_sizes_host is None else self.local_sizes_host


@dataclass
class CompactPlan:
    """The backward's exchange of retained rows only (sizes known on every rank from the quota shares).

    send_splits / recv_splits: retained rows to / from each EP rank (host ints).
    regroup [M'] / regroup_inverse [M']: received retained rows -> grouped by local expert (None if R == 1).
    group_sizes [E_l] (device) and group_sizes_host: retained rows per local expert (the host list is None
    where the backward counted them on the device: one rank, the "threshold" allocation).
    """
    send_splits: List[int]
    recv_splits: List[int]
    regroup: Optional[torch.Tensor]
    regroup_inverse: Optional[torch.Tensor]
    group_sizes: torch.Tensor
    group_sizes_host: Optional[List[int]]


class _GatherRows(torch.autograd.Function):
    """out = x[index]; backward dx[t] = sum_j dout[backward_index[t, j]] (a deterministic gather-sum)."""

    @staticmethod
    def forward(ctx, x, index, backward_index):
        ctx.save_for_backward(backward_index)
        return ops.permute(x, index)

    @staticmethod
    def backward(ctx, dout):
        (backward_index,) = ctx.saved_tensors
        ones = torch.ones(backward_index.shape, dtype=dout.dtype, device=dout.device)
        return ops.unpermute(dout.contiguous(), backward_index, ones), None, None


class _Combine(torch.autograd.Function):
    """out[t] = sum_k weight[t, k] rows[row_of_pair[t, k]]; the gate gradient is exact (from rows)."""

    @staticmethod
    def forward(ctx, rows, row_of_pair, weight, order):
        ctx.save_for_backward(rows, row_of_pair, weight, order)
        return ops.unpermute(rows, row_of_pair, weight)

    @staticmethod
    def backward(ctx, dout):
        rows, row_of_pair, weight, order = ctx.saved_tensors
        T, K = row_of_pair.shape
        dout = dout.contiguous()
        d_rows = d_weight = None
        if ctx.needs_input_grad[0] and ctx.needs_input_grad[2]:  # both from one read of dout
            d_rows, d_weight = ops.unpermute_backward(rows, row_of_pair, weight, dout)
        elif ctx.needs_input_grad[0]:
            d_rows = ops.permute(dout, order // K, weight.reshape(-1).index_select(0, order))
        elif ctx.needs_input_grad[2]:
            d_weight = ops.unpermute_weight_grad(rows, row_of_pair, dout)
        return d_rows, None, None if d_weight is None else d_weight.to(weight.dtype), None


class _AllToAll(torch.autograd.Function):
    """Variable-split all-to-all of rows; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, recv_splits, send_splits, group):
        ctx.splits, ctx.group = (recv_splits, send_splits), group
        return _all_to_all(x, recv_splits, send_splits, group)

    @staticmethod
    def backward(ctx, dout):
        recv_splits, send_splits = ctx.splits
        return _all_to_all(dout, send_splits, recv_splits, ctx.group), None, None, None


def _all_to_all(x, recv_splits, send_splits, group):
    out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
    COLLECTIVE_CALLS["all_to_all"] += 1
    COLLECTIVE_BYTES["all_to_all"] += x.numel() * x.element_size()
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


class AllToAllDispatcher:
    """Dispatch and combine over an expert-parallel group, one home instance per expert.

    Expert e lives on EP rank e // E_l as its local expert e % E_l.
    """

    def __init__(self, num_experts: int, ep_size: int, ep_group=None):
        if num_experts % ep_size:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by ep_size ({ep_size})")
        self.num_experts, self.ep_size, self.ep_group = num_experts, ep_size, ep_group
        self.num_local_experts = num_experts // ep_size

    def plan(self, topk_index: torch.Tensor, counts: torch.Tensor, early_counts: bool = True) -> DispatchPlan:
        """topk_index [T, K], counts [E] (pairs per expert from this rank) -> DispatchPlan.

        early_counts: on one rank, start the counts' host copy now (for a caller that will read
        ``all_counts``: retention's quotas, the per-expert loop); else it is copied when first read."""
        E, El, R = self.num_experts, self.num_local_experts, self.ep_size
        _, order, _ = ops.routing_plan(topk_index.reshape(-1), E)
        row_of_pair = _inverse_permutation(order).view(topk_index.shape)
        if R == 1:
            # no collective, so no host read here: the exact CUDA path never waits for the counts; the
            # reference ops' loops read them, and retention's quota planning once the forward's GEMMs are queued
            return DispatchPlan(order, row_of_pair, None, None, None, None, counts,
                                HostCopy(counts.view(1, E), early_counts))
        if self.ep_group is None:
            raise RuntimeError("ep_size > 1 but the layer has no expert-parallel group: build the model's "
                               "engine with lrmoe_ds.initialize (or deepspeed.initialize) first")
        all_counts = counts.new_empty(R * E)
        COLLECTIVE_CALLS["all_gather"] += 1
        dist.all_gather_into_tensor(all_counts, counts.contiguous(), group=self.ep_group)
        # the one host read of the forward: the all-to-all's split sizes
        all_counts = all_counts.cpu().view(R, E)
        rank = dist.get_rank(self.ep_group)
        mine = all_counts[:, rank * El:(rank + 1) * El]                      # [R, E_l] rows from each rank
        send_splits = all_counts[rank].view(R, El).sum(1).tolist()
        recv_splits = mine.sum(1).tolist()
        group_sizes_host = mine.sum(0)
        device = topk_index.device
        regroup, regroup_inverse = self._regroup_for(mine, device)
        return DispatchPlan(order, row_of_pair, send_splits, recv_splits, regroup, regroup_inverse,
                            group_sizes_host.to(device), HostCopy(all_counts), group_sizes_host.tolist())

    def _regroup_for(self, counts: torch.Tensor, device):
        """counts [R, G] host (rows from each rank to each local group) -> received order -> grouped."""
        R, El = counts.shape
        group_of_row = to_device(torch.repeat_interleave(torch.arange(El).repeat(R), counts.reshape(-1)), device)
        _, regroup, _ = ops.routing_plan(group_of_row, El)
        return regroup, _inverse_permutation(regroup)

    def compact(self, shares: torch.Tensor, device) -> CompactPlan:
        """shares [R, R * G] host: retained pairs from each rank to each group slot (G = E_l, the local experts;
        or E_l plus replica slots, :class:`~lrmoe_ds.placement.ReplicaPlan`) -> the backward's CompactPlan."""
        R = self.ep_size
        El = shares.shape[1] // R
        if R == 1:
            sizes = shares[0].tolist()
            return CompactPlan([sum(sizes)], [sum(sizes)], None, None, to_device(shares[0], device), sizes)
        rank = dist.get_rank(self.ep_group)
        mine = shares[:, rank * El:(rank + 1) * El]
        regroup, regroup_inverse = self._regroup_for(mine, device)
        return CompactPlan(shares[rank].view(R, El).sum(1).tolist(), mine.sum(1).tolist(), regroup, regroup_inverse,
                           to_device(mine.sum(0), device), mine.sum(0).tolist())

    def compact_kept(self, kept_sizes: torch.Tensor):
        """kept_sizes [E] (device): this rank's retained pairs per expert, counted in the backward (the
        "threshold" allocation) -> (its CompactPlan, kept pairs per expert over the group [E]). R > 1: one
        all-gather of the counts, and the host read of the exchange sizes."""
        R, E = self.ep_size, self.num_experts
        if R == 1:
            return CompactPlan([], [], None, None, kept_sizes, None), kept_sizes
        counts = kept_sizes.new_empty(R * E)
        COLLECTIVE_CALLS["all_gather"] += 1
        dist.all_gather_into_tensor(counts, kept_sizes.contiguous(), group=self.ep_group)
        counts = counts.cpu().view(R, E)
        return self.compact(counts, kept_sizes.device), counts.sum(0)

    def sum_over_group(self, t: torch.Tensor) -> torch.Tensor:
        """t summed in place over the expert-parallel group (one all-reduce; nothing on one rank)."""
        if self.ep_size > 1:
            COLLECTIVE_CALLS["all_reduce"] += 1
            dist.all_reduce(t, group=self.ep_group)
        return t

    # Plain (not autograd) exchanges, for callers that write their own backward. `splits` is the
    # DispatchPlan of the forward or the CompactPlan of the backward's retained rows.
    def to_experts(self, rows: torch.Tensor, splits) -> torch.Tensor:
        """Rows in send order (grouped by global expert) -> rows at the experts, grouped by local expert."""
        if self.ep_size == 1:
            return rows
        rows = _all_to_all(rows, splits.recv_splits, splits.send_splits, self.ep_group)
        return ops.permute(rows, splits.regroup)

    def from_experts(self, rows: torch.Tensor, splits) -> torch.Tensor:
        """The reverse of :meth:`to_experts`."""
        if self.ep_size == 1:
            return rows
        rows = ops.permute(rows, splits.regroup_inverse)
        return _all_to_all(rows, splits.send_splits, splits.recv_splits, self.ep_group)

    def positions_at_experts(self, kept: torch.Tensor, plan: DispatchPlan, compact: CompactPlan) -> torch.Tensor:
        """Send-order positions of retained rows [P'] -> their positions among the forward's grouped
        rows at the experts [M'] (in the compacted grouped order): where their stash is."""
        if self.ep_size == 1:
            return kept
        R, dev = self.ep_size, kept.device
        send_start = to_device(torch.tensor([0] + plan.send_splits[:-1]).cumsum(0), dev)
        dest = to_device(torch.repeat_interleave(torch.arange(R), torch.tensor(compact.send_splits)), dev)
        offset = (kept - send_start[dest]).unsqueeze(1)
        offset = _all_to_all(offset, compact.recv_splits, compact.send_splits, self.ep_group).squeeze(1)
        recv_start = to_device(torch.tensor([0] + plan.recv_splits[:-1]).cumsum(0), dev)
        src = to_device(torch.repeat_interleave(torch.arange(R), torch.tensor(compact.recv_splits)), dev)
        grouped = plan.regroup_inverse.index_select(0, recv_start[src] + offset)
        return grouped.index_select(0, compact.regroup)

    def fetch_replicas(self, stacked, exchange) -> List[torch.Tensor]:
        """The weights of this rank's replica slots from their home ranks, ``exchange`` being this rank's
        :meth:`~lrmoe_ds.placement.ReplicaPlan.weight_exchange`: for each stacked weight [E_l, ...], [n, ...]
        in its receive order (one all-to-all for all of them)."""
        send, send_splits, recv_splits, _ = exchange
        index = to_device(torch.tensor(send, dtype=torch.long), stacked[0].device)
        flat = torch.cat([W.detach().index_select(0, index).flatten(1) for W in stacked], 1)
        got = _all_to_all(flat, recv_splits, send_splits, self.ep_group)
        sizes = [W[0].numel() for W in stacked]
        return [part.view(-1, *W.shape[1:]) for part, W in zip(got.split(sizes, 1), stacked)]

    def return_replica_grads(self, grads, exchange, into) -> None:
        """The reverse of :meth:`fetch_replicas` for the replicas' gradients ``grads`` (receive order): each is
        added into its home expert's slice of ``into`` (stacked gradients [E_l, ...]), in a fixed order."""
        send, send_splits, recv_splits, _ = exchange
        flat = torch.cat([g.flatten(1) for g in grads], 1)
        back = _all_to_all(flat, send_splits, recv_splits, self.ep_group)
        for part, dW in zip(back.split([g[0].numel() for g in into], 1), into):
            for row, e in zip(part, send):  # an expert may have replicas on several ranks: summed in rank order
                dW[e] += row.view_as(dW[e])

    def dispatch(self, x: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """x [T, H] -> rows [M, H] grouped by local expert."""
        K = plan.row_of_pair.shape[1]
        rows = _GatherRows.apply(x, plan.order // K, plan.row_of_pair)
        if self.ep_size == 1:
            return rows
        rows = _AllToAll.apply(rows, plan.recv_splits, plan.send_splits, self.ep_group)
        return _GatherRows.apply(rows, plan.regroup, plan.regroup_inverse.unsqueeze(1))

    def combine(self, rows: torch.Tensor, topk_weight: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """Expert outputs [M, H] grouped by local expert, gate weights [T, K] -> [T, H]."""
        if self.ep_size > 1:
            rows = _GatherRows.apply(rows, plan.regroup_inverse, plan.regroup.unsqueeze(1))
            rows = _AllToAll.apply(rows, plan.send_splits, plan.recv_splits, self.ep_group)
        return _Combine.apply(rows, plan.row_of_pair, topk_weight, plan.order)
