"""The op API of lrmoe_ds (installed as ``lrmoe_ds.ops``).

Every caller uses these functions. Each takes ``backend``:
  - ``"torch"``: the torch reference in ``reference.py`` (the CPU path and the test oracle);
  - ``"cuda"``: the JIT-built kernels of ``csrc/``; an error naming the reason if they cannot be used;
  - ``"auto"`` (default): the CUDA kernels for CUDA tensors where they build, else the reference
    (said once in the log).
The process-wide default can be changed with :func:`set_default_backend` (the ``"lrmoe"`` config's
``ops_backend`` key does this).

Shape letters: T tokens, H hidden, N/K a GEMM's output/reduction size, G groups, P pairs, I instances,
E experts (K is also the router's top-k).
"""
import logging
from typing import Optional, Sequence

import torch

from . import reference

__all__ = ["routing_plan", "permute", "unpermute", "unpermute_weight_grad", "unpermute_backward", "swiglu",
           "swiglu_backward", "swiglu_dot",
           "grouped_linear", "grouped_linear_dgrad",
           "grouped_linear_wgrad", "split_groups", "topk_retention", "priority_sample", "retained_pairs",
           "capacity_route", "router_topk",
           "router_topk_backward",
           "set_default_backend",
           "cuda_ops_status", "BACKENDS"]

BACKENDS = ("auto", "torch", "cuda")
_default_backend = "auto"
_logger = logging.getLogger(__name__)
_cuda_module = None   # the loaded extension wrapper, once loaded
_cuda_error = None    # why it cannot be loaded, once known
_fallback_said = False


def set_default_backend(backend: str) -> None:
    """Set the backend used where a call passes ``backend="default"`` or none."""
    global _default_backend
    _check_backend(backend)
    _default_backend = backend


def _check_backend(backend):
    if backend not in BACKENDS:
        raise ValueError(f"unknown ops backend {backend!r}; accepted: {', '.join(BACKENDS)}")


def _resolve_backend(backend: Optional[str]) -> str:
    """A call's backend: its own, or the default for None / "default"; checked."""
    backend = _default_backend if backend in (None, "default") else backend
    _check_backend(backend)
    return backend


def cuda_ops_status():
    """(available: bool, reason: str) for the CUDA kernels on this machine; loads them if possible."""
    global _cuda_module, _cuda_error
    if _cuda_module is None and _cuda_error is None:
        if not torch.cuda.is_available():
            _cuda_error = "no CUDA device is visible to torch"
        else:
            try:
                from . import cuda as cuda_ops  # JIT-builds csrc/ on first use
                cuda_ops.load()
                _cuda_module = cuda_ops
            except Exception as exc:  # the reason is reported to whoever asks for the kernels
                _cuda_error = f"{type(exc).__name__}: {exc}"
    return _cuda_module is not None, (_cuda_error or "built")


def _select(name: str, backend: Optional[str], tensor: torch.Tensor, cuda_takes: bool = True):
    """The implementation of op ``name`` for ``tensor``. ``cuda_takes``: False where the CUDA op does not
    take these inputs (a dtype or size outside its range); "auto" then runs the reference."""
    global _fallback_said
    backend = _resolve_backend(backend)
    if backend == "torch" or (backend == "auto" and not (tensor.is_cuda and cuda_takes)):
        return getattr(reference, name)
    ok, reason = cuda_ops_status()
    if ok and hasattr(_cuda_module, name) and tensor.is_cuda:
        return getattr(_cuda_module, name)
    if backend == "cuda":
        if not tensor.is_cuda:
            reason = f"its input is on {tensor.device}, not on a CUDA device"
        elif ok:
            reason = "this op has no CUDA kernel yet"
        raise RuntimeError(f"lrmoe_ds.ops.{name}: CUDA ops were asked for but cannot be used: {reason}")
    if not _fallback_said:
        _logger.warning("lrmoe_ds.ops: CUDA kernels unavailable (%s); using the torch reference ops", reason)
        _fallback_said = True
    return getattr(reference, name)


def routing_plan(group_of_pair: torch.Tensor, num_groups: int, backend: Optional[str] = None):
    """Group pairs by destination: ``(counts [G], order [P], offsets [G+1])``; see reference.routing_plan."""
    return _select("routing_plan", backend, group_of_pair)(group_of_pair, num_groups)


def permute(x: torch.Tensor, row_index: torch.Tensor, row_scale: Optional[torch.Tensor] = None,
            backend: Optional[str] = None) -> torch.Tensor:
    """Row gather ``x[row_index]`` (times ``row_scale[i]`` per row, if given): x [T, H], row_index [P] -> [P, H]."""
    return _select("permute", backend, x)(x, row_index, row_scale)


def unpermute(rows: torch.Tensor, row_of_pair: torch.Tensor, weight: torch.Tensor,
              backend: Optional[str] = None) -> torch.Tensor:
    """Weighted combine ``out[t] = sum_k weight[t,k] rows[row_of_pair[t,k]]``: rows [P, H] -> [T, H];
    a pair whose row index is -1 adds nothing."""
    return _select("unpermute", backend, rows)(rows, row_of_pair, weight)


def unpermute_weight_grad(rows: torch.Tensor, row_of_pair: torch.Tensor, dout: torch.Tensor,
                          backend: Optional[str] = None) -> torch.Tensor:
    """unpermute's weight gradient ``out[t,k] = <rows[row_of_pair[t,k]], dout[t]>`` [T, K], float32 (float64
    for float64 rows); a pair whose row index is -1 gets 0."""
    return _select("unpermute_weight_grad", backend, rows)(rows, row_of_pair, dout)


def unpermute_backward(rows: torch.Tensor, row_of_pair: torch.Tensor, weight: torch.Tensor, dout: torch.Tensor,
                       d_row_of_pair: Optional[torch.Tensor] = None, num_d_rows: Optional[int] = None,
                       backend: Optional[str] = None):
    """unpermute's rows and weight gradients from one read of dout: ``(d_rows [P, H], d_weight [T, K] float32)``;
    every row must be the row of exactly one pair (P = T K). With ``d_row_of_pair`` [T, K] and ``num_d_rows``,
    d_rows [num_d_rows, H] goes by that map (-1: the pair gets no row). See reference.unpermute_backward."""
    return _select("unpermute_backward", backend, rows)(rows, row_of_pair, weight, dout, d_row_of_pair, num_d_rows)


def swiglu(h: torch.Tensor, backend: Optional[str] = None) -> torch.Tensor:
    """``silu(h[:, :F]) * h[:, F:]``: h [M, 2F] (gate columns first) -> [M, F]. Not differentiable."""
    return _select("swiglu", backend, h)(h)


def swiglu_backward(h: torch.Tensor, da: torch.Tensor, inplace: bool = False, with_activation: bool = False,
                    index: Optional[torch.Tensor] = None, with_dot: bool = False, backend: Optional[str] = None):
    """dh [M, 2F] of :func:`swiglu` from h [M, 2F] and da [M, F]; ``inplace``: written over h;
    ``with_activation``: returns (dh, swiglu(h)) from one read of h; ``index`` [M] int64: read h's rows
    index[m] instead (h [Mh, 2F]; not with inplace); ``with_dot`` (with ``with_activation``): returns
    (dh, a, dot), dot [M] = <a_m, da_m> (float32, float64 for float64 inputs) from the same pass."""
    if with_dot and not with_activation:
        raise ValueError("swiglu_backward: with_dot needs with_activation (the dot is <a_m, da_m>)")
    return _select("swiglu_backward", backend, h)(h, da, inplace, with_activation, index, with_dot)


def swiglu_dot(h: torch.Tensor, dz: torch.Tensor, index: Optional[torch.Tensor] = None,
               backend: Optional[str] = None) -> torch.Tensor:
    """dot [M] = <swiglu(h)_m, dz_m> (float32, float64 for float64 inputs), h [M, 2F] or, with ``index`` [M] int64,
    its rows index[m]; dz [M, F]. :func:`swiglu_backward`'s dot alone, without its dh and a."""
    return _select("swiglu_dot", backend, h)(h, dz, index)


def grouped_linear(x: torch.Tensor, weights: Sequence[torch.Tensor], group_sizes: torch.Tensor,
                   backend: Optional[str] = None) -> torch.Tensor:
    """Segmented GEMM ``out_g = x_g W_g^T``: x [M, K], G weights [N, K] (or one stacked [G, N, K] tensor, which the
    CUDA op takes without a tensor per group crossing from Python), group_sizes [G] -> [M, N]."""
    return _select("grouped_linear", backend, x)(x, weights, group_sizes)


def grouped_linear_dgrad(dy: torch.Tensor, weights: Sequence[torch.Tensor], group_sizes: torch.Tensor,
                         backend: Optional[str] = None) -> torch.Tensor:
    """Segmented GEMM dgrad ``dx_g = dy_g W_g``: dy [M, N], G weights [N, K] (or stacked [G, N, K]) -> [M, K]."""
    return _select("grouped_linear_dgrad", backend, dy)(dy, weights, group_sizes)


def grouped_linear_wgrad(dy: torch.Tensor, x: torch.Tensor, group_sizes: torch.Tensor,
                         out: Optional[Sequence[torch.Tensor]] = None, accumulate: bool = False,
                         backend: Optional[str] = None):
    """Segmented GEMM wgrad ``dW_g = dy_g^T x_g`` into G tensors [N, K] or one stacked [G, N, K] (``out``,
    optionally accumulated)."""
    return _select("grouped_linear_wgrad", backend, dy)(dy, x, group_sizes, out=out, accumulate=accumulate)


def split_groups(buffer: torch.Tensor, backend: Optional[str] = None):
    """G plain tensors (no autograd) viewing the groups of a contiguous buffer [G, ...]: how a stacked
    [G, N, K] weight or gradient is handed to the grouped GEMMs, which take one tensor per group."""
    return _select("split_groups", backend, buffer)(buffer)


def topk_retention(scores: torch.Tensor, group_sizes: torch.Tensor, quotas: torch.Tensor,
                   num_kept: Optional[int] = None, backend: Optional[str] = None):
    """Per group keep the q_g highest scores: ``(kept [P'], kept_sizes [G], threshold [G])``.

    ``num_kept``: P' = sum_g min(q_g, n_g) where the caller knows it; the CUDA op then reads nothing
    back to the host (and skips its input checks)."""
    return _select("topk_retention", backend, scores)(scores, group_sizes, quotas, num_kept)


def priority_sample(metric: torch.Tensor, group_sizes: torch.Tensor, quotas: torch.Tensor,
                    u: Optional[torch.Tensor] = None, num_kept: Optional[int] = None, backend: Optional[str] = None):
    """Priority sampling within per-group quotas: ``(kept [P'], scale [P'], kept_sizes [G], threshold [G])``, keys
    metric / (1 - u) (u None: plain top-k by the metric, weights 1); see reference.priority_sample. The CUDA op
    takes float32 metric and u ("auto" runs other dtypes on the reference); ``num_kept`` as topk_retention."""
    takes = metric.dtype == torch.float32 and (u is None or u.dtype == torch.float32)
    return _select("priority_sample", backend, metric, takes)(metric, group_sizes, quotas, u, num_kept)


def retained_pairs(kept: torch.Tensor, scale: torch.Tensor, order: torch.Tensor, weight_of_row: torch.Tensor, k: int,
                   rescale: bool = True, backend: Optional[str] = None):
    """The retained pairs' maps: ``(kept_pairs, src, gate, row_weight, kept_row_of_pair [T, k], pair_weight [T, k])``
    from the kept send rows and their weights; see reference.retained_pairs. The CUDA op takes a float32 scale and
    float32/16 or bfloat16 gate weights ("auto" runs others on the reference)."""
    takes = scale.dtype == torch.float32 and weight_of_row.dtype in (torch.float32, torch.float16, torch.bfloat16)
    return _select("retained_pairs", backend, kept, takes)(kept, scale, order, weight_of_row, k, rescale)


def retention_metric(order: torch.Tensor, topk_weight: torch.Tensor, metric: str,
                     dout_norm: Optional[torch.Tensor] = None, x_norm: Optional[torch.Tensor] = None,
                     group_sizes: Optional[torch.Tensor] = None, backend: Optional[str] = None):
    """The send rows' gates and retention metric, and each group's metric mass with ``group_sizes``:
    ``(weight_of_row [P], metric [P] float32, mass [G] float32 or None)``; see reference.retention_metric.
    The CUDA op takes float32/16 or bfloat16 gates and float32 norms ("auto" runs others on the reference)."""
    takes = topk_weight.dtype in (torch.float32, torch.float16, torch.bfloat16) and all(
        n is None or n.dtype == torch.float32 for n in (dout_norm, x_norm))
    return _select("retention_metric", backend, order, takes)(order, topk_weight, metric, dout_norm, x_norm,
                                                               group_sizes)


def capacity_route(pair_group, pair_rank, instance_group, instance_rank, instance_capacity,
                   backend: Optional[str] = None) -> torch.Tensor:
    """Assign retained pairs to expert instances under capacities: pair_instance [P] (-1: fits nowhere)."""
    return _select("capacity_route", backend, pair_group)(pair_group, pair_rank, instance_group,
                                                          instance_rank, instance_capacity)


ROUTER_CUDA_MAX_EXPERTS = 1024  # kRouterMaxExperts in csrc/kernels.h


def _router_cuda_takes(logits: torch.Tensor) -> bool:
    return logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1] <= ROUTER_CUDA_MAX_EXPERTS


def router_topk(logits: torch.Tensor, k: int, score_func: str = "softmax", norm_topk_prob: bool = True,
                score_bias: Optional[torch.Tensor] = None, backend: Optional[str] = None, num_groups: int = 1,
                topk_groups: Optional[int] = None):
    """The router's top-k math: ``(topk_index [T, K] int64, topk_weight [T, K], counts [E] int64, prob_sum [E])``
    from logits [T, E]; see reference.router_topk. :func:`router_topk_backward` is its gradient. The CUDA
    op takes float32 logits and up to 1024 experts; under "auto", other logits (float64) run on the
    reference, and under "cuda" they raise. Group-limited selection (``topk_groups`` < ``num_groups``)
    has no CUDA kernel: it runs the reference (torch ops) on every device, and raises under "cuda"."""
    if topk_groups is not None and topk_groups < num_groups:
        if _resolve_backend(backend) == "cuda":
            raise RuntimeError("lrmoe_ds.ops.router_topk: CUDA ops were asked for but cannot be used: "
                               "group-limited selection (topk_groups < num_groups) has no CUDA kernel yet")
        return reference.router_topk(logits, k, score_func, norm_topk_prob, score_bias, num_groups, topk_groups)
    impl = _select("router_topk", backend, logits, _router_cuda_takes(logits))
    return impl(logits, k, score_func, norm_topk_prob, score_bias)


def router_topk_backward(logits: torch.Tensor, topk_index: torch.Tensor, d_topk_weight: torch.Tensor,
                         d_prob_sum: Optional[torch.Tensor], score_func: str = "softmax", norm_topk_prob: bool = True,
                         backend: Optional[str] = None) -> torch.Tensor:
    """d_logits [T, E] of :func:`router_topk` from d_topk_weight [T, K] and d_prob_sum [E] (None: prob_sum
    unused); see reference.router_topk_backward. Dtypes and backends as :func:`router_topk`."""
    impl = _select("router_topk_backward", backend, logits, _router_cuda_takes(logits))
    return impl(logits, topk_index, d_topk_weight, d_prob_sum, score_func, norm_topk_prob)
