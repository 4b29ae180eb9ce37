"""Bytes a forward keeps for its backward, as saved-tensor hooks see them (shared by the layer and the multi-rank
tests)."""
import contextlib

import torch


@contextlib.contextmanager
def counting_saved_bytes():
    """Within it, every tensor saved for a backward adds its bytes to the yielded dict's "bytes"."""
    counter = {"bytes": 0}

    def pack(t):
        counter["bytes"] += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield counter
