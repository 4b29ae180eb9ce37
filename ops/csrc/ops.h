// Tensor-level entry points (ops.cpp, grouped_gemm.cpp): check arguments, allocate scratch, call
// the launchers of kernels.h on the current stream. Outputs are allocated by the caller (ops/cuda.py).
#pragma once

#include <torch/extension.h>

#include <string>
#include <type_traits>
#include <vector>

namespace lrmoe {

// Error text built without std::ostream number formatting: on the GPU machine's image, streaming an
// integer into torch's message stream from this extension crashed the process (strings did not), so
// numbers, shapes, devices and dtypes are turned into strings here first.
inline std::string msg_part(const std::string& s) { return s; }
inline std::string msg_part(const char* s) { return s; }
inline std::string msg_part(at::IntArrayRef shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}
inline std::string msg_part(const c10::Device& d) { return d.str(); }
inline std::string msg_part(at::ScalarType t) { return c10::toString(t); }
template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
inline std::string msg_part(T v) { return std::to_string(v); }
template <typename... A> std::string msg(const A&... parts) { return (std::string() + ... + msg_part(parts)); }
#define LRMOE_CHECK(cond, ...) TORCH_CHECK(cond, ::lrmoe::msg(__VA_ARGS__))

void routing_plan_op(const at::Tensor& group_of_pair, int64_t num_groups, at::Tensor& counts, at::Tensor& order,
                     at::Tensor& offsets);
void permute_op(const at::Tensor& x, const at::Tensor& row_index, at::Tensor& out);
void permute_scaled_op(const at::Tensor& x, const at::Tensor& row_index, const at::Tensor& row_scale, at::Tensor& out);
void unpermute_op(const at::Tensor& rows, const at::Tensor& row_of_pair, const at::Tensor& weight, at::Tensor& out);
void unpermute_weight_grad_op(const at::Tensor& rows, const at::Tensor& row_of_pair, const at::Tensor& dout,
                              at::Tensor& out);
void swiglu_op(const at::Tensor& h, at::Tensor& out);
void unpermute_backward_op(const at::Tensor& rows, const at::Tensor& row_of_pair, const at::Tensor& weight,
                           const at::Tensor& dout, at::Tensor& d_rows, at::Tensor& d_weight,
                           const c10::optional<at::Tensor>& d_row_of_pair);
void swiglu_backward_op(const at::Tensor& h, const at::Tensor& da, at::Tensor& dh, const c10::optional<at::Tensor>& a,
                        const c10::optional<at::Tensor>& index, const c10::optional<at::Tensor>& dot);
void swiglu_dot_op(const at::Tensor& h, const at::Tensor& dz, const c10::optional<at::Tensor>& index, at::Tensor& dot);
void topk_retention_op(const at::Tensor& scores, const at::Tensor& group_sizes, const at::Tensor& quotas,
                       at::Tensor& kept, at::Tensor& kept_sizes, at::Tensor& threshold, at::Tensor& summary);
void priority_sample_op(const at::Tensor& metric, const c10::optional<at::Tensor>& u, const at::Tensor& group_sizes,
                        const at::Tensor& quotas, at::Tensor& kept, at::Tensor& kept_sizes, at::Tensor& threshold,
                        at::Tensor& scale, at::Tensor& summary);
void retained_pairs_op(const at::Tensor& kept, const at::Tensor& scale, const at::Tensor& order,
                       const at::Tensor& weight_of_row, int64_t k, bool rescale, at::Tensor& kept_pairs, at::Tensor& src,
                       at::Tensor& gate, at::Tensor& row_weight, at::Tensor& kept_row_of_pair, at::Tensor& pair_weight);
void retention_metric_op(const at::Tensor& order, const at::Tensor& topk_weight, int64_t metric_kind,
                         const c10::optional<at::Tensor>& dout_norm, const c10::optional<at::Tensor>& x_norm,
                         const c10::optional<at::Tensor>& group_sizes, at::Tensor& weight_of_row, at::Tensor& metric,
                         const c10::optional<at::Tensor>& mass);
void capacity_route_op(const at::Tensor& pair_group, const at::Tensor& pair_rank, const at::Tensor& instance_group,
                       const at::Tensor& instance_rank, const at::Tensor& instance_capacity, at::Tensor& out);
void router_topk_op(const at::Tensor& logits, int64_t k, bool use_sigmoid, bool norm_topk_prob,
                    const c10::optional<at::Tensor>& score_bias, at::Tensor& topk_index, at::Tensor& topk_weight,
                    at::Tensor& counts, at::Tensor& prob_sum);
void router_topk_backward_op(const at::Tensor& logits, const at::Tensor& topk_index, const at::Tensor& d_topk_weight,
                             const c10::optional<at::Tensor>& d_prob_sum, bool use_sigmoid, bool norm_topk_prob,
                             at::Tensor& d_logits);

// pass 0 forward, 1 dgrad, 2 wgrad (kernels.h); returns whether the CUTLASS kernel ran.
bool grouped_gemm_op(int64_t pass, const at::Tensor& a, const c10::optional<at::Tensor>& b,
                     const std::vector<at::Tensor>& group_tensors, const at::Tensor& group_sizes,
                     const c10::optional<at::Tensor>& out, bool accumulate, bool allow_cutlass);
// buffer [G, ...] contiguous -> G tensors buffer[g] on its storage (plain tensors, not autograd views).
std::vector<at::Tensor> split_groups_op(const at::Tensor& buffer);

}  // namespace lrmoe
