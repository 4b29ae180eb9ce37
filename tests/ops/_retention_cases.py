"""Group sizes and quotas shared by the retention op tests (topk_retention, priority_sample)."""
import torch

SPREADS = ["uniform", "empty_and_hot", "all_empty"]


def groups_and_quotas(G: int, how: str, gen: torch.Generator):
    """(sizes [G], quotas [G]) int64: sizes by ``how`` (uniform; most groups empty and one hot; all empty), quotas
    mixing 0, < n, = n and > n."""
    if how == "uniform":
        sizes = torch.randint(0, 300, (G,), generator=gen)
    elif how == "empty_and_hot":
        sizes = torch.zeros(G, dtype=torch.long)
        sizes[int(torch.randint(0, G, (1,), generator=gen))] = 20000
        sizes[: G // 3] = torch.randint(0, 3, (G // 3,), generator=gen)
    else:
        sizes = torch.zeros(G, dtype=torch.long)
    q = (sizes.double() * torch.rand(G, generator=gen) * 1.3).long()
    q[::5] = 0
    q[1::7] = sizes[1::7]
    q[2::7] = sizes[2::7] + 5
    return sizes, q
