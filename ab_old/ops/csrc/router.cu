// The router's top-k math, one warp per token: scores (softmax over the experts or sigmoid per expert),
// the k best experts by selection score (score + optional bias; ties to the lower expert index), their
// gate weights (renormalised on request), and per-expert pair counts and probability sums; and its
// backward (closed form, see ops/reference.py router_topk_backward). fp32 math, no fast-math.
//
// A warp holds a token's E <= 32 * VPT scores in registers (lane l has experts l, l + 32, ...). The
// top-k is k rounds of a warp arg-max over (selection score, expert index), a strict total order
// (NaN selection scores count as -inf), so every lane agrees on each round's winner.
// Deterministic: prob_sum is summed per warp, then over a block's warps in order, then over the blocks
// in order by a second kernel; the row-to-block split depends only on T. Counts use integer atomics in
// shared memory only. No host synchronisation.
#include <algorithm>
#include <cfloat>
#include <climits>

#include "device_utils.cuh"

namespace lrmoe {
namespace {

constexpr int kWarps = 8;                 // warps per block
constexpr int kThreads = kWarps * 32;
constexpr int kMinRowsPerBlock = 32;
constexpr int kMaxBlocks = 512;           // the second pass sums at most this many partials per expert
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float warp_sum(float v) {
  // xor butterfly: each step adds the same two values on both lanes, so every lane ends bitwise equal
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(kFull, v, off);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(kFull, v, off));
  return v;
}

// A row's scores: softmax needs the row's max and sum of exp(x - max); sigmoid needs neither. One
// expression for both kernels, so the backward recomputes the forward's values bit for bit.
struct RowScores {
  bool use_sigmoid;
  float row_max, row_sum;
  __device__ __forceinline__ float exp_part(float x) const { return expf(x - row_max); }
  __device__ __forceinline__ float of(float x) const {
    return use_sigmoid ? 1.f / (1.f + expf(-x)) : exp_part(x) / row_sum;
  }
};

// Loads the row's logits into x (-inf past E), returns its RowScores and fills s with the scores.
template <int VPT>
__device__ __forceinline__ RowScores load_scores(const float* __restrict__ row, int E, bool use_sigmoid, int lane,
                                                 float (&x)[VPT], float (&s)[VPT]) {
  RowScores rs{use_sigmoid, 0.f, 1.f};
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int e = lane + 32 * j;
    x[j] = e < E ? row[e] : -INFINITY;
  }
  if (!use_sigmoid) {
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < VPT; ++j) m = fmaxf(m, x[j]);
    rs.row_max = warp_max(m);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < VPT; ++j) sum += lane + 32 * j < E ? rs.exp_part(x[j]) : 0.f;
    rs.row_sum = warp_sum(sum);
  }
#pragma unroll
  for (int j = 0; j < VPT; ++j) s[j] = lane + 32 * j < E ? rs.of(x[j]) : 0.f;
  return rs;
}

// (v, i) ranks before (bv, bi): higher value, then lower index. Values are never NaN here.
__device__ __forceinline__ bool ranks_before(float v, int i, float bv, int bi) {
  return v > bv || (v == bv && i < bi);
}

// Grid: blocks over contiguous runs of rows_per_block rows; in a block, warp w takes rows w, w + kWarps, ...
// Writes topk_index/topk_weight rows, and the block's partials block_prob[b][E], block_counts[b][E].
template <int VPT>
__global__ void __launch_bounds__(kThreads) router_topk_kernel(
    const float* __restrict__ logits, const float* __restrict__ score_bias, int64_t T, int E, int K, bool use_sigmoid,
    bool norm_topk_prob, int64_t rows_per_block, int64_t* __restrict__ topk_index, float* __restrict__ topk_weight,
    float* __restrict__ block_prob, int* __restrict__ block_counts) {
  extern __shared__ float smem[];  // [kWarps][E] per-warp probability sums, then [E] int counts
  int* counts = reinterpret_cast<int*>(smem + kWarps * E);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int e = threadIdx.x; e < E; e += blockDim.x) counts[e] = 0;
  __syncthreads();

  float bias[VPT], prob_acc[VPT];
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int e = lane + 32 * j;
    bias[j] = score_bias != nullptr && e < E ? score_bias[e] : 0.f;
    prob_acc[j] = 0.f;
  }
  const int64_t row_begin = blockIdx.x * rows_per_block, row_end = min(T, row_begin + rows_per_block);
  for (int64_t t = row_begin + warp; t < row_end; t += kWarps) {
    float x[VPT], s[VPT];
    load_scores<VPT>(logits + t * E, E, use_sigmoid, lane, x, s);
    // probs: the scores (softmax), or the scores over their row sum (sigmoid)
    float z = 1.f;
    if (use_sigmoid) {
      float part = 0.f;
#pragma unroll
      for (int j = 0; j < VPT; ++j) part += s[j];
      z = warp_sum(part);
    }
    float sel[VPT];
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      prob_acc[j] += use_sigmoid ? s[j] / z : s[j];  // s = 0 past E
      const float v = s[j] + bias[j];
      sel[j] = v != v ? -INFINITY : v;  // NaN -> -inf: keeps the order total
    }

    unsigned taken = 0;  // bit j: expert lane + 32 j is chosen
    float weight_sum = 0.f;
    int64_t* index_row = topk_index + t * K;
    float* weight_row = topk_weight + t * K;
    for (int r = 0; r < K; ++r) {
      float bv = -INFINITY, bs = 0.f;
      int bi = INT_MAX;  // no candidate
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        const int e = lane + 32 * j;
        if (e < E && !((taken >> j) & 1u) && ranks_before(sel[j], e, bv, bi)) {
          bv = sel[j];
          bi = e;
          bs = s[j];
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off /= 2) {
        const float ov = __shfl_xor_sync(kFull, bv, off), os = __shfl_xor_sync(kFull, bs, off);
        const int oi = __shfl_xor_sync(kFull, bi, off);
        if (ranks_before(ov, oi, bv, bi)) {
          bv = ov;
          bi = oi;
          bs = os;
        }
      }
      // K <= E, so every round finds an expert: bi < E on all lanes
      if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
      weight_sum += bs;  // in round order, the same on every lane
      if ((r & 31) == lane) {
        index_row[r] = bi;
        weight_row[r] = bs;
        atomicAdd(&counts[bi], 1);
      }
    }
    if (norm_topk_prob && K > 1) {
      // clamp_min(tiny) as the reference (a NaN sum stays NaN); each lane rescales the weights it wrote
      const float denom = weight_sum < FLT_MIN ? FLT_MIN : weight_sum;
      for (int r = lane; r < K; r += 32) weight_row[r] = weight_row[r] / denom;
    }
  }

  float* warp_prob = smem + warp * E;
#pragma unroll
  for (int j = 0; j < VPT; ++j)
    if (lane + 32 * j < E) warp_prob[lane + 32 * j] = prob_acc[j];
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    float acc = 0.f;
    for (int w = 0; w < kWarps; ++w) acc += smem[w * E + e];
    block_prob[(int64_t)blockIdx.x * E + e] = acc;
    block_counts[(int64_t)blockIdx.x * E + e] = counts[e];
  }
}

// prob_sum[e] and counts[e]: the blocks' partials summed in block order.
__global__ void router_topk_finalize_kernel(const float* __restrict__ block_prob, const int* __restrict__ block_counts,
                                            int blocks, int E, float* __restrict__ prob_sum, int64_t* __restrict__ counts) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  float acc = 0.f;
  int64_t n = 0;
#pragma unroll 8
  for (int b = 0; b < blocks; ++b) {
    acc += block_prob[(int64_t)b * E + e];
    n += block_counts[(int64_t)b * E + e];
  }
  prob_sum[e] = acc;
  counts[e] = n;
}

// One warp per row, rows grid-strided. d_scores lives in shared memory for the scatter of the
// top-k gradients (a row's experts are distinct, so the warp's lanes never write the same place).
template <int VPT>
__global__ void __launch_bounds__(kThreads) router_topk_backward_kernel(
    const float* __restrict__ logits, const int64_t* __restrict__ topk_index, const float* __restrict__ d_topk_weight,
    const float* __restrict__ d_prob_sum, int64_t T, int E, int K, bool use_sigmoid, bool norm_topk_prob,
    float* __restrict__ d_logits) {
  extern __shared__ float smem[];  // [kWarps][E] d_scores
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* d_scores = smem + warp * E;
  float gp[VPT];
#pragma unroll
  for (int j = 0; j < VPT; ++j) gp[j] = d_prob_sum != nullptr && lane + 32 * j < E ? d_prob_sum[lane + 32 * j] : 0.f;

  for (int64_t t = (int64_t)blockIdx.x * kWarps + warp; t < T; t += (int64_t)gridDim.x * kWarps) {
    const float* row = logits + t * E;
    float x[VPT], s[VPT], g[VPT];
    const RowScores rs = load_scores<VPT>(row, E, use_sigmoid, lane, x, s);
    // prob_sum's part: ds = gp (softmax); ds = (gp - sum_e gp_e s_e / z) / z with z = sum_e s_e (sigmoid)
    if (use_sigmoid && d_prob_sum != nullptr) {
      float z = 0.f, gs = 0.f;
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        z += s[j];
        gs += gp[j] * s[j];
      }
      z = warp_sum(z);
      const float c = warp_sum(gs) / z;
#pragma unroll
      for (int j = 0; j < VPT; ++j) g[j] = (gp[j] - c) / z;
    } else {
#pragma unroll
      for (int j = 0; j < VPT; ++j) g[j] = gp[j];
    }
#pragma unroll
    for (int j = 0; j < VPT; ++j)
      if (lane + 32 * j < E) d_scores[lane + 32 * j] = g[j];

    // the renormalisation's sums: S = sum_j w_j, GW = sum_j g_j w_j (w recomputed from the logits)
    const int64_t* index_row = topk_index + t * K;
    const float* dw_row = d_topk_weight + t * K;
    const bool renorm = norm_topk_prob && K > 1;
    float w_sum = 0.f, gw_sum = 0.f;
    if (renorm) {
      for (int r = lane; r < K; r += 32) {
        const int64_t i = index_row[r];
        LRMOE_DEVICE_ASSERT(i >= 0 && i < E, "router_topk_backward: topk_index out of range [0, E)");
        const float w = rs.of(row[i]);
        w_sum += w;
        gw_sum += dw_row[r] * w;
      }
      w_sum = warp_sum(w_sum);
      gw_sum = warp_sum(gw_sum);
    }
    const float denom = w_sum < FLT_MIN ? FLT_MIN : w_sum;
    __syncwarp();
    for (int r = lane; r < K; r += 32) {
      const int64_t i = index_row[r];
      LRMOE_DEVICE_ASSERT(i >= 0 && i < E, "router_topk_backward: topk_index out of range [0, E)");
      float dw = dw_row[r];
      if (renorm) dw = w_sum >= FLT_MIN ? (dw - gw_sum / denom) / denom : dw / denom;
      d_scores[i] += dw;
    }
    __syncwarp();
#pragma unroll
    for (int j = 0; j < VPT; ++j) g[j] = lane + 32 * j < E ? d_scores[lane + 32 * j] : 0.f;
    __syncwarp();  // the next row overwrites d_scores

    float out[VPT];
    if (use_sigmoid) {
      // 1 - s as exp(-x) s where x >= 0 (no cancellation near s = 1), as the reference
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        const float one_minus_s = x[j] >= 0.f ? expf(-x[j]) * s[j] : 1.f - s[j];
        out[j] = g[j] * s[j] * one_minus_s;
      }
    } else {
      float gs = 0.f;
#pragma unroll
      for (int j = 0; j < VPT; ++j) gs += g[j] * s[j];
      gs = warp_sum(gs);
#pragma unroll
      for (int j = 0; j < VPT; ++j) out[j] = s[j] * (g[j] - gs);
    }
    float* out_row = d_logits + t * E;
#pragma unroll
    for (int j = 0; j < VPT; ++j)
      if (lane + 32 * j < E) out_row[lane + 32 * j] = out[j];
  }
}

// VPT = the power of two >= ceil(E / 32), as a compile-time constant.
template <typename Launch>
void with_vpt(int E, Launch&& launch) {
  const int need = (E + 31) / 32;
  if (need <= 1) launch(std::integral_constant<int, 1>{});
  else if (need <= 2) launch(std::integral_constant<int, 2>{});
  else if (need <= 4) launch(std::integral_constant<int, 4>{});
  else if (need <= 8) launch(std::integral_constant<int, 8>{});
  else if (need <= 16) launch(std::integral_constant<int, 16>{});
  else launch(std::integral_constant<int, 32>{});
}

int topk_blocks(int64_t T) {
  return (int)std::min<int64_t>((T + kMinRowsPerBlock - 1) / kMinRowsPerBlock, kMaxBlocks);
}

void check_router_sizes(int64_t T, int E, int K, const char* what) {
  if (T < 0 || E < 1 || E > kRouterMaxExperts || K < 1 || K > E)
    throw std::invalid_argument(std::string(what) + ": needs 1 <= K <= E <= " + std::to_string(kRouterMaxExperts) +
                                " and T >= 0; got T " + std::to_string(T) + ", E " + std::to_string(E) + ", K " +
                                std::to_string(K));
}

}  // namespace

size_t router_topk(const float* logits, const float* score_bias, int64_t T, int E, int K, bool use_sigmoid,
                   bool norm_topk_prob, int64_t* topk_index, float* topk_weight, int64_t* counts, float* prob_sum,
                   void* temp, size_t temp_bytes, cudaStream_t stream) {
  check_router_sizes(T, E, K, "router_topk");
  const int blocks = topk_blocks(T);
  Scratch scratch(temp);
  float* block_prob = scratch.take<float>((size_t)blocks * E);
  int* block_counts = scratch.take<int>((size_t)blocks * E);
  if (temp == nullptr) return scratch.used;
  if (temp_bytes < scratch.used) throw std::runtime_error("router_topk: scratch too small");
  if (blocks > 0) {
    const int64_t rows_per_block = (T + blocks - 1) / blocks;
    const size_t smem = (size_t)kWarps * E * sizeof(float) + (size_t)E * sizeof(int);
    with_vpt(E, [&](auto vpt) {
      router_topk_kernel<decltype(vpt)::value><<<blocks, kThreads, smem, stream>>>(
          logits, score_bias, T, E, K, use_sigmoid, norm_topk_prob, rows_per_block, topk_index, topk_weight,
          block_prob, block_counts);
    });
    LRMOE_LAUNCH_CHECK("router_topk");
  }
  // with no rows (blocks = 0) this writes zeros
  router_topk_finalize_kernel<<<(E + 127) / 128, 128, 0, stream>>>(block_prob, block_counts, blocks, E, prob_sum,
                                                                   counts);
  LRMOE_LAUNCH_CHECK("router_topk (finalize)");
  return scratch.used;
}

void router_topk_backward(const float* logits, const int64_t* topk_index, const float* d_topk_weight,
                          const float* d_prob_sum, int64_t T, int E, int K, bool use_sigmoid, bool norm_topk_prob,
                          float* d_logits, cudaStream_t stream) {
  check_router_sizes(T, E, K, "router_topk_backward");
  if (T == 0) return;
  const int blocks = (int)std::min<int64_t>((T + kWarps - 1) / kWarps, (int64_t)num_sms() * 8);
  const size_t smem = (size_t)kWarps * E * sizeof(float);
  with_vpt(E, [&](auto vpt) {
    router_topk_backward_kernel<decltype(vpt)::value><<<blocks, kThreads, smem, stream>>>(
        logits, topk_index, d_topk_weight, d_prob_sum, T, E, K, use_sigmoid, norm_topk_prob, d_logits);
  });
  LRMOE_LAUNCH_CHECK("router_topk_backward");
}

}  // namespace lrmoe
