// Tensor glue for the routing, permutation, retention, capacity-routing and router kernels.
#include "ops.h"

#include <c10/cuda/CUDAGuard.h>
#include <ATen/MemoryOverlap.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels.h"

namespace lrmoe {
namespace {

void check_cuda(const at::Tensor& t, const char* name) {
  LRMOE_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
  LRMOE_CHECK(t.is_contiguous(), name, " must be contiguous");
}
void check_out(const at::Tensor& t, at::IntArrayRef shape, at::ScalarType dtype, const at::Tensor& like,
               const char* name) {
  LRMOE_CHECK(t.sizes() == shape && t.scalar_type() == dtype && t.is_contiguous() && t.device() == like.device(),
              name, " must be a contiguous ", dtype, " tensor of shape ", shape, " on ", like.device(), "; got ",
              t.scalar_type(), " ", t.sizes(), " on ", t.device());
}
IType itype_of(const at::Tensor& t, const char* name) {
  LRMOE_CHECK(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, name, " must be int32 or int64, got ",
              t.scalar_type());
  return t.scalar_type() == at::kLong ? IType::kI64 : IType::kI32;
}
DType dtype_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kF32;
    case at::kHalf: return DType::kF16;
    case at::kBFloat16: return DType::kBF16;
    default: LRMOE_CHECK(false, name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}
at::Tensor scratch(size_t bytes, const at::Tensor& like) {
  return at::empty({(int64_t)std::max<size_t>(bytes, 1)}, like.options().dtype(at::kByte));
}
cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }
constexpr int64_t kMaxPairs = (int64_t(1) << 31) - 1;

}  // namespace

void routing_plan_op(const at::Tensor& group_of_pair, int64_t num_groups, at::Tensor& counts, at::Tensor& order,
                     at::Tensor& offsets) {
  check_cuda(group_of_pair, "routing_plan: group_of_pair");
  const IType it = itype_of(group_of_pair, "routing_plan: group_of_pair");
  const int64_t P = group_of_pair.numel();
  LRMOE_CHECK(num_groups >= 1 && num_groups <= (int64_t(1) << 31), "routing_plan: num_groups must be in [1, 2^31], got ",
              num_groups);
  LRMOE_CHECK(P <= kMaxPairs, "routing_plan: at most 2^31-1 pairs, got ", P);
  check_out(counts, {num_groups}, at::kLong, group_of_pair, "routing_plan: counts");
  check_out(order, {P}, at::kLong, group_of_pair, "routing_plan: order");
  check_out(offsets, {num_groups + 1}, at::kLong, group_of_pair, "routing_plan: offsets");
  const c10::cuda::CUDAGuard guard(group_of_pair.device());
  auto args = [&](void* temp, size_t bytes) {
    return routing_plan(group_of_pair.data_ptr(), it, P, num_groups, counts.data_ptr<int64_t>(),
                        order.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), temp, bytes, stream());
  };
  const size_t bytes = args(nullptr, 0);
  at::Tensor temp = scratch(bytes, group_of_pair);
  args(temp.data_ptr(), bytes);
}

void permute_op(const at::Tensor& x, const at::Tensor& row_index, at::Tensor& out) {
  check_cuda(x, "permute: x");
  check_cuda(row_index, "permute: row_index");
  LRMOE_CHECK(x.dim() == 2, "permute: x must be [T, H], got shape ", x.sizes());
  LRMOE_CHECK(row_index.dim() == 1, "permute: row_index must be [P], got shape ", row_index.sizes());
  const IType it = itype_of(row_index, "permute: row_index");
  const int64_t P = row_index.numel();
  check_out(out, {P, x.size(1)}, x.scalar_type(), x, "permute: out");
  const c10::cuda::CUDAGuard guard(x.device());
  permute(x.data_ptr(), x.size(0), x.size(1) * x.element_size(), row_index.data_ptr(), it, P, out.data_ptr(), stream());
}

void permute_scaled_op(const at::Tensor& x, const at::Tensor& row_index, const at::Tensor& row_scale, at::Tensor& out) {
  check_cuda(x, "permute: x");
  check_cuda(row_index, "permute: row_index");
  check_cuda(row_scale, "permute: row_scale");
  LRMOE_CHECK(x.dim() == 2, "permute: x must be [T, H], got shape ", x.sizes());
  LRMOE_CHECK(row_index.dim() == 1, "permute: row_index must be [P], got shape ", row_index.sizes());
  const int64_t P = row_index.numel();
  LRMOE_CHECK(row_scale.dim() == 1 && row_scale.size(0) == P, "permute: row_scale must be [P] = [", P, "], got shape ",
              row_scale.sizes());
  LRMOE_CHECK(P < (int64_t(1) << 31), "permute: at most 2^31-1 rows with a row_scale");
  const IType it = itype_of(row_index, "permute: row_index");
  const DType xt = dtype_of(x, "permute: x (with a row_scale)"), st = dtype_of(row_scale, "permute: row_scale");
  check_out(out, {P, x.size(1)}, x.scalar_type(), x, "permute: out");
  const c10::cuda::CUDAGuard guard(x.device());
  permute_scaled(x.data_ptr(), xt, x.size(0), x.size(1), row_index.data_ptr(), it, P, row_scale.data_ptr(), st,
                 out.data_ptr(), stream());
}

void unpermute_op(const at::Tensor& rows, const at::Tensor& row_of_pair, const at::Tensor& weight, at::Tensor& out) {
  check_cuda(rows, "unpermute: rows");
  check_cuda(row_of_pair, "unpermute: row_of_pair");
  check_cuda(weight, "unpermute: weight");
  LRMOE_CHECK(rows.dim() == 2, "unpermute: rows must be [P, H], got shape ", rows.sizes());
  LRMOE_CHECK(row_of_pair.dim() == 2 && weight.sizes() == row_of_pair.sizes(),
              "unpermute: row_of_pair and weight must both be [T, K]; got ", row_of_pair.sizes(), " and ",
              weight.sizes());
  const IType it = itype_of(row_of_pair, "unpermute: row_of_pair");
  const DType rt = dtype_of(rows, "unpermute: rows"), wt = dtype_of(weight, "unpermute: weight");
  const int64_t T = row_of_pair.size(0), H = rows.size(1);
  LRMOE_CHECK(T < (int64_t(1) << 31), "unpermute: at most 2^31-1 tokens");
  check_out(out, {T, H}, rows.scalar_type(), rows, "unpermute: out");
  const c10::cuda::CUDAGuard guard(rows.device());
  unpermute(rows.data_ptr(), rt, rows.size(0), H, row_of_pair.data_ptr(), it, weight.data_ptr(), wt, T,
            (int)row_of_pair.size(1), out.data_ptr(), stream());
}

namespace {
// The checks unpermute_weight_grad and unpermute_backward share; returns T.
int64_t check_weight_grad_args(const at::Tensor& rows, const at::Tensor& row_of_pair, const at::Tensor& dout,
                               at::Tensor& out, const char* op, const char* out_name) {
  check_cuda(rows, msg(op, ": rows").c_str());
  check_cuda(row_of_pair, msg(op, ": row_of_pair").c_str());
  check_cuda(dout, msg(op, ": dout").c_str());
  LRMOE_CHECK(rows.dim() == 2 && row_of_pair.dim() == 2 && dout.dim() == 2, op,
              ": rows must be [P, H], row_of_pair [T, K] and dout [T, H]; got ", rows.sizes(), ", ",
              row_of_pair.sizes(), " and ", dout.sizes());
  const int64_t T = row_of_pair.size(0), H = rows.size(1);
  LRMOE_CHECK(dout.size(0) == T && dout.size(1) == H, op, ": dout must be [T, H] = [", T, ", ", H, "], got ",
              dout.sizes());
  LRMOE_CHECK(dout.scalar_type() == rows.scalar_type(), op, ": dout must have rows' dtype ", rows.scalar_type(),
              ", got ", dout.scalar_type());
  LRMOE_CHECK(T < (int64_t(1) << 31), op, ": at most 2^31-1 tokens");
  check_out(out, {T, row_of_pair.size(1)}, at::kFloat, rows, msg(op, ": ", out_name).c_str());
  return T;
}
}  // namespace

void unpermute_weight_grad_op(const at::Tensor& rows, const at::Tensor& row_of_pair, const at::Tensor& dout,
                              at::Tensor& out) {
  const int64_t T = check_weight_grad_args(rows, row_of_pair, dout, out, "unpermute_weight_grad", "out");
  const IType it = itype_of(row_of_pair, "unpermute_weight_grad: row_of_pair");
  const DType rt = dtype_of(rows, "unpermute_weight_grad: rows");
  const c10::cuda::CUDAGuard guard(rows.device());
  unpermute_weight_grad(rows.data_ptr(), rt, rows.size(0), rows.size(1), row_of_pair.data_ptr(), it, dout.data_ptr(),
                        T, (int)row_of_pair.size(1), out.data_ptr<float>(), nullptr, nullptr, nullptr, 0, stream());
}

void unpermute_backward_op(const at::Tensor& rows, const at::Tensor& row_of_pair, const at::Tensor& weight,
                           const at::Tensor& dout, at::Tensor& d_rows, at::Tensor& d_weight,
                           const c10::optional<at::Tensor>& d_row_of_pair) {
  const int64_t T = check_weight_grad_args(rows, row_of_pair, dout, d_weight, "unpermute_backward", "d_weight");
  check_cuda(weight, "unpermute_backward: weight");
  LRMOE_CHECK(weight.scalar_type() == at::kFloat && weight.sizes() == row_of_pair.sizes(),
              "unpermute_backward: weight must be a float32 [T, K] tensor like row_of_pair ", row_of_pair.sizes(),
              ", got ", weight.scalar_type(), " ", weight.sizes());
  const void* drp = nullptr;
  if (d_row_of_pair) {  // d_rows by a map of its own: any number of rows, each some pair's (checked on the device)
    check_cuda(*d_row_of_pair, "unpermute_backward: d_row_of_pair");
    LRMOE_CHECK(d_row_of_pair->sizes() == row_of_pair.sizes() && d_row_of_pair->scalar_type() == row_of_pair.scalar_type(),
                "unpermute_backward: d_row_of_pair must be a ", row_of_pair.scalar_type(), " ", row_of_pair.sizes(),
                " tensor like row_of_pair, got ", d_row_of_pair->scalar_type(), " ", d_row_of_pair->sizes());
    check_out(d_rows, {d_rows.dim() == 2 ? d_rows.size(0) : 0, rows.size(1)}, rows.scalar_type(), rows,
              "unpermute_backward: d_rows");
    drp = d_row_of_pair->data_ptr();
  } else {
    // every row is some pair's: d_rows is written whole (a -1 in row_of_pair is a device-side error)
    LRMOE_CHECK(rows.size(0) == row_of_pair.numel(), "unpermute_backward: every row must be the row of exactly one ",
                "pair: rows must have T * K = ", row_of_pair.numel(), " rows, got ", rows.size(0));
    check_out(d_rows, rows.sizes(), rows.scalar_type(), rows, "unpermute_backward: d_rows");
  }
  const IType it = itype_of(row_of_pair, "unpermute_backward: row_of_pair");
  const DType rt = dtype_of(rows, "unpermute_backward: rows");
  const c10::cuda::CUDAGuard guard(rows.device());
  unpermute_weight_grad(rows.data_ptr(), rt, rows.size(0), rows.size(1), row_of_pair.data_ptr(), it, dout.data_ptr(),
                        T, (int)row_of_pair.size(1), d_weight.data_ptr<float>(), weight.data_ptr<float>(),
                        d_rows.data_ptr(), drp, d_rows.size(0), stream());
}

void swiglu_op(const at::Tensor& h, at::Tensor& out) {
  check_cuda(h, "swiglu: h");
  LRMOE_CHECK(h.dim() == 2 && h.size(1) % 2 == 0, "swiglu: h must be [M, 2F], got shape ", h.sizes());
  const DType dt = dtype_of(h, "swiglu: h");
  check_out(out, {h.size(0), h.size(1) / 2}, h.scalar_type(), h, "swiglu: out");
  const c10::cuda::CUDAGuard guard(h.device());
  swiglu(h.data_ptr(), dt, h.size(0), h.size(1) / 2, out.data_ptr(), stream());
}

namespace {
// The rows M of a swiglu backward's outputs (h's, or the index's), with h [Mh, 2F], index and the gradient g [M, F]
// checked.
int64_t swiglu_backward_rows(const at::Tensor& h, const at::Tensor& g, const c10::optional<at::Tensor>& index,
                             const char* op, const char* g_name) {
  check_cuda(h, msg(op, ": h").c_str());
  check_cuda(g, msg(op, ": ", g_name).c_str());
  LRMOE_CHECK(h.dim() == 2 && h.size(1) % 2 == 0, op, ": h must be [Mh, 2F], got shape ", h.sizes());
  int64_t M = h.size(0);
  if (index.has_value()) {
    check_cuda(*index, msg(op, ": index").c_str());
    LRMOE_CHECK(index->dim() == 1 && index->scalar_type() == at::kLong && index->device() == h.device(),
                op, ": index must be int64 [M] on ", h.device(), ", got ", index->scalar_type(), " ",
                index->sizes(), " on ", index->device());
    M = index->size(0);
  }
  LRMOE_CHECK(g.dim() == 2 && g.size(0) == M && g.size(1) == h.size(1) / 2 && g.scalar_type() == h.scalar_type(),
              op, ": ", g_name, " must be [M, F] = [", M, ", ", h.size(1) / 2, "] in ", h.scalar_type(), ", got ",
              g.scalar_type(), " ", g.sizes());
  return M;
}
}  // namespace

void swiglu_backward_op(const at::Tensor& h, const at::Tensor& da, at::Tensor& dh, const c10::optional<at::Tensor>& a,
                        const c10::optional<at::Tensor>& index, const c10::optional<at::Tensor>& dot) {
  const int64_t M = swiglu_backward_rows(h, da, index, "swiglu_backward", "da");
  const DType dt = dtype_of(h, "swiglu_backward: h");
  check_out(dh, {M, h.size(1)}, h.scalar_type(), h, "swiglu_backward: dh");
  // dh is h itself (in place, without an index) or apart from it; nothing else may share memory
  if (index.has_value()) at::assert_no_overlap(dh, h);
  else at::assert_no_partial_overlap(dh, h);
  at::assert_no_overlap(dh, da);
  if (a.has_value()) {
    check_out(*a, da.sizes(), h.scalar_type(), h, "swiglu_backward: a");
    at::assert_no_overlap(*a, h);
    at::assert_no_overlap(*a, da);
  }
  if (dot.has_value()) {  // <a_m, da_m>: computed with a, so a comes too
    LRMOE_CHECK(a.has_value(), "swiglu_backward: dot needs a (the dot is <a_m, da_m> of the recomputed activation)");
    check_out(*dot, {M}, at::kFloat, h, "swiglu_backward: dot");
    for (const at::Tensor& t : {h, da, dh, *a}) at::assert_no_overlap(*dot, t);
  }
  const c10::cuda::CUDAGuard guard(h.device());
  swiglu_backward(h.data_ptr(), da.data_ptr(), dt, M, h.size(1) / 2, dh.data_ptr(),
                  a.has_value() ? a->data_ptr() : nullptr, dot.has_value() ? dot->data_ptr<float>() : nullptr,
                  index.has_value() ? index->data_ptr<int64_t>() : nullptr, h.size(0), stream());
}

void swiglu_dot_op(const at::Tensor& h, const at::Tensor& dz, const c10::optional<at::Tensor>& index, at::Tensor& dot) {
  const int64_t M = swiglu_backward_rows(h, dz, index, "swiglu_dot", "dz");
  const DType dt = dtype_of(h, "swiglu_dot: h");
  check_out(dot, {M}, at::kFloat, h, "swiglu_dot: dot");
  at::assert_no_overlap(dot, h);
  at::assert_no_overlap(dot, dz);
  const c10::cuda::CUDAGuard guard(h.device());
  swiglu_dot(h.data_ptr(), dz.data_ptr(), dt, M, h.size(1) / 2, dot.data_ptr<float>(),
             index.has_value() ? index->data_ptr<int64_t>() : nullptr, h.size(0), stream());
}

void topk_retention_op(const at::Tensor& scores, const at::Tensor& group_sizes, const at::Tensor& quotas,
                       at::Tensor& kept, at::Tensor& kept_sizes, at::Tensor& threshold, at::Tensor& summary) {
  check_cuda(scores, "topk_retention: scores");
  check_cuda(group_sizes, "topk_retention: group_sizes");
  check_cuda(quotas, "topk_retention: quotas");
  LRMOE_CHECK(scores.dim() == 1, "topk_retention: scores must be [P], got shape ", scores.sizes());
  LRMOE_CHECK(group_sizes.scalar_type() == at::kLong && quotas.scalar_type() == at::kLong,
              "topk_retention: group_sizes and quotas must be int64");
  const int64_t P = scores.numel(), G = group_sizes.numel();
  LRMOE_CHECK(quotas.numel() == G, "topk_retention: ", quotas.numel(), " quotas for ", G, " groups");
  LRMOE_CHECK(P <= kMaxPairs, "topk_retention: at most 2^31-1 pairs, got ", P);
  const DType st = dtype_of(scores, "topk_retention: scores");
  check_out(kept, {P}, at::kLong, scores, "topk_retention: kept");
  check_out(kept_sizes, {G}, at::kLong, scores, "topk_retention: kept_sizes");
  check_out(threshold, {G}, scores.scalar_type(), scores, "topk_retention: threshold");
  check_out(summary, {3}, at::kLong, scores, "topk_retention: summary");
  const c10::cuda::CUDAGuard guard(scores.device());
  auto args = [&](void* temp, size_t bytes) {
    return topk_retention(scores.data_ptr(), st, P, group_sizes.data_ptr(), IType::kI64, quotas.data_ptr(),
                          IType::kI64, G, kept.data_ptr<int64_t>(), kept_sizes.data_ptr<int64_t>(),
                          threshold.data_ptr(), summary.data_ptr<int64_t>(), temp, bytes, stream());
  };
  const size_t bytes = args(nullptr, 0);
  at::Tensor temp = scratch(bytes, scores);
  args(temp.data_ptr(), bytes);
}

void priority_sample_op(const at::Tensor& metric, const c10::optional<at::Tensor>& u, const at::Tensor& group_sizes,
                        const at::Tensor& quotas, at::Tensor& kept, at::Tensor& kept_sizes, at::Tensor& threshold,
                        at::Tensor& scale, at::Tensor& summary) {
  check_cuda(metric, "priority_sample: metric");
  check_cuda(group_sizes, "priority_sample: group_sizes");
  check_cuda(quotas, "priority_sample: quotas");
  LRMOE_CHECK(metric.dim() == 1 && metric.scalar_type() == at::kFloat, "priority_sample: metric must be a float32 [P] "
              "tensor, got ", metric.scalar_type(), " of shape ", metric.sizes());
  const int64_t P = metric.numel(), G = group_sizes.numel();
  if (u.has_value()) {
    check_cuda(*u, "priority_sample: u");
    LRMOE_CHECK(u->scalar_type() == at::kFloat && u->sizes() == metric.sizes(), "priority_sample: u must be float32 of "
                "metric's shape ", metric.sizes(), ", got ", u->scalar_type(), " ", u->sizes());
  }
  LRMOE_CHECK(group_sizes.scalar_type() == at::kLong && quotas.scalar_type() == at::kLong,
              "priority_sample: group_sizes and quotas must be int64");
  LRMOE_CHECK(quotas.numel() == G, "priority_sample: ", quotas.numel(), " quotas for ", G, " groups");
  LRMOE_CHECK(P <= kMaxPairs, "priority_sample: at most 2^31-1 pairs, got ", P);
  check_out(kept, {P}, at::kLong, metric, "priority_sample: kept");
  check_out(kept_sizes, {G}, at::kLong, metric, "priority_sample: kept_sizes");
  check_out(threshold, {G}, at::kFloat, metric, "priority_sample: threshold");
  check_out(scale, {P}, at::kFloat, metric, "priority_sample: scale");
  check_out(summary, {3}, at::kLong, metric, "priority_sample: summary");
  const c10::cuda::CUDAGuard guard(metric.device());
  const float* up = u.has_value() ? u->data_ptr<float>() : nullptr;
  auto args = [&](void* temp, size_t bytes) {
    return priority_sample(metric.data_ptr<float>(), up, P, group_sizes.data_ptr<int64_t>(), quotas.data_ptr<int64_t>(),
                           G, kept.data_ptr<int64_t>(), kept_sizes.data_ptr<int64_t>(), threshold.data_ptr<float>(),
                           scale.data_ptr<float>(), summary.data_ptr<int64_t>(), temp, bytes, stream());
  };
  const size_t bytes = args(nullptr, 0);
  at::Tensor temp = scratch(bytes, metric);
  args(temp.data_ptr(), bytes);
}

void retained_pairs_op(const at::Tensor& kept, const at::Tensor& scale, const at::Tensor& order,
                       const at::Tensor& weight_of_row, int64_t k, bool rescale, at::Tensor& kept_pairs, at::Tensor& src,
                       at::Tensor& gate, at::Tensor& row_weight, at::Tensor& kept_row_of_pair, at::Tensor& pair_weight) {
  const std::pair<const at::Tensor*, const char*> ins[] = {
      {&kept, "retained_pairs: kept"}, {&scale, "retained_pairs: scale"}, {&order, "retained_pairs: order"},
      {&weight_of_row, "retained_pairs: weight_of_row"}};
  for (const auto& [t, name] : ins) {
    check_cuda(*t, name);
    LRMOE_CHECK(t->dim() == 1 && t->device() == kept.device(), name, " must be a 1-d tensor on ", kept.device());
  }
  const int64_t n = kept.numel(), P = order.numel();
  LRMOE_CHECK(kept.scalar_type() == at::kLong && order.scalar_type() == at::kLong,
              "retained_pairs: kept and order must be int64");
  LRMOE_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == n, "retained_pairs: scale must be float32 with one "
              "entry per kept row (", n, "), got ", scale.scalar_type(), " ", scale.sizes());
  LRMOE_CHECK(weight_of_row.numel() == P, "retained_pairs: ", weight_of_row.numel(), " row weights for ", P, " send rows");
  LRMOE_CHECK(k >= 1 && P % k == 0, "retained_pairs: ", P, " send rows are not a multiple of k = ", k);
  LRMOE_CHECK(n <= P, "retained_pairs: ", n, " kept rows of ", P);
  const DType wt = dtype_of(weight_of_row, "retained_pairs: weight_of_row");
  const at::ScalarType rwt = rescale ? at::kFloat : weight_of_row.scalar_type();
  check_out(kept_pairs, {n}, at::kLong, kept, "retained_pairs: kept_pairs");
  check_out(src, {n}, at::kLong, kept, "retained_pairs: src");
  check_out(gate, {n}, weight_of_row.scalar_type(), kept, "retained_pairs: gate");
  check_out(row_weight, {n}, rwt, kept, "retained_pairs: row_weight");
  check_out(kept_row_of_pair, {P / k, k}, at::kLong, kept, "retained_pairs: kept_row_of_pair");
  check_out(pair_weight, {P / k, k}, rwt, kept, "retained_pairs: pair_weight");
  const c10::cuda::CUDAGuard guard(kept.device());
  retained_pairs(kept.data_ptr<int64_t>(), scale.data_ptr<float>(), n, order.data_ptr<int64_t>(), P, k,
                 weight_of_row.data_ptr(), wt, rescale, kept_pairs.data_ptr<int64_t>(), src.data_ptr<int64_t>(),
                 gate.data_ptr(), row_weight.data_ptr(), kept_row_of_pair.data_ptr<int64_t>(), pair_weight.data_ptr(),
                 stream());
}

void retention_metric_op(const at::Tensor& order, const at::Tensor& topk_weight, int64_t metric_kind,
                         const c10::optional<at::Tensor>& dout_norm, const c10::optional<at::Tensor>& x_norm,
                         const c10::optional<at::Tensor>& group_sizes, at::Tensor& weight_of_row, at::Tensor& metric,
                         const c10::optional<at::Tensor>& mass) {
  check_cuda(order, "retention_metric: order");
  check_cuda(topk_weight, "retention_metric: topk_weight");
  LRMOE_CHECK(order.scalar_type() == at::kLong && order.dim() == 1, "retention_metric: order must be 1-d int64");
  LRMOE_CHECK(topk_weight.dim() == 2 && topk_weight.device() == order.device(),
              "retention_metric: topk_weight must be [T, K] on ", order.device());
  LRMOE_CHECK(metric_kind >= 0 && metric_kind <= 2, "retention_metric: metric_kind must be 0, 1 or 2, got ", metric_kind);
  const int64_t P = order.numel(), K = topk_weight.size(1), T = topk_weight.size(0);
  LRMOE_CHECK(P == T * K, "retention_metric: ", P, " send rows for ", T, " x ", K, " pairs");
  LRMOE_CHECK(P <= kMaxPairs, "retention_metric: at most 2^31-1 pairs, got ", P);
  const DType wt = dtype_of(topk_weight, "retention_metric: topk_weight");
  const float* norms[2] = {nullptr, nullptr};
  if (metric_kind == 0) {
    const c10::optional<at::Tensor>* given[2] = {&dout_norm, &x_norm};
    const char* names[2] = {"retention_metric: dout_norm", "retention_metric: x_norm"};
    for (int i = 0; i < 2; ++i) {
      LRMOE_CHECK(given[i]->has_value(), names[i], " is needed for the grad_norm metric");
      const at::Tensor& n = **given[i];
      check_cuda(n, names[i]);
      LRMOE_CHECK(n.scalar_type() == at::kFloat && n.numel() == T && n.device() == order.device(), names[i],
                  " must be float32 with one entry per token (", T, ") on ", order.device(), "; got ", n.scalar_type(),
                  " ", n.sizes());
      norms[i] = n.data_ptr<float>();
    }
  }
  check_out(weight_of_row, {P}, topk_weight.scalar_type(), order, "retention_metric: weight_of_row");
  check_out(metric, {P}, at::kFloat, order, "retention_metric: metric");
  LRMOE_CHECK(group_sizes.has_value() == mass.has_value(), "retention_metric: give group_sizes and mass together");
  int64_t G = 0;
  if (group_sizes.has_value()) {
    check_cuda(*group_sizes, "retention_metric: group_sizes");
    LRMOE_CHECK(group_sizes->scalar_type() == at::kLong && group_sizes->dim() == 1 &&
                group_sizes->device() == order.device(), "retention_metric: group_sizes must be 1-d int64 on ",
                order.device());
    G = group_sizes->numel();
    check_out(*mass, {G}, at::kFloat, order, "retention_metric: mass");
  }
  const c10::cuda::CUDAGuard guard(order.device());
  retention_metric(order.data_ptr<int64_t>(), P, K, topk_weight.data_ptr(), wt, (int)metric_kind, norms[0], norms[1],
                   G ? group_sizes->data_ptr<int64_t>() : nullptr, G, weight_of_row.data_ptr(),
                   metric.data_ptr<float>(), mass.has_value() ? mass->data_ptr<float>() : nullptr, stream());
}

void capacity_route_op(const at::Tensor& pair_group, const at::Tensor& pair_rank, const at::Tensor& instance_group,
                       const at::Tensor& instance_rank, const at::Tensor& instance_capacity, at::Tensor& out) {
  const std::pair<const at::Tensor*, const char*> all[] = {
      {&pair_group, "capacity_route: pair_group"}, {&pair_rank, "capacity_route: pair_rank"},
      {&instance_group, "capacity_route: instance_group"}, {&instance_rank, "capacity_route: instance_rank"},
      {&instance_capacity, "capacity_route: instance_capacity"}};
  for (const auto& [t, name] : all) {
    check_cuda(*t, name);
    LRMOE_CHECK(t->scalar_type() == at::kLong && t->dim() == 1, name, " must be a 1-d int64 tensor");
  }
  const int64_t P = pair_group.numel(), I = instance_group.numel();
  LRMOE_CHECK(pair_rank.numel() == P, "capacity_route: ", pair_rank.numel(), " pair ranks for ", P, " pairs");
  LRMOE_CHECK(instance_rank.numel() == I && instance_capacity.numel() == I,
              "capacity_route: instance_group, instance_rank and instance_capacity must have the same length");
  LRMOE_CHECK(P <= kMaxPairs, "capacity_route: at most 2^31-1 pairs, got ", P);
  LRMOE_CHECK(I <= 8192, "capacity_route: at most 8192 instances, got ", I);
  check_out(out, {P}, at::kLong, pair_group, "capacity_route: out");
  const c10::cuda::CUDAGuard guard(pair_group.device());
  auto args = [&](void* temp, size_t bytes) {
    return capacity_route(pair_group.data_ptr(), pair_rank.data_ptr(), IType::kI64, P, instance_group.data_ptr(),
                          instance_rank.data_ptr(), instance_capacity.data_ptr(), IType::kI64, I,
                          out.data_ptr<int64_t>(), temp, bytes, stream());
  };
  const size_t bytes = args(nullptr, 0);
  at::Tensor temp = scratch(bytes, pair_group);
  args(temp.data_ptr(), bytes);
}

namespace {
void check_router_logits(const at::Tensor& logits, const char* name) {
  check_cuda(logits, name);
  LRMOE_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, name,
              " must be a float32 [T, E] tensor (the CUDA kernel computes in fp32; float64 runs on the torch "
              "reference), got ", logits.scalar_type(), " of shape ", logits.sizes());
  LRMOE_CHECK(logits.size(1) >= 1 && logits.size(1) <= kRouterMaxExperts, name, ": the CUDA kernel takes 1 to ",
              kRouterMaxExperts, " experts, got ", logits.size(1));
}
void check_router_vector(const at::Tensor& v, const at::Tensor& logits, const char* name) {
  check_cuda(v, name);
  LRMOE_CHECK(v.dim() == 1 && v.size(0) == logits.size(1) && v.scalar_type() == at::kFloat &&
                  v.device() == logits.device(),
              name, " must be a float32 [E] = [", logits.size(1), "] tensor on ", logits.device(), ", got ",
              v.scalar_type(), " ", v.sizes(), " on ", v.device());
}
}  // namespace

void router_topk_op(const at::Tensor& logits, int64_t k, bool use_sigmoid, bool norm_topk_prob,
                    const c10::optional<at::Tensor>& score_bias, at::Tensor& topk_index, at::Tensor& topk_weight,
                    at::Tensor& counts, at::Tensor& prob_sum) {
  check_router_logits(logits, "router_topk: logits");
  const int64_t T = logits.size(0), E = logits.size(1);
  LRMOE_CHECK(k >= 1 && k <= E, "router_topk: k must be in [1, E=", E, "], got ", k);
  if (score_bias.has_value()) check_router_vector(*score_bias, logits, "router_topk: score_bias");
  check_out(topk_index, {T, k}, at::kLong, logits, "router_topk: topk_index");
  check_out(topk_weight, {T, k}, at::kFloat, logits, "router_topk: topk_weight");
  check_out(counts, {E}, at::kLong, logits, "router_topk: counts");
  check_out(prob_sum, {E}, at::kFloat, logits, "router_topk: prob_sum");
  const c10::cuda::CUDAGuard guard(logits.device());
  const float* bias = score_bias.has_value() ? score_bias->data_ptr<float>() : nullptr;
  auto args = [&](void* temp, size_t bytes) {
    return router_topk(logits.data_ptr<float>(), bias, T, (int)E, (int)k, use_sigmoid, norm_topk_prob,
                       topk_index.data_ptr<int64_t>(), topk_weight.data_ptr<float>(), counts.data_ptr<int64_t>(),
                       prob_sum.data_ptr<float>(), temp, bytes, stream());
  };
  const size_t bytes = args(nullptr, 0);
  at::Tensor temp = scratch(bytes, logits);
  args(temp.data_ptr(), bytes);
}

void router_topk_backward_op(const at::Tensor& logits, const at::Tensor& topk_index, const at::Tensor& d_topk_weight,
                             const c10::optional<at::Tensor>& d_prob_sum, bool use_sigmoid, bool norm_topk_prob,
                             at::Tensor& d_logits) {
  check_router_logits(logits, "router_topk_backward: logits");
  check_cuda(topk_index, "router_topk_backward: topk_index");
  check_cuda(d_topk_weight, "router_topk_backward: d_topk_weight");
  const int64_t T = logits.size(0), E = logits.size(1);
  LRMOE_CHECK(topk_index.dim() == 2 && topk_index.size(0) == T && topk_index.size(1) >= 1 && topk_index.size(1) <= E &&
                  topk_index.scalar_type() == at::kLong,
              "router_topk_backward: topk_index must be an int64 [T, K] tensor with T = ", T, " and 1 <= K <= E = ",
              E, ", got ", topk_index.scalar_type(), " ", topk_index.sizes());
  const int64_t K = topk_index.size(1);
  LRMOE_CHECK(d_topk_weight.sizes() == topk_index.sizes() && d_topk_weight.scalar_type() == at::kFloat &&
                  d_topk_weight.device() == logits.device(),
              "router_topk_backward: d_topk_weight must be a float32 [T, K] = ", topk_index.sizes(), " tensor on ",
              logits.device(), ", got ", d_topk_weight.scalar_type(), " ", d_topk_weight.sizes());
  if (d_prob_sum.has_value()) check_router_vector(*d_prob_sum, logits, "router_topk_backward: d_prob_sum");
  check_out(d_logits, {T, E}, at::kFloat, logits, "router_topk_backward: d_logits");
  const c10::cuda::CUDAGuard guard(logits.device());
  router_topk_backward(logits.data_ptr<float>(), topk_index.data_ptr<int64_t>(), d_topk_weight.data_ptr<float>(),
                       d_prob_sum.has_value() ? d_prob_sum->data_ptr<float>() : nullptr, T, (int)E, (int)K,
                       use_sigmoid, norm_topk_prob, d_logits.data_ptr<float>(), stream());
}

}  // namespace lrmoe
