"""Memory planner: turns DeepSpeed's memory accounting and the per-GPU budget into each LRMoE layer's MemoryPlan.

Memory model, in bytes per rank. Every measured number is the max over all ranks, so every rank makes the
same plan (the quotas, and with them the backward all-to-all sizes, must agree across ranks):
  budget B   = budget_gib (or budget_fraction * total_memory()) - reserve_gib
  non-MoE N  = max(warm-up peak - smallest MoE estimate of a warm-up step, static)  (overestimates N)
  MoE est.   = held S (sum over layers of rows at the most loaded rank * the bytes the forward keeps per row under
               the layer's policy: the stash, or recompute's token inputs; plus the expert outputs where the exact
               router gradient keeps them, see quotas.expert_row_bytes); a plan's options are weighed by what a step
               under its row cap keeps, where pairs may drop (RetentionStats.capped_bytes_per_row)
               + backward W (largest layer's retained rows * backward_bytes_per_row: one backward at a time)
  "auto"     stashes iff (S_stash + W) * (1 + MARGIN) <= B - N; else, where the config's "dropped_router_dots" is
             "auto" and a stash without the expert outputs keeps less than "recompute", that stash; else recompute.
             ("stash" with "auto" dots drops the outputs where the stash with them does not fit.)
             Row cap = (B - N - S kept) // backward_bytes_per_row
  over B     each layer's cap drops by ceil(excess * (1 + MARGIN) / backward_bytes_per_row) from the rows it used
The config's floor wins over the cap (plan_quotas), so a cap is a request, not a guarantee.
"""
import deepspeed.comm as dist
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import log_dist, logger

from lrmoe_ds.config import LRMoEConfig
from lrmoe_ds.quotas import MemoryPlan, RetentionStats

GIB = 1 << 30
MARGIN = 0.1  # slack on estimates made from one step's routing, which varies from step to step


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if torch.is_tensor(t) else 0


def optimizer_bytes(optimizer) -> tuple:
    """(ZeRO fp32 partition bytes, optimizer state bytes) of a DeepSpeed or torch optimizer; 0 where unknown."""
    if optimizer is None:
        return 0, 0
    groups = (getattr(optimizer, "single_partition_of_fp32_groups", None)  # ZeRO 1/2
              or getattr(optimizer, "fp32_partitioned_groups_flat", None) or [])  # ZeRO 3
    inner = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps the torch optimizer
    state = getattr(inner, "state", None) or {}
    try:
        state_bytes = sum(_nbytes(v) for s in state.values() for v in s.values())
    except (AttributeError, TypeError):  # not a torch-style state dict: leave it to the measured peak
        state_bytes = 0
    return sum(_nbytes(t) for t in groups), state_bytes


def _held_bytes(s: RetentionStats, policy: str, dots: str = "saved", capped: bool = False) -> int:
    return int(s.rows_per_rank.max()) * s.held_bytes_per_row(policy, dots, capped)


def _backward_bytes(s: RetentionStats) -> int:
    return int(s.retained_per_rank.max()) * s.backward_bytes_per_row


def register_step_hook(engine, callback):
    """Calls ``callback(engine.global_steps)`` before the first training forward of each optimizer step of a
    DeepSpeed engine (gradient accumulation runs several forwards per step; evaluation forwards are not
    steps). Returns the hook's handle."""
    last = [None]

    def on_forward(module, args):
        if module.training and engine.global_steps != last[0]:
            last[0] = engine.global_steps
            callback(engine.global_steps)

    return engine.module.register_forward_pre_hook(on_forward)


class MemoryPlanner:
    """Sets ``layer.memory_plan`` of every LRMoE layer from the budget and the measured peak; writes monitor events.

    Use: ``planner = MemoryPlanner(config, layers); planner.attach(engine)``. Until ``warmup_steps`` steps have been
    measured every layer runs unbounded (stash under "auto"); then ``replan()``, and again whenever the peak
    over a step exceeds the budget. ``self.plans`` keeps every plan with the numbers that produced it.
    """

    def __init__(self, config: LRMoEConfig, layers: list, accelerator=None, monitor=None):
        self.config = config
        self.layers = list(layers)
        self.accelerator = accelerator if accelerator is not None else get_accelerator()
        self.monitor = monitor
        self.device = torch.device("cpu")  # where the cross-rank max runs; the engine's device once attached
        self.static_bytes = 0
        self.warmup_peak = 0
        self.warmup_moe_bytes: int | None = None
        self.steps_measured = 0
        self.last_step: int | None = None
        self.plans: list[dict] = []
        self._broken_queries = set()
        self._smallest_total: int | None = None  # the accelerator memory of the smallest rank (budget_fraction)
        self._install([(layer, self._unbounded_plan()) for layer in self.layers], "warm-up (unbounded)", {})

    def _memory(self, name: str) -> int:
        """One accelerator memory query; 0 where this accelerator lacks it or it fails (logged once)."""
        try:
            return int(getattr(self.accelerator, name)() or 0)
        except (AttributeError, ImportError, NotImplementedError, OSError, RuntimeError, TypeError) as err:
            # an accelerator without memory accounting (e.g. CPU without psutil) must not stop training
            if name not in self._broken_queries:
                self._broken_queries.add(name)
                logger.warning(f"LRMoE memory planner: accelerator.{name}() unavailable ({err!r}); taken as 0")
            return 0

    def _max_over_ranks(self, *values: int) -> list[int]:
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return list(values)
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [int(v) for v in t.tolist()]

    def budget_bytes(self) -> int | None:
        """Bytes per rank the training may use (budget less reserve); None: unbounded. budget_fraction is of the
        smallest rank's accelerator (read once), so that unlike devices still make one plan."""
        c = self.config
        if c.budget_gib is not None:
            total = c.budget_gib * GIB
        elif c.budget_fraction is not None:
            if self._smallest_total is None:  # every rank must plan from the same budget (their quotas must agree)
                self._smallest_total = -self._max_over_ranks(-self._memory("total_memory"))[0]
            total = c.budget_fraction * self._smallest_total
        else:
            return None
        if total <= c.reserve_gib * GIB:  # (budget_gib: the config refuses it) a budget of nothing caps every layer
            raise ValueError(f"budget_fraction {c.budget_fraction:g} of this accelerator's {total / c.budget_fraction / GIB:.1f} "
                             f"GiB leaves nothing above reserve_gib ({c.reserve_gib:g})"
                             + ("; it reports no total memory: give budget_gib instead" if total == 0 else ""))
        return int(total - c.reserve_gib * GIB)

    def attach(self, engine) -> None:
        """Reads the engine's static memory and monitor, and calls on_step at the first forward of each step."""
        self.monitor = getattr(engine, "monitor", None) or self.monitor
        self.device = getattr(engine, "device", None) or self.device
        partition, state = optimizer_bytes(getattr(engine, "optimizer", None))
        allocated = self._memory("memory_allocated")
        self.static_bytes = self._max_over_ranks(max(allocated, partition + state))[0]

        self.hook = register_step_hook(engine, lambda step: self.on_step(step))  # looked up per call
        log_dist(f"LRMoE memory planner: budget {self._gib(self.budget_bytes())} GiB, static "
                 f"{self._gib(self.static_bytes)} GiB (allocated {self._gib(allocated)}, ZeRO fp32 partitions "
                 f"{self._gib(partition)}, optimizer state {self._gib(state)}); first plan: {self.plans[-1]}",
                 ranks=[0])

    def on_step(self, step: int) -> None:
        """Measures the step that just finished (the first call only starts measuring), reports it, re-plans."""
        for layer in self.layers:
            layer.optimizer_step = step  # the retention schedule's clock
        peak = self._memory("max_memory_allocated")
        self._memory("reset_max_memory_allocated")
        first, self.last_step = self.last_step is None, step
        if first:
            return
        peak = self._max_over_ranks(peak)[0]  # every rank then takes the same re-plan decision
        budget = self.budget_bytes()
        self._write_events(step, peak, budget)
        self.steps_measured += 1
        if self.steps_measured <= self.config.warmup_steps:
            self.warmup_peak = max(self.warmup_peak, peak)
            moe = self._moe_bytes()
            self.warmup_moe_bytes = moe if self.warmup_moe_bytes is None else min(self.warmup_moe_bytes, moe)
            if self.steps_measured == self.config.warmup_steps:
                self.replan()
        elif budget is not None and peak > budget:
            self.replan(peak)

    def replan(self, peak: int | None = None) -> None:
        """Sets every layer's plan from the memory model (module docstring); lowers the caps when ``peak`` > budget."""
        budget = self.budget_bytes()
        if budget is None:
            return self._install([(layer, self._unbounded_plan()) for layer in self.layers], "unbounded", {})
        measured = [layer for layer in self.layers if layer.last_stats is not None]
        if peak is not None and peak > budget:
            excess = peak - budget
            plans = []
            for layer in measured:
                s, plan = layer.last_stats, layer.memory_plan
                used = int(s.retained_per_rank.max())  # the rows that produced the peak, below any slack cap
                if plan.max_rows_per_rank is not None:
                    used = min(used, plan.max_rows_per_rank)
                drop = -(-int(excess * (1 + MARGIN)) // max(1, s.backward_bytes_per_row))  # ceil, in integers
                plans.append((layer, MemoryPlan(plan.policy, max(1, used - drop), plan.dropped_router_dots)))
            return self._install(plans, "peak over budget", {"budget": budget, "peak": peak, "excess": excess})
        non_moe = max(self.warmup_peak - (self.warmup_moe_bytes or 0), self.static_bytes)
        left = budget - non_moe
        # every plan below has a row cap: what a step under one keeps
        options = (("stash", "saved"), ("stash", "recomputed"), ("recompute", "saved"))
        held = {option: int(sum(_held_bytes(layer.last_stats, *option, capped=True) for layer in measured)
                            * (1 + MARGIN)) for option in options}
        backward = int(max((_backward_bytes(layer.last_stats) for layer in measured), default=0) * (1 + MARGIN))
        stash_fits = held["stash", "saved"] + backward <= left
        lean = held["stash", "recomputed"] < held["stash", "saved"]  # the outputs can go (router dots "auto")
        policy = self.config.policy
        if policy == "auto":  # the stash if it fits, else the lighter of recompute and the stash without the outputs
            policy = "stash" if stash_fits or lean and held["stash", "recomputed"] <= held["recompute", "saved"] \
                else "recompute"
        option = (policy, "recomputed" if policy == "stash" and lean and not stash_fits else "saved")
        room = left - held[option]  # what one layer's backward buffers may use
        plans = [(layer, MemoryPlan(option[0], max(1, room // max(1, layer.last_stats.backward_bytes_per_row)),
                                    option[1])) for layer in measured]
        numbers = {"budget": budget, "warmup_peak": self.warmup_peak, "warmup_moe": self.warmup_moe_bytes,
                   "static": self.static_bytes, "non_moe": non_moe, "left": left, "stash": held["stash", "saved"],
                   "stash_dots_recomputed": held["stash", "recomputed"], "recompute_held": held["recompute", "saved"],
                   "backward": backward}
        self._install(plans, "budget", numbers)

    def _unbounded_plan(self) -> MemoryPlan:
        return MemoryPlan("stash" if self.config.policy == "auto" else self.config.policy, None)

    def _moe_bytes(self) -> int:
        """MoE bytes of the step just finished at its peak: the stashes, plus one layer's backward buffers."""
        stats = [layer.last_stats for layer in self.layers if layer.last_stats is not None]
        held = sum(_held_bytes(s, s.policy, s.dropped_router_dots) for s in stats)
        return held + max((_backward_bytes(s) for s in stats), default=0)

    def _install(self, plans: list, reason: str, numbers: dict) -> None:
        """plans: (layer, MemoryPlan) pairs (a list: layers need not be hashable)."""
        for layer, plan in plans:
            layer.memory_plan = plan
        record = {"step": self.last_step, "reason": reason, **numbers,
                  "layers": {layer.layer_number: plan for layer, plan in plans}}
        self.plans.append(record)
        log_dist(f"LRMoE memory plan: {record}", ranks=[0])

    @staticmethod
    def _gib(n: int | None):
        return None if n is None else round(n / GIB, 3)

    def _write_events(self, step: int, peak: int, budget: int | None) -> None:
        if self.monitor is None or not getattr(self.monitor, "enabled", False):
            return
        events = [("lrmoe/peak_memory_gib", peak / GIB, step)]
        if budget is not None:
            events.append(("lrmoe/budget_gib", budget / GIB, step))
        per_expert = step % self.config.report_interval == 0
        for layer in self.layers:
            s, plan, tag = layer.last_stats, layer.memory_plan, f"lrmoe/layer{layer.layer_number}"
            if s is not None:
                n, q = s.counts.double(), torch.minimum(s.retained().double(), s.counts.double())
                events.append((f"{tag}/retention", float(q.sum() / n.sum()) if n.sum() > 0 else 1.0, step))
                if s.replica_rows:
                    events.append((f"{tag}/replica_rows", float(s.replica_rows), step))
            events.append((f"{tag}/policy_recompute", float(plan.policy == "recompute"), step))
            if plan.dropped_router_dots == "recomputed":
                events.append((f"{tag}/router_dots_recomputed", 1.0, step))
            if plan.max_rows_per_rank is not None:
                events.append((f"{tag}/max_rows_per_rank", float(plan.max_rows_per_rank), step))
            if per_expert and s is not None:
                ratios = torch.where(n > 0, q / n.clamp_min(1), torch.ones_like(n))
                events += [(f"{tag}/expert{e}/retention", r, step) for e, r in enumerate(ratios.tolist())]
        self.monitor.write_events(events)
