"""The router's logits GEMM, logits [T, E] = x [T, H] @ wg [E, H]^T, accumulated in fp32 or wider.

On CUDA with bf16 (or fp16) x and wg, the GEMMs run on the tensor cores with fp32 accumulation and
fp32 output (``torch.mm(..., out_dtype=torch.float32)``) instead of on fp32 copies of both operands:
the products of bf16 values are exact in fp32 either way, so the logits differ from the fp32 GEMM's
only in the order of the summation. Everywhere else (CPU, fp32 or fp64 inputs, a torch without that
GEMM) the logits are ``F.linear`` on copies in the wider of x's dtype and fp32, as they always were.
"""
import torch
import torch.nn.functional as F

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_fp32_out_mm_works = {}  # (dtype, device) -> whether torch.mm(..., out_dtype=float32) runs there


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, H], weight [E, H] -> logits [T, E] in the wider of x's dtype and fp32 (differentiable).
    No tokens (T = 0) take the plain path: there is no GEMM to speed up."""
    if (x.is_cuda and x.dtype in _LOW_PRECISION and weight.dtype == x.dtype and x.shape[0] > 0
            and _fp32_out_mm(x.dtype, x.device)):
        return RouterLogits.apply(x, weight)
    dtype = torch.promote_types(x.dtype, torch.float32)
    return F.linear(x.to(dtype), weight.to(dtype))


def _fp32_out_mm(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this torch runs a ``dtype`` GEMM with fp32 output on ``device`` (tried once per pair)."""
    key = (dtype, device)
    if key not in _fp32_out_mm_works:
        try:
            a = torch.zeros(1, 1, dtype=dtype, device=device)
            torch.mm(a, a, out_dtype=torch.float32)  # an unsupported build or device raises here, no sync
            _fp32_out_mm_works[key] = True
        except (RuntimeError, TypeError, NotImplementedError):
            _fp32_out_mm_works[key] = False
    return _fp32_out_mm_works[key]


def split_hi_lo(d: torch.Tensor, dtype: torch.dtype):
    """d [T, E] fp32 as two ``dtype`` halves side by side, for GEMMs whose operands are ``dtype``.

    Returns (d2 [T, 2E] = [hi | lo] with hi = dtype(d * scale), lo = dtype(d * scale - hi), scale):
    hi + lo holds about 16 significant bits of d (relative error ~1e-5 in bf16), where one rounding
    to bf16 would keep 8. ``scale`` is 1 (a float) in bf16, whose exponent range is fp32's; in fp16
    (normal numbers only down to 6e-5) it is a power of two on the device, as a 0-d tensor, that
    brings max |d| into [1, 2) (exact, and no host read); the caller divides its results by it.
    """
    scale = 1.0
    if dtype == torch.float16:
        amax = d.abs().amax().clamp_min(torch.finfo(torch.float32).tiny)
        scale = torch.exp2(-torch.floor(torch.log2(amax)))
        d = d * scale
    E = d.shape[1]
    d2 = torch.empty(d.shape[0], 2 * E, dtype=dtype, device=d.device)
    d2[:, :E].copy_(d)
    d2[:, E:].copy_(d - d2[:, :E])  # d - hi is exact in fp32; lo is its rounding
    return d2, scale


def logits_dgrad_fp32(d2: torch.Tensor, weight: torch.Tensor, scale) -> torch.Tensor:
    """dx [T, H] in fp32 = (hi + lo) @ weight, as one GEMM over [hi | lo] [T, 2E] and [weight; weight] [2E, H]."""
    out = torch.mm(d2, torch.cat([weight, weight]), out_dtype=torch.float32)
    return out if isinstance(scale, float) else out.div_(scale)


def logits_wgrad_fp32(d2: torch.Tensor, x: torch.Tensor, scale) -> torch.Tensor:
    """dW [E, H] in fp32 = (hi + lo)^T @ x, as one GEMM [hi | lo]^T [2E, T] @ x [T, H] and a sum of its halves."""
    E = d2.shape[1] // 2
    both = torch.mm(d2.t(), x, out_dtype=torch.float32)
    out = both[:E].add_(both[E:])
    return out if isinstance(scale, float) else out.div_(scale)


class RouterLogits(torch.autograd.Function):
    """logits [T, E] fp32 = x [T, H] @ weight [E, H]^T for bf16 or fp16 CUDA x and weight, fp32 accumulation.

    Forward: one tensor-core GEMM with fp32 output; the same products as the fp32 GEMM (exact), summed
    in another order. Backward: d_logits is fp32, and rounding it to bf16 would keep 8 bits, so it is
    split into hi + lo halves (:func:`split_hi_lo`, ~16 bits, relative error ~1e-5 against the fp32
    path) that run as one GEMM each for dx and dW, with fp32 output, rounded once to x's and
    weight's dtypes (as the fp32 path rounds its gradients when it casts them back).
    """

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return torch.mm(x, weight.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, d_logits):
        x, weight = ctx.saved_tensors
        d2, scale = split_hi_lo(d_logits.float(), x.dtype)
        dx = logits_dgrad_fp32(d2, weight, scale).to(x.dtype) if ctx.needs_input_grad[0] else None
        dw = logits_wgrad_fp32(d2, x, scale).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw
