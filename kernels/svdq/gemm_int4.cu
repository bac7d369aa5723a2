// The native INT4 W4A4 GEMM (kernels/svdq/gemm_int4.h says what and why).
// Compiled for every target of the build; the body exists only in the
// images of the targets with 4-bit mma.sync (8.x, 12.0, and 9.0 where it is
// emulated), and the host takes this path only on such a device.
#include "kernels/svdq/gemm_int4.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include "kernels/common/cuda_utils.cuh"
#include "kernels/svdq/epilogue.cuh"
#include "kernels/svdq/layouts.cuh"

#if defined(__CUDA_ARCH__) && ((__CUDA_ARCH__ >= 800 && __CUDA_ARCH__ <= 900) || __CUDA_ARCH__ == 1200)
#define CACHE_DIT_SVDQ_INT4_BODY 1
#endif

namespace cache_dit::svdq::int4 {
namespace {

constexpr int kBM = 64;       // tile rows: 4 warps of 16
constexpr int kBN = 128;      // tile columns: one packed-scale block
constexpr int kThreads = 128;

#ifdef CACHE_DIT_SVDQ_INT4_BODY

// d = A (16 x 64 s4, row) B (64 x 8 s4, col), int32, exact. PTX fragments:
// A a0 / a1 rows g / g + 8, k 8 t .. 8 t + 7 (nibble i = k 8 t + i), a2 / a3
// the same at k + 32; B b0 n g, k 8 t + i, b1 k + 32; D rows g (d0, d1) and
// g + 8 (d2, d3), n 2 t, 2 t + 1.
__device__ __forceinline__ void mma_s4(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k64.row.col.s32.s4.s4.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
}

// Four e4m3 codes of INT4 values -> their four nibbles (code i -> bits 4 i).
__device__ __forceinline__ uint32_t nibbles_of_codes(uint32_t codes) {
  uint32_t v = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v |= (static_cast<uint32_t>(int4_of_e4m3((codes >> (8 * i)) & 0xFFu)) & 0xFu) << (4 * i);
  }
  return v;
}

#endif  // CACHE_DIT_SVDQ_INT4_BODY

template <typename T, typename Out>
__global__ void __launch_bounds__(kThreads)
    gemm_kernel(const uint8_t* __restrict__ act, const int32_t* __restrict__ wgt, const T* __restrict__ ascales,
                const T* __restrict__ wscales, const float* __restrict__ lora_act, const T* __restrict__ up,
                const T* __restrict__ bias, Out* __restrict__ out, int m_pad, int n_cols, int k_dim, int rank) {
#ifdef CACHE_DIT_SVDQ_INT4_BODY
  // One group of the tile's 64 rows as nibbles: row r's k = 2 c, 2 c + 1 in byte c.
  __shared__ alignas(16) uint8_t nib[kBM][32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.x * kBN, m0 = blockIdx.y * kBM, groups = k_dim / 64;
  const int r0 = warp * 16 + g;  // this lane's rows r0, r0 + 8 of the tile
  float acc[64] = {};            // the epilogue's layout: acc[(2 p + h) * 4 + r]

  for (int gi = 0; gi < groups; ++gi) {
    {  // thread: row threadIdx.x / 2, codes 32 (threadIdx.x % 2) .. + 31 of the group
      const int row = threadIdx.x / 2, half = threadIdx.x % 2;
      uint4 c[2] = {};
      if (m0 + row < m_pad) {
        const uint4* src = reinterpret_cast<const uint4*>(act + int64_t{m0 + row} * k_dim + gi * 64 + half * 32);
        c[0] = src[0];
        c[1] = src[1];
      }
      const uint32_t w[8] = {c[0].x, c[0].y, c[0].z, c[0].w, c[1].x, c[1].y, c[1].z, c[1].w};
      uint32_t q[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) q[i] = nibbles_of_codes(w[2 * i]) | (nibbles_of_codes(w[2 * i + 1]) << 16);
      *reinterpret_cast<uint4*>(&nib[row][half * 16]) = make_uint4(q[0], q[1], q[2], q[3]);
    }
    __syncthreads();
    const uint32_t a[4] = {*reinterpret_cast<const uint32_t*>(&nib[r0][4 * t]),
                           *reinterpret_cast<const uint32_t*>(&nib[r0 + 8][4 * t]),
                           *reinterpret_cast<const uint32_t*>(&nib[r0][16 + 4 * t]),
                           *reinterpret_cast<const uint32_t*>(&nib[r0 + 8][16 + 4 * t])};
    __syncthreads();  // the next group may overwrite nib
    // Rows past M_pad (the last tile) read scale 0: their codes were 0 too.
    const float as0 = m0 + r0 < m_pad ? cuda::to_float(ascales[int64_t{gi} * m_pad + m0 + r0]) : 0.f;
    const float as1 = m0 + r0 + 8 < m_pad ? cuda::to_float(ascales[int64_t{gi} * m_pad + m0 + r0 + 8]) : 0.f;
    // 16-column block p of the tile: the lane's 16 bytes of qweight, words (n_half, k_half), start at the
    // word of column 16 p + g, k 8 t; its wscales, columns 16 p + {2 t, 2 t + 1, 2 t + 8, 2 t + 9}, are 4
    // consecutive entries from column 16 p + 2 t's. A block further is 128 words (qweight_word's n_pack)
    // and 16 entries (scale_pos's j) on.
    const int32_t* wq = wgt + qweight_word(n0 + g, int64_t{gi} * 64 + 8 * t, groups);
    const T* wsc = wscales + scale_pos(n0 + 2 * t, gi, groups);
#pragma unroll
    for (int p = 0; p < 8; ++p) {
      const uint4 b = *reinterpret_cast<const uint4*>(wq + p * 128);
      const uint2 raw = *reinterpret_cast<const uint2*>(wsc + p * 16);
      const T* ws = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int d[4];
        mma_s4(d, a, h == 0 ? b.x : b.z, h == 0 ? b.y : b.w);
#pragma unroll
        for (int r = 0; r < 4; ++r) {  // one FMUL (exact) and one FFMA, as the portable kernel
          const float f = __fmul_rn(static_cast<float>(d[r]), r < 2 ? as0 : as1);
          float& o = acc[(2 * p + h) * 4 + r];
          o = __fmaf_rn(f, cuda::to_float(ws[h * 2 + r % 2]), o);
        }
      }
    }
  }
  epilogue<T, Out>(acc, bias, lora_act, up, out, int64_t{m0} + r0, n0, m_pad, n_cols, rank, lane);
#else
  __trap();  // never launched: the host takes this path only on a device with that image
#endif
}

}  // namespace

bool usable(const at::Tensor& act, bool emulated_ok) {
  // A build that runs on the device at all holds its image (8.x binaries run
  // on every 8.x; sm_90a's and sm_120a's only on 9.0 and 12.0), and there the
  // body exists.
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(act.get_device());
  const bool native = prop->major == 8 || (prop->major == 12 && prop->minor == 0);
  const bool emulated = prop->major == 9 && prop->minor == 0;
  return (native || (emulated_ok && emulated)) && act.size(1) > 0;
}

template <typename T, typename Out>
void gemm(const at::Tensor& act, const at::Tensor& wgt, const at::Tensor& ascales, const at::Tensor& wscales,
          const std::optional<at::Tensor>& lora_act, const std::optional<at::Tensor>& lora_up,
          const std::optional<at::Tensor>& bias, Out* out) {
  const int64_t m_pad = act.size(0), k = act.size(1), n = wgt.size(0);
  const int64_t rank = lora_up ? lora_up->size(1) : 0;
  const dim3 grid(static_cast<unsigned>(n / kBN), static_cast<unsigned>(cuda::ceil_div(m_pad, kBM)));
  gemm_kernel<T, Out><<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const uint8_t*>(act.data_ptr()), static_cast<const int32_t*>(wgt.data_ptr()),
      reinterpret_cast<const T*>(ascales.data_ptr()), reinterpret_cast<const T*>(wscales.data_ptr()),
      lora_act ? static_cast<const float*>(lora_act->data_ptr()) : nullptr,
      lora_up ? reinterpret_cast<const T*>(lora_up->data_ptr()) : nullptr,
      bias ? reinterpret_cast<const T*>(bias->data_ptr()) : nullptr, out, static_cast<int>(m_pad),
      static_cast<int>(n), static_cast<int>(k), static_cast<int>(rank));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

#define CACHE_DIT_SVDQ_INT4_GEMM(T, Out)                                                                        \
  template void gemm<T, Out>(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,     \
                             const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,              \
                             const std::optional<at::Tensor>&, Out*);
CACHE_DIT_SVDQ_INT4_GEMM(__half, __half)
CACHE_DIT_SVDQ_INT4_GEMM(__half, __nv_bfloat16)
CACHE_DIT_SVDQ_INT4_GEMM(__half, float)
CACHE_DIT_SVDQ_INT4_GEMM(__nv_bfloat16, __half)
CACHE_DIT_SVDQ_INT4_GEMM(__nv_bfloat16, __nv_bfloat16)
CACHE_DIT_SVDQ_INT4_GEMM(__nv_bfloat16, float)
#undef CACHE_DIT_SVDQ_INT4_GEMM

}  // namespace cache_dit::svdq::int4
