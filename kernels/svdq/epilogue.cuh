// File: kernels/svdq/epilogue.cuh
//
// The tensor-core GEMMs' shared epilogue (kernels/svdq/gemm_sm90.cu,
// kernels/svdq/gemm_int4.cu): a warp's 16 rows x 128 columns of fp32 results
// in the m16n8 D layout, acc[4 j + r] at row row0 + 8 (r / 2), column
// n0 + 8 j + 2 t + r % 2 (lane 4 g + t); then + bias, then + LoRA-up
// (mma.sync on the model dtype into the same accumulators: nunchaku's packed
// proj_up is that MMA's B fragments), then the store. Numerics:
// kernels/svdq/svdq.h (bias, then the LoRA sums in this MMA's order).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/common/cuda_utils.cuh"
#include "kernels/svdq/mma.cuh"

namespace cache_dit::svdq {

template <typename Out>
__device__ __forceinline__ void store2(Out* p, float x, float y) {
  if constexpr (std::is_same_v<Out, float>) {
    *reinterpret_cast<float2*>(p) = make_float2(x, y);
  } else {
    *reinterpret_cast<uint32_t*>(p) = pack2<Out>(x, y);
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
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = row0 + 8 * h;
      if (row < m_pad) store2<Out>(out + row * n_cols + n0 + 8 * j + 2 * t, acc[j * 4 + 2 * h], acc[j * 4 + 2 * h + 1]);
    }
  }
}

}  // namespace cache_dit::svdq
