"""MemoryPlanner on stub layers, a fake accelerator and a stub monitor (no LRMoE forward needed)."""
from types import SimpleNamespace

import pytest
import torch

from lrmoe_ds.config import LRMoEConfig
from lrmoe_ds.planner import GIB, MemoryPlanner, optimizer_bytes
from lrmoe_ds.quotas import MemoryPlan, RetentionStats

MB = 1_000_000
STASH_BPR, BACKWARD_BPR = 100_000, 200_000  # bytes per routed row stashed / per retained row in the backward


class FakeAccelerator:
    def __init__(self, total=64 * GIB, allocated=0, peak=0):
        self.total, self.allocated, self.peak = total, allocated, peak
        self.resets = 0

    def total_memory(self):
        return self.total

    def memory_allocated(self):
        return self.allocated

    def max_memory_allocated(self):
        return self.peak

    def reset_max_memory_allocated(self):
        self.resets += 1
        self.peak = self.allocated


class RecordingMonitor:
    enabled = True

    def __init__(self):
        self.events = []

    def write_events(self, events):
        self.events.extend(events)

    def named(self, step=None):
        return {name: value for name, value, s in self.events if step is None or s == step}


def stub_layer(number, config, counts=(400, 0, 600), quotas=(200, 0, 600), rows=(1000, 500), retained=(500, 250),
               policy="stash", recompute_bpr=0, lean_bpr=None):
    stats = RetentionStats(counts=torch.tensor(counts), quotas=torch.tensor(quotas), rows_per_rank=torch.tensor(rows),
                           retained_per_rank=torch.tensor(retained), policy=policy, stash_bytes_per_row=STASH_BPR,
                           backward_bytes_per_row=BACKWARD_BPR, recompute_bytes_per_row=recompute_bpr,
                           lean_stash_bytes_per_row=lean_bpr)
    return SimpleNamespace(layer_number=number, lrmoe_config=config, memory_plan=MemoryPlan(), last_stats=stats)


def warmed_up(config, peak=700 * MB, allocated=100 * MB, monitor=None, recompute_bpr=0, lean_bpr=None):
    """Two stub layers; the planner measured `warmup_steps` steps of `peak` bytes and made its first plan.

    Per layer: stash 1000 rows * 100 kB = 100 MB, backward 500 rows * 200 kB = 100 MB; the warm-up's MoE
    estimate is 2 * 100 MB + 100 MB = 300 MB, so the non-MoE part of a 700 MB peak is 400 MB.
    """
    layers = [stub_layer(n, config, recompute_bpr=recompute_bpr, lean_bpr=lean_bpr) for n in (0, 1)]
    acc = FakeAccelerator(allocated=allocated)
    planner = MemoryPlanner(config, layers, accelerator=acc, monitor=monitor)
    planner.on_step(0)  # starts measuring
    for step in range(1, config.warmup_steps + 1):
        acc.peak = peak
        planner.on_step(step)
    return planner, layers, acc


def test_budget_bytes_arithmetic():
    acc = FakeAccelerator(total=64 * GIB)
    assert MemoryPlanner(LRMoEConfig(), [], accelerator=acc).budget_bytes() is None
    assert MemoryPlanner(LRMoEConfig(budget_gib=10, reserve_gib=1), [], accelerator=acc).budget_bytes() == 9 * GIB
    half = MemoryPlanner(LRMoEConfig(budget_fraction=0.5, reserve_gib=2), [], accelerator=acc)
    assert half.budget_bytes() == 30 * GIB
    with pytest.raises(ValueError, match="leaves nothing above reserve_gib"):
        LRMoEConfig(budget_gib=1, reserve_gib=3)
    with pytest.raises(ValueError, match="budget_fraction 0.01 of this accelerator's 64.0 GiB leaves nothing"):
        MemoryPlanner(LRMoEConfig(budget_fraction=0.01, reserve_gib=1), [], accelerator=acc).budget_bytes()


@pytest.mark.parametrize("policy, expected", [("auto", "stash"), ("stash", "stash"), ("recompute", "recompute")])
def test_unbounded_budget_gives_config_policy_and_no_cap(policy, expected):
    config = LRMoEConfig(policy=policy, warmup_steps=2)
    planner, layers, _ = warmed_up(config, peak=1000 * GIB)  # no budget: any peak is fine
    assert len(planner.plans) == 2 and planner.plans[-1]["reason"] == "unbounded"
    for layer in layers:
        assert layer.memory_plan == MemoryPlan(expected, None)


def test_auto_stashes_when_it_fits_and_caps_rows():
    planner, layers, _ = warmed_up(LRMoEConfig(policy="auto", budget_gib=1, reserve_gib=0, warmup_steps=2))
    plan = planner.plans[-1]
    assert plan["non_moe"] == 400 * MB and plan["stash"] == 220 * MB and plan["backward"] == 110 * MB
    # (1 GiB - 400 MB non-MoE - 220 MB stash) // 200 kB per retained row
    assert [layer.memory_plan for layer in layers] == [MemoryPlan("stash", 2268)] * 2


def test_auto_switches_to_recompute_when_stash_does_not_fit():
    planner, layers, _ = warmed_up(LRMoEConfig(policy="auto", budget_gib=0.6, reserve_gib=0, warmup_steps=2))
    # left = 644245094 - 400 MB = 244 MB < 330 MB (stash + backward with margin): recompute, no stash kept
    assert planner.plans[-1]["left"] == 244245094
    assert [layer.memory_plan for layer in layers] == [MemoryPlan("recompute", 244245094 // BACKWARD_BPR)] * 2


def test_recompute_counts_what_it_keeps():
    """Under recompute the forward still keeps the token inputs (and the expert outputs the exact router gradient
    reads): their bytes come off the room for the backward's rows, as the stash's do under stash."""
    planner, layers, _ = warmed_up(LRMoEConfig(policy="auto", budget_gib=0.6, reserve_gib=0, warmup_steps=2),
                                   recompute_bpr=20_000)
    plan = planner.plans[-1]  # 2 layers x 1000 rows at the most loaded rank x 20 kB, with the 10% margin
    assert plan["recompute_held"] == 44 * MB and plan["left"] == 244245094
    assert [layer.memory_plan for layer in layers] == \
        [MemoryPlan("recompute", (244245094 - 44 * MB) // BACKWARD_BPR)] * 2


@pytest.mark.parametrize("policy, lean_kb, budget_gib, expected", [
    ("auto", 30, 0.6, ("stash", 66, "recomputed")),     # the stash without the outputs keeps less than recompute
    ("auto", 50, 0.6, ("recompute", 88, "saved")),      # ... or more
    ("auto", None, 0.6, ("recompute", 88, "saved")),    # the outputs cannot go (saved by config, or no drops)
    ("stash", 50, 0.6, ("stash", 110, "recomputed")),   # a fixed stash drops its outputs where it does not fit
    ("auto", 30, 1.0, ("stash", 220, "saved")),         # the stash with the outputs fits: it is the fastest
    ("recompute", 30, 0.6, ("recompute", 88, "saved"))])
def test_the_stash_without_expert_outputs_where_the_budget_needs_it(policy, lean_kb, budget_gib, expected):
    """"dropped_router_dots": "auto": where the stash with the exact router gradient's expert outputs does not fit,
    the planner takes the stash that recomputes the dropped pairs' dots instead, if that keeps less than recompute
    (or the policy is stash); the bytes it keeps come off the backward's room and the monitor says so."""
    monitor = RecordingMonitor()
    config = LRMoEConfig(policy=policy, budget_gib=budget_gib, reserve_gib=0, warmup_steps=2)
    planner, layers, _ = warmed_up(config, recompute_bpr=40_000, monitor=monitor,
                                   lean_bpr=None if lean_kb is None else lean_kb * 1000)
    plan = planner.plans[-1]
    want_policy, held_mb, dots = expected
    left = plan["left"]  # 2 layers x 1000 rows x the bytes per row, with the 10% margin
    assert [layer.memory_plan for layer in layers] == \
        [MemoryPlan(want_policy, (left - held_mb * MB) // BACKWARD_BPR, dots)] * 2
    planner.on_step(3)
    assert monitor.named(step=3).get("lrmoe/layer0/router_dots_recomputed") == (1.0 if dots == "recomputed" else None)


H, F, T, k = 16, 4, 64, 2  # the real layers below


def budgeted_real_layer(retention_ratio, budget_bytes):
    """(layer, planner, step(n)): a real fp64 layer on CPU under "auto" and a budget, planned after one warm-up
    step; step(n) is the planner's step hook then one training step."""
    import lrmoe_ds
    torch.manual_seed(0)
    layer = lrmoe_ds.LRMoE(H, num_experts=4, k=k, ffn_hidden_size=F).double()
    config = LRMoEConfig(enabled=True, retention_ratio=retention_ratio, policy="auto", budget_gib=budget_bytes / GIB,
                         reserve_gib=0, warmup_steps=1)
    layer.configure(config)
    planner = MemoryPlanner(config, [layer], accelerator=FakeAccelerator())
    x = torch.randn(T, H, dtype=torch.float64)

    def step(n):
        planner.on_step(n)
        layer(x.clone().requires_grad_(True))[0].sum().backward()
    return layer, planner, step


def test_real_layer_under_a_budget_keeps_the_stash_without_its_expert_outputs():
    """A real layer (fp64, CPU; 2F < H, so the stash without the exact router gradient's expert outputs keeps less
    than recompute's token inputs and outputs) under "auto" and a budget the stash with the outputs exceeds: the
    planner's first plan keeps the stash and recomputes the dropped pairs' dots, and the layer's next step does."""
    layer, planner, step = budgeted_real_layer(retention_ratio=0.5, budget_bytes=70_000)
    step(0)
    stats = layer.last_stats  # per routed row, fp64: stash x/k + h + y, without y, recompute x/k + y
    assert (stats.stash_bytes_per_row, stats.lean_stash_bytes_per_row, stats.recompute_bytes_per_row) == \
        ((H // k + 2 * F + H) * 8, (H // k + 2 * F) * 8, (H // k + H) * 8)
    step(1)  # the warm-up step measured: the first plan
    plan = planner.plans[-1]
    assert plan["stash"] + plan["backward"] > plan["left"] >= plan["stash_dots_recomputed"] + plan["backward"]
    assert layer.memory_plan == MemoryPlan("stash", (plan["left"] - plan["stash_dots_recomputed"]) //
                                           stats.backward_bytes_per_row, "recomputed")
    step(2)
    assert layer.last_stats.dropped_router_dots == "recomputed" and layer.last_stats.policy == "stash"


def test_no_lean_stash_across_ranks():
    """The planner's stash without the expert outputs comes with a row cap, under which pairs may drop; across
    ranks the router's dots come from the rows only where none drops, so no lean stash is planned there, even
    from a step that dropped none. On one rank it is."""
    import lrmoe_ds
    from lrmoe_ds.retention import BackwardSpec
    layer = lrmoe_ds.LRMoE(16, num_experts=4, k=2, ffn_hidden_size=4)
    layer.configure(LRMoEConfig(enabled=True))  # "dropped_router_dots": "auto"

    def capped(may_drop, dots):
        stats = RetentionStats(None, None, None, None, "stash", **layer._row_bytes(BackwardSpec(may_drop=may_drop),
                                                                                   torch.bfloat16))
        return stats.held_bytes_per_row("stash", dots, capped=True)
    for may_drop in (False, True):
        assert capped(may_drop, "recomputed") < capped(may_drop, "saved")
    layer.ep_size = 2  # _row_bytes reads the layout alone
    for may_drop in (False, True):
        assert capped(may_drop, "recomputed") == capped(may_drop, "saved")


def test_exact_until_the_budget_plans_what_a_capped_step_keeps():
    """Retention 1.0 with a budget: the warm-up steps drop nothing (on one rank the stash keeps the rows, and the
    router's dots come from them: no outputs kept), but every budgeted plan caps the rows, and a capped step keeps
    x, and the outputs where the dots are not recomputed. The plan weighs those: here the stash with the dots
    recomputed fits and is lighter than "recompute" with its outputs; the capped step then keeps what was planned."""
    # per row, fp64, capped: stash 256 (x/k + h + y), lean 128, recompute 192 (x/k + y); backward 576
    layer, planner, step = budgeted_real_layer(retention_ratio=1.0, budget_bytes=105_000)
    step(0)
    stats = layer.last_stats
    assert stats.held_bytes_per_row("stash") == (H + 2 * F) * 8  # this step's: the rows and h
    assert stats.capped_bytes_per_row == ((H // k + 2 * F + H) * 8, (H // k + 2 * F) * 8, (H // k + H) * 8)
    step(1)
    plan = planner.plans[-1]
    assert plan["stash"] + plan["backward"] > plan["left"] >= plan["stash_dots_recomputed"] + plan["backward"]
    assert plan["stash_dots_recomputed"] < plan["recompute_held"]
    assert layer.memory_plan.policy == "stash" and layer.memory_plan.dropped_router_dots == "recomputed"
    step(2)
    assert layer.last_stats.capped_bytes_per_row is None  # capped now
    assert layer.last_stats.held_bytes_per_row("stash", "recomputed") == (H // k + 2 * F) * 8


def test_fixed_stash_policy_keeps_stash_and_floors_cap_at_one():
    _, layers, _ = warmed_up(LRMoEConfig(policy="stash", budget_gib=0.6, reserve_gib=0, warmup_steps=2))
    assert layers[0].memory_plan == MemoryPlan("stash", (244245094 - 220 * MB) // BACKWARD_BPR)
    _, layers, _ = warmed_up(LRMoEConfig(policy="stash", budget_gib=0.3, reserve_gib=0, warmup_steps=2))
    assert layers[0].memory_plan == MemoryPlan("stash", 1)


def test_static_memory_floors_the_non_moe_part():
    planner, _, _ = warmed_up(LRMoEConfig(budget_gib=1, reserve_gib=0, warmup_steps=1), allocated=500 * MB)
    planner.static_bytes = 500 * MB  # as attach measures it: more than the 400 MB the peak leaves
    planner.replan()
    assert planner.plans[-1]["non_moe"] == 500 * MB


def test_peak_over_budget_lowers_the_cap_by_the_excess():
    config = LRMoEConfig(policy="auto", budget_gib=1, reserve_gib=0, warmup_steps=2)
    planner, layers, acc = warmed_up(config)
    n_plans = len(planner.plans)
    acc.peak = GIB - 1  # under budget: no new plan
    planner.on_step(3)
    assert len(planner.plans) == n_plans and layers[0].memory_plan.max_rows_per_rank == 2268
    acc.peak = GIB + 50 * MB
    planner.on_step(4)
    assert len(planner.plans) == n_plans + 1 and planner.plans[-1]["excess"] == 50 * MB
    # from the 500 rows actually retained (under the 2268 cap), less ceil(55 MB / 200 kB) = 275 rows
    assert [layer.memory_plan for layer in layers] == [MemoryPlan("stash", 225)] * 2
    acc.peak = GIB + 500 * MB
    planner.on_step(5)
    assert layers[0].memory_plan == MemoryPlan("stash", 1)


def test_monitor_events_names_and_values():
    monitor = RecordingMonitor()
    config = LRMoEConfig(policy="recompute", budget_gib=1, reserve_gib=0, warmup_steps=1, report_interval=100)
    planner, layers, acc = warmed_up(config, monitor=monitor)
    events = monitor.named(step=1)  # written before the plan: the warm-up plan, uncapped
    assert events["lrmoe/peak_memory_gib"] == pytest.approx(700 * MB / GIB)
    assert events["lrmoe/budget_gib"] == 1.0
    assert events["lrmoe/layer0/retention"] == pytest.approx(0.8) and events["lrmoe/layer1/retention"] == 0.8
    assert events["lrmoe/layer0/policy_recompute"] == 1.0
    assert "lrmoe/layer0/max_rows_per_rank" not in events
    assert "lrmoe/layer0/replica_rows" not in events                 # written only where replicas ran rows
    acc.peak = 600 * MB
    layers[1].last_stats.replica_rows = 120
    planner.on_step(2)
    events = monitor.named(step=2)
    assert events["lrmoe/layer1/max_rows_per_rank"] == layers[1].memory_plan.max_rows_per_rank
    assert events["lrmoe/layer1/replica_rows"] == 120.0 and "lrmoe/layer0/replica_rows" not in events
    assert not any("expert" in name for name in monitor.named())
    assert all(step in (1, 2) for _, _, step in monitor.events)


def test_disabled_monitor_gets_nothing():
    monitor = RecordingMonitor()
    monitor.enabled = False
    warmed_up(LRMoEConfig(warmup_steps=2), monitor=monitor)
    assert monitor.events == []


def test_per_expert_events_every_report_interval():
    monitor = RecordingMonitor()
    warmed_up(LRMoEConfig(warmup_steps=5, report_interval=2), monitor=monitor)  # steps 1..5
    steps = sorted({s for name, _, s in monitor.events if "/expert" in name})
    assert steps == [2, 4]
    at2 = monitor.named(step=2)
    assert [at2[f"lrmoe/layer0/expert{e}/retention"] for e in range(3)] == [0.5, 1.0, 1.0]  # n_1 = 0 -> 1.0


def test_retention_events_use_the_backwards_kept_counts_where_it_chose_them():
    """Under "threshold" the quotas are caps; the backward's kept counts (set_kept) are what was retained."""
    monitor = RecordingMonitor()
    planner, layers, acc = warmed_up(LRMoEConfig(warmup_steps=1, report_interval=2), monitor=monitor)
    layers[0].last_stats.set_kept(torch.tensor([100, 0, 300]))   # counts (400, 0, 600): 0.4 kept in all
    planner.on_step(2)
    at2 = monitor.named(step=2)
    assert at2["lrmoe/layer0/retention"] == pytest.approx(0.4) and at2["lrmoe/layer1/retention"] == pytest.approx(0.8)
    assert [at2[f"lrmoe/layer0/expert{e}/retention"] for e in range(3)] == [0.25, 1.0, 0.5]


def test_forward_pre_hook_calls_on_step_once_per_global_step():
    planner = MemoryPlanner(LRMoEConfig(), [], accelerator=FakeAccelerator())
    engine = SimpleNamespace(module=torch.nn.Linear(2, 2), global_steps=0, monitor=RecordingMonitor(),
                             optimizer=None, device=torch.device("cpu"))
    planner.attach(engine)
    assert planner.monitor is engine.monitor
    calls = []
    planner.on_step = calls.append
    x = torch.zeros(1, 2)
    for step in range(3):
        engine.global_steps = step
        for _ in range(4):  # gradient accumulation: four forwards per optimizer step
            engine.module(x)
    engine.module.eval()
    engine.global_steps = 3
    engine.module(x)  # evaluation: not a training step
    assert calls == [0, 1, 2]


def test_on_step_gives_layers_the_optimizer_step():
    """The retention schedule's clock: each layer learns the optimizer step at its first forward."""
    layers = [SimpleNamespace(optimizer_step=None, last_stats=None, memory_plan=MemoryPlan(), layer_number=i)
              for i in range(2)]
    planner = MemoryPlanner(LRMoEConfig(enabled=True), layers, accelerator=FakeAccelerator())
    for step in (0, 7):
        planner.on_step(step)
        assert [layer.optimizer_step for layer in layers] == [step, step]


def test_attach_counts_zero_partitions_and_optimizer_state():
    inner = SimpleNamespace(state={"p": {"exp_avg": torch.zeros(250), "exp_avg_sq": torch.zeros(250), "step": 3}})
    zero = SimpleNamespace(single_partition_of_fp32_groups=[torch.zeros(1000)], optimizer=inner)
    assert optimizer_bytes(zero) == (4000, 2000)
    assert optimizer_bytes(None) == (0, 0)
    planner = MemoryPlanner(LRMoEConfig(), [], accelerator=FakeAccelerator(allocated=10))
    planner.attach(SimpleNamespace(module=torch.nn.Linear(1, 1), global_steps=0, monitor=None, optimizer=zero))
    assert planner.static_bytes == 6000


def test_real_cpu_accelerator():
    config = LRMoEConfig(budget_fraction=0.5, reserve_gib=0, warmup_steps=2)
    layers = [stub_layer(0, config)]
    planner = MemoryPlanner(config, layers)  # DeepSpeed's own accelerator: CPU here (psutil RSS)
    total = planner.accelerator.total_memory()
    assert total > 0 and planner.budget_bytes() == int(0.5 * total)
    planner.attach(SimpleNamespace(module=torch.nn.Linear(1, 1), global_steps=0, monitor=None, optimizer=None))
    assert 0 < planner.static_bytes < total
    for step in range(3):
        planner.on_step(step)
    assert 0 < planner.warmup_peak < total
    assert planner.plans[-1]["reason"] == "budget"
    assert layers[0].memory_plan.policy == "stash" and layers[0].memory_plan.max_rows_per_rank >= 1


class NoMemoryAccelerator:
    def total_memory(self):
        raise RuntimeError("no accounting")


def test_accelerator_without_memory_queries_does_not_crash():
    config = LRMoEConfig(budget_fraction=0.5, warmup_steps=1)
    planner = MemoryPlanner(config, [stub_layer(0, config)], accelerator=NoMemoryAccelerator())
    with pytest.raises(ValueError, match="reports no total memory: give budget_gib instead"):
        planner.budget_bytes()  # a fraction of nothing: said, not planned as a 1-row cap
    config = LRMoEConfig(budget_gib=2, reserve_gib=1, warmup_steps=1)
    planner = MemoryPlanner(config, [stub_layer(0, config)], accelerator=NoMemoryAccelerator())
    planner.on_step(0)
    planner.on_step(1)
    assert planner.plans[-1]["layers"][0].max_rows_per_rank > 1  # planned from the budget (peaks read as 0)


@pytest.mark.parametrize("allocation", ["waterfill", "threshold"])
def test_replan_over_budget_counts_the_rows_the_backward_kept(allocation):
    """Under "threshold" the quotas are only caps: the planner reads the rows the backward kept (not every routed
    row), so a step over budget lowers the kept rows under both allocations alike."""
    import lrmoe_ds
    torch.manual_seed(0)
    layer = lrmoe_ds.LRMoE(H, num_experts=4, k=k, ffn_hidden_size=F).double()
    config = LRMoEConfig(enabled=True, retention_ratio=0.5, quota_allocation=allocation, budget_gib=1, reserve_gib=0)
    layer.configure(config)
    planner = MemoryPlanner(config, [layer], accelerator=FakeAccelerator())
    x = torch.randn(T, H, dtype=torch.float64)

    def kept_rows():
        layer(x.clone().requires_grad_(True))[0].square().sum().backward()
        return int(layer.last_stats.retained().sum())

    assert kept_rows() == T * k // 2 == int(layer.last_stats.retained_per_rank.sum())
    planner.replan(planner.budget_bytes() + 20 * layer.last_stats.backward_bytes_per_row)
    assert layer.memory_plan.max_rows_per_rank < T * k // 2 and kept_rows() <= layer.memory_plan.max_rows_per_rank


def test_budget_fraction_is_of_the_smallest_ranks_accelerator():
    """Unlike devices must still make one plan: budget_fraction takes the smallest total over the ranks (here a
    stand-in for the cross-rank max, another rank having 32 GiB), read once."""
    acc = FakeAccelerator(total=64 * GIB)
    planner = MemoryPlanner(LRMoEConfig(budget_fraction=0.5, reserve_gib=2), [], accelerator=acc)
    planner._max_over_ranks = lambda *values: [max(v, -32 * GIB) for v in values]
    assert planner.budget_bytes() == 14 * GIB
    acc.total = 8 * GIB  # read once: later calls plan from the same budget
    assert planner.budget_bytes() == 14 * GIB
