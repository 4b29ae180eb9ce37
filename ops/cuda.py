"""The CUDA side of the op API: loads the kernels of ``csrc/`` on first use and wraps them.

Each function has the name, signature and results of its twin in ``reference.py`` (the
specification); it allocates the outputs and calls the extension on the current stream. None of
them synchronises with the host (pass group sizes as CUDA tensors: a host tensor is copied over),
except ``topk_retention`` and ``priority_sample`` called without ``num_kept``: their output length
sum_g min(q_g, n_g) is data-dependent, so they read one 3-element summary (that length and two input
checks) back to the host, once, after all of their kernels have been queued.
"""
import importlib
import threading
import warnings
from typing import Optional, Sequence

import torch

from . import reference

_ext = None
_lock = threading.Lock()


def load():
    """The extension module: the ahead-of-time build (``LRMOE_BUILD_OPS=1``) if installed, else a
    cached JIT build through DeepSpeed's op builder. Raises RuntimeError with the reason."""
    global _ext
    if _ext is not None:
        return _ext
    with _lock:
        if _ext is None:
            try:
                _ext = importlib.import_module("._C", __package__)
            except ImportError:
                if not torch.cuda.is_available():
                    raise RuntimeError("lrmoe_ds CUDA ops need a CUDA device; torch sees none")
                from .builder import LRMoEOpBuilder
                try:
                    _ext = LRMoEOpBuilder().load(verbose=False)
                except Exception as exc:
                    raise RuntimeError(f"building the lrmoe_ds CUDA ops failed: {type(exc).__name__}: {exc}") from exc
            _warn_if_untuned_cutlass(_ext.cutlass_version())
    return _ext


def _warn_if_untuned_cutlass(version: str):
    # Other releases compile but change the kernels' speed: with 4.5.0 the default wgrad ran up to 26% slower
    # (benchmarks/results/grouped_gemm_h100_cutlass45_ab.md), with 3.8.0 the median ratio to
    # torch._grouped_mm fell from 0.99 to 0.94 (grouped_gemm_h100_cutlass38.md).
    from .builder import TUNED_CUTLASS
    if version != TUNED_CUTLASS:
        warnings.warn(f"lrmoe_ds CUDA ops built with CUTLASS {version}; their kernel choices were measured with "
                      f"{TUNED_CUTLASS} (pip install nvidia-cutlass=={TUNED_CUTLASS}.0 --no-deps, CUTLASS_PATH unset)")


def _long_on(t: torch.Tensor, device) -> torch.Tensor:
    return t.reshape(-1).to(device=device, dtype=torch.long).contiguous()


def routing_plan(group_of_pair: torch.Tensor, num_groups: int):
    g = group_of_pair.reshape(-1).contiguous()
    P = g.numel()
    counts = torch.empty(num_groups, dtype=torch.long, device=g.device)
    order = torch.empty(P, dtype=torch.long, device=g.device)
    offsets = torch.empty(num_groups + 1, dtype=torch.long, device=g.device)
    load().routing_plan(g, int(num_groups), counts, order, offsets)
    return counts, order, offsets


def permute(x: torch.Tensor, row_index: torch.Tensor, row_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    x = x.contiguous()
    index = row_index.reshape(-1).contiguous()
    if x.dim() != 2:
        raise ValueError(f"permute: x must be [T, H], got shape {tuple(x.shape)}")
    out = x.new_empty(index.numel(), x.shape[1])
    if row_scale is None:
        load().permute(x, index, out)
    else:
        load().permute_scaled(x, index, row_scale.reshape(-1).contiguous(), out)
    return out


def unpermute(rows: torch.Tensor, row_of_pair: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows, row_of_pair, weight = rows.contiguous(), row_of_pair.contiguous(), weight.contiguous()
    if row_of_pair.dim() != 2 or rows.dim() != 2:
        raise ValueError(f"unpermute: rows must be [P, H] and row_of_pair [T, K]; got {tuple(rows.shape)} "
                         f"and {tuple(row_of_pair.shape)}")
    out = rows.new_empty(row_of_pair.shape[0], rows.shape[1])
    load().unpermute(rows, row_of_pair, weight, out)
    return out


def unpermute_weight_grad(rows: torch.Tensor, row_of_pair: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    rows, row_of_pair, dout = rows.contiguous(), row_of_pair.contiguous(), dout.contiguous()
    if row_of_pair.dim() != 2:
        raise ValueError(f"unpermute_weight_grad: row_of_pair must be [T, K], got shape {tuple(row_of_pair.shape)}")
    out = torch.empty(row_of_pair.shape, dtype=torch.float32, device=rows.device)
    load().unpermute_weight_grad(rows, row_of_pair, dout, out)
    return out


def unpermute_backward(rows: torch.Tensor, row_of_pair: torch.Tensor, weight: torch.Tensor, dout: torch.Tensor,
                       d_row_of_pair: Optional[torch.Tensor] = None, num_d_rows: Optional[int] = None):
    rows, row_of_pair, dout = rows.contiguous(), row_of_pair.contiguous(), dout.contiguous()
    if row_of_pair.dim() != 2:
        raise ValueError(f"unpermute_backward: row_of_pair must be [T, K], got shape {tuple(row_of_pair.shape)}")
    if (d_row_of_pair is None) != (num_d_rows is None):
        raise ValueError("unpermute_backward: d_row_of_pair and num_d_rows come together")
    weight = weight.to(torch.float32).contiguous()  # exact for half and bfloat16 weights; rounded to rows' dtype inside
    if d_row_of_pair is None:
        d_rows = torch.empty_like(rows)
    else:
        d_row_of_pair = d_row_of_pair.contiguous()
        d_rows = rows.new_empty(num_d_rows, rows.shape[-1])
    d_weight = torch.empty(row_of_pair.shape, dtype=torch.float32, device=rows.device)
    load().unpermute_backward(rows, row_of_pair, weight, dout, d_rows, d_weight, d_row_of_pair)
    return d_rows, d_weight


def swiglu(h: torch.Tensor) -> torch.Tensor:
    h = h.contiguous()
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"swiglu: h must be [M, 2F], got shape {tuple(h.shape)}")
    out = h.new_empty(h.shape[0], h.shape[1] // 2)
    load().swiglu(h, out)
    return out


def swiglu_backward(h: torch.Tensor, da: torch.Tensor, inplace: bool = False, with_activation: bool = False,
                    index: Optional[torch.Tensor] = None, with_dot: bool = False):
    if inplace and index is not None:
        raise ValueError("swiglu_backward: inplace writes over h's own rows; it takes no index")
    if inplace and not h.is_contiguous():
        raise ValueError("swiglu_backward: inplace needs a contiguous h")
    h, da = h.contiguous(), da.contiguous()
    if index is not None:
        index = index.contiguous()
    M = h.shape[0] if index is None else index.shape[0]
    dh = h if inplace else h.new_empty((M,) + tuple(h.shape[1:]))
    a = h.new_empty(M, h.shape[1] // 2) if with_activation and h.dim() == 2 else None
    dot = h.new_empty(M, dtype=torch.float32) if with_dot else None
    load().swiglu_backward(h, da, dh, a, index, dot)
    return (dh, a, dot) if with_dot else (dh, a) if with_activation else dh


def swiglu_dot(h: torch.Tensor, dz: torch.Tensor, index: Optional[torch.Tensor] = None) -> torch.Tensor:
    h, dz = h.contiguous(), dz.contiguous()
    if index is not None:
        index = index.contiguous()
    dot = h.new_empty(h.shape[0] if index is None else index.shape[0], dtype=torch.float32)
    load().swiglu_dot(h, dz, index, dot)
    return dot


def _retention_inputs(name: str, scores: torch.Tensor, group_sizes: torch.Tensor, quotas: torch.Tensor):
    if scores.dim() != 1:
        raise ValueError(f"{name}: scores must be [P], got shape {tuple(scores.shape)}")
    dev = scores.device
    sizes, quotas = _long_on(group_sizes, dev), _long_on(quotas, dev)
    if sizes.numel() != quotas.numel():
        raise ValueError(f"{name}: {quotas.numel()} quotas for {sizes.numel()} groups")
    P, G = scores.numel(), sizes.numel()
    kept = torch.empty(P, dtype=torch.long, device=dev)
    kept_sizes = torch.empty(G, dtype=torch.long, device=dev)
    summary = torch.empty(3, dtype=torch.long, device=dev)
    return scores.contiguous(), sizes, quotas, kept, kept_sizes, summary


def _kept_count(name: str, P: int, summary: torch.Tensor, num_kept) -> int:
    if num_kept is not None:  # the caller knows the size: no host read
        return num_kept
    # Host synchronisation (the only one in these ops): the kept count sizes the output.
    n_kept, total, negative = summary.tolist()
    if total != P:
        raise ValueError(f"{name}: {P} scores for groups summing to {total}")
    if negative:
        raise ValueError(f"{name}: quotas must be >= 0")
    return n_kept


def topk_retention(scores: torch.Tensor, group_sizes: torch.Tensor, quotas: torch.Tensor, num_kept=None):
    scores, sizes, quotas, kept, kept_sizes, summary = _retention_inputs("topk_retention", scores, group_sizes, quotas)
    threshold = torch.empty(sizes.numel(), dtype=scores.dtype, device=scores.device)
    load().topk_retention(scores, sizes, quotas, kept, kept_sizes, threshold, summary)
    return kept[:_kept_count("topk_retention", scores.numel(), summary, num_kept)], kept_sizes, threshold


def priority_sample(metric: torch.Tensor, group_sizes: torch.Tensor, quotas: torch.Tensor, u=None, num_kept=None):
    metric, sizes, quotas, kept, kept_sizes, summary = _retention_inputs("priority_sample", metric, group_sizes, quotas)
    threshold = torch.empty(sizes.numel(), dtype=torch.float32, device=metric.device)
    scale = torch.empty(metric.numel(), dtype=torch.float32, device=metric.device)
    load().priority_sample(metric, None if u is None else u.contiguous(), sizes, quotas, kept, kept_sizes, threshold,
                           scale, summary)
    n = _kept_count("priority_sample", metric.numel(), summary, num_kept)
    return kept[:n], scale[:n], kept_sizes, threshold


def retained_pairs(kept: torch.Tensor, scale: torch.Tensor, order: torch.Tensor, weight_of_row: torch.Tensor, k: int,
                   rescale: bool = True):
    n, P, dev = kept.numel(), order.numel(), kept.device
    if k < 1 or P % k:
        raise ValueError(f"retained_pairs: {P} send rows are not a multiple of k = {k}")
    rw_dtype = torch.float32 if rescale else weight_of_row.dtype
    kept_pairs, src = torch.empty(n, dtype=torch.long, device=dev), torch.empty(n, dtype=torch.long, device=dev)
    gate = torch.empty(n, dtype=weight_of_row.dtype, device=dev)
    row_weight = torch.empty(n, dtype=rw_dtype, device=dev)
    kept_row_of_pair = torch.empty(P // k, k, dtype=torch.long, device=dev)
    pair_weight = torch.empty(P // k, k, dtype=rw_dtype, device=dev)
    load().retained_pairs(kept.contiguous(), scale.contiguous(), order.contiguous(), weight_of_row.contiguous(), k,
                          rescale, kept_pairs, src, gate, row_weight, kept_row_of_pair, pair_weight)
    return kept_pairs, src, gate, row_weight, kept_row_of_pair, pair_weight


def retention_metric(order: torch.Tensor, topk_weight: torch.Tensor, metric: str, dout_norm=None, x_norm=None,
                     group_sizes=None):
    if metric not in reference.RETENTION_METRICS:
        raise ValueError(f"unknown retention metric {metric!r}; expected one of {', '.join(reference.RETENTION_METRICS)}")
    if metric == "grad_norm" and (dout_norm is None or x_norm is None):
        raise ValueError('retention_metric: "grad_norm" needs dout_norm and x_norm')
    dev, P = order.device, order.numel()
    weight_of_row = torch.empty(P, dtype=topk_weight.dtype, device=dev)
    m = torch.empty(P, dtype=torch.float32, device=dev)
    sizes = mass = None
    if group_sizes is not None:
        sizes = _long_on(group_sizes, dev)
        mass = torch.empty(sizes.numel(), dtype=torch.float32, device=dev)
    norms = (None, None) if metric != "grad_norm" else (dout_norm.contiguous(), x_norm.contiguous())
    load().retention_metric(order.contiguous(), topk_weight.contiguous(), reference.RETENTION_METRICS.index(metric),
                            *norms, sizes, weight_of_row, m, mass)
    return weight_of_row, m, mass


def capacity_route(pair_group, pair_rank, instance_group, instance_rank, instance_capacity) -> torch.Tensor:
    dev = pair_group.device
    args = [_long_on(t, dev) for t in (pair_group, pair_rank, instance_group, instance_rank, instance_capacity)]
    out = torch.empty(args[0].numel(), dtype=torch.long, device=dev)
    load().capacity_route(*args, out)
    return out


def _float32_logits(logits: torch.Tensor, name: str) -> torch.Tensor:
    if logits.dtype != torch.float32:
        raise ValueError(f"{name}: the CUDA kernel takes float32 logits, got {logits.dtype}; "
                         f"float64 runs on the torch reference (backend 'torch', or 'auto', which picks it)")
    return logits.contiguous()


def router_topk(logits: torch.Tensor, k: int, score_func: str = "softmax", norm_topk_prob: bool = True,
                score_bias: Optional[torch.Tensor] = None):
    reference._check_router(logits, k, score_func, score_bias)
    logits = _float32_logits(logits, "router_topk")
    T, E = logits.shape
    dev = logits.device
    topk_index = torch.empty(T, k, dtype=torch.long, device=dev)
    topk_weight = torch.empty(T, k, dtype=torch.float32, device=dev)
    counts = torch.empty(E, dtype=torch.long, device=dev)
    prob_sum = torch.empty(E, dtype=torch.float32, device=dev)
    if score_bias is not None:  # the reference adds the bias in the logits' dtype too
        score_bias = score_bias.to(device=dev, dtype=torch.float32).contiguous()
    load().router_topk(logits, int(k), score_func == "sigmoid", bool(norm_topk_prob), score_bias, topk_index,
                       topk_weight, counts, prob_sum)
    return topk_index, topk_weight, counts, prob_sum


def router_topk_backward(logits: torch.Tensor, topk_index: torch.Tensor, d_topk_weight: torch.Tensor,
                         d_prob_sum: Optional[torch.Tensor], score_func: str = "softmax",
                         norm_topk_prob: bool = True) -> torch.Tensor:
    K = topk_index.shape[-1] if topk_index.dim() else 0
    reference._check_router(logits, K, score_func, None, topk_index, d_topk_weight, d_prob_sum)
    logits = _float32_logits(logits, "router_topk_backward")
    d_logits = torch.empty_like(logits)
    if d_prob_sum is not None:
        d_prob_sum = d_prob_sum.float().contiguous()
    load().router_topk_backward(logits, topk_index.long().contiguous(), d_topk_weight.float().contiguous(),
                                d_prob_sum, score_func == "sigmoid", bool(norm_topk_prob), d_logits)
    return d_logits


_FWD, _DGRAD, _WGRAD = 0, 1, 2


def _groups(tensors):
    """The extension's group tensors: a stacked [G, N, K] tensor goes as one (the extension steps through it), else
    the G tensors themselves."""
    return [tensors] if isinstance(tensors, torch.Tensor) else tensors


def grouped_linear(x: torch.Tensor, weights: Sequence[torch.Tensor], group_sizes: torch.Tensor) -> torch.Tensor:
    reference._check_groups(x, weights, group_sizes, dim=1)
    x = x.contiguous()
    out = x.new_empty(x.shape[0], weights[0].shape[0])
    load().grouped_gemm(_FWD, x, None, _groups(weights), _long_on(group_sizes, x.device), out, False)
    return out


def grouped_linear_dgrad(dy: torch.Tensor, weights: Sequence[torch.Tensor], group_sizes: torch.Tensor) -> torch.Tensor:
    reference._check_groups(dy, weights, group_sizes, dim=0)
    dy = dy.contiguous()
    out = dy.new_empty(dy.shape[0], weights[0].shape[1])
    load().grouped_gemm(_DGRAD, dy, None, _groups(weights), _long_on(group_sizes, dy.device), out, False)
    return out


def grouped_linear_wgrad(dy: torch.Tensor, x: torch.Tensor, group_sizes: torch.Tensor,
                         out: Optional[Sequence[torch.Tensor]] = None, accumulate: bool = False):
    if dy.shape[0] != x.shape[0]:
        raise ValueError(f"grouped_linear_wgrad: dy has {dy.shape[0]} rows but x has {x.shape[0]}")
    G = group_sizes.numel()
    if out is None:
        # Every gradient is written (empty groups get zeros), so no zeroing first. One buffer for all:
        # one allocation instead of G, and the GEMM writes one region (faster, benchmarks/results). Split
        # in C++ into plain tensors: unbind's autograd views cost ~1 us of host time each.
        out = load().split_groups(dy.new_empty(G, dy.shape[1], x.shape[1]))
        accumulate = False
    elif len(out) != G:
        raise ValueError(f"grouped_linear_wgrad: {len(out)} output tensors for {G} groups")
    # the extension checks every output's shape, dtype, device and contiguity
    load().grouped_gemm(_WGRAD, dy.contiguous(), x.contiguous(), _groups(out), _long_on(group_sizes, dy.device), None,
                        bool(accumulate))
    return out if isinstance(out, torch.Tensor) else list(out)


def split_groups(buffer: torch.Tensor):
    return load().split_groups(buffer.detach())
