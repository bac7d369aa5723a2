// File: kernels/svdq/epilogue.cuh
//
// The tensor-core GEMMs' shared epilogue (kernels/svdq/gemm_sm90.cu,
// kernels/svdq/gemm_int4.cu): a warp's 16 rows x 128 columns of fp32 results
// in the m16n8 D layout, acc[4 j + r] at row row0 + 8 (r / 2), column
// n0 + 8 j + 2 t + r % 2 (lane 4 g + t); then + bias, then + LoRA-up
// (mma.sync on the model dtype into the same accumulators: nunchaku's packed
// proj_up is that MMA's B fragments), then the store (16-bit outputs as
// 16-byte vectors, store_row_16bit). Numerics:
// kernels/svdq/svdq.h (bias, then the LoRA sums in this MMA's order).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/common/cuda_utils.cuh"
#include "kernels/svdq/mma.cuh"

namespace cache_dit::svdq {

__device__ __forceinline__ void swap_if(bool c, uint32_t& a, uint32_t& b) {
  const uint32_t lo = c ? b : a, hi = c ? a : b;
  a = lo;
  b = hi;
}

// x[i] <- x[i ^ t] for t in 0..3 (static indices, selects only).
__device__ __forceinline__ void xor_permute(uint32_t (&x)[4], int t) {
  swap_if(t & 1, x[0], x[1]);
  swap_if(t & 1, x[2], x[3]);
  swap_if(t & 2, x[0], x[2]);
  swap_if(t & 2, x[1], x[3]);
}

// One row of a 16-bit output tile: lane t of the quad that shares the row
// holds w[j], the two outputs at columns 8 j + 2 t (+ 1), j = 0..15. A 4 x 4
// transpose of words within the quad per 32 columns (three xor shuffles)
// gives lane t columns 32 b + 8 t .. + 7, stored as one 16-byte vector:
// a quarter of the store instructions of 4-byte stores, and whole sectors.
// Every lane of the warp calls it (the shuffles); `ok` masks the store.
__device__ __forceinline__ void store_row_16bit(void* row, const uint32_t (&w)[16], int t, bool ok) {
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    uint32_t x[4] = {w[4 * b], w[4 * b + 1], w[4 * b + 2], w[4 * b + 3]};
    xor_permute(x, t);  // x[r] = this lane's word of j = 4 b + (r ^ t)
    uint32_t y[4] = {x[0], __shfl_xor_sync(0xFFFFFFFFu, x[1], 1), __shfl_xor_sync(0xFFFFFFFFu, x[2], 2),
                     __shfl_xor_sync(0xFFFFFFFFu, x[3], 3)};
    xor_permute(y, t);  // y[u] = lane u's word of j = 4 b + t
    if (ok) reinterpret_cast<uint4*>(row)[4 * b + t] = make_uint4(y[0], y[1], y[2], y[3]);
  }
}

// n0: the tile's first column (a multiple of 128); rows >= m_pad are not
// read or written. bias, lora_act/up may be null (rank 0).
template <typename T, typename Out>
__device__ __forceinline__ void epilogue(float (&acc)[64], const T* __restrict__ bias,
                                         const float* __restrict__ lora_act, const T* __restrict__ up,
                                         Out* __restrict__ out, int64_t row0, int n0, int m_pad, int n_cols,
                                         int rank, int lane) {
  const int t = lane % 4;
  if (bias != nullptr) {
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {  // packed: 4 values at (n0 / 128 * 32 + 4 jj + t) * 4
      const uint2 raw = *reinterpret_cast<const uint2*>(bias + (int64_t{n0} / 128 * 32 + jj * 4 + t) * 4);
      const T* b = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const int i = jj * 8 + r;  // (2 jj + r / 4) * 4 + r % 4
        acc[i] = __fadd_rn(acc[i], cuda::to_float(b[(r / 4) * 2 + r % 2]));
      }
    }
  }
  if (rank > 0) {
    // Two steps a pass: a rank-32 LoRA's loads are all in flight before its
    // first MMA (measured, bench/results/2026-12-05-h100-svdq-epilogue.md;
    // hoisting them above the bias as well spilled ~330 bytes).
#pragma unroll 2
    for (int kr = 0; kr < rank / 16; ++kr) {
      float2 x[4] = {};  // (row0, k 2t), (row0 + 8, k 2t), (row0, k 2t + 8), (row0 + 8, k 2t + 8)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int64_t row = row0 + (q % 2) * 8;
        if (row < m_pad) {
          x[q] = *reinterpret_cast<const float2*>(lora_act + row * rank + kr * 16 + 2 * t + (q / 2) * 8);
        }
      }
      const uint32_t a[4] = {pack2<T>(x[0].x, x[0].y), pack2<T>(x[1].x, x[1].y), pack2<T>(x[2].x, x[2].y),
                             pack2<T>(x[3].x, x[3].y)};
#pragma unroll
      for (int cc = 0; cc < 8; ++cc) {  // 16-channel tile cc: words (n_half, k_half) of lane's 16 bytes
        const uint4 b = *reinterpret_cast<const uint4*>(up + ((int64_t{n0} / 16 + cc) * (rank / 16) + kr) * 256 +
                                                        lane * 8);
        float* d = acc + 8 * cc;
        mma_16816<T>(d[0], d[1], d[2], d[3], a, b.x, b.y);
        mma_16816<T>(d[4], d[5], d[6], d[7], a, b.z, b.w);
      }
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = row0 + 8 * h;
    Out* dst = out + row * n_cols + n0;
    if constexpr (std::is_same_v<Out, float>) {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        if (row < m_pad) {
          *reinterpret_cast<float2*>(dst + 8 * j + 2 * t) = make_float2(acc[j * 4 + 2 * h], acc[j * 4 + 2 * h + 1]);
        }
      }
    } else {
      uint32_t w[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) w[j] = pack2<Out>(acc[j * 4 + 2 * h], acc[j * 4 + 2 * h + 1]);
      store_row_16bit(dst, w, t, row < m_pad);
    }
  }
}

}  // namespace cache_dit::svdq
