// Routing plan (group pairs by destination), permute (row gather) and unpermute (weighted combine).
// Device-side and deterministic; no host synchronisation.
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <type_traits>

#include "device_utils.cuh"

namespace lrmoe {
namespace {

constexpr int64_t kSharedCountLimit = 8192;  // groups counted in shared memory before global atomics

// keys[i] = group of pair i (checked to be in range), values[i] = i; per-group counts by integer
// atomics (the totals do not depend on the order of the additions).
template <typename index_t>
__global__ void plan_prepare_kernel(const index_t* __restrict__ group_of_pair, int64_t P, int64_t G,
                                    uint32_t* __restrict__ keys, int64_t* __restrict__ values,
                                    unsigned long long* __restrict__ counts) {
  extern __shared__ unsigned int local_counts[];
  const bool use_shared = G <= kSharedCountLimit;
  if (use_shared) {
    for (int64_t g = threadIdx.x; g < G; g += blockDim.x) local_counts[g] = 0;
    __syncthreads();
  }
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < P; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t g = group_of_pair[i];
    LRMOE_DEVICE_ASSERT(g >= 0 && g < G, "routing_plan: group id out of range [0, num_groups)");
    keys[i] = static_cast<uint32_t>(g);
    values[i] = i;
    if (use_shared) atomicAdd(&local_counts[g], 1u);
    else atomicAdd(&counts[g], 1ull);
  }
  if (use_shared) {
    __syncthreads();
    for (int64_t g = threadIdx.x; g < G; g += blockDim.x)
      if (local_counts[g]) atomicAdd(&counts[g], (unsigned long long)local_counts[g]);
  }
}

// R rows per block, their loads issued before their stores (R independent accesses in flight).
template <typename V, typename index_t, int R>
__global__ void gather_rows_kernel(const V* __restrict__ x, const index_t* __restrict__ index, V* __restrict__ out,
                                   int64_t P, int64_t T, int64_t vecs_per_row) {
  const int64_t r0 = (int64_t)blockIdx.x * R;
  int64_t src[R];
#pragma unroll
  for (int j = 0; j < R; ++j) {
    src[j] = r0 + j < P ? (int64_t)index[r0 + j] : -1;
    LRMOE_DEVICE_ASSERT(r0 + j >= P || (src[j] >= 0 && src[j] < T), "permute: row index out of range [0, T)");
  }
  for (int64_t c = threadIdx.x; c < vecs_per_row; c += blockDim.x) {
    V v[R];
#pragma unroll
    for (int j = 0; j < R; ++j)
      if (src[j] >= 0) v[j] = __ldg(x + src[j] * vecs_per_row + c);
#pragma unroll
    for (int j = 0; j < R; ++j)
      if (src[j] >= 0) out[(r0 + j) * vecs_per_row + c] = v[j];
  }
}

// One row per block: out[i, :] = x[index[i], :] * scale[i], the scale rounded to x's dtype first and the
// product rounded once (as torch's x[index] * scale.to(x.dtype)).
template <typename row_t, typename scale_t, typename index_t, int VEC>
__global__ void gather_scale_rows_kernel(const row_t* __restrict__ x, const index_t* __restrict__ index,
                                         const scale_t* __restrict__ scale, row_t* __restrict__ out, int64_t T,
                                         int64_t H) {
  using Vec = typename std::conditional<VEC * sizeof(row_t) == 16, uint4, row_t>::type;
  const int64_t i = blockIdx.x;
  const int64_t src = index[i];
  LRMOE_DEVICE_ASSERT(src >= 0 && src < T, "permute: row index out of range [0, T)");
  const float s = to_float(from_float<row_t>(to_float(scale[i])));
  for (int64_t c = threadIdx.x; c < H / VEC; c += blockDim.x) {
    const Vec raw = __ldg(reinterpret_cast<const Vec*>(x + src * H) + c);
    const row_t* e = reinterpret_cast<const row_t*>(&raw);
    Vec res;
    row_t* o = reinterpret_cast<row_t*>(&res);
#pragma unroll
    for (int v = 0; v < VEC; ++v) o[v] = from_float<row_t>(to_float(e[v]) * s);
    reinterpret_cast<Vec*>(out + i * H)[c] = res;
  }
}

// One token per block: out[t, :] = sum_k w[t, k] * rows[row_of_pair[t, k], :], fp32 accumulation in k order;
// a negative row index adds nothing (the row is not read, so 0 * inf cannot make a NaN). The first warp lists the
// pairs that have a row, in k order, in shared memory (K entries of dynamic shared memory: int64 row, fp32
// weight), so that each thread's loads run back to back over them alone: where the backward dropped half the
// pairs, half the rounds of loads (skipping them in the loop kept the rounds of all K).
template <typename row_t, typename weight_t, typename index_t, int VEC>
__global__ void combine_kernel(const row_t* __restrict__ rows, const index_t* __restrict__ row_of_pair,
                               const weight_t* __restrict__ weight, row_t* __restrict__ out, int64_t P, int K,
                               int64_t H) {
  using Vec = typename std::conditional<VEC * sizeof(row_t) == 16, uint4, row_t>::type;
  static_assert(sizeof(Vec) == VEC * sizeof(row_t), "vector width");
  extern __shared__ int64_t listed_row[];                   // [K], then the weights [K] as float
  float* listed_weight = reinterpret_cast<float*>(listed_row + K);
  __shared__ int num_listed;
  const int64_t t = blockIdx.x;
  const int64_t nvec = H / VEC;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int n = 0;
    for (int k0 = 0; k0 < K; k0 += 32) {
      const int k = k0 + lane;
      const int64_t r = k < K ? (int64_t)row_of_pair[t * K + k] : -1;
      const unsigned has_row = __ballot_sync(0xffffffffu, r >= 0);
      if (r >= 0) {
        LRMOE_DEVICE_ASSERT(r < P, "unpermute: row_of_pair out of range [-1, P)");
        const int at = n + __popc(has_row & ((1u << lane) - 1u));
        listed_row[at] = r;
        listed_weight[at] = to_float(weight[t * K + k]);
      }
      n += __popc(has_row);
    }
    if (lane == 0) num_listed = n;
  }
  __syncthreads();
  const int n = num_listed;
  for (int64_t c = threadIdx.x; c < nvec; c += blockDim.x) {
    float acc[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[v] = 0.f;
#pragma unroll 4
    for (int j = 0; j < n; ++j) {
      const float w = listed_weight[j];
      const Vec raw = __ldg(reinterpret_cast<const Vec*>(rows + listed_row[j] * H) + c);
      const row_t* e = reinterpret_cast<const row_t*>(&raw);
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[v] = fmaf(w, to_float(e[v]), acc[v]);
    }
    Vec res;
    row_t* o = reinterpret_cast<row_t*>(&res);
#pragma unroll
    for (int v = 0; v < VEC; ++v) o[v] = from_float<row_t>(acc[v]);
    reinterpret_cast<Vec*>(out + t * H)[c] = res;
  }
}

// One token per block: out[t, k] = <rows[row_of_pair[t, k], :], dout[t, :]> in fp32 (the gradient of the
// combine's weights); a negative row index gives 0. Up to kPairsPerPass pairs share one block reduction.
// WRITE_ROWS: also the gradient of the combine's rows, d_rows[d_row_of_pair[t, k], :] = weight[t, k] dout[t, :]
// (rounded as permute_scaled rounds), from the dout vector already loaded: the backward's dout is read once.
// d_row_of_pair is row_of_pair itself (every pair has a row) or a map of its own into Pd rows, -1 where a pair
// gets none (a retained backward's dy rows, compacted).
constexpr int kPairsPerPass = 8;
template <typename row_t, typename index_t, int VEC, bool WRITE_ROWS>
__global__ void combine_weight_grad_kernel(const row_t* __restrict__ rows, const index_t* __restrict__ row_of_pair,
                                           const row_t* __restrict__ dout, float* __restrict__ out, int64_t P, int K,
                                           int64_t H, const float* __restrict__ weight, row_t* __restrict__ d_rows,
                                           const index_t* __restrict__ d_row_of_pair, int64_t Pd) {
  using Vec = typename std::conditional<VEC * sizeof(row_t) == 16, uint4, row_t>::type;
  __shared__ float partial[kPairsPerPass][32];
  const int64_t t = blockIdx.x;
  const int64_t nvec = H / VEC;
  const index_t* rp = row_of_pair + t * K;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = (blockDim.x + 31) / 32;
  for (int k0 = 0; k0 < K; k0 += kPairsPerPass) {
    const int nk = min(kPairsPerPass, K - k0);
    float acc[kPairsPerPass];
#pragma unroll
    for (int j = 0; j < kPairsPerPass; ++j) acc[j] = 0.f;
    for (int64_t c = threadIdx.x; c < nvec; c += blockDim.x) {
      const Vec draw = __ldg(reinterpret_cast<const Vec*>(dout + t * H) + c);
      const row_t* d = reinterpret_cast<const row_t*>(&draw);
#pragma unroll
      for (int j = 0; j < kPairsPerPass; ++j) {
        if (j >= nk) break;
        const int64_t r = rp[k0 + j];
        if (r >= 0) {
          LRMOE_DEVICE_ASSERT(r < P, "unpermute_weight_grad: row_of_pair out of range [-1, P)");
          const Vec raw = __ldg(reinterpret_cast<const Vec*>(rows + r * H) + c);
          const row_t* e = reinterpret_cast<const row_t*>(&raw);
#pragma unroll
          for (int v = 0; v < VEC; ++v) acc[j] = fmaf(to_float(e[v]), to_float(d[v]), acc[j]);
        }
        if constexpr (WRITE_ROWS) {
          const int64_t rd = d_row_of_pair[t * K + k0 + j];
          LRMOE_DEVICE_ASSERT(d_row_of_pair != row_of_pair || rd >= 0,
                              "unpermute_backward: a pair without a row (row_of_pair -1)");
          if (rd < 0) continue;
          LRMOE_DEVICE_ASSERT(rd < Pd, "unpermute_backward: d_row_of_pair out of range [-1, num_d_rows)");
          const float s = to_float(from_float<row_t>(weight[t * K + k0 + j]));
          Vec res;
          row_t* o = reinterpret_cast<row_t*>(&res);
#pragma unroll
          for (int v = 0; v < VEC; ++v) o[v] = from_float<row_t>(to_float(d[v]) * s);
          reinterpret_cast<Vec*>(d_rows + rd * H)[c] = res;
        }
      }
    }
    // fixed-order reduction (warp shuffles, then warp 0 over the warps): deterministic
#pragma unroll
    for (int j = 0; j < kPairsPerPass; ++j) {
      float v = acc[j];
      for (int off = 16; off > 0; off /= 2) v += __shfl_down_sync(0xffffffffu, v, off);
      if (lane == 0) partial[j][warp] = v;
    }
    __syncthreads();
    if (warp == 0) {
      for (int j = 0; j < nk; ++j) {
        float v = lane < nwarps ? partial[j][lane] : 0.f;
        for (int off = 16; off > 0; off /= 2) v += __shfl_down_sync(0xffffffffu, v, off);
        if (lane == 0) out[t * K + k0 + j] = v;
      }
    }
    __syncthreads();
  }
}

int threads_for(int64_t work) { return (int)std::min<int64_t>(256, std::max<int64_t>(32, (work + 31) / 32 * 32)); }

}  // namespace

size_t routing_plan(const void* group_of_pair, IType itype, int64_t P, int64_t G, int64_t* counts, int64_t* order,
                    int64_t* offsets, void* temp, size_t temp_bytes, cudaStream_t stream) {
  Scratch s(temp);
  uint32_t* keys_in = s.take<uint32_t>(P);
  uint32_t* keys_out = s.take<uint32_t>(P);
  int64_t* values = s.take<int64_t>(P);
  size_t sort_bytes = 0, scan_bytes = 0;
  LRMOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, keys_in, keys_out, values, order, P, 0,
                                                   end_bit_for(G), stream));
  LRMOE_CUDA_CHECK(cub::DeviceScan::InclusiveSum(nullptr, scan_bytes, counts, offsets + 1, G, stream));
  void* cub_temp = s.take<char>(std::max(sort_bytes, scan_bytes));
  if (temp == nullptr) return s.used;
  if (temp_bytes < s.used) throw std::runtime_error("routing_plan: scratch too small");

  LRMOE_CUDA_CHECK(cudaMemsetAsync(counts, 0, G * sizeof(int64_t), stream));
  LRMOE_CUDA_CHECK(cudaMemsetAsync(offsets, 0, sizeof(int64_t), stream));
  if (P == 0) {
    LRMOE_CUDA_CHECK(cudaMemsetAsync(offsets + 1, 0, G * sizeof(int64_t), stream));
    return s.used;
  }
  const int threads = 256;
  const int blocks = (int)std::min<int64_t>((P + threads - 1) / threads, 4 * num_sms());
  const size_t smem = G <= kSharedCountLimit ? G * sizeof(unsigned int) : 0;
  dispatch_index(itype, [&](auto tag) {
    using index_t = decltype(tag);
    plan_prepare_kernel<index_t><<<blocks, threads, smem, stream>>>(
        static_cast<const index_t*>(group_of_pair), P, G, keys_in, values, reinterpret_cast<unsigned long long*>(counts));
  });
  LRMOE_LAUNCH_CHECK("routing_plan: prepare");
  size_t bytes = sort_bytes;
  LRMOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(cub_temp, bytes, keys_in, keys_out, values, order, P, 0,
                                                   end_bit_for(G), stream));
  bytes = scan_bytes;
  LRMOE_CUDA_CHECK(cub::DeviceScan::InclusiveSum(cub_temp, bytes, counts, offsets + 1, G, stream));
  return s.used;
}

void permute(const void* x, int64_t T, int64_t row_bytes, const void* index, IType itype, int64_t P, void* out,
             cudaStream_t stream) {
  if (P == 0 || row_bytes == 0) return;
  constexpr int R = 4;
  const unsigned blocks = (unsigned)((P + R - 1) / R);
  auto launch = [&](auto vec_tag) {
    using V = decltype(vec_tag);
    const int64_t vpr = row_bytes / (int64_t)sizeof(V);
    dispatch_index(itype, [&](auto itag) {
      using index_t = decltype(itag);
      gather_rows_kernel<V, index_t, R><<<blocks, threads_for(vpr), 0, stream>>>(
          static_cast<const V*>(x), static_cast<const index_t*>(index), static_cast<V*>(out), P, T, vpr);
    });
  };
  if (row_bytes % 16 == 0 && aligned16(x) && aligned16(out)) launch(uint4{});
  else if (row_bytes % 4 == 0 && (reinterpret_cast<uintptr_t>(x) % 4 == 0) && (reinterpret_cast<uintptr_t>(out) % 4 == 0)) launch(uint32_t{});
  else if (row_bytes % 2 == 0) launch(uint16_t{});
  else launch(uint8_t{});
  LRMOE_LAUNCH_CHECK("permute");
}

void permute_scaled(const void* x, DType xtype, int64_t T, int64_t H, const void* index, IType itype, int64_t P,
                    const void* scale, DType stype, void* out, cudaStream_t stream) {
  if (P == 0 || H == 0) return;
  dispatch_float(xtype, [&](auto xtag) {
    using row_t = decltype(xtag);
    dispatch_float(stype, [&](auto stag) {
      using scale_t = decltype(stag);
      dispatch_index(itype, [&](auto itag) {
        using index_t = decltype(itag);
        constexpr int VEC = 16 / sizeof(row_t);
        const auto* xr = static_cast<const row_t*>(x);
        const auto* ix = static_cast<const index_t*>(index);
        const auto* sc = static_cast<const scale_t*>(scale);
        auto* o = static_cast<row_t*>(out);
        if (H % VEC == 0 && aligned16(x) && aligned16(out))
          gather_scale_rows_kernel<row_t, scale_t, index_t, VEC><<<(unsigned)P, threads_for(H / VEC), 0, stream>>>(xr, ix, sc, o, T, H);
        else
          gather_scale_rows_kernel<row_t, scale_t, index_t, 1><<<(unsigned)P, threads_for(H), 0, stream>>>(xr, ix, sc, o, T, H);
      });
    });
  });
  LRMOE_LAUNCH_CHECK("permute (scaled)");
}

void unpermute(const void* rows, DType rtype, int64_t P, int64_t H, const void* row_of_pair, IType itype,
               const void* weight, DType wtype, int64_t T, int K, void* out, cudaStream_t stream) {
  if (T == 0 || H == 0) return;
  dispatch_float(rtype, [&](auto rtag) {
    using row_t = decltype(rtag);
    if (K == 0) {
      LRMOE_CUDA_CHECK(cudaMemsetAsync(out, 0, T * H * sizeof(row_t), stream));
      return;
    }
    dispatch_float(wtype, [&](auto wtag) {
      using weight_t = decltype(wtag);
      dispatch_index(itype, [&](auto itag) {
        using index_t = decltype(itag);
        constexpr int VEC = 16 / sizeof(row_t);
        const auto* r = static_cast<const row_t*>(rows);
        const auto* rp = static_cast<const index_t*>(row_of_pair);
        const auto* w = static_cast<const weight_t*>(weight);
        auto* o = static_cast<row_t*>(out);
        const size_t listed = (size_t)K * (sizeof(int64_t) + sizeof(float));  // combine_kernel's list of pairs
        if (H % VEC == 0 && aligned16(rows) && aligned16(out))
          combine_kernel<row_t, weight_t, index_t, VEC><<<(unsigned)T, threads_for(H / VEC), listed, stream>>>(
              r, rp, w, o, P, K, H);
        else
          combine_kernel<row_t, weight_t, index_t, 1><<<(unsigned)T, threads_for(H), listed, stream>>>(
              r, rp, w, o, P, K, H);
      });
    });
  });
  LRMOE_LAUNCH_CHECK("unpermute");
}

void unpermute_weight_grad(const void* rows, DType rtype, int64_t P, int64_t H, const void* row_of_pair, IType itype,
                           const void* dout, int64_t T, int K, float* out, const float* weight, void* d_rows,
                           const void* d_row_of_pair, int64_t Pd, cudaStream_t stream) {
  if (T == 0 || K == 0) return;
  if (H == 0) {
    LRMOE_CUDA_CHECK(cudaMemsetAsync(out, 0, T * K * sizeof(float), stream));
    return;
  }
  dispatch_float(rtype, [&](auto rtag) {
    using row_t = decltype(rtag);
    dispatch_index(itype, [&](auto itag) {
      using index_t = decltype(itag);
      constexpr int VEC = 16 / sizeof(row_t);
      const auto* r = static_cast<const row_t*>(rows);
      const auto* rp = static_cast<const index_t*>(row_of_pair);
      const auto* d = static_cast<const row_t*>(dout);
      auto* dr = static_cast<row_t*>(d_rows);
      const auto* drp = static_cast<const index_t*>(d_row_of_pair != nullptr ? d_row_of_pair : row_of_pair);
      if (d_row_of_pair == nullptr) Pd = P;
      const bool vec = H % VEC == 0 && aligned16(rows) && aligned16(dout) && (d_rows == nullptr || aligned16(d_rows));
      auto launch = [&](auto write_rows) {
        constexpr bool W = decltype(write_rows)::value;
        if (vec)
          combine_weight_grad_kernel<row_t, index_t, VEC, W><<<(unsigned)T, threads_for(H / VEC), 0, stream>>>(
              r, rp, d, out, P, K, H, weight, dr, drp, Pd);
        else
          combine_weight_grad_kernel<row_t, index_t, 1, W><<<(unsigned)T, threads_for(H), 0, stream>>>(
              r, rp, d, out, P, K, H, weight, dr, drp, Pd);
      };
      if (d_rows != nullptr) launch(std::true_type{});
      else launch(std::false_type{});
    });
  });
  LRMOE_LAUNCH_CHECK(d_rows != nullptr ? "unpermute_backward" : "unpermute_weight_grad");
}

}  // namespace lrmoe
