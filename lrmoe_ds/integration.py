"""Connecting the "lrmoe" config block to a model and to DeepSpeed's engine."""
import glob
import os
import time
from typing import Any, Dict, List, Optional

import deepspeed
import torch.distributed as dist
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.utils import logger
from torch import nn

from lrmoe_ds.balancing import ExpertBiasBalancer
from lrmoe_ds.config import LRMoEConfig, parse_config
from lrmoe_ds.layer import LRMoE
from lrmoe_ds.planner import MemoryPlanner


def lrmoe_layers(model: nn.Module) -> List[LRMoE]:
    """The LRMoE layers of a model, in module order."""
    return [m for m in model.modules() if isinstance(m, LRMoE)]


def configure_model(model: nn.Module, config: Optional[LRMoEConfig] = None) -> LRMoEConfig:
    """Apply an "lrmoe" block to every LRMoE layer of ``model`` (numbering the layers for seeding)."""
    config = config or LRMoEConfig()
    for number, layer in enumerate(lrmoe_layers(model)):
        layer.configure(config, layer_number=number)
    return config


def initialize(args=None, model: Optional[nn.Module] = None, config: Any = None,
               model_parameters: Optional[Any] = None, **kwargs):
    """``deepspeed.initialize`` for models with LRMoE layers.

    Reads and validates the config's "lrmoe" block (the config given here, ``config_params``, or
    ``args.deepspeed_config``) before anything starts, configures every LRMoE layer with it, builds
    DeepSpeed's MoE parameter groups when ``model_parameters`` is not given, then calls
    ``deepspeed.initialize`` with the same arguments, and (when the block is enabled) attaches a
    :class:`~lrmoe_ds.planner.MemoryPlanner` as ``engine.lrmoe_planner``, which sets each layer's
    activation policy and retention cap from the memory budget and logs to DeepSpeed's monitor; with
    ``expert_bias_update_rate`` > 0, an :class:`~lrmoe_ds.balancing.ExpertBiasBalancer` as
    ``engine.lrmoe_balancer``, which updates the layers' selection biases after every optimizer step.
    Returns ``(engine, optimizer, dataloader, lr_scheduler)`` as ``deepspeed.initialize`` does.
    """
    if model is None:
        raise ValueError("lrmoe_ds.initialize needs a model")
    # wherever deepspeed.initialize would read the config from: config, config_params (its older name), the args
    source = next((c for c in (config, kwargs.get("config_params"), getattr(args, "deepspeed_config", None),
                               getattr(args, "deepscale_config", None)) if c is not None), None)
    lrmoe_config = configure_model(model, parse_config(source))
    if model_parameters is None:
        params: Dict[str, Any] = {"params": [p for p in model.parameters() if p.requires_grad], "name": "parameters"}
        model_parameters = split_params_into_different_moe_groups_for_optimizer(params)
    if config is not None:
        kwargs["config"] = config
    engine, *rest = deepspeed.initialize(args=args, model=model, model_parameters=model_parameters, **kwargs)
    if lrmoe_config.expert_bias_update_rate > 0:
        engine.lrmoe_balancer = ExpertBiasBalancer(lrmoe_layers(model), lrmoe_config.expert_bias_update_rate)
        engine.lrmoe_balancer.attach(engine)
    if not lrmoe_config.enabled and (lrmoe_config.budget_gib is not None or lrmoe_config.budget_fraction is not None):
        logger.warning('LRMoE: the "lrmoe" block sets a memory budget but "enabled" is false: every layer is exact, '
                       "no planner is attached and the budget is not used")
    if lrmoe_config.enabled and lrmoe_layers(model):
        # the memory planner follows every training step through a forward pre-hook on the engine's module
        engine.lrmoe_planner = MemoryPlanner(lrmoe_config, lrmoe_layers(model))
        engine.lrmoe_planner.attach(engine)
    return (engine, *rest)


def cpu_allreduce_segments(port: Any = "*", addr: str = "*", rank: Any = "*") -> List[str]:
    """The /dev/shm segments of DeepSpeed's CPU all-reduce for a rendezvous (``MASTER_ADDR``, ``MASTER_PORT``).

    DeepSpeed 0.19 (ops/csrc/cpu/comm/shm.cpp) creates one 69 MB segment per rank under this name and
    never unlinks it, so every CPU launch leaves 69 MB per rank in shared memory until the machine
    restarts: a few hundred test launches filled 20 GB of a 24 GB machine."""
    return glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}")


def remove_cpu_allreduce_segments(port: Any = "*", addr: str = "*", rank: Any = "*") -> None:
    """Unlinks the segments :func:`cpu_allreduce_segments` names (memory returns once no process maps them)."""
    for path in cpu_allreduce_segments(port, addr, rank):
        try:
            os.unlink(path)
        except FileNotFoundError:  # another rank or process got there first
            pass


def shutdown() -> None:
    """Ends a distributed run in order: a barrier (no rank leaves while another still talks to it), this
    rank's CPU all-reduce segment unlinked (every rank has mapped it by now), then gloo/NCCL torn down, and
    a pause for the backends' worker threads.

    Why the pause: a gloo worker thread drops its finished collective (and with it the last reference to a
    Python-made tensor) a moment after the caller's wait returns. If Python is finalizing by then, the
    thread's wait for the GIL ends it with pthread_exit inside C++ code that may not unwind, and the
    process aborts ("terminate called without an active exception"; caught with a std::terminate
    backtrace in ProcessGroupGloo::runLoop -> TensorImpl::decref_pyobject -> PyEval_AcquireThread: 2 of
    about 190 two-rank test launches on a 2-core machine). destroy_process_group does not join those threads."""
    if not dist.is_initialized():
        return
    dist.barrier()
    remove_cpu_allreduce_segments(os.environ.get("MASTER_PORT", "*"), os.environ.get("MASTER_ADDR", "*"),
                                  dist.get_rank())
    dist.destroy_process_group()
    time.sleep(0.25)
