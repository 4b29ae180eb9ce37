// Shared by gemm.cu and the CUTLASS passes (gemm_*_bf16.cu), without the CUTLASS headers.
#pragma once

#include <cstdlib>
#include <string>

#include "device_utils.cuh"

namespace lrmoe {

// An environment variable's value, or ``fallback`` where it is unset (the GEMM's benchmark switches).
inline std::string env_or(const char* name, const char* fallback) {
  const char* value = std::getenv(name);
  return value ? value : fallback;
}

constexpr int kPtrChunk = 256;  // group pointers passed per launch, as kernel parameters (2 KiB)
struct PtrChunk {
  const void* p[kPtrChunk];
};

namespace cutlass_gemm {  // per pass: cooperative 128x256x64 in gemm_<pass>_bf16.cu; for wgrad also
                          // ping-pong 128x128x64 in gemm_wgrad_pingpong_bf16.cu; forward and dgrad ping-pong
                          // 64x256x64 in gemm_m64_bf16.cu; scratch bytes when temp == nullptr
#define LRMOE_CUTLASS_PASS(name)                                                                             \
  size_t name(int64_t M, int64_t N, int64_t K, int64_t G, const void* a, const void* b,                     \
              const void* const* group_ptrs, const int64_t* sizes, void* out,                               \
              bool accumulate, void* temp, size_t temp_bytes, cudaStream_t stream)
LRMOE_CUTLASS_PASS(run_fwd);
LRMOE_CUTLASS_PASS(run_dgrad);
LRMOE_CUTLASS_PASS(run_wgrad);
LRMOE_CUTLASS_PASS(run_wgrad_pingpong);
LRMOE_CUTLASS_PASS(run_fwd_m64);
LRMOE_CUTLASS_PASS(run_dgrad_m64);
}  // namespace cutlass_gemm

}  // namespace lrmoe
