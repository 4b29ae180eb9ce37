"""Cases shared by the three segmented-GEMM tests (forward, dgrad, wgrad)."""
import itertools

import torch

# (N, K): aligned for the CUTLASS path, odd-but-aligned, unaligned (CUDA-core path), larger
SHAPES = [(64, 128), (24, 40), (13, 7), (384, 512)]
# how the rows spread over the groups
SPREADS = ["uniform", "with_empty", "one_hot", "ragged"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# G = 300: more groups than one setup launch takes (256 pointers), so the later chunks' row offsets
# continue the first chunk's
GRID = list(itertools.product(SHAPES, SPREADS, DTYPES, [8, 1])) + [
    ((64, 128), spread, torch.bfloat16, 300) for spread in ("with_empty", "ragged")]


def group_sizes(G, spread, gen, rows=600):
    if spread == "uniform":
        s = torch.full((G,), rows // G)
    elif spread == "with_empty":
        s = torch.randint(0, 2 * rows // G + 1, (G,), generator=gen)
        s[::2] = 0
    elif spread == "one_hot":
        s = torch.zeros(G, dtype=torch.long)
        s[G // 2] = rows
    else:  # sizes that are no multiple of any tile
        s = torch.randint(1, 2 * rows // G + 1, (G,), generator=gen) * 3 + 1
    return s.long()


def expected_path(dtype, N, K):
    """Whether the CUTLASS kernel should run (bf16, rows of whole 16-byte words) on an sm_90 GPU."""
    return dtype == torch.bfloat16 and N % 8 == 0 and K % 8 == 0 and torch.cuda.get_device_capability() == (9, 0)


def use_kernels(monkeypatch, config):
    """Sets the kernels a loop case names: "coop", "m64", ... (LRMOE_GEMM_CONFIG), a "+rows" suffix listing the
    problems by their rows, most first (LRMOE_GEMM_ORDER=rows)."""
    monkeypatch.setenv("LRMOE_GEMM_CONFIG", config.split("+")[0])
    monkeypatch.setenv("LRMOE_GEMM_ORDER", "rows" if config.endswith("+rows") else "index")
