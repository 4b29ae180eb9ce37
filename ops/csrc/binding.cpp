// pybind11 binding of the lrmoe_ds CUDA ops; ops/cuda.py is the Python side.
#include "kernels.h"
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lrmoe_ds CUDA ops (see ops/cuda.py)";
  m.def("routing_plan", &lrmoe::routing_plan_op, "group pairs by destination (counts, order, offsets)");
  m.def("permute", &lrmoe::permute_op, "row gather out[i] = x[row_index[i]]");
  m.def("permute_scaled", &lrmoe::permute_scaled_op, "scaled row gather out[i] = x[row_index[i]] * row_scale[i]");
  m.def("unpermute", &lrmoe::unpermute_op, "weighted combine out[t] = sum_k w[t,k] rows[row_of_pair[t,k]]");
  m.def("unpermute_weight_grad", &lrmoe::unpermute_weight_grad_op,
        "the combine's weight gradient out[t,k] = <rows[row_of_pair[t,k]], dout[t]> (fp32)");
  m.def("swiglu", &lrmoe::swiglu_op, "a = silu(h[:, :F]) * h[:, F:]");
  m.def("unpermute_backward", &lrmoe::unpermute_backward_op,
        "the combine's rows and weight gradients in one pass: d_rows[d_row_of_pair[t,k]] = w[t,k] dout[t] (d_row_of_pair: "
        "row_of_pair if not given), d_weight", pybind11::arg("rows"), pybind11::arg("row_of_pair"), pybind11::arg("weight"),
        pybind11::arg("dout"), pybind11::arg("d_rows"), pybind11::arg("d_weight"),
        pybind11::arg("d_row_of_pair") = pybind11::none());
  m.def("swiglu_backward", &lrmoe::swiglu_backward_op,
        "dh of swiglu from h (its rows index[m] if given) and da (dh may be h: in place), a = swiglu(h) if given, and "
        "dot[m] = <a_m, da_m> (fp32) if given",
        pybind11::arg("h"), pybind11::arg("da"), pybind11::arg("dh"), pybind11::arg("a") = pybind11::none(),
        pybind11::arg("index") = pybind11::none(), pybind11::arg("dot") = pybind11::none());
  m.def("swiglu_dot", &lrmoe::swiglu_dot_op, "dot[m] = <swiglu(h[index[m]]), dz[m]> (fp32; h's rows in order without index)",
        pybind11::arg("h"), pybind11::arg("dz"), pybind11::arg("index"), pybind11::arg("dot"));
  m.def("topk_retention", &lrmoe::topk_retention_op, "quota-aware top-k retention per group");
  m.def("priority_sample", &lrmoe::priority_sample_op,
        "priority sampling within quotas: keys metric / (1 - u), kept, kept_sizes, threshold, the kept pairs' weights",
        pybind11::arg("metric"), pybind11::arg("u"), pybind11::arg("group_sizes"), pybind11::arg("quotas"),
        pybind11::arg("kept"), pybind11::arg("kept_sizes"), pybind11::arg("threshold"), pybind11::arg("scale"),
        pybind11::arg("summary"));
  m.def("retained_pairs", &lrmoe::retained_pairs_op,
        "the retained pairs' maps: kept_pairs, src, gate, row_weight, kept_row_of_pair, pair_weight");
  m.def("retention_metric", &lrmoe::retention_metric_op,
        "the send rows' gates and retention metric (0 grad_norm, 1 gate, 2 uniform), and each group's metric mass",
        pybind11::arg("order"), pybind11::arg("topk_weight"), pybind11::arg("metric_kind"), pybind11::arg("dout_norm"),
        pybind11::arg("x_norm"), pybind11::arg("group_sizes"), pybind11::arg("weight_of_row"),
        pybind11::arg("metric"), pybind11::arg("mass"));
  m.def("capacity_route", &lrmoe::capacity_route_op, "assign retained pairs to instances under capacities");
  m.def("router_topk", &lrmoe::router_topk_op,
        "the router's top-k math: topk_index, topk_weight, counts, prob_sum from fp32 logits");
  m.def("router_topk_backward", &lrmoe::router_topk_backward_op, "d_logits of router_topk");
  m.def("grouped_gemm", &lrmoe::grouped_gemm_op, "segmented GEMM: pass 0 forward, 1 dgrad, 2 wgrad",
        pybind11::arg("pass"), pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("group_tensors"),
        pybind11::arg("group_sizes"), pybind11::arg("out"), pybind11::arg("accumulate"),
        pybind11::arg("allow_cutlass") = true);
  m.def("gemm_default_config", &lrmoe::gemm_default_config,
        "the segmented GEMM's default CUTLASS kernels on the current device: m64 or coop (gemm.cu)");
  m.def("gemm_config", [](int pass, int64_t M, int64_t K, int64_t G) {
          return lrmoe::gemm_config(static_cast<lrmoe::GemmPass>(pass), M, K, G); },
        "the CUTLASS kernels the segmented GEMM runs for pass (0 fwd, 1 dgrad, 2 wgrad), M rows, K (the dgrad's "
        "output width) and G groups", pybind11::arg("pass"), pybind11::arg("M"), pybind11::arg("K"), pybind11::arg("G"));
  m.def("cutlass_version", &lrmoe::cutlass_version, "the CUTLASS release the kernels were built with");
  m.def("peak_memory_tbps", &lrmoe::peak_memory_tbps, "the current device's peak memory bandwidth, TB/s");
  m.def("split_groups", &lrmoe::split_groups_op,
        "buffer [G, ...] -> G tensors buffer[g] on its storage (plain tensors, not autograd views)");
}
