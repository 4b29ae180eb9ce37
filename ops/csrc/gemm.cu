// Segmented (grouped) GEMM: the dispatcher between the CUTLASS Hopper kernel (bf16, 16-byte aligned
// rows and pointers) and a tiled CUDA-core kernel for everything else (fp32, fp16, odd sizes, an
// fp32 gradient of bf16 inputs). Group sizes stay on the device; both paths handle empty groups.
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "cutlass/version.h"
#include "gemm_common.h"

namespace lrmoe {


namespace {

constexpr int kTile = 64, kTileK = 16;

// Group g's GEMM in a common form: D_g[Mg, Ng] (+)= A_g[Mg, Kg] @ B_g[Kg, Ng], with element strides.
struct GroupView {
  int64_t Mg, Ng, Kg;
  const void* A; int64_t sai, sak;
  const void* B; int64_t sbk, sbj;
  void* D; int64_t ldd;
};

template <typename T>
__device__ GroupView group_view(GemmPass pass, int64_t g, int64_t M, int64_t N, int64_t K, const T* a, const T* b,
                                const PtrChunk& ptrs, int64_t g0, const int64_t* sizes, const int64_t* offsets,
                                void* out, int64_t out_esize) {
  const int64_t off = offsets[g];
  const int64_t m = max(int64_t(0), min(sizes[g], M - off));
  const void* w = ptrs.p[g - g0];
  char* o = static_cast<char*>(out);
  if (pass == GemmPass::kFwd)  // out rows = x rows @ W^T: B(k, j) = W[j, k]
    return {m, N, K, a + off * K, K, 1, w, 1, K, o + off * N * out_esize, N};
  if (pass == GemmPass::kDgrad)  // out rows = dy rows @ W: B(k, j) = W[k, j]
    return {m, K, N, a + off * N, N, 1, w, K, 1, o + off * K * out_esize, K};
  // dW = dy^T @ x: A(i, k) = dy[off + k, i], B(k, j) = x[off + k, j]
  return {N, K, m, a + off * N, 1, N, b + off * K, K, 1, const_cast<void*>(w), K};
}

// 64x64 output tile per block (256 threads, 4x4 each), K in steps of 16 through shared memory.
template <typename T, typename TO>
__global__ void __launch_bounds__(256) simt_grouped_gemm_kernel(GemmPass pass, int64_t M, int64_t N, int64_t K,
                                                                int64_t g0, PtrChunk ptrs, const int64_t* sizes,
                                                                const int64_t* offsets, const T* a, const T* b,
                                                                void* out, bool accumulate) {
  const int64_t g = g0 + blockIdx.z;
  const GroupView v = group_view<T>(pass, g, M, N, K, a, b, ptrs, g0, sizes, offsets, out, sizeof(TO));
  const int64_t i0 = (int64_t)blockIdx.y * kTile, j0 = (int64_t)blockIdx.x * kTile;
  if (i0 >= v.Mg || j0 >= v.Ng) return;
  const T* A = static_cast<const T*>(v.A);
  const T* B = static_cast<const T*>(v.B);
  TO* D = static_cast<TO*>(v.D);
  __shared__ float As[kTileK][kTile + 1], Bs[kTileK][kTile + 1];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < v.Kg; k0 += kTileK) {
    for (int e = threadIdx.x; e < kTile * kTileK; e += blockDim.x) {
      const int r = e / kTileK, kk = e % kTileK;
      const int64_t i = i0 + r, k = k0 + kk;
      As[kk][r] = (i < v.Mg && k < v.Kg) ? to_float(A[i * v.sai + k * v.sak]) : 0.f;
      const int64_t j = j0 + r;
      Bs[kk][r] = (j < v.Ng && k < v.Kg) ? to_float(B[k * v.sbk + j * v.sbj]) : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTileK; ++kk) {
      float av[4], bv[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) { av[q] = As[kk][ty + 16 * q]; bv[q] = Bs[kk][tx + 16 * q]; }
#pragma unroll
      for (int p = 0; p < 4; ++p)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[p][q] = fmaf(av[p], bv[q], acc[p][q]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int p = 0; p < 4; ++p)
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int64_t i = i0 + ty + 16 * p, j = j0 + tx + 16 * q;
      if (i < v.Mg && j < v.Ng) {
        TO* d = D + i * v.ldd + j;
        *d = from_float<TO>(accumulate ? acc[p][q] + to_float(*d) : acc[p][q]);
      }
    }
}

// wgrad overwrite: the CUTLASS path gives an empty group no tiles, so its gradient is zeroed here. Usually no
// group is empty, so the kernel must cost little then: each block reads the chunk's sizes at once (one per
// thread: blockDim.x == kPtrChunk) and leaves unless one is 0. A block per (group, slice) cost 6 us of early
// exits per call on the H100, and blocks reading the sizes one after another 17 us on the H200
// (benchmarks/results/profile_gemm_h*.md).
__global__ void zero_empty_groups_kernel(int64_t g0, int64_t count, PtrChunk ptrs, const int64_t* sizes,
                                         int64_t bytes) {
  __shared__ bool empty[kPtrChunk];
  const bool mine = threadIdx.x < count && sizes[g0 + threadIdx.x] == 0;
  empty[threadIdx.x] = mine;
  if (!__syncthreads_or(mine)) return;
  for (int64_t g = 0; g < count; ++g) {
    if (!empty[g]) continue;
    uint4* p = static_cast<uint4*>(const_cast<void*>(ptrs.p[g]));
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < bytes / 16; i += (int64_t)gridDim.x * blockDim.x)
      p[i] = make_uint4(0, 0, 0, 0);
  }
}

PtrChunk chunk_at(const void* const* ptrs, int64_t g0, int64_t G) {
  PtrChunk c{};
  for (int64_t i = 0; i < std::min<int64_t>(kPtrChunk, G - g0); ++i) c.p[i] = ptrs[g0 + i];
  return c;
}

size_t esize(DType t) { return t == DType::kF32 ? 4 : 2; }

}  // namespace

double peak_memory_tbps() {
  int dev = 0, khz = 0, bits = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, dev);
  cudaDeviceGetAttribute(&bits, cudaDevAttrGlobalMemoryBusWidth, dev);
  return 2.0 * khz * 1e3 * (bits / 8.0) / 1e12;  // double data rate
}

std::string cutlass_version() {
  return std::to_string(CUTLASS_MAJOR) + "." + std::to_string(CUTLASS_MINOR) + "." + std::to_string(CUTLASS_PATCH);
}

std::string gemm_default_config() {
  constexpr int kMaxDevices = 64;
  static std::string picked[kMaxDevices];  // per device, decided once
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= kMaxDevices) return peak_memory_tbps() >= 4.5 ? "m64" : "coop";
  if (picked[dev].empty()) picked[dev] = peak_memory_tbps() >= 4.5 ? "m64" : "coop";
  return picked[dev];
}

std::string gemm_config(GemmPass pass, int64_t M, int64_t K, int64_t G) {
  // Kernels per pass. "m64": ping-pong 64x256x64 for forward and dgrad (a group's last row tile is partly
  // empty, and 64-row tiles leave half as much empty as 128-row ones), ping-pong 128x128x64 for wgrad.
  // "coop": CUTLASS's cooperative 128x256x64 in every pass, torch._grouped_mm's. "pingpong": cooperative
  // forward and dgrad, ping-pong wgrad. "auto" (the default) picks by the device's memory: on an H200
  // (4.8 TB/s) "m64" was 2-18% faster than "coop" in most forward and dgrad cells, on an H100 (3.35 TB/s)
  // up to 27% slower at GLM-4.5-Air's shapes, where "coop" matched torch
  // (benchmarks/results/grouped_gemm_h200_1205.md, grouped_gemm_dgrad128_h100.md). LRMOE_GEMM_CONFIG,
  // read per call for benchmarks and tests, forces one.
  const std::string forced = env_or("LRMOE_GEMM_CONFIG", "auto");
  if (forced != "auto" && forced != "m64" && forced != "coop" && forced != "pingpong")
    throw std::invalid_argument("LRMOE_GEMM_CONFIG must be auto, m64, coop or pingpong, not '" + forced + "'");
  if (forced != "auto") return forced;
  const std::string cfg = gemm_default_config();
  // A dgrad whose output width leaves a half-empty last 256-wide tile (GLM-4.5-Air's 1408 columns) with about
  // 1k rows per group ran 4-8% faster on the cooperative kernel than on m64 in both H200 runs at 16k tokens
  // (0.97-0.99 of torch against 0.90-0.95); at about 512 rows m64 was as fast or faster
  // (grouped_gemm_h200_1205.md, grouped_gemm_h200_1205b.md).
  if (cfg == "m64" && pass == GemmPass::kDgrad && K % 256 != 0 && M >= 768 * G) return "coop";
  return cfg;
}

bool grouped_gemm_uses_cutlass(GemmPass pass, DType dtype, DType out_dtype, int64_t N, int64_t K, int64_t G,
                               const void* a, const void* b, const void* const* group_ptrs, const void* out) {
  if (dtype != DType::kBF16 || out_dtype != DType::kBF16 || N % 8 || K % 8 || N == 0 || K == 0) return false;
  if (!aligned16(a) || (pass == GemmPass::kWgrad ? !aligned16(b) : !aligned16(out))) return false;
  for (int64_t g = 0; g < G; ++g)
    if (!aligned16(group_ptrs[g])) return false;
  int dev = 0, major = 0, minor = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  return major == 9 && minor == 0;
}

size_t grouped_gemm(GemmPass pass, DType dtype, DType out_dtype, int64_t M, int64_t N, int64_t K, int64_t G,
                    const void* a, const void* b, const void* const* group_ptrs, const int64_t* group_sizes,
                    void* out, bool accumulate, bool allow_cutlass, void* temp, size_t temp_bytes, cudaStream_t stream) {
  const bool use_cutlass =
      allow_cutlass && grouped_gemm_uses_cutlass(pass, dtype, out_dtype, N, K, G, a, b, group_ptrs, out);
  Scratch sc(temp);
  size_t gemm_bytes = 0;
  auto cutlass_run = [&](void* t, size_t bytes) {
    const std::string cfg = gemm_config(pass, M, K, G);
    const bool coop = cfg == "coop";
    const bool m64 = cfg == "m64";
    auto fn = pass == GemmPass::kFwd ? (m64 ? cutlass_gemm::run_fwd_m64 : cutlass_gemm::run_fwd)
              : pass == GemmPass::kDgrad ? (m64 ? cutlass_gemm::run_dgrad_m64 : cutlass_gemm::run_dgrad)
                                         : (coop ? cutlass_gemm::run_wgrad : cutlass_gemm::run_wgrad_pingpong);
    return fn(M, N, K, G, a, b, group_ptrs, group_sizes, out, accumulate, t, bytes, stream);
  };
  if (use_cutlass) {  // the CUTLASS setup kernel makes the row offsets itself
    gemm_bytes = cutlass_run(nullptr, 0);
    void* gemm_temp = sc.take<char>(gemm_bytes);
    if (temp == nullptr) return sc.used;
    if (temp_bytes < sc.used) throw std::runtime_error("grouped_gemm: scratch too small");
    if (G == 0) return sc.used;
    if (pass == GemmPass::kWgrad && !accumulate) {
      const int64_t nbytes = N * K * 2;  // N * K % 8 == 0: whole 16-byte words
      for (int64_t g0 = 0; g0 < G; g0 += kPtrChunk) {
        const unsigned blocks = (unsigned)std::min<int64_t>((nbytes / 16 + 255) / 256, 64);
        zero_empty_groups_kernel<<<blocks, kPtrChunk, 0, stream>>>(g0, std::min<int64_t>(kPtrChunk, G - g0),
                                                             chunk_at(group_ptrs, g0, G), group_sizes, nbytes);
        LRMOE_LAUNCH_CHECK("grouped_gemm: zero empty groups");
      }
    }
    cutlass_run(gemm_temp, gemm_bytes);
    return sc.used;
  }
  int64_t* offsets = sc.take<int64_t>(G + 1);
  size_t scan_bytes = 0;
  LRMOE_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, group_sizes, offsets, G, stream));
  void* scan_temp = sc.take<char>(scan_bytes);
  if (temp == nullptr) return sc.used;
  if (temp_bytes < sc.used) throw std::runtime_error("grouped_gemm: scratch too small");
  if (G == 0) return sc.used;
  size_t bytes = scan_bytes;
  LRMOE_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(scan_temp, bytes, group_sizes, offsets, G, stream));
  if (N == 0 || K == 0) return sc.used;
  // M is host-known and bounds every group's rows: blocks past a group's end return at once.
  const int64_t rows = pass == GemmPass::kWgrad ? N : M;
  const int64_t cols = pass == GemmPass::kFwd ? N : K;
  dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto otag) {
      using TO = decltype(otag);
      for (int64_t g0 = 0; g0 < G; g0 += kPtrChunk) {
        const dim3 grid((unsigned)((cols + kTile - 1) / kTile), (unsigned)std::max<int64_t>(1, (rows + kTile - 1) / kTile),
                        (unsigned)std::min<int64_t>(kPtrChunk, G - g0));
        simt_grouped_gemm_kernel<T, TO><<<grid, 256, 0, stream>>>(pass, M, N, K, g0, chunk_at(group_ptrs, g0, G),
                                                                  group_sizes, offsets, static_cast<const T*>(a),
                                                                  static_cast<const T*>(b), out, accumulate);
        LRMOE_LAUNCH_CHECK("grouped_gemm: simt kernel");
      }
    };
    if (out_dtype == dtype) launch(T{});
    else if (out_dtype == DType::kF32) launch(float{});
    else throw std::runtime_error("grouped_gemm: the output dtype must be the input's or float32");
  });
  (void)esize;
  return sc.used;
}

}  // namespace lrmoe
