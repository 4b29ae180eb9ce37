// CUTLASS grouped GEMM, bf16, the wgrad pass (A ColumnMajor, B RowMajor in CUTLASS's terms); see gemm_cutlass.cuh.
#include "gemm_cutlass.cuh"

namespace lrmoe {
namespace cutlass_gemm {
LRMOE_CUTLASS_PASS(run_wgrad) {
  using Cfg = Config<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, Shape<_128, _256, _64>, Shape<_2, _1, _1>,
                     Cooperative, CooperativeEpi>;
  return run<Cfg>(GemmPass::kWgrad, M, N, K, G, a, b, group_ptrs, sizes, out, accumulate, temp, temp_bytes,
                  stream);
}
}  // namespace cutlass_gemm
}  // namespace lrmoe
