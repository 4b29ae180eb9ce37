// CUTLASS grouped GEMM, bf16, dgrad with 128-column tiles (see gemm_cutlass.cuh): cooperative 128x128x64
// and ping-pong 64x128x64. A dgrad whose output width is no multiple of 256 (GLM-4.5-Air's expert width
// 1408 = 5.5 x 256 = 11 x 128) leaves part of every 256-wide tile's columns empty; 128-wide tiles fit it.
#include "gemm_cutlass.cuh"

namespace lrmoe {
namespace cutlass_gemm {
LRMOE_CUTLASS_PASS(run_dgrad_coop128) {
  using Cfg = Config<cutlass::layout::RowMajor, cutlass::layout::RowMajor, Shape<_128, _128, _64>, Shape<_2, _1, _1>,
                     Cooperative, CooperativeEpi>;
  return run<Cfg>(GemmPass::kDgrad, M, N, K, G, a, b, group_ptrs, sizes, out, accumulate, temp, temp_bytes,
                  stream);
}
LRMOE_CUTLASS_PASS(run_dgrad_m64n128) {
  using Cfg = Config<cutlass::layout::RowMajor, cutlass::layout::RowMajor, Shape<_64, _128, _64>, Shape<_2, _1, _1>,
                     Pingpong, PingpongEpi>;
  return run<Cfg>(GemmPass::kDgrad, M, N, K, G, a, b, group_ptrs, sizes, out, accumulate, temp, temp_bytes,
                  stream);
}
}  // namespace cutlass_gemm
}  // namespace lrmoe
