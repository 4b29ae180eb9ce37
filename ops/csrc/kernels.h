// Launchers of the lrmoe_ds CUDA kernels. The .cu files include only CUDA, CUB and CUTLASS headers
// (no torch), so they compile anywhere nvcc is; ops.cpp does the tensor checks and allocation.
// Every launcher writes into buffers its caller allocated and enqueues on `stream`; none of them
// synchronises with the host. Launchers taking `temp` return the scratch bytes they need when
// called with temp == nullptr (the CUB convention) and do nothing else then.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace lrmoe {

enum class DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };
enum class IType : int { kI32 = 0, kI64 = 1 };

inline void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("lrmoe_ds CUDA error in ") + what + ": " + cudaGetErrorString(err));
}

// Routing plan: counts [G], order [P] (stable), offsets [G+1], all int64.
size_t routing_plan(const void* group_of_pair, IType itype, int64_t P, int64_t G, int64_t* counts, int64_t* order,
                    int64_t* offsets, void* temp, size_t temp_bytes, cudaStream_t stream);
// out[i, :] = x[index[i], :]; rows of `row_bytes` bytes.
void permute(const void* x, int64_t T, int64_t row_bytes, const void* index, IType itype, int64_t P, void* out,
             cudaStream_t stream);
// out[i, :] = x[index[i], :] * scale[i] (x [T, H] float; the scale rounded to x's dtype, one rounding of the product).
void permute_scaled(const void* x, DType xtype, int64_t T, int64_t H, const void* index, IType itype, int64_t P,
                    const void* scale, DType stype, void* out, cudaStream_t stream);
// out[t, :] = sum_k weight[t, k] * rows[row_of_pair[t, k], :]  (fp32 accumulation, k order).
void unpermute(const void* rows, DType rtype, int64_t P, int64_t H, const void* row_of_pair, IType itype,
               const void* weight, DType wtype, int64_t T, int K, void* out, cudaStream_t stream);

// out[t, k] = <rows[row_of_pair[t, k], :], dout[t, :]>, fp32 [T, K] (unpermute's weight gradient); -1 rows give 0.
// d_rows (nullptr: not computed) [P, H] in rows' dtype: also unpermute's rows gradient,
// d_rows[row_of_pair[t, k], :] = weight[t, k] * dout[t, :] (weight fp32 [T, K], rounded to rows' dtype first, one
// rounding of the product); then every pair must have a row (-1 is a device-side error). With d_row_of_pair
// (same index type, [T, K]) d_rows [Pd, H] goes by that map instead, a pair at -1 getting no row.
void unpermute_weight_grad(const void* rows, DType rtype, int64_t P, int64_t H, const void* row_of_pair, IType itype,
                           const void* dout, int64_t T, int K, float* out, const float* weight, void* d_rows,
                           const void* d_row_of_pair, int64_t Pd, cudaStream_t stream);
// SwiGLU on h [M, 2F] (gate columns first): a[M, F] = silu(gate) * up; and its backward
// dh[M, 2F] from h and da [M, F] (dh may be h itself: written in place), with a as well where a is not nullptr
// (the forward recomputed from the same read of h), and where dot is not nullptr (a given too) dot[m] = <a_m, da_m>
// in fp32. fp32 arithmetic, one rounding per output.
void swiglu(const void* h, DType dtype, int64_t M, int64_t F, void* a, cudaStream_t stream);
void swiglu_backward(const void* h, const void* da, DType dtype, int64_t M, int64_t F, void* dh, void* a,
                     float* dot, const int64_t* index, int64_t Mh, cudaStream_t stream);
// dot[m] = <swiglu(h[index[m]]) as rounded to h's dtype, dz_m> (fp32), dz [M, F]: swiglu_backward's dot alone, the
// same bits, without its dh and a (the router's dot of a dropped pair, dz = dout W2).
void swiglu_dot(const void* h, const void* dz, DType dtype, int64_t M, int64_t F, float* dot, const int64_t* index,
                int64_t Mh, cudaStream_t stream);

// Quota-aware top-k; see retention.cu. kept [P] (the first sum_g min(q_g, n_g) entries are written),
// kept_sizes [G] int64, threshold [G] in scores' dtype, summary [3] int64 = (kept total, sum of
// group_sizes, number of negative quotas), read by the caller in its one synchronisation.
size_t topk_retention(const void* scores, DType stype, int64_t P, const void* group_sizes, IType gtype,
                      const void* quotas, IType qtype, int64_t G, int64_t* kept, int64_t* kept_sizes,
                      void* threshold, int64_t* summary, void* temp, size_t temp_bytes, cudaStream_t stream);
// Priority sampling (reference.priority_sample): topk_retention over keys metric / (1 - u) (u nullptr: the metric
// itself), threshold [G] the keys' (q_g+1)-th largest, and scale [P] (the first summary[0] written) each kept
// pair's weight max(1, tau_g / max(metric_p, FLT_MIN)) (1 without u). float32 throughout.
size_t priority_sample(const float* metric, const float* u, int64_t P, const int64_t* group_sizes,
                       const int64_t* quotas, int64_t G, int64_t* kept, int64_t* kept_sizes, float* threshold,
                       float* scale, int64_t* summary, void* temp, size_t temp_bytes, cudaStream_t stream);
// The retained pairs' maps (reference.retained_pairs) from kept [n_kept] send rows and scale [n_kept] fp32:
// kept_pairs, src [n_kept] int64; gate [n_kept] in weight_of_row's dtype; row_weight [n_kept] (fp32 if rescale,
// else weight_of_row's dtype); kept_row_of_pair [P] int64 (-1: dropped) and pair_weight [P] (row_weight's dtype, 0).
void retained_pairs(const int64_t* kept, const float* scale, int64_t n_kept, const int64_t* order, int64_t P, int64_t K,
                    const void* weight_of_row, DType wtype, bool rescale, int64_t* kept_pairs, int64_t* src, void* gate,
                    void* row_weight, int64_t* kept_row_of_pair, void* pair_weight, cudaStream_t stream);
// The send rows' gates and retention metric (reference.retention_metric) from order [P] int64 and
// topk_weight [P / K, K]: weight_of_row [P] (topk_weight's dtype), metric [P] fp32; metric_kind 0
// "grad_norm" (dout_norm, x_norm [P / K] fp32), 1 "gate", 2 "uniform". With mass (not nullptr): mass [G] fp32, each
// group's summed metric, the groups consecutive runs of group_sizes [G] int64 send rows (summing to P).
void retention_metric(const int64_t* order, int64_t P, int64_t K, const void* topk_weight, DType wtype, int metric_kind,
                      const float* dout_norm, const float* x_norm, const int64_t* group_sizes, int64_t G,
                      void* weight_of_row, float* metric, float* mass, cudaStream_t stream);
// The router's top-k math; see router.cu and ops/reference.py router_topk. logits [T, E] fp32 -> topk_index
// [T, K] int64, topk_weight [T, K] fp32, counts [E] int64, prob_sum [E] fp32; score_bias [E] fp32 or nullptr.
// 1 <= K <= E <= kRouterMaxExperts.
constexpr int kRouterMaxExperts = 1024;
size_t router_topk(const float* logits, const float* score_bias, int64_t T, int E, int K, bool use_sigmoid,
                   bool norm_topk_prob, int64_t* topk_index, float* topk_weight, int64_t* counts, float* prob_sum,
                   void* temp, size_t temp_bytes, cudaStream_t stream);
// Its backward: d_logits [T, E] fp32 from topk_index [T, K] (distinct experts per row), d_topk_weight [T, K]
// fp32 and d_prob_sum [E] fp32 or nullptr (prob_sum unused).
void router_topk_backward(const float* logits, const int64_t* topk_index, const float* d_topk_weight,
                          const float* d_prob_sum, int64_t T, int E, int K, bool use_sigmoid, bool norm_topk_prob,
                          float* d_logits, cudaStream_t stream);
// Capacity routing; see retention.cu. pair_instance [P] int64.
size_t capacity_route(const void* pair_group, const void* pair_rank, IType ptype, int64_t P, const void* instance_group,
                      const void* instance_rank, const void* instance_capacity, IType itype, int64_t I,
                      int64_t* pair_instance, void* temp, size_t temp_bytes, cudaStream_t stream);

}  // namespace lrmoe

// Device-side check: fails the kernel with a message (surfaces as a CUDA error at the next sync).
#define LRMOE_DEVICE_ASSERT(cond, msg)                                       \
  do {                                                                      \
    if (!(cond)) __assert_fail(msg, __FILE__, __LINE__, __func__);          \
  } while (0)
#define LRMOE_CUDA_CHECK(expr) ::lrmoe::cuda_check((expr), #expr)
#define LRMOE_LAUNCH_CHECK(what) ::lrmoe::cuda_check(cudaGetLastError(), what)

namespace lrmoe {

// Segmented GEMM over G groups of rows, nn.Linear layout (weights [N, K]):
//   kFwd:   out[M, N] rows of group g = a[M, K] rows of g  @ W_g^T        (W_g = group_ptrs[g])
//   kDgrad: out[M, K] rows of group g = a[M, N] rows of g  @ W_g
//   kWgrad: D_g [N, K] (+)= a[M, N] rows of g ^T @ b[M, K] rows of g       (D_g = group_ptrs[g])
// group_sizes: device int64 [G] (sum = M; rows past the sum are not written). `group_ptrs` is a host
// array (it travels to the device as kernel parameters: no copy, no synchronisation). fp32 accumulation.
enum class GemmPass : int { kFwd = 0, kDgrad = 1, kWgrad = 2 };
size_t grouped_gemm(GemmPass pass, DType dtype, DType out_dtype, int64_t M, int64_t N, int64_t K, int64_t G,
                    const void* a, const void* b, const void* const* group_ptrs, const int64_t* group_sizes,
                    void* out, bool accumulate, bool allow_cutlass, void* temp, size_t temp_bytes, cudaStream_t stream);
// The CUTLASS kernels grouped_gemm runs by default on the current device: "m64" or "coop" (see gemm.cu),
// and the device's peak memory bandwidth in TB/s that decides it.
std::string gemm_default_config();
// The CUTLASS release whose headers the kernels were built with (CUTLASS_PATH or the nvidia-cutlass wheel).
std::string cutlass_version();
double peak_memory_tbps();
// The CUTLASS kernels grouped_gemm runs for one call ("m64", "coop" or "pingpong"): LRMOE_GEMM_CONFIG if set,
// else the device's default, adjusted by the pass and shape (dgrad output width K, M rows over G groups).
std::string gemm_config(GemmPass pass, int64_t M, int64_t K, int64_t G);
// Which path grouped_gemm takes for these arguments: true for the CUTLASS (TMA, wgmma) kernel.
bool grouped_gemm_uses_cutlass(GemmPass pass, DType dtype, DType out_dtype, int64_t N, int64_t K, int64_t G,
                               const void* a, const void* b, const void* const* group_ptrs, const void* out);

}  // namespace lrmoe
