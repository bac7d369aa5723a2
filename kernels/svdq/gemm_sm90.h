// File: kernels/svdq/gemm_sm90.h
//
// The sm_90a tensor-core path of svdq_gemm_w4a4 (internal to the svdq family;
// kernels/svdq/svdq.h states the op's contract and numerics, which this path
// meets bit for bit, LoRA aside).
//
// Operands reach the tensor cores as FP8 e4m3: every INT4 value -8..7 is an
// e4m3 number, products of two are integers of magnitude <= 64, and an FP8
// wgmma sums them into fp32 exactly (a 64-group dot has magnitude <= 4096;
// measured exact on the H200 up to sums of 2^20, docs/DESIGN.md section 8).
// FP8 rather than INT8 because the accumulators are already fp32: the
// per-group rescale is one FFMA per output (with the scale products from the
// tensor cores, Schedule::loop), where int32 needs a conversion as well, and
// that rescale, not the FP8 MMAs, bounds this GEMM.
//
// Per call: the packed qweight is expanded to e4m3 [N, K] row-major and the
// packed wscales to fp32 rows in scratch from the caching allocator (one
// pass over the weight, about 5% of the GEMM at FLUX shapes); then one
// kernel: TMA loads into a 6-stage ring of 128 x 128 x 128 tiles, one
// producer warpgroup (one thread issues the copies), two consumer
// warpgroups of 64 x 128, each rescaling a group while the other's MMAs run
// (kernels/svdq/sm90_mainloop.cuh). Bias and LoRA-up (mma.sync on the model
// dtype, into the same accumulators) in the epilogue.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace cache_dit::svdq::sm90 {

// How the kernel is launched. The default takes both: measured on the H200,
// 1.03-1.10x the one-CTA-per-tile launch at the benchmark's shapes
// (docs/DESIGN.md section 8); CACHE_DIT_SVDQ_GEMM (kernels/svdq/svdq.cu)
// selects the others, for measuring. The results are the same bit for bit
// (loop 2: where its condition below holds).
struct Schedule {
  // Clusters of two CTAs on neighbouring column tiles share the activation
  // tile (each copies half to both with TMA multicast): a quarter less L2
  // traffic per MMA. Taken only where N / 128 is even.
  bool multicast = true;
  // One CTA (cluster) per SM (pair) walking the tiles, its copies running
  // ahead into the next tile during the epilogue, instead of one per tile.
  bool persistent = true;
  // The consumer's main loop: 0 waits for each 64-group's MMAs before
  // rescaling it (the other warpgroup's MMAs are all that overlap it); 1
  // issues a stage's second group before it rescales the first, into a
  // second accumulator array; 2 has the tensor cores also form each group's
  // scale products ascale x wscale (a TF32 MMA, k 0 only), so the rescale is
  // one FFMA per output instead of an FMUL, an FFMA and the scale loads
  // (the same bits where the product is a normal fp32 number; kernels/svdq/
  // sm90_mainloop.cuh consume()). Measured against 1, same run each time,
  // GEMM time at M = 4608 in three runs: 2 is 1.03-1.11x, level at
  // 3072 x 12288, 0.98x at one shape in two of the runs (H100,
  // bench/results/2026-12-05-h100-svdq-epilogue.md);
  // 1 was 1.07-1.15x 0 (H200, 2026-12-05-h200-svdq-step.md).
  // CACHE_DIT_SVDQ_GEMM=sm90-serial / sm90-overlap select the others.
  int loop = 2;
};

// Whether this build has the sm_90a kernel and `act`'s device can run it
// (sm 9.0; M_pad a multiple of 8, for the TMA row stride of ascales; K > 0).
// Every operand is 16-byte aligned already (check_gemm).
bool usable(const at::Tensor& act);

// out = the op's result, T the model dtype (__half or __nv_bfloat16), Out the
// output's (T's two or float); inputs already checked by check_gemm. Launches
// on the current stream of act's device (the caller holds the device guard).
template <typename T, typename Out>
void gemm(const at::Tensor& act, const at::Tensor& wgt, const at::Tensor& ascales, const at::Tensor& wscales,
          const std::optional<at::Tensor>& lora_act, const std::optional<at::Tensor>& lora_up,
          const std::optional<at::Tensor>& bias, Out* out, Schedule schedule = {});

}  // namespace cache_dit::svdq::sm90
