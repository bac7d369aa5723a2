// File: kernels/svdq/mma.cuh
//
// mma.sync helpers on the model dtype (sm_80+), shared by the LoRA parts of
// the svdq kernels: packing two fp32 values into a register of T, and the
// m16n8k16 MMA with fp32 accumulators. Fragment layouts are PTX's: A row g
// (+ 8), k 2 t (+ 1, + 8); B n g, k 2 t (+ 1, + 8); D row g (+ 8), n 2 t (+ 1),
// for lane 4 g + t. nunchaku's packed proj_down / proj_up hold exactly these
// B fragments (kernels/svdq/layouts.cuh, lowrank_pos).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace cache_dit::svdq {

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// d[0..3] += A (16 x 16, model dtype) B (16 x 8): the m16n8 D layout is the
// wgmma accumulator's, chunk by chunk, so LoRA-up lands in the same registers.
template <typename T>
__device__ __forceinline__ void mma_16816(float& d0, float& d1, float& d2, float& d3, const uint32_t (&a)[4],
                                          uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

}  // namespace cache_dit::svdq
