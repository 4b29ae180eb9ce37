"""A straightforward MoE, written independently of the package: loops over tokens and their experts.

The oracle of the layer tests (run it in fp64). Differentiable through plain autograd.
"""
import torch
import torch.nn.functional as F


def expert_forward(activation, w1, w2, x):
    """One expert on one token row x [H]; w1 [F or 2F, H], w2 [H, F] in nn.Linear layout."""
    h = w1 @ x
    if activation == "swiglu":
        gate, up = h.chunk(2)
        a = F.silu(gate) * up
    else:
        a = F.gelu(h)
    return w2 @ a


def reference_moe(x, wg, w1s, w2s, k, activation="swiglu", score_func="softmax", norm_topk_prob=True,
                  score_bias=None):
    """x [T, H], wg [E, H], w1s/w2s: E expert weights. Returns (out [T, H], aux, z_loss, counts [E])."""
    T, E = x.shape[0], wg.shape[0]
    logits = x @ wg.t()
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    probs = scores if score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
    rows = []
    counts = torch.zeros(E, dtype=torch.long)
    for t in range(T):
        select = scores[t].detach() + (0 if score_bias is None else score_bias)
        chosen = torch.topk(select, k).indices.tolist()
        weights = torch.stack([scores[t, e] for e in chosen])
        if norm_topk_prob and k > 1:
            weights = weights / weights.sum()
        y = x.new_zeros(x.shape[1])
        for e, w in zip(chosen, weights):
            y = y + w * expert_forward(activation, w1s[e], w2s[e], x[t])
            counts[e] += 1
        rows.append(y)
    aux = E * sum(probs[:, e].mean() * counts[e] / (T * k) for e in range(E))
    z_loss = torch.logsumexp(logits, -1).square().mean()
    return torch.stack(rows), aux, z_loss, counts
