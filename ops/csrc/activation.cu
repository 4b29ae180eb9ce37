// SwiGLU over the up-projection's output h [M, 2F] (gate columns first, then up): forward a = silu(gate) * up
// and its backward, each one pass over memory with 16-byte accesses (torch's version of the same, on the
// strided halves of h, takes several non-vectorised passes). fp32 arithmetic, one rounding per output.
#include <algorithm>
#include <type_traits>

#include "device_utils.cuh"

namespace lrmoe {
namespace {

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// i runs over M * F / VEC packs of the output; each reads the matching packs of gate and up.
template <typename T, int VEC>
__global__ void swiglu_kernel(const T* __restrict__ h, T* __restrict__ a, int64_t M, int64_t F) {
  using P = Pack<T, VEC>;
  const int64_t per_row = F / VEC, n = M * per_row;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t m = i / per_row, c = i - m * per_row;
    const P g = reinterpret_cast<const P*>(h + m * 2 * F)[c];
    const P u = reinterpret_cast<const P*>(h + m * 2 * F + F)[c];
    P out;
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const float x = to_float(g.v[v]);
      out.v[v] = from_float<T>(x * sigmoid(x) * to_float(u.v[v]));
    }
    reinterpret_cast<P*>(a + m * F)[c] = out;
  }
}

// d gate = da * up * s * (1 + g * (1 - s)),  d up = da * g * s,  s = sigmoid(g); and a = silu(g) * up, as
// swiglu_kernel computes it: one pack of each, in fp32, rounded once.
template <typename T, int VEC, typename P = Pack<T, VEC>>
__device__ __forceinline__ void backward_pack(const P& g, const P& u, const P& d, P& dg, P& du, P& act) {
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    const float x = to_float(g.v[v]), up = to_float(u.v[v]), grad = to_float(d.v[v]);
    const float s = sigmoid(x);
    dg.v[v] = from_float<T>(grad * up * s * (1.f + x * (1.f - s)));
    du.v[v] = from_float<T>(grad * x * s);
    act.v[v] = from_float<T>(x * s * up);  // swiglu_kernel's expression
  }
}

// dh may be h itself (no __restrict__ on either): each pack is read before the same thread overwrites it.
// WITH_ACT: also a (the backward recomputes the activation for the down projection's weight gradient; one
// pass instead of two). index (or nullptr): output row m reads h's row index[m] of Mh (the retained rows of a
// stash, gathered in the same pass instead of copied first).
template <typename T, int VEC, bool WITH_ACT>
__global__ void swiglu_backward_kernel(const T* h, const T* __restrict__ da, T* dh, T* __restrict__ a, int64_t M,
                                       int64_t F, const int64_t* __restrict__ index, int64_t Mh) {
  using P = Pack<T, VEC>;
  const int64_t per_row = F / VEC, n = M * per_row;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t m = i / per_row, c = i - m * per_row;
    const int64_t r = index != nullptr ? index[m] : m;
    LRMOE_DEVICE_ASSERT(r >= 0 && r < Mh, "swiglu_backward: index out of range [0, rows of h)");
    P dg, du, act;
    backward_pack<T, VEC>(reinterpret_cast<const P*>(h + r * 2 * F)[c], reinterpret_cast<const P*>(h + r * 2 * F + F)[c],
                          reinterpret_cast<const P*>(da + m * F)[c], dg, du, act);
    reinterpret_cast<P*>(dh + m * 2 * F)[c] = dg;
    reinterpret_cast<P*>(dh + m * 2 * F + F)[c] = du;
    if constexpr (WITH_ACT) reinterpret_cast<P*>(a + m * F)[c] = act;
  }
}

// swiglu_backward_kernel with a, plus dot[m] = <a_m, da_m> (a as rounded, fp32 sum): one warp per row, whose
// lanes sum in a fixed order (deterministic). The router's gradient <y_m, dy_m> = <a_m, da_m> from this pass
// instead of a read of a and da of its own. WRITE false: the dot alone (dh and a unused), the same bits.
template <typename T, int VEC, bool WRITE>
__global__ void swiglu_backward_dot_kernel(const T* h, const T* __restrict__ da, T* dh, T* __restrict__ a,
                                           float* __restrict__ dot, int64_t M, int64_t F,
                                           const int64_t* __restrict__ index, int64_t Mh) {
  using P = Pack<T, VEC>;
  const int lane = threadIdx.x & 31;
  const int64_t per_row = F / VEC, warps = (int64_t)gridDim.x * (blockDim.x >> 5);
  for (int64_t m = blockIdx.x * (int64_t)(blockDim.x >> 5) + (threadIdx.x >> 5); m < M; m += warps) {
    const int64_t r = index != nullptr ? index[m] : m;
    LRMOE_DEVICE_ASSERT(r >= 0 && r < Mh, "swiglu_backward: index out of range [0, rows of h)");
    float sum = 0.f;
    for (int64_t c = lane; c < per_row; c += 32) {
      const P d = reinterpret_cast<const P*>(da + m * F)[c];
      P dg, du, act;
      backward_pack<T, VEC>(reinterpret_cast<const P*>(h + r * 2 * F)[c],
                            reinterpret_cast<const P*>(h + r * 2 * F + F)[c], d, dg, du, act);
      if constexpr (WRITE) {
        reinterpret_cast<P*>(dh + m * 2 * F)[c] = dg;
        reinterpret_cast<P*>(dh + m * 2 * F + F)[c] = du;
        reinterpret_cast<P*>(a + m * F)[c] = act;
      }
#pragma unroll
      for (int v = 0; v < VEC; ++v) sum += to_float(act.v[v]) * to_float(d.v[v]);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) dot[m] = sum;
  }
}

unsigned blocks_for(int64_t n, int threads) {
  return (unsigned)std::max<int64_t>(1, std::min<int64_t>((n + threads - 1) / threads, (int64_t)num_sms() * 16));
}

// The widest pack that divides F and keeps every row's halves aligned (h, a, dh are allocated aligned).
template <typename T, typename Launch>
void with_pack(int64_t F, const void* const* ptrs, int nptrs, Launch&& launch) {
  constexpr int kVec = 16 / sizeof(T);
  bool aligned = F % kVec == 0;
  for (int i = 0; i < nptrs; ++i) aligned = aligned && aligned16(ptrs[i]);
  if (aligned) launch(std::integral_constant<int, kVec>{});
  else launch(std::integral_constant<int, 1>{});
}

}  // namespace

void swiglu(const void* h, DType dtype, int64_t M, int64_t F, void* a, cudaStream_t stream) {
  if (M == 0 || F == 0) return;
  dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    const void* ptrs[] = {h, a};
    with_pack<T>(F, ptrs, 2, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      const int64_t n = M * (F / VEC);
      swiglu_kernel<T, VEC><<<blocks_for(n, 256), 256, 0, stream>>>(static_cast<const T*>(h), static_cast<T*>(a), M, F);
    });
  });
  LRMOE_LAUNCH_CHECK("swiglu");
}

void swiglu_backward(const void* h, const void* da, DType dtype, int64_t M, int64_t F, void* dh, void* a,
                     float* dot, const int64_t* index, int64_t Mh, cudaStream_t stream) {
  if (M == 0) return;
  if (F == 0) {  // empty rows: their dots are 0
    if (dot != nullptr) LRMOE_CUDA_CHECK(cudaMemsetAsync(dot, 0, M * sizeof(float), stream));
    return;
  }
  dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    const void* ptrs[] = {h, da, dh, a != nullptr ? a : h};
    with_pack<T>(F, ptrs, 4, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      const int64_t n = M * (F / VEC);
      const auto* hp = static_cast<const T*>(h);
      const auto* dap = static_cast<const T*>(da);
      if (dot != nullptr)
        swiglu_backward_dot_kernel<T, VEC, true><<<blocks_for(M * 32, 256), 256, 0, stream>>>(
            hp, dap, static_cast<T*>(dh), static_cast<T*>(a), dot, M, F, index, Mh);
      else if (a != nullptr)
        swiglu_backward_kernel<T, VEC, true><<<blocks_for(n, 256), 256, 0, stream>>>(
            hp, dap, static_cast<T*>(dh), static_cast<T*>(a), M, F, index, Mh);
      else
        swiglu_backward_kernel<T, VEC, false><<<blocks_for(n, 256), 256, 0, stream>>>(
            hp, dap, static_cast<T*>(dh), nullptr, M, F, index, Mh);
    });
  });
  LRMOE_LAUNCH_CHECK("swiglu_backward");
}

void swiglu_dot(const void* h, const void* dz, DType dtype, int64_t M, int64_t F, float* dot, const int64_t* index,
                int64_t Mh, cudaStream_t stream) {
  if (M == 0) return;
  if (F == 0) {
    LRMOE_CUDA_CHECK(cudaMemsetAsync(dot, 0, M * sizeof(float), stream));
    return;
  }
  dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    const void* ptrs[] = {h, dz};
    with_pack<T>(F, ptrs, 2, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      swiglu_backward_dot_kernel<T, VEC, false><<<blocks_for(M * 32, 256), 256, 0, stream>>>(
          static_cast<const T*>(h), static_cast<const T*>(dz), nullptr, nullptr, dot, M, F, index, Mh);
    });
  });
  LRMOE_LAUNCH_CHECK("swiglu_dot");
}

}  // namespace lrmoe
