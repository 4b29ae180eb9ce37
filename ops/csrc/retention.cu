// Quota-aware top-k retention and capacity routing. Device-side and deterministic (stable radix
// sorts, no floating-point atomics); no host synchronisation (the caller reads `summary` once).
#include <cub/block/block_reduce.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <cub/device/device_select.cuh>
#include <thrust/iterator/counting_iterator.h>

#include <algorithm>
#include <cfloat>

#include "device_utils.cuh"

namespace lrmoe {
namespace {

constexpr uint64_t kNoKey = ~uint64_t(0);

// Monotone map float -> uint32 (a < b  =>  f(a) < f(b)); -0.0 is mapped as +0.0 so they tie.
__device__ __forceinline__ uint32_t orderable(float v) {
  if (v == 0.f) v = 0.f;
  const uint32_t u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ int64_t group_of_position(const int64_t* offsets, int64_t G, int64_t p) {
  int64_t lo = 0, hi = G;  // the last g with offsets[g] <= p; G when p >= offsets[G]
  if (p >= offsets[G]) return G;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (offsets[mid] <= p) lo = mid; else hi = mid;
  }
  return lo;
}

template <typename T>
__device__ __forceinline__ int64_t lower_bound(const T* a, int64_t lo, int64_t hi, T key) {
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (a[mid] < key) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// ---- top-k retention --------------------------------------------------------------------------

__global__ void retention_groups_kernel(const int64_t* __restrict__ group_sizes, const int64_t* __restrict__ quotas,
                                        const int64_t* __restrict__ offsets, int64_t G, int64_t* __restrict__ kept_sizes,
                                        int64_t* __restrict__ summary) {
  for (int64_t g = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; g < G; g += (int64_t)gridDim.x * blockDim.x) {
    const int64_t q = quotas[g], n = group_sizes[g];
    kept_sizes[g] = max(int64_t(0), min(q, n));
    if (q < 0) atomicAdd(reinterpret_cast<unsigned long long*>(summary + 2), 1ull);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) summary[1] = offsets[G];
}

// Pair p's sort score: scores[p], or with u (priority sampling; float scores) scores[p] / (1 - u[p]), the same
// IEEE operations as the reference's, so the same bits.
template <typename score_t>
__device__ __forceinline__ float key_at(const score_t* scores, const float* u, int64_t p) {
  const float s = to_float(scores[p]);
  return u == nullptr ? s : s / (1.0f - u[p]);
}

template <typename score_t>
__global__ void retention_keys_kernel(const score_t* __restrict__ scores, const float* __restrict__ u,
                                      const int64_t* __restrict__ offsets, int64_t G,
                                      int64_t P, uint64_t* __restrict__ keys, int32_t* __restrict__ positions,
                                      uint8_t* __restrict__ flags, score_t* __restrict__ threshold) {
  for (int64_t p = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; p < P; p += (int64_t)gridDim.x * blockDim.x) {
    const int64_t g = group_of_position(offsets, G, p);
    // ascending (group, score descending); stable, so equal scores stay in position order
    keys[p] = (uint64_t(g) << 32) | uint64_t(~orderable(key_at(scores, u, p)));
    positions[p] = (int32_t)p;
    flags[p] = 0;
  }
  for (int64_t g = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; g < G; g += (int64_t)gridDim.x * blockDim.x)
    threshold[g] = from_float<score_t>(0.f);
}

template <typename score_t>
__global__ void retention_mark_kernel(const uint64_t* __restrict__ sorted_keys, const int32_t* __restrict__ sorted_pos,
                                      const score_t* __restrict__ scores, const float* __restrict__ u,
                                      const int64_t* __restrict__ offsets, const int64_t* __restrict__ quotas, int64_t G,
                                      int64_t P, uint8_t* __restrict__ flags, score_t* __restrict__ threshold) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < P; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t g = int64_t(sorted_keys[i] >> 32);
    if (g >= G) continue;  // positions past sum(group_sizes): reported by the caller
    const int64_t rank = i - offsets[g], q = max(int64_t(0), quotas[g]);
    const int32_t p = sorted_pos[i];
    if (rank < q) flags[p] = 1;
    // the (q+1)-th largest: one writer per group (a score's float round trip is exact)
    else if (rank == q) threshold[g] = from_float<score_t>(key_at(scores, u, p));
  }
}

// Priority sampling's weights: kept entry i (of summary[0]) at grouped position p in group g gets
// max(1, tau_g / max(metric_p, FLT_MIN)) (as the reference: tau_g = 0, a whole group kept, gives 1), or 1 without u.
__global__ void retention_scale_kernel(const int64_t* __restrict__ kept, const int64_t* __restrict__ summary,
                                       const float* __restrict__ metric, const float* __restrict__ u,
                                       const int64_t* __restrict__ offsets, int64_t G, const float* __restrict__ threshold,
                                       int64_t P, float* __restrict__ scale) {
  const int64_t n = summary[0];
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < P && i < n; i += (int64_t)gridDim.x * blockDim.x) {
    if (u == nullptr) { scale[i] = 1.0f; continue; }
    const int64_t p = kept[i];
    const float tau = threshold[group_of_position(offsets, G, p)];
    scale[i] = fmaxf(tau / fmaxf(metric[p], FLT_MIN), 1.0f);
  }
}

// The retained pairs' maps (reference.retained_pairs): kept_row_of_pair and pair_weight cleared first (-1, 0).
template <typename w_t, typename rw_t, bool kRescale>
__global__ void retained_pairs_kernel(const int64_t* __restrict__ kept, const float* __restrict__ scale, int64_t n,
                                      const int64_t* __restrict__ order, int64_t P, int64_t K,
                                      const w_t* __restrict__ weight_of_row, int64_t* __restrict__ kept_pairs,
                                      int64_t* __restrict__ src, w_t* __restrict__ gate, rw_t* __restrict__ row_weight,
                                      int64_t* __restrict__ kept_row_of_pair, rw_t* __restrict__ pair_weight) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = kept[i];
    LRMOE_DEVICE_ASSERT(r >= 0 && r < P, "retained_pairs: kept send rows must be in [0, P)");
    const int64_t p = order[r];
    LRMOE_DEVICE_ASSERT(p >= 0 && p < P, "retained_pairs: order must map send rows to pairs in [0, P)");
    const w_t g = weight_of_row[r];
    rw_t w;
    if constexpr (kRescale) w = to_float(g) * scale[i];  // the promoted (fp32) product, as torch's gate * scale
    else w = g;
    kept_pairs[i] = p;
    src[i] = p / K;
    gate[i] = g;
    row_weight[i] = w;
    kept_row_of_pair[p] = i;
    pair_weight[p] = w;
  }
}

// The send rows' gates and retention metric (reference.retention_metric). kMetric: 0 "grad_norm"
// ((g ||dout|| ) ||x||: the reference's two fp32 products in its order, so the same bits), 1 "gate", 2 "uniform".
template <typename w_t, int kMetric>
__global__ void retention_metric_kernel(const int64_t* __restrict__ order, int64_t P, int64_t K,
                                        const w_t* __restrict__ topk_weight, const float* __restrict__ dout_norm,
                                        const float* __restrict__ x_norm, w_t* __restrict__ weight_of_row,
                                        float* __restrict__ metric) {
  for (int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; r < P; r += (int64_t)gridDim.x * blockDim.x) {
    const int64_t p = order[r];
    LRMOE_DEVICE_ASSERT(p >= 0 && p < P, "retention_metric: order must map send rows to pairs in [0, P)");
    const int64_t t = p / K;
    const w_t g = topk_weight[p];
    weight_of_row[r] = g;
    if constexpr (kMetric == 0) metric[r] = to_float(g) * dout_norm[t] * x_norm[t];
    else if constexpr (kMetric == 1) metric[r] = to_float(g);
    else metric[r] = 1.0f;
  }
}

// Each group's summed metric, one block per group: its offset from the sizes before it, then a block reduction
// in a fixed order (no atomics: the same inputs give the same bits; a last-bit change can move a quota).
constexpr int kMassThreads = 256;
__global__ void group_mass_kernel(const float* __restrict__ metric, int64_t P, const int64_t* __restrict__ group_sizes,
                                  float* __restrict__ mass) {
  using SizeSum = cub::BlockReduce<int64_t, kMassThreads>;
  using MassSum = cub::BlockReduce<float, kMassThreads>;
  __shared__ union { typename SizeSum::TempStorage sizes; typename MassSum::TempStorage mass; } temp;
  __shared__ int64_t start;
  const int64_t g = blockIdx.x;
  int64_t before = 0;
  for (int64_t i = threadIdx.x; i < g; i += kMassThreads) before += group_sizes[i];
  before = SizeSum(temp.sizes).Sum(before);
  if (threadIdx.x == 0) start = before;
  __syncthreads();
  const int64_t begin = start, end = begin + group_sizes[g];
  LRMOE_DEVICE_ASSERT(group_sizes[g] >= 0 && end <= P, "retention_metric: group_sizes must be >= 0 and sum to P");
  float sum = 0.f;
  for (int64_t r = begin + threadIdx.x; r < end; r += kMassThreads) sum += metric[r];
  sum = MassSum(temp.mass).Sum(sum);
  if (threadIdx.x == 0) mass[g] = sum;
}

// ---- capacity routing -------------------------------------------------------------------------

__global__ void route_prepare_kernel(const int64_t* __restrict__ pair_group, const int64_t* __restrict__ pair_rank,
                                     int64_t P, uint64_t* __restrict__ keys, int32_t* __restrict__ values,
                                     uint64_t* __restrict__ spill_keys, int64_t* __restrict__ out) {
  for (int64_t p = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; p < P; p += (int64_t)gridDim.x * blockDim.x) {
    const int64_t g = pair_group[p], r = pair_rank[p];
    LRMOE_DEVICE_ASSERT(g >= 0 && g < (int64_t(1) << 31) && r >= 0 && r < (int64_t(1) << 31),
                        "capacity_route: pair_group and pair_rank must be in [0, 2^31)");
    keys[p] = (uint64_t(g) << 32) | uint64_t(r);
    values[p] = (int32_t)p;
    spill_keys[p] = kNoKey;
    out[p] = -1;
  }
}

// Block b works for expert e = instance_group[b] if b is e's first instance (else returns): it
// gathers e's instances in index order into shared memory (a stable block-wide compaction).
// Returns the number of instances, or -1 when this block has nothing to do.
__device__ int gather_instances(const int64_t* __restrict__ instance_group, int64_t I, int32_t* list, int* warp_counts) {
  __shared__ int s_total, s_first;
  const int64_t b = blockIdx.x, e = instance_group[b];
  if (threadIdx.x == 0) { s_total = 0; s_first = 1; }
  __syncthreads();
  for (int64_t k = threadIdx.x; k < b; k += blockDim.x)
    if (instance_group[k] == e) s_first = 0;
  __syncthreads();
  if (!s_first) return -1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int64_t base = 0; base < I; base += blockDim.x) {
    const int64_t k = base + threadIdx.x;
    const bool mine = k < I && instance_group[k] == e;
    const unsigned ballot = __ballot_sync(0xffffffffu, mine);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    if (threadIdx.x == 0) {
      int run = s_total;
      for (int w = 0; w < nwarps; ++w) { const int c = warp_counts[w]; warp_counts[w] = run; run += c; }
      s_total = run;
    }
    __syncthreads();
    if (mine) list[warp_counts[warp] + __popc(ballot & ((1u << lane) - 1u))] = (int32_t)k;
    __syncthreads();
  }
  return s_total;
}

// Stage 1 (local first): each pair of e whose rank has an instance of e takes it, in pair order, up to
// its capacity; the rest are marked as spilled. Writes every instance's spare capacity.
__global__ void route_local_kernel(const uint64_t* __restrict__ keys, const int32_t* __restrict__ pos, int64_t P,
                                   const int64_t* __restrict__ instance_group, const int64_t* __restrict__ instance_rank,
                                   const int64_t* __restrict__ capacity, int64_t I, int64_t* __restrict__ spare,
                                   uint64_t* __restrict__ spill_keys, int64_t* __restrict__ out) {
  extern __shared__ int32_t list[];
  __shared__ int warp_counts[32];
  __shared__ int64_t seg[2];
  const int m = gather_instances(instance_group, I, list, warp_counts);
  if (m < 0) return;
  const uint64_t e = (uint64_t)instance_group[blockIdx.x];
  if (threadIdx.x == 0) {
    seg[0] = lower_bound<uint64_t>(keys, 0, P, e << 32);
    seg[1] = lower_bound<uint64_t>(keys, seg[0], P, (e + 1) << 32);
  }
  __syncthreads();
  const int64_t s = seg[0], t = seg[1];
  for (int j = threadIdx.x; j < m; j += blockDim.x) {
    const int32_t inst = list[j];
    const int64_t cap = capacity[inst], r = instance_rank[inst];
    LRMOE_DEVICE_ASSERT(cap >= 0, "capacity_route: capacities must be >= 0");
    bool first_on_rank = true;
    for (int k = 0; k < j; ++k) first_on_rank &= instance_rank[list[k]] != r;
    int64_t take = 0;
    if (first_on_rank) {
      const uint64_t key = (e << 32) | uint64_t(r);
      const int64_t run = lower_bound<uint64_t>(keys, s, t, key + 1) - lower_bound<uint64_t>(keys, s, t, key);
      take = min(cap, run);
    }
    spare[inst] = cap - take;
  }
  for (int64_t i = s + threadIdx.x; i < t; i += blockDim.x) {
    const uint64_t key = keys[i];
    const int64_t r = int64_t(key & 0xffffffffu);
    const int32_t p = pos[i];
    int32_t local = -1;
    for (int k = 0; k < m && local < 0; ++k)
      if (instance_rank[list[k]] == r) local = list[k];
    if (local >= 0 && i - lower_bound<uint64_t>(keys, s, i, key) < capacity[local]) out[p] = local;
    else spill_keys[p] = (e << 32) | uint64_t(p);
  }
}

// Stage 2 (spill): e's spilled pairs, in pair order, are spread as if one at a time onto the instance
// with the most spare capacity (ties: lowest index) = a water-fill to level L; each instance in index
// order then takes a contiguous run. Pairs beyond the total spare stay -1.
__global__ void route_spill_kernel(const uint64_t* __restrict__ spill_keys, int64_t P,
                                   const int64_t* __restrict__ instance_group, int64_t I,
                                   const int64_t* __restrict__ spare, int64_t* __restrict__ out) {
  extern __shared__ int32_t list[];
  __shared__ int warp_counts[32];
  __shared__ int64_t seg[2];
  const int m = gather_instances(instance_group, I, list, warp_counts);
  if (m < 0) return;
  int64_t* prefix = reinterpret_cast<int64_t*>(list + ((I + 1) / 2) * 2);  // m + 1 entries
  const uint64_t e = (uint64_t)instance_group[blockIdx.x];
  if (threadIdx.x == 0) {
    seg[0] = lower_bound<uint64_t>(spill_keys, 0, P, e << 32);
    seg[1] = lower_bound<uint64_t>(spill_keys, seg[0], P, (e + 1) << 32);
    const int64_t S = seg[1] - seg[0];
    int64_t total = 0, top = 0;
    for (int j = 0; j < m; ++j) { total += spare[list[j]]; top = max(top, spare[list[j]]); }
    int64_t level = 0, extra = 0;  // takes_j = max(0, s_j - level) + (first `extra` with s_j >= level)
    if (S < total) {
      int64_t lo = 1, hi = top;  // smallest L >= 1 with f(L) = sum max(0, s_j - L) <= S
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        int64_t f = 0;
        for (int j = 0; j < m; ++j) f += max(int64_t(0), spare[list[j]] - mid);
        if (f <= S) hi = mid; else lo = mid + 1;
      }
      level = lo;
      int64_t f = 0;
      for (int j = 0; j < m; ++j) f += max(int64_t(0), spare[list[j]] - level);
      extra = S - f;
    }
    prefix[0] = 0;
    for (int j = 0; j < m; ++j) {
      const int64_t sj = spare[list[j]];
      int64_t take = max(int64_t(0), sj - level);
      if (S < total && sj >= level && extra > 0) { ++take; --extra; }
      prefix[j + 1] = prefix[j] + take;
    }
  }
  __syncthreads();
  const int64_t s = seg[0], t = seg[1], placed = prefix[m];
  for (int64_t k = threadIdx.x; k < t - s && k < placed; k += blockDim.x) {
    int lo = 0, hi = m;  // the j with prefix[j] <= k < prefix[j+1]
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (prefix[mid] <= k) lo = mid; else hi = mid;
    }
    out[int64_t(spill_keys[s + k] & 0xffffffffu)] = list[lo];
  }
}

int grid_for(int64_t n, int threads = 256) {
  return (int)std::max<int64_t>(1, std::min<int64_t>((n + threads - 1) / threads, 8 * num_sms()));
}

}  // namespace

namespace {
// topk_retention, and with scale (float scores) priority sampling: keys from u, then the kept pairs' weights.
size_t topk_impl(const void* scores, DType stype, const float* u, int64_t P, const void* group_sizes, IType gtype,
                 const void* quotas, IType qtype, int64_t G, int64_t* kept, int64_t* kept_sizes, void* threshold,
                 float* scale, int64_t* summary, void* temp, size_t temp_bytes, cudaStream_t stream) {
  if (gtype != IType::kI64 || qtype != IType::kI64) throw std::runtime_error("topk_retention: int64 sizes expected");
  if ((u != nullptr || scale != nullptr) && stype != DType::kF32)
    throw std::runtime_error("priority_sample: float32 metric expected");
  Scratch sc(temp);
  int64_t* offsets = sc.take<int64_t>(G + 1);
  uint64_t* keys_in = sc.take<uint64_t>(P);
  uint64_t* keys_out = sc.take<uint64_t>(P);
  int32_t* pos_in = sc.take<int32_t>(P);
  int32_t* pos_out = sc.take<int32_t>(P);
  uint8_t* flags = sc.take<uint8_t>(P);
  const auto* gs = static_cast<const int64_t*>(group_sizes);
  const auto* qs = static_cast<const int64_t*>(quotas);
  const int end_bit = 32 + end_bit_for(G + 1);
  thrust::counting_iterator<int64_t> iota(0);
  size_t sort_bytes = 0, scan_bytes = 0, select_bytes = 0;
  LRMOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, keys_in, keys_out, pos_in, pos_out, P, 0, end_bit, stream));
  LRMOE_CUDA_CHECK(cub::DeviceScan::InclusiveSum(nullptr, scan_bytes, gs, offsets + 1, G, stream));
  LRMOE_CUDA_CHECK(cub::DeviceSelect::Flagged(nullptr, select_bytes, iota, flags, kept, summary, P, stream));
  void* cub_temp = sc.take<char>(std::max({sort_bytes, scan_bytes, select_bytes}));
  if (temp == nullptr) return sc.used;
  if (temp_bytes < sc.used) throw std::runtime_error("topk_retention: scratch too small");

  LRMOE_CUDA_CHECK(cudaMemsetAsync(summary, 0, 3 * sizeof(int64_t), stream));
  LRMOE_CUDA_CHECK(cudaMemsetAsync(offsets, 0, sizeof(int64_t), stream));
  if (G > 0) {
    size_t bytes = scan_bytes;
    LRMOE_CUDA_CHECK(cub::DeviceScan::InclusiveSum(cub_temp, bytes, gs, offsets + 1, G, stream));
    retention_groups_kernel<<<grid_for(G), 256, 0, stream>>>(gs, qs, offsets, G, kept_sizes, summary);
    LRMOE_LAUNCH_CHECK("topk_retention: groups");
  }
  dispatch_float(stype, [&](auto tag) {
    using score_t = decltype(tag);
    const auto* sp = static_cast<const score_t*>(scores);
    auto* th = static_cast<score_t*>(threshold);
    retention_keys_kernel<score_t><<<grid_for(std::max(P, G)), 256, 0, stream>>>(sp, u, offsets, G, P, keys_in, pos_in,
                                                                                flags, th);
    LRMOE_LAUNCH_CHECK("topk_retention: keys");
    if (P == 0) return;
    size_t bytes = sort_bytes;
    LRMOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(cub_temp, bytes, keys_in, keys_out, pos_in, pos_out, P, 0, end_bit, stream));
    retention_mark_kernel<score_t><<<grid_for(P), 256, 0, stream>>>(keys_out, pos_out, sp, u, offsets, qs, G, P, flags,
                                                                    th);
    LRMOE_LAUNCH_CHECK("topk_retention: mark");
    bytes = select_bytes;
    LRMOE_CUDA_CHECK(cub::DeviceSelect::Flagged(cub_temp, bytes, iota, flags, kept, summary, P, stream));
    if (scale != nullptr) {
      retention_scale_kernel<<<grid_for(P), 256, 0, stream>>>(kept, summary, static_cast<const float*>(scores), u,
                                                              offsets, G, static_cast<const float*>(threshold), P, scale);
      LRMOE_LAUNCH_CHECK("priority_sample: scale");
    }
  });
  return sc.used;
}
}  // namespace

size_t topk_retention(const void* scores, DType stype, int64_t P, const void* group_sizes, IType gtype,
                      const void* quotas, IType qtype, int64_t G, int64_t* kept, int64_t* kept_sizes,
                      void* threshold, int64_t* summary, void* temp, size_t temp_bytes, cudaStream_t stream) {
  return topk_impl(scores, stype, nullptr, P, group_sizes, gtype, quotas, qtype, G, kept, kept_sizes, threshold, nullptr,
                   summary, temp, temp_bytes, stream);
}

size_t priority_sample(const float* metric, const float* u, int64_t P, const int64_t* group_sizes,
                       const int64_t* quotas, int64_t G, int64_t* kept, int64_t* kept_sizes, float* threshold,
                       float* scale, int64_t* summary, void* temp, size_t temp_bytes, cudaStream_t stream) {
  return topk_impl(metric, DType::kF32, u, P, group_sizes, IType::kI64, quotas, IType::kI64, G, kept, kept_sizes,
                   threshold, scale, summary, temp, temp_bytes, stream);
}

void retained_pairs(const int64_t* kept, const float* scale, int64_t n_kept, const int64_t* order, int64_t P, int64_t K,
                    const void* weight_of_row, DType wtype, bool rescale, int64_t* kept_pairs, int64_t* src, void* gate,
                    void* row_weight, int64_t* kept_row_of_pair, void* pair_weight, cudaStream_t stream) {
  const size_t rw_bytes = rescale ? sizeof(float) : (wtype == DType::kF32 ? 4 : 2);
  LRMOE_CUDA_CHECK(cudaMemsetAsync(kept_row_of_pair, 0xff, P * sizeof(int64_t), stream));  // all bits set: -1
  LRMOE_CUDA_CHECK(cudaMemsetAsync(pair_weight, 0, P * rw_bytes, stream));
  if (n_kept == 0) return;
  dispatch_float(wtype, [&](auto tag) {
    using w_t = decltype(tag);
    const auto* w = static_cast<const w_t*>(weight_of_row);
    if (rescale)
      retained_pairs_kernel<w_t, float, true><<<grid_for(n_kept), 256, 0, stream>>>(
          kept, scale, n_kept, order, P, K, w, kept_pairs, src, static_cast<w_t*>(gate), static_cast<float*>(row_weight),
          kept_row_of_pair, static_cast<float*>(pair_weight));
    else
      retained_pairs_kernel<w_t, w_t, false><<<grid_for(n_kept), 256, 0, stream>>>(
          kept, scale, n_kept, order, P, K, w, kept_pairs, src, static_cast<w_t*>(gate), static_cast<w_t*>(row_weight),
          kept_row_of_pair, static_cast<w_t*>(pair_weight));
  });
  LRMOE_LAUNCH_CHECK("retained_pairs");
}

void retention_metric(const int64_t* order, int64_t P, int64_t K, const void* topk_weight, DType wtype, int metric_kind,
                      const float* dout_norm, const float* x_norm, const int64_t* group_sizes, int64_t G,
                      void* weight_of_row, float* metric, float* mass, cudaStream_t stream) {
  if (P > 0) {
    dispatch_float(wtype, [&](auto tag) {
      using w_t = decltype(tag);
      const auto* w = static_cast<const w_t*>(topk_weight);
      auto* wr = static_cast<w_t*>(weight_of_row);
      if (metric_kind == 0)
        retention_metric_kernel<w_t, 0><<<grid_for(P), 256, 0, stream>>>(order, P, K, w, dout_norm, x_norm, wr, metric);
      else if (metric_kind == 1)
        retention_metric_kernel<w_t, 1><<<grid_for(P), 256, 0, stream>>>(order, P, K, w, dout_norm, x_norm, wr, metric);
      else
        retention_metric_kernel<w_t, 2><<<grid_for(P), 256, 0, stream>>>(order, P, K, w, dout_norm, x_norm, wr, metric);
    });
    LRMOE_LAUNCH_CHECK("retention_metric");
  }
  if (mass != nullptr && G > 0) {
    group_mass_kernel<<<(unsigned)G, kMassThreads, 0, stream>>>(metric, P, group_sizes, mass);
    LRMOE_LAUNCH_CHECK("retention_metric: mass");
  }
}

size_t capacity_route(const void* pair_group, const void* pair_rank, IType ptype, int64_t P, const void* instance_group,
                      const void* instance_rank, const void* instance_capacity, IType itype, int64_t I,
                      int64_t* pair_instance, void* temp, size_t temp_bytes, cudaStream_t stream) {
  if (ptype != IType::kI64 || itype != IType::kI64) throw std::runtime_error("capacity_route: int64 inputs expected");
  Scratch sc(temp);
  uint64_t* keys_in = sc.take<uint64_t>(P);
  uint64_t* keys_out = sc.take<uint64_t>(P);
  int32_t* pos_in = sc.take<int32_t>(P);
  int32_t* pos_out = sc.take<int32_t>(P);
  uint64_t* spill_in = sc.take<uint64_t>(P);
  uint64_t* spill_out = sc.take<uint64_t>(P);
  int64_t* spare = sc.take<int64_t>(I);
  size_t pair_bytes = 0, key_bytes = 0;
  LRMOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, pair_bytes, keys_in, keys_out, pos_in, pos_out, P, 0, 64, stream));
  LRMOE_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(nullptr, key_bytes, spill_in, spill_out, P, 0, 64, stream));
  void* cub_temp = sc.take<char>(std::max(pair_bytes, key_bytes));
  if (temp == nullptr) return sc.used;
  if (temp_bytes < sc.used) throw std::runtime_error("capacity_route: scratch too small");
  if (P == 0) return sc.used;
  const auto* pg = static_cast<const int64_t*>(pair_group);
  const auto* pr = static_cast<const int64_t*>(pair_rank);
  const auto* ig = static_cast<const int64_t*>(instance_group);
  const auto* ir = static_cast<const int64_t*>(instance_rank);
  const auto* cap = static_cast<const int64_t*>(instance_capacity);
  route_prepare_kernel<<<grid_for(P), 256, 0, stream>>>(pg, pr, P, keys_in, pos_in, spill_in, pair_instance);
  LRMOE_LAUNCH_CHECK("capacity_route: prepare");
  if (I == 0) return sc.used;
  size_t bytes = pair_bytes;
  LRMOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(cub_temp, bytes, keys_in, keys_out, pos_in, pos_out, P, 0, 64, stream));
  const size_t list_bytes = ((I + 1) / 2) * 2 * sizeof(int32_t);
  route_local_kernel<<<(unsigned)I, 256, list_bytes, stream>>>(keys_out, pos_out, P, ig, ir, cap, I, spare, spill_in,
                                                               pair_instance);
  LRMOE_LAUNCH_CHECK("capacity_route: local");
  bytes = key_bytes;
  LRMOE_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(cub_temp, bytes, spill_in, spill_out, P, 0, 64, stream));
  const size_t spill_smem = list_bytes + (I + 1) * sizeof(int64_t);  // up to 96 KiB at I = 8192
  if (spill_smem > 48 * 1024)
    LRMOE_CUDA_CHECK(cudaFuncSetAttribute(route_spill_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)spill_smem));
  route_spill_kernel<<<(unsigned)I, 256, spill_smem, stream>>>(spill_out, P, ig, I, spare,
                                                                                          pair_instance);
  LRMOE_LAUNCH_CHECK("capacity_route: spill");
  return sc.used;
}

}  // namespace lrmoe
