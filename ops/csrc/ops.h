// Tensor-level entry points (ops.cpp, grouped_gemm.cpp): check arguments, allocate scratch, call
// the launchers of kernels.h on the current stream. Outputs are allocated by the caller (ops/cuda.py).
#pragma once

#include <torch/extension.h>

#include <vector>

namespace lrmoe {

void routing_plan_op(const at::Tensor& group_of_pair, int64_t num_groups, at::Tensor& counts, at::Tensor& order,
                     at::Tensor& offsets);
void permute_op(const at::Tensor& x, const at::Tensor& row_index, at::Tensor& out);
void unpermute_op(const at::Tensor& rows, const at::Tensor& row_of_pair, const at::Tensor& weight, at::Tensor& out);
void topk_retention_op(const at::Tensor& scores, const at::Tensor& group_sizes, const at::Tensor& quotas,
                       at::Tensor& kept, at::Tensor& kept_sizes, at::Tensor& threshold, at::Tensor& summary);
void capacity_route_op(const at::Tensor& pair_group, const at::Tensor& pair_rank, const at::Tensor& instance_group,
                       const at::Tensor& instance_rank, const at::Tensor& instance_capacity, at::Tensor& out);

}  // namespace lrmoe
