"""Segmented GEMM forward on CUDA (CUTLASS and CUDA-core paths) vs the fp64 reference."""
import pytest
import torch

from _gemm_cases import GRID, expected_path, group_sizes, use_kernels
from lrmoe_ds import ops
from lrmoe_ds.ops import reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape,spread,dtype,G", GRID)
def test_matches_fp64_reference(ext, rel_fro, tol, monkeypatch, shape, spread, dtype, G):
    N, K = shape
    gen = torch.Generator().manual_seed(N * 7 + K + G)
    sizes = group_sizes(G, spread, gen)
    M = int(sizes.sum())
    x = torch.randn(M, K, generator=gen).to(dtype)
    ws = [torch.randn(N, K, generator=gen).to(dtype) / K ** 0.5 for _ in range(G)]
    ref = reference.grouped_linear(x.double(), [w.double() for w in ws], sizes)
    xc, wc, sc = x.cuda(), [w.cuda() for w in ws], sizes.cuda()
    for allow_cutlass, config in ((True, "coop"), (True, "m64"), (True, "auto+rows"), (False, "auto")):
        # both CUTLASS kernels, the default ones with the problems listed by rows, the CUDA-core one; then the API
        use_kernels(monkeypatch, config)
        out = torch.full((M, N), float("nan"), dtype=dtype, device="cuda")
        used = ext.grouped_gemm(0, xc, None, wc, sc, out, False, allow_cutlass)
        assert used == (allow_cutlass and expected_path(dtype, N, K))
        assert rel_fro(out, ref) < tol[dtype], f"cutlass={used} {config}"
    api = ops.grouped_linear(xc, wc, sc, backend="cuda")
    assert rel_fro(api, ref) < tol[dtype]
    assert torch.equal(api, ops.grouped_linear(xc, wc, sc, backend="cuda"))  # deterministic


def test_bad_input(ext, monkeypatch):
    x = torch.randn(8, 16, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(32, 16, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    for var, value in (("LRMOE_GEMM_CONFIG", "fast"), ("LRMOE_GEMM_RASTER", "k"), ("LRMOE_GEMM_SWIZZLE", "3"),
                       ("LRMOE_GEMM_ORDER", "size")):
        with monkeypatch.context() as env:  # the benchmarks' kernel switches: a typo is an error, not the default
            env.setenv(var, value)
            with pytest.raises(ValueError, match=f"{var} must be .*'{value}'"):
                ops.grouped_linear(x, ws, torch.tensor([4, 4], device="cuda"), backend="cuda")
    with pytest.raises(ValueError, match="3 weights for 2 groups|2 weights for 3 groups"):
        ops.grouped_linear(x, ws, torch.tensor([4, 2, 2], device="cuda"), backend="cuda")
    with pytest.raises(ValueError, match="does not match"):
        ops.grouped_linear(x[:, :8].contiguous(), ws, torch.tensor([4, 4], device="cuda"), backend="cuda")
    with pytest.raises(RuntimeError, match="weight 1 must be c10::BFloat16|weight 1 must be BFloat16"):
        ops.grouped_linear(x, [ws[0], ws[1].float()], torch.tensor([4, 4], device="cuda"), backend="cuda")


def test_default_kernels_follow_the_memory_bandwidth(ext):
    """The default CUTLASS kernels are chosen by the device's peak memory bandwidth (gemm.cu): a bandwidth
    read as 0 (an attribute the driver no longer reports) would silently pick the other kernels."""
    tbps = ext.peak_memory_tbps()
    props = torch.cuda.get_device_properties(0)
    assert 1.0 < tbps < 20.0, f"{props.name}: peak memory bandwidth read as {tbps} TB/s"
    assert ext.gemm_default_config() == ("m64" if tbps >= 4.5 else "coop")
    if "H200" in props.name:  # where the 64-row kernels were measured faster
        assert ext.gemm_default_config() == "m64"
    if "H100" in props.name and "NVL" not in props.name:
        assert ext.gemm_default_config() == "coop"


def test_built_with_the_cutlass_headers_found(ext):
    """The extension reports the CUTLASS release it was compiled with: the one the builder finds now
    (CUTLASS_PATH or the nvidia-cutlass wheel), so benchmarks name the headers that made their kernels."""
    from lrmoe_ds.ops.builder import cutlass_version
    assert ext.cutlass_version() == cutlass_version()


def test_kernels_per_call_follow_pass_and_shape(ext, monkeypatch):
    """gemm_config: the device's default, except a dgrad of a width that is no multiple of 256 with >= 768 rows
    per group, which runs the cooperative kernel where the default is m64; LRMOE_GEMM_CONFIG overrides all."""
    monkeypatch.delenv("LRMOE_GEMM_CONFIG", raising=False)
    default = ext.gemm_default_config()
    glm_down = 1408  # GLM-4.5-Air's expert width: the down projection's dgrad output
    assert ext.gemm_config(1, 131072, glm_down, 128) == "coop"  # 1024 rows per group
    assert ext.gemm_config(1, 65536, glm_down, 128) == default  # 512 rows per group
    assert ext.gemm_config(1, 131072, 2048, 128) == default  # a whole number of 256-wide tiles
    assert ext.gemm_config(0, 131072, glm_down, 128) == default  # forward: K is the reduction there
    monkeypatch.setenv("LRMOE_GEMM_CONFIG", "m64")
    assert ext.gemm_config(1, 131072, glm_down, 128) == "m64"
    monkeypatch.setenv("LRMOE_GEMM_CONFIG", "bogus")
    with pytest.raises(ValueError, match="LRMOE_GEMM_CONFIG must be"):
        ext.gemm_config(0, 8, 8, 1)


def test_dgrad_at_glm_down_width_matches_reference(ext, rel_fro, monkeypatch):
    """The dgrad shape that gemm_config moves to the cooperative kernel on m64 devices, end to end through the
    default path (G groups of ~1k rows, output width 1408), against the fp64 reference."""
    monkeypatch.delenv("LRMOE_GEMM_CONFIG", raising=False)
    gen = torch.Generator().manual_seed(7)
    sizes = torch.tensor([1100, 0, 1300, 1201])  # 900 rows per group on average, one group empty
    assert ext.gemm_config(1, int(sizes.sum()), 1408, 4) == "coop"
    dy = torch.randn(int(sizes.sum()), 256, generator=gen).bfloat16()
    ws = [(torch.randn(256, 1408, generator=gen) / 16).bfloat16() for _ in range(4)]
    out = ops.grouped_linear_dgrad(dy.cuda(), [w.cuda() for w in ws], sizes.cuda(), backend="cuda")
    ref = reference.grouped_linear_dgrad(dy.double(), [w.double() for w in ws], sizes)
    assert rel_fro(out, ref) < 1e-2


@pytest.mark.parametrize("shape,dtype,G", [((64, 128), torch.bfloat16, 8), ((13, 7), torch.float32, 8),
                                           ((64, 128), torch.bfloat16, 300)])
def test_stacked_weights_are_the_per_group_tensors(ext, shape, dtype, G):
    """Weights as one stacked [G, N, K] tensor (how a layer holds them; here strided along G, as a view of a larger
    buffer, and with transposed slices, which are copied first) give the per-group tensors' result bit for bit."""
    N, K = shape
    gen = torch.Generator().manual_seed(G + N)
    sizes = group_sizes(G, "with_empty", gen)
    x = torch.randn(int(sizes.sum()), K, generator=gen).to(dtype).cuda()
    stacked = torch.randn(G, N + 3, K, generator=gen).to(dtype).cuda()[:, :N]
    sc = sizes.cuda()
    expected = ops.grouped_linear(x, list(stacked.unbind(0)), sc, backend="cuda")
    assert torch.equal(ops.grouped_linear(x, stacked, sc, backend="cuda"), expected)
    transposed_slices = stacked.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(ops.grouped_linear(x, transposed_slices, sc, backend="cuda"), expected)
    ref = reference.grouped_linear(x.cpu().double(), stacked.cpu().double(), sizes)
    torch.testing.assert_close(ref, reference.grouped_linear(x.cpu().double(), list(stacked.cpu().double()), sizes))
    with pytest.raises(RuntimeError, match="weights must be"):
        ops.grouped_linear(x, stacked.double(), sc, backend="cuda")
