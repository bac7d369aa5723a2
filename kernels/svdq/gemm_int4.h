// File: kernels/svdq/gemm_int4.h
//
// The native INT4 tensor-core path of svdq_gemm_w4a4 for the GPUs where
// 4-bit mma.sync runs at full rate: sm_80, sm_86, sm_89 and sm_120a
// (internal to the svdq family; kernels/svdq/svdq.h states the op's
// contract and numerics, which this path meets bit for bit, LoRA aside).
//
// mma.sync.m16n8k64.s4.s4.s32: one instruction is one 64-group's exact
// int32 dot for a 16 x 8 tile. The packed qweight is that MMA's B fragments
// as stored (nunchaku designed it so: lane 4 g + t's 16 bytes of a 16-column
// block hold columns g and 8 + g, k 8 t .. 8 t + 7 and + 32); the activation
// arrives as e4m3 codes (svdq_quantize_w4a4_act_fuse_lora's output on every
// GPU), which the block converts to nibbles in shared memory once per group
// for all its warps. Per group: acc = fma(dot * ascale, wscale, acc), as the
// portable kernel; then bias and LoRA-up.
//
// Where it is checked: the project's only GPU is an H200 (sm_90, where the
// wgmma path runs; 4-bit mma.sync is emulated there, exact but slow), so
// tests/kernels/test_svdq_gpu.py runs this kernel on it through
// CACHE_DIT_SVDQ_GEMM=int4 against the other paths bit for bit, and
// tests/kernels/test_svdq_reference_cpu.py replays its fragment indexing
// against the PTX fragment layout on the CPU. Its speed on 8.x / 12.0 is
// not measured.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace cache_dit::svdq::int4 {

// Whether `act`'s device runs 4-bit mma.sync natively (compute capability
// 8.x or 12.0), or, with emulated_ok, at all (9.0 emulates it: exact, about
// a fifth of the INT8 rate; CACHE_DIT_SVDQ_GEMM=int4, for checking this path
// on an H200). K = 0 takes the portable kernel.
bool usable(const at::Tensor& act, bool emulated_ok);

// out = the op's result, T the model dtype (__half or __nv_bfloat16), Out the
// output's; inputs already checked by check_gemm. Launches on the current
// stream of act's device (the caller holds the device guard).
template <typename T, typename Out>
void gemm(const at::Tensor& act, const at::Tensor& wgt, const at::Tensor& ascales, const at::Tensor& wscales,
          const std::optional<at::Tensor>& lora_act, const std::optional<at::Tensor>& lora_up,
          const std::optional<at::Tensor>& bias, Out* out);

}  // namespace cache_dit::svdq::int4
