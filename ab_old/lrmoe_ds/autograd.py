"""A faster ``torch.autograd.Function.apply`` for the layer's own Functions (ExpertWeights, RoutedMLP, RouterTopK)."""
import torch


def apply_fast(fn, *args):
    """``fn.apply(*args)`` without Function.apply's Python pass over the arguments (functorch's unwrapping
    of dead wrappers, about 1 us of host time per argument; RoutedMLP takes a dozen) where no functorch
    transform is active, as Function.apply itself then does. Under a transform, or while torch.compile
    traces (it recognises ``fn.apply``): ``fn.apply``."""
    if torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
        return fn.apply(*args)
    return super(torch.autograd.Function, fn).apply(*args)
