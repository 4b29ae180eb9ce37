// CUTLASS grouped GEMM, bf16, forward and dgrad with 64-row tiles (ping-pong 64x256x64; see gemm_cutlass.cuh).
// A group's last row tile is partly empty; with ~512 rows per group (8k tokens, 128 experts, top-8) a
// 128-row tile wastes about an eighth of the tiles, a 64-row tile half as much.
#include "gemm_cutlass.cuh"

namespace lrmoe {
namespace cutlass_gemm {
LRMOE_CUTLASS_PASS(run_fwd_m64) {
  using Cfg = Config<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, Shape<_64, _256, _64>, Shape<_2, _1, _1>,
                     Pingpong, PingpongEpi>;
  return run<Cfg>(GemmPass::kFwd, M, N, K, G, a, b, group_ptrs, sizes, out, accumulate, temp, temp_bytes,
                  stream);
}
LRMOE_CUTLASS_PASS(run_dgrad_m64) {
  using Cfg = Config<cutlass::layout::RowMajor, cutlass::layout::RowMajor, Shape<_64, _256, _64>, Shape<_2, _1, _1>,
                     Pingpong, PingpongEpi>;
  return run<Cfg>(GemmPass::kDgrad, M, N, K, G, a, b, group_ptrs, sizes, out, accumulate, temp, temp_bytes,
                  stream);
}
}  // namespace cutlass_gemm
}  // namespace lrmoe
