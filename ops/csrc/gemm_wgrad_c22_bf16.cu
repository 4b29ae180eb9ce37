// CUTLASS grouped GEMM, bf16, the wgrad pass, ping-pong 128x128x64 on a 2x2 cluster: both operands' tiles are
// multicast to two CTAs, so a CTA reads half of each from L2 (85 -> 128 FLOP per L2 byte against the 2x1
// cluster, which shares one operand). A trial, config "m64c22": whether the skewed cells' wgrad (a hot expert's
// long reduction) is bound by L2 bandwidth, about 9 TB/s at the dense rate on a 2x1 cluster. See gemm_cutlass.cuh.
#include "gemm_cutlass.cuh"

namespace lrmoe {
namespace cutlass_gemm {
LRMOE_CUTLASS_PASS(run_wgrad_c22) {
  using Cfg = Config<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, Shape<_128, _128, _64>, Shape<_2, _2, _1>,
                     Pingpong, PingpongEpi>;
  return run<Cfg>(GemmPass::kWgrad, M, N, K, G, a, b, group_ptrs, sizes, out, accumulate, temp, temp_bytes,
                  stream);
}
}  // namespace cutlass_gemm
}  // namespace lrmoe
