// Small device helpers shared by the .cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels.h"

namespace lrmoe {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename F> void dispatch_float(DType t, F&& f) {
  switch (t) {
    case DType::kF32: f(float{}); return;
    case DType::kF16: f(__half{}); return;
    case DType::kBF16: f(__nv_bfloat16{}); return;
  }
  throw std::runtime_error("lrmoe_ds: unsupported float dtype");
}
template <typename F> void dispatch_index(IType t, F&& f) {
  if (t == IType::kI64) f(int64_t{});
  else f(int32_t{});
}

inline int num_sms() {
  static int n = [] {
    int dev = 0, sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    return sms > 0 ? sms : 132;
  }();
  return n;
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

inline int end_bit_for(int64_t n) {  // bits that hold values in [0, n)
  int bits = 1;
  while (bits < 63 && (int64_t(1) << bits) < n) ++bits;
  return bits;
}

// Carve aligned slices out of one scratch allocation (nullptr base: only count the bytes).
struct Scratch {
  char* base;
  size_t used = 0;
  explicit Scratch(void* p) : base(static_cast<char*>(p)) {}
  template <typename T> T* take(size_t n) {
    used = (used + 255) / 256 * 256;
    T* p = base ? reinterpret_cast<T*>(base + used) : nullptr;
    used += n * sizeof(T);
    return p;
  }
};

}  // namespace lrmoe
