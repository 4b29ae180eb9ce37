// The CUTLASS 3.x Hopper grouped GEMM (pointer-array, TMA, warp-specialised) used by the segmented
// GEMM of gemm.cu. Each gemm_<pass>.cu instantiates one pass, so they compile in parallel.
// Per-group problem shapes, pointers and strides are written on the device by setup_kernel from the
// device group sizes (it also makes the groups' row offsets, by a block scan: no separate scan launch);
// the problem shapes never visit the host.
#pragma once

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/thread/linear_combination.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "gemm_common.h"

namespace lrmoe {

namespace cutlass_gemm {
using namespace cute;

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group
using Element = cutlass::bfloat16_t;
constexpr int kAlign = 8;  // 16 bytes of bf16

template <class LayoutA, class LayoutB, class TileShape, class ClusterShape, class KernelSchedule,
          class EpilogueSchedule>
struct Config {
  using LayoutD = cutlass::layout::RowMajor;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, LayoutD*, kAlign, Element, LayoutD*,
      kAlign, EpilogueSchedule, cutlass::epilogue::fusion::LinearCombination<Element, float>>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlign, Element, LayoutB*, kAlign, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

using Cooperative = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
using CooperativeEpi = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
using Pingpong = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
using PingpongEpi = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;

// One block of kPtrChunk threads per chunk of groups; thread i sets up group g0 + i. Its first row is
// the sum of the sizes before it: those of earlier chunks (a block reduction) plus a block scan here.
// The persistent scheduler hands out tiles in problem order, tile i to CTA i mod grid. by_rows lists the
// problems by their rows, most first (ties by group index): a wgrad tile's length is its group's rows, so a
// hot expert's long tiles then start first instead of wherever its index falls.
template <class Cfg>
__global__ void __launch_bounds__(kPtrChunk) setup_kernel(
    GemmPass pass, int64_t M, int64_t N, int64_t K, int64_t G, int64_t g0, int64_t count, bool by_rows, PtrChunk ptrs,
    const int64_t* __restrict__ sizes, const Element* a, const Element* b, Element* out,
    ProblemShape::UnderlyingProblemShape* problems, const Element** pa, const Element** pb, const Element** pc,
    Element** pd, typename Cfg::StrideA* sa, typename Cfg::StrideB* sb, typename Cfg::StrideD* sd,
    typename Cfg::StrideA stride_a, typename Cfg::StrideB stride_b, typename Cfg::StrideD stride_d) {
  using Reduce = cub::BlockReduce<int64_t, kPtrChunk>;
  using Scan = cub::BlockScan<int64_t, kPtrChunk>;
  __shared__ union { typename Reduce::TempStorage reduce; typename Scan::TempStorage scan; } tmp;
  __shared__ int64_t rows_before_chunk;
  const int i = threadIdx.x;
  int64_t before = 0;
  for (int64_t j = i; j < g0; j += kPtrChunk) before += sizes[j];
  before = Reduce(tmp.reduce).Sum(before);  // valid in thread 0
  if (i == 0) rows_before_chunk = before;
  __syncthreads();  // also before tmp is reused by the scan
  int64_t off = 0;
  Scan(tmp.scan).ExclusiveSum(i < count ? sizes[g0 + i] : int64_t(0), off);
  if (i >= count) return;
  off += rows_before_chunk;
  const int64_t own = g0 + i;
  const int64_t m = max(int64_t(0), min(sizes[own], M - off));  // rows past M are never touched
  Element* group = static_cast<Element*>(const_cast<void*>(ptrs.p[i]));
  int64_t g = own;  // the problem's place in the list
  if (by_rows) {
    g = 0;
    for (int64_t j = 0; j < G; ++j) g += sizes[j] > sizes[own] || (sizes[j] == sizes[own] && j < own);
  }
  if (pass == GemmPass::kFwd) {
    problems[g] = make_shape(int(m), int(N), int(K));
    pa[g] = a + off * K;
    pb[g] = group;
    pd[g] = out + off * N;
  } else if (pass == GemmPass::kDgrad) {
    problems[g] = make_shape(int(m), int(K), int(N));
    pa[g] = a + off * N;
    pb[g] = group;
    pd[g] = out + off * K;
  } else {  // an empty group gets no tiles (its zeroing, if asked, is done by gemm.cu)
    problems[g] = make_shape(m > 0 ? int(N) : 0, int(K), int(m));
    pa[g] = a + off * N;
    pb[g] = b + off * K;
    pd[g] = group;
  }
  pc[g] = pd[g];
  sa[g] = stride_a;
  sb[g] = stride_b;
  sd[g] = stride_d;
}

template <class Cfg>
size_t run(GemmPass pass, int64_t M, int64_t N, int64_t K, int64_t G, const void* a, const void* b,
           const void* const* group_ptrs, const int64_t* sizes, void* out, bool accumulate,
           void* temp, size_t temp_bytes, cudaStream_t stream) {
  using Gemm = typename Cfg::Gemm;
  using SA = typename Cfg::StrideA;
  using SB = typename Cfg::StrideB;
  using SD = typename Cfg::StrideD;
  Scratch sc(temp);
  auto* problems = sc.take<ProblemShape::UnderlyingProblemShape>(G);
  auto* pa = sc.take<const Element*>(G);
  auto* pb = sc.take<const Element*>(G);
  auto* pc = sc.take<const Element*>(G);
  auto* pd = sc.take<Element*>(G);
  auto* sa = sc.take<SA>(G);
  auto* sb = sc.take<SB>(G);
  auto* sd = sc.take<SD>(G);
  // The GEMM of each pass in CUTLASS's (M, N, K): the strides do not depend on the group's rows.
  const int gm = 1;  // a placeholder row count: packed strides of these layouts ignore it
  SA stride_a; SB stride_b; SD stride_d;
  if (pass == GemmPass::kFwd) {
    stride_a = cutlass::make_cute_packed_stride(SA{}, make_shape(gm, int(K), 1));
    stride_b = cutlass::make_cute_packed_stride(SB{}, make_shape(int(N), int(K), 1));
    stride_d = cutlass::make_cute_packed_stride(SD{}, make_shape(gm, int(N), 1));
  } else if (pass == GemmPass::kDgrad) {
    stride_a = cutlass::make_cute_packed_stride(SA{}, make_shape(gm, int(N), 1));
    stride_b = cutlass::make_cute_packed_stride(SB{}, make_shape(int(K), int(N), 1));
    stride_d = cutlass::make_cute_packed_stride(SD{}, make_shape(gm, int(K), 1));
  } else {
    stride_a = cutlass::make_cute_packed_stride(SA{}, make_shape(int(N), gm, 1));
    stride_b = cutlass::make_cute_packed_stride(SB{}, make_shape(int(K), gm, 1));
    stride_d = cutlass::make_cute_packed_stride(SD{}, make_shape(int(N), int(K), 1));
  }
  cutlass::KernelHardwareInfo hw;
  LRMOE_CUDA_CHECK(cudaGetDevice(&hw.device_id));
  hw.sm_count = num_sms();
  typename Gemm::Arguments args;
  decltype(args.epilogue.thread) fusion;
  fusion.alpha = 1.f;
  fusion.beta = accumulate ? 1.f : 0.f;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = nullptr;
  fusion.beta_ptr_array = nullptr;
  fusion.dAlpha = {_0{}, _0{}, 0};
  fusion.dBeta = {_0{}, _0{}, 0};
  args = typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                  {int(G), problems, nullptr},
                                  {pa, sa, pb, sb},
                                  {fusion, accumulate ? pc : nullptr, sd, pd, sd},
                                  hw};
  // Tile order of the persistent scheduler (read per call, so benchmarks can compare):
  // LRMOE_GEMM_RASTER=m|n, LRMOE_GEMM_SWIZZLE=1|2|4|8. By default forward and dgrad walk down M (consecutive
  // tiles share the weight tile), swizzle 1; wgrad walks along N with swizzle 2, which was faster than M on
  // the H200 in 10 of 16 wgrad cells (up to 20%, at GLM-4.5-Air's skewed 16k; slower in 4, by 3% at most) and
  // on the H100 in 11 (slower in 2, by 10% in one) (benchmarks/results/grouped_gemm_h200_1205.md,
  // grouped_gemm_wgrad_raster_h100.md; both with the ping-pong 128x128x64 wgrad kernel).
  const bool wgrad = pass == GemmPass::kWgrad;
  const std::string raster = env_or("LRMOE_GEMM_RASTER", wgrad ? "n" : "m");
  const std::string swizzle = env_or("LRMOE_GEMM_SWIZZLE", wgrad ? "2" : "1");
  // LRMOE_GEMM_ORDER=index|rows: the problems in group order (the default) or by their rows, most first
  // (setup_kernel). Its wgrad on an H100 (grouped_gemm_wgrad_rows_h100.md): faster where a hot expert sits
  // late in the list at 16k tokens (bench --routing zipf_shuffled: Qwen3 down 1.18 of torch against 1.02, GLM
  // down 1.07 against 1.03), 1-3% slower in most other cells; on the bench's Zipf, which lists the hottest
  // group first already, it gained nothing (grouped_gemm_wgrad_order_h200.md). So an option, not the default.
  const std::string order = env_or("LRMOE_GEMM_ORDER", "index");
  if (order != "index" && order != "rows")
    throw std::invalid_argument("LRMOE_GEMM_ORDER must be index or rows, not '" + order + "'");
  if (raster != "m" && raster != "n")
    throw std::invalid_argument("LRMOE_GEMM_RASTER must be m or n, not '" + raster + "'");
  if (swizzle != "1" && swizzle != "2" && swizzle != "4" && swizzle != "8")
    throw std::invalid_argument("LRMOE_GEMM_SWIZZLE must be 1, 2, 4 or 8, not '" + swizzle + "'");
  using Raster = decltype(args.scheduler.raster_order);  // its namespace moved between CUTLASS versions
  args.scheduler.raster_order = raster == "n" ? Raster::AlongN : Raster::AlongM;
  args.scheduler.max_swizzle_size = std::stoi(swizzle);
  const size_t workspace_bytes = Gemm::get_workspace_size(args);
  void* workspace = sc.take<char>(workspace_bytes);
  if (temp == nullptr) return sc.used;
  if (temp_bytes < sc.used) throw std::runtime_error("grouped_gemm: scratch too small");

  for (int64_t g0 = 0; g0 < G; g0 += kPtrChunk) {
    PtrChunk chunk;
    const int64_t count = std::min<int64_t>(kPtrChunk, G - g0);
    for (int64_t i = 0; i < count; ++i) chunk.p[i] = group_ptrs[g0 + i];
    setup_kernel<Cfg><<<1, kPtrChunk, 0, stream>>>(pass, M, N, K, G, g0, count, order == "rows", chunk, sizes,
                                                   static_cast<const Element*>(a), static_cast<const Element*>(b),
                                                   static_cast<Element*>(out), problems, pa, pb, pc, pd, sa, sb, sd,
                                                   stride_a, stride_b, stride_d);
    LRMOE_LAUNCH_CHECK("grouped_gemm: setup");
  }
  Gemm gemm;
  cutlass::Status st = gemm.can_implement(args);
  if (st != cutlass::Status::kSuccess)
    throw std::runtime_error(std::string("grouped_gemm: CUTLASS cannot run these arguments: ") + cutlassGetStatusString(st));
  st = gemm.initialize(args, workspace, stream);
  if (st != cutlass::Status::kSuccess)
    throw std::runtime_error(std::string("grouped_gemm: CUTLASS initialize failed: ") + cutlassGetStatusString(st));
  st = gemm.run(stream);
  if (st != cutlass::Status::kSuccess)
    throw std::runtime_error(std::string("grouped_gemm: CUTLASS run failed: ") + cutlassGetStatusString(st));
  LRMOE_LAUNCH_CHECK("grouped_gemm: CUTLASS kernel");
  return sc.used;
}

}  // namespace cutlass_gemm
}  // namespace lrmoe
