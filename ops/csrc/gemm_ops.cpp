// Tensor glue for the segmented GEMM (gemm.cu): argument checks, scratch, the per-group pointers.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels.h"
#include "ops.h"

namespace lrmoe {
namespace {

DType gemm_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kF32;
    case at::kHalf: return DType::kF16;
    case at::kBFloat16: return DType::kBF16;
    default: LRMOE_CHECK(false, name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

// name(): the tensor's name in an error message, built only when a check fails (the per-group checks
// run G times per call, so an eager std::string would cost host time on every call)
template <class Name>
void check_matrix(const at::Tensor& t, int64_t rows, int64_t cols, at::ScalarType dtype, const at::Tensor& like,
                  const Name& name) {
  LRMOE_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, name(), " must be [", rows, ", ", cols,
              "], got shape ", t.sizes());
  LRMOE_CHECK(t.scalar_type() == dtype, name(), " must be ", dtype, ", got ", t.scalar_type());
  LRMOE_CHECK(t.is_contiguous(), name(), " must be contiguous");
  LRMOE_CHECK(t.device() == like.device(), name(), " is on ", t.device(), ", not on ", like.device());
}

}  // namespace

bool grouped_gemm_op(int64_t pass_id, const at::Tensor& a, const c10::optional<at::Tensor>& b,
                     const std::vector<at::Tensor>& group_tensors, const at::Tensor& group_sizes,
                     const c10::optional<at::Tensor>& out, bool accumulate, bool allow_cutlass) {
  LRMOE_CHECK(pass_id >= 0 && pass_id <= 2, "grouped_gemm: unknown pass ", pass_id);
  const auto pass = static_cast<GemmPass>(pass_id);
  const char* op = pass == GemmPass::kFwd ? "grouped_linear" : pass == GemmPass::kDgrad ? "grouped_linear_dgrad"
                                                                                        : "grouped_linear_wgrad";
  const std::string opn(op);
  LRMOE_CHECK(a.is_cuda(), op, ": input must be a CUDA tensor, got one on ", a.device());
  LRMOE_CHECK(a.dim() == 2, op, ": input must be 2-d, got shape ", a.sizes());
  const DType dt = gemm_dtype(a, op);
  // One stacked [G, N, K] tensor (a layer's stacked weights or gradient buffer) instead of G [N, K] tensors: the
  // pointers step along its first dimension, without G tensors crossing from Python (host time per call).
  const bool stacked = group_tensors.size() == 1 && group_tensors[0].dim() == 3;
  at::Tensor stack;  // the stacked tensor, made contiguous per group (weights only) and alive until the GEMM is queued
  if (stacked) {
    stack = group_tensors[0];
    const bool slices_contiguous = stack.size(2) <= 1 || stack.stride(2) == 1;
    const bool rows_contiguous = stack.size(1) <= 1 || stack.stride(1) == stack.size(2);
    if (!(slices_contiguous && rows_contiguous)) {
      LRMOE_CHECK(pass != GemmPass::kWgrad, op, ": each group of the stacked gradients must be contiguous");
      stack = stack.contiguous();
    }
  }
  const at::Tensor& first = stacked ? stack : group_tensors[0];
  const int64_t G = stacked ? stack.size(0) : (int64_t)group_tensors.size(), M = a.size(0);
  const int64_t dims = stacked ? 3 : 2, n_dim = dims - 2, k_dim = dims - 1;
  LRMOE_CHECK(group_sizes.is_cuda() && group_sizes.device() == a.device() && group_sizes.scalar_type() == at::kLong &&
                  group_sizes.dim() == 1 && group_sizes.is_contiguous(),
              op, ": group_sizes must be a contiguous int64 [G] tensor on ", a.device());
  LRMOE_CHECK(group_sizes.numel() == G, op, ": ", G, " group tensors for ", group_sizes.numel(), " groups");
  LRMOE_CHECK(G > 0, op, ": at least one group");
  int64_t N, K;
  DType out_dt = dt;
  void* out_ptr = nullptr;
  const void* b_ptr = nullptr;
  if (pass == GemmPass::kWgrad) {
    LRMOE_CHECK(b.has_value(), op, ": x is missing");
    N = a.size(1);
    K = b->dim() == 2 ? b->size(1) : -1;
    check_matrix(*b, M, K, a.scalar_type(), a, [&] { return opn + ": x"; });
    b_ptr = b->data_ptr();
    out_dt = gemm_dtype(first, op);
    LRMOE_CHECK(out_dt == dt || out_dt == DType::kF32, op, ": gradients must be ", a.scalar_type(),
                " or float32, got ", first.scalar_type());
  } else {
    N = first.dim() == dims ? first.size(n_dim) : -1;
    K = first.dim() == dims ? first.size(k_dim) : -1;
    LRMOE_CHECK(N >= 0, op, ": weights must be [N, K], got shape ", first.sizes());
    LRMOE_CHECK(a.size(1) == (pass == GemmPass::kFwd ? K : N), op, ": input of shape ", a.sizes(),
                " does not match weights of shape ", first.sizes());
    LRMOE_CHECK(out.has_value(), op, ": out is missing");
    check_matrix(*out, M, pass == GemmPass::kFwd ? N : K, a.scalar_type(), a, [&] { return opn + ": out"; });
    out_ptr = out->data_ptr();
  }
  LRMOE_CHECK(a.is_contiguous(), op, ": input must be contiguous");
  std::vector<const void*> ptrs(G);
  std::vector<at::Tensor> copies;  // contiguous copies of strided weights, alive until the GEMM is queued
  if (stacked) {
    const at::ScalarType want = pass == GemmPass::kWgrad ? stack.scalar_type() : a.scalar_type();
    LRMOE_CHECK(stack.size(1) == N && stack.size(2) == K && stack.scalar_type() == want,
                opn + (pass == GemmPass::kWgrad ? ": gradients" : ": weights"), " must be [", G, ", ", N, ", ", K,
                "] ", want, ", got ", stack.scalar_type(), " ", stack.sizes());
    LRMOE_CHECK(stack.device() == a.device(), op, ": stacked tensor is on ", stack.device(), ", not on ", a.device());
    auto* base = static_cast<char*>(stack.data_ptr());
    const int64_t step = stack.stride(0) * (int64_t)stack.element_size();
    for (int64_t g = 0; g < G; ++g) ptrs[g] = base + g * step;
  }
  for (int64_t g = 0; g < (stacked ? 0 : G); ++g) {
    const at::Tensor* t = &group_tensors[g];
    if (pass != GemmPass::kWgrad && !t->is_contiguous()) {  // gradients are written: they must be contiguous
      copies.push_back(t->contiguous());
      t = &copies.back();
    }
    check_matrix(*t, N, K, pass == GemmPass::kWgrad ? group_tensors[0].scalar_type() : a.scalar_type(), a,
                 [&] { return opn + (pass == GemmPass::kWgrad ? ": gradient " : ": weight ") + std::to_string(g); });
    ptrs[g] = t->data_ptr();
  }
  LRMOE_CHECK(M < (int64_t(1) << 31) && N < (int64_t(1) << 31) && K < (int64_t(1) << 31), op, ": sizes must be < 2^31");
  const c10::cuda::CUDAGuard guard(a.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const bool cutlass = allow_cutlass && grouped_gemm_uses_cutlass(pass, dt, out_dt, N, K, G, a.data_ptr(), b_ptr,
                                                                  ptrs.data(), out_ptr);
  auto call = [&](void* temp, size_t bytes) {
    return grouped_gemm(pass, dt, out_dt, M, N, K, G, a.data_ptr(), b_ptr, ptrs.data(), group_sizes.data_ptr<int64_t>(),
                        out_ptr, accumulate, cutlass, temp, bytes, stream);
  };
  const size_t bytes = call(nullptr, 0);
  at::Tensor temp = at::empty({(int64_t)std::max<size_t>(bytes, 1)}, a.options().dtype(at::kByte));
  call(temp.data_ptr(), bytes);
  return cutlass;
}

std::vector<at::Tensor> split_groups_op(const at::Tensor& buffer) {
  LRMOE_CHECK(buffer.dim() >= 1 && buffer.is_contiguous(), "split_groups: buffer must be contiguous with a group "
              "dimension first, got shape ", buffer.sizes());
  const int64_t G = buffer.size(0);
  const auto sizes = buffer.sizes().slice(1);
  const auto strides = buffer.strides().slice(1);
  const int64_t step = G > 0 ? buffer.stride(0) : 0;
  std::vector<at::Tensor> out;
  out.reserve(G);
  // Plain tensors on the buffer's storage, made without the dispatcher: unbind's G selects (autograd views)
  // cost about a microsecond each, and the wgrad of one layer's backward makes 2 x 128 of them.
  for (int64_t g = 0; g < G; ++g) {
    auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(buffer.storage()), buffer.key_set(), buffer.dtype());
    impl->set_sizes_and_strides(sizes, strides, buffer.storage_offset() + g * step);
    out.emplace_back(std::move(impl));
  }
  return out;
}

}  // namespace lrmoe
