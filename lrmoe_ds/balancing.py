"""Aux-loss-free load balancing: the selection bias of each router moves towards balance after every
optimizer step (DeepSeek-V3's rule, as Megatron-Core's ``moe_router_bias_update_rate`` applies it):

    b_e += rate * sign(mean_e' n_e' - n_e)

with n_e the pairs routed to expert e over the step (every micro-batch, every rank: one all-reduce of
the [layers, E] counts per step). The bias only selects experts; the gate weights never see it.
"""
from typing import List

import torch
import torch.distributed as dist

from lrmoe_ds.layer import LRMoE


class ExpertBiasBalancer:
    """Counts the pairs per expert of every training forward of ``layers`` (a forward hook each; no
    host synchronisation) and updates their ``score_bias`` in :meth:`update`, once per optimizer step.

    Recomputed forwards (activation checkpointing) count their layer twice, which leaves the update unchanged:
    it depends only on each count's sign against the layer's mean."""

    def __init__(self, layers: List[LRMoE], rate: float):
        self.layers = [layer for layer in layers if layer.deepspeed_moe.gate.score_bias is not None]
        if not self.layers:
            raise ValueError("expert_bias_update_rate > 0 needs LRMoE layers built with expert_bias=True "
                             "(a selection bias to update); this model has none")
        if rate <= 0:
            raise ValueError(f"expert_bias_update_rate must be > 0 here, got {rate}")
        self.rate = rate
        self.counts = [None] * len(self.layers)
        self.hooks = [layer.register_forward_hook(self._counter(i)) for i, layer in enumerate(self.layers)]

    def _counter(self, i: int):
        def count(module, inputs, outputs):
            if module.training:
                pairs = outputs[2].detach()
                self.counts[i] = pairs.clone() if self.counts[i] is None else self.counts[i].add_(pairs)
        return count

    @torch.no_grad()
    def update(self) -> None:
        """Move every bias by the counts since the last update, then start counting afresh. Collective:
        every rank calls it (it sums the counts over the default process group when one exists)."""
        if all(c is None for c in self.counts):
            return  # no training forward since the last update (the same on every rank)
        like = next(c for c in self.counts if c is not None)
        counts = torch.stack([like.new_zeros(like.shape) if c is None else c for c in self.counts]).float()
        self.counts = [None] * len(self.layers)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        offset = torch.sign(counts.mean(dim=1, keepdim=True) - counts)
        for layer, step in zip(self.layers, offset):
            bias = layer.deepspeed_moe.gate.score_bias
            bias.add_(step.to(bias.dtype), alpha=self.rate)

    def attach(self, engine) -> None:
        """Update right after each optimizer step of a DeepSpeed engine (its ``step()`` at a gradient-accumulation
        boundary, seen as ``global_steps`` advancing), so that a checkpoint saved after the step holds the updated
        bias and nothing is left pending: a resumed run moves its biases as an uninterrupted one does."""
        step = engine.step

        def step_then_update(*args, **kwargs):
            before = engine.global_steps
            out = step(*args, **kwargs)
            if engine.global_steps != before:
                self.update()
            return out

        engine.step = step_then_update
        self._engine = engine

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        engine = getattr(self, "_engine", None)
        if engine is not None and "step" in vars(engine):
            del engine.step  # the class's own step again
        self._engine = None
