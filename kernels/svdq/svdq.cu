// SVDQuant W4A4 kernels, launchers and entry points (kernels/svdq/svdq.h has
// the contracts). The quantizers, and the portable GEMM that every target
// but sm_90a runs (kernels/svdq/gemm_sm90.cu is the tensor-core one): plain
// CUDA-core code, one thread or warp per output, written to be obviously
// equal to kernels/svdq_reference.py. Each rounding is explicit (__fmul_rn,
// __fmaf_rn, __fdiv_rn): no contraction the reference does not make.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <cuda_fp8.h>

#include <cstdlib>
#include <cstring>

#include "kernels/common/cuda_utils.cuh"
#include "kernels/ops.h"
#include "kernels/svdq/gemm_sm90.h"
#include "kernels/svdq/layouts.cuh"
#include "kernels/svdq/mma.cuh"
#include "kernels/svdq/svdq.h"

namespace cache_dit::svdq {
namespace {

using cuda::from_float;
using cuda::to_float;

constexpr unsigned kFull = 0xffffffffu;
constexpr int kWarps = 8;  // warps per block of the warp-per-group kernels

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

__device__ __forceinline__ int clamp_q(int q) { return max(-8, min(7, q)); }

// ---- kernels ---------------------------------------------------------------------------------------------

// One warp per (row, 64-group); lane l takes k = 64 g + 2 l, 2 l + 1.
template <typename T>
__global__ void quantize_act_kernel(const T* __restrict__ x, const T* __restrict__ smooth, uint8_t* __restrict__ q,
                                    T* __restrict__ scales, int64_t m_rows, int64_t m_pad, int64_t k_dim) {
  const int lane = threadIdx.x % 32;
  const int64_t groups = k_dim / 64;
  const int64_t g = int64_t{blockIdx.y} * kWarps + threadIdx.x / 32;
  const int64_t m = blockIdx.x;
  if (g >= groups) return;
  const int64_t k = g * 64 + 2 * lane;
  float v[2] = {0.f, 0.f};
  if (m < m_rows) {
    for (int e = 0; e < 2; ++e) {
      float xv = to_float(x[m * k_dim + k + e]);
      // x / s rounded to the model dtype, as the reference
      if (smooth != nullptr) xv = to_float(from_float<T>(__fdiv_rn(xv, to_float(smooth[scale_pos(k + e, 0, 1)]))));
      v[e] = xv;
    }
  }
  const float amax = warp_max(fmaxf(fabsf(v[0]), fabsf(v[1])));
  const float scale = __fmul_rn(amax, 1.0f / 7.0f);
  const float recip = scale == 0.f ? 0.f : __frcp_rn(scale);
  const int q0 = clamp_q(__float2int_rn(__fmul_rn(v[0], recip)));
  const int q1 = clamp_q(__float2int_rn(__fmul_rn(v[1], recip)));
  // e4m3 codes of q0, q1 (exact): k and k + 1 of row m
  const __nv_fp8x2_storage_t codes =
      __nv_cvt_float2_to_fp8x2(make_float2(static_cast<float>(q0), static_cast<float>(q1)), __NV_SATFINITE, __NV_E4M3);
  reinterpret_cast<__nv_fp8x2_storage_t*>(q)[(m * k_dim + k) / 2] = codes;
  if (lane == 0) scales[g * m_pad + m] = from_float<T>(scale);
}

// lora_act[m, r] = sum_k x[m, k] * down[r, k], fp32 accumulators on tensor
// cores (m16n8k16 on T). A block takes 16 rows; its 8 warps split K in
// contiguous eighths and add their partial sums in warp order (deterministic).
// Rows >= m_rows read as 0. The packed proj_down is the MMA's B fragments.
constexpr int kDownWarps = 8;
template <typename T>
__global__ void __launch_bounds__(32 * kDownWarps) lora_down_kernel(const T* __restrict__ x, const T* __restrict__ down,
                                                                  float* __restrict__ act, int64_t m_rows,
                                                                  int64_t m_pad, int64_t k_dim, int64_t rank) {
  __shared__ float partial[kDownWarps][16][16];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t m0 = int64_t{blockIdx.x} * 16;
  const int64_t steps = k_dim / 16, per_warp = (steps + kDownWarps - 1) / kDownWarps;
  const int64_t s_begin = warp * per_warp, s_end = min(steps, s_begin + per_warp);
  const T* rows[2] = {m0 + g < m_rows ? x + (m0 + g) * k_dim : nullptr,
                      m0 + g + 8 < m_rows ? x + (m0 + g + 8) * k_dim : nullptr};
  auto pair = [](const T* row, int64_t k) {
    return row == nullptr ? 0u : *reinterpret_cast<const uint32_t*>(row + k);
  };
  for (int64_t rt = 0; rt < rank / 16; ++rt) {
    float d[8] = {};
    for (int64_t st = s_begin; st < s_end; ++st) {
      const int64_t k0 = st * 16;
      const uint32_t a[4] = {pair(rows[0], k0 + 2 * t), pair(rows[1], k0 + 2 * t), pair(rows[0], k0 + 2 * t + 8),
                             pair(rows[1], k0 + 2 * t + 8)};
      const uint4 b = *reinterpret_cast<const uint4*>(down + (st * (rank / 16) + rt) * 256 + lane * 8);
      mma_16816<T>(d[0], d[1], d[2], d[3], a, b.x, b.y);  // ranks 16 rt + 0..7
      mma_16816<T>(d[4], d[5], d[6], d[7], a, b.z, b.w);  // ranks 16 rt + 8..15
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) partial[warp][g + 8 * ((i / 2) % 2)][(i / 4) * 8 + 2 * t + i % 2] = d[i];
    __syncthreads();
    for (int e = threadIdx.x; e < 256; e += blockDim.x) {
      const int r = e / 16, c = e % 16;
      float sum = 0.f;
      for (int w = 0; w < kDownWarps; ++w) sum += partial[w][r][c];
      if (m0 + r < m_pad) act[(m0 + r) * rank + rt * 16 + c] = sum;
    }
    __syncthreads();
  }
}

// One warp per (row n, 64-group): offline numerics (fp32, scale = amax / 7
// rounded to T, 1 for an all-zero group, q = rni(w / scale_rounded)).
template <typename T>
__global__ void quantize_wgt_kernel(const T* __restrict__ w, int32_t* __restrict__ qw, T* __restrict__ scales,
                                    int64_t n_rows, int64_t k_dim) {
  const int lane = threadIdx.x % 32;
  const int64_t groups = k_dim / 64;
  const int64_t warp = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32;
  const int64_t n = warp / groups, g = warp % groups;
  if (n >= n_rows) return;  // the whole warp
  const int64_t k = g * 64 + 2 * lane;
  const float a = to_float(w[n * k_dim + k]), b = to_float(w[n * k_dim + k + 1]);
  const float amax = warp_max(fmaxf(fabsf(a), fabsf(b)));
  const T stored = from_float<T>(amax == 0.f ? 1.f : __fdiv_rn(amax, 7.f));
  const float s = to_float(stored);
  const int q0 = clamp_q(__float2int_rn(__fdiv_rn(a, s))), q1 = clamp_q(__float2int_rn(__fdiv_rn(b, s)));
  const uint32_t byte = static_cast<uint32_t>((q0 & 0xF) | ((q1 & 0xF) << 4));
  // Lanes 4 t .. 4 t + 3 hold the 8 nibbles of one word (k = 64 g + 8 t ..).
  const uint32_t b1 = __shfl_down_sync(kFull, byte, 1), b2 = __shfl_down_sync(kFull, byte, 2),
                 b3 = __shfl_down_sync(kFull, byte, 3);
  if (lane % 4 == 0) {
    qw[qweight_word(n, g * 64 + 8 * (lane / 4), groups)] =
        static_cast<int32_t>(byte | (b1 << 8) | (b2 << 16) | (b3 << 24));
  }
  if (lane == 0) scales[scale_pos(n, g, groups)] = stored;
}

// One thread per output: over groups in order, acc = fma(dot * as, ws, acc)
// (dot * as is exact), then bias, then LoRA-up (lora_act rounded to T).
template <typename T, typename Out>
__global__ void gemm_kernel(const uint8_t* __restrict__ act, const int32_t* __restrict__ wgt,
                            const T* __restrict__ ascales, const T* __restrict__ wscales,
                            const float* __restrict__ lora_act, const T* __restrict__ up, const T* __restrict__ bias,
                            Out* __restrict__ out, int64_t m_pad, int64_t n_cols, int64_t k_dim, int64_t rank) {
  const int64_t n = int64_t{blockIdx.x} * 16 + threadIdx.x;
  const int64_t m = int64_t{blockIdx.y} * 16 + threadIdx.y;
  if (m >= m_pad || n >= n_cols) return;
  const int64_t groups = k_dim / 64;
  const uint8_t* row = act + m * k_dim;
  float acc = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    int dot = 0;
    for (int t = 0; t < 8; ++t) {
      const auto w = static_cast<uint32_t>(wgt[qweight_word(n, g * 64 + 8 * t, groups)]);
      for (int e = 0; e < 8; ++e) {
        const int qw = static_cast<int>(w << (28 - 4 * e)) >> 28;  // nibble e, sign-extended
        dot += qw * int4_of_e4m3(row[g * 64 + 8 * t + e]);
      }
    }
    const float f = __fmul_rn(static_cast<float>(dot), to_float(ascales[g * m_pad + m]));
    acc = __fmaf_rn(f, to_float(wscales[scale_pos(n, g, groups)]), acc);
  }
  if (bias != nullptr) acc = __fadd_rn(acc, to_float(bias[scale_pos(n, 0, 1)]));
  if (rank > 0) {
    float l = 0.f;
    for (int64_t r = 0; r < rank; ++r) {
      l = fmaf(to_float(from_float<T>(lora_act[m * rank + r])), to_float(up[lowrank_pos(n, r, rank, false)]), l);
    }
    acc = __fadd_rn(acc, l);
  }
  out[m * n_cols + n] = from_float<Out>(acc);
}

// ---- launchers: check, guard the device, launch on the current stream ---------------------------------------

template <typename F>
void dispatch_half(at::ScalarType t, F&& f) {
  if (t == at::kHalf) {
    f(__half{});
  } else {
    f(__nv_bfloat16{});
  }
}

// CACHE_DIT_SVDQ_GEMM=portable (read once) sends every GEMM to the portable
// kernel, so one GPU can check both paths against each other.
bool portable_gemm_forced() {
  static const bool forced = [] {
    const char* v = std::getenv("CACHE_DIT_SVDQ_GEMM");
    return v != nullptr && std::strcmp(v, "portable") == 0;
  }();
  return forced;
}

template <typename T>
const T* ptr_or_null(const OptTensor& t) {
  return t ? reinterpret_cast<const T*>(t->data_ptr()) : nullptr;
}

void quantize_act_launcher(const at::Tensor& input, const OptTensor& lora_down, const OptTensor& smooth, bool fuse_glu,
                           bool fp4, int64_t pad_size, at::Tensor& output, at::Tensor& oscales,
                           at::Tensor& lora_act_out) {
  const ActQuantOutputs outs{&output, &oscales, &lora_act_out};
  check_quantize_act(input, lora_down, smooth, fuse_glu, fp4, pad_size, &outs);
  const int64_t m = input.size(0), k = input.size(1), m_pad = output.size(0);
  const int64_t rank = lora_act_out.size(1);
  if (m_pad == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch_half(input.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const dim3 grid(static_cast<unsigned>(m_pad), static_cast<unsigned>(cuda::ceil_div(k / 64, kWarps)));
    quantize_act_kernel<T><<<grid, 32 * kWarps, 0, stream>>>(
        reinterpret_cast<const T*>(input.data_ptr()), ptr_or_null<T>(smooth),
        static_cast<uint8_t*>(output.data_ptr()), reinterpret_cast<T*>(oscales.data_ptr()), m, m_pad, k);
    if (rank > 0) {
      lora_down_kernel<T><<<static_cast<unsigned>(cuda::ceil_div(m_pad, 16)), 32 * kDownWarps, 0, stream>>>(
          reinterpret_cast<const T*>(input.data_ptr()), ptr_or_null<T>(lora_down),
          static_cast<float*>(lora_act_out.data_ptr()), m, m_pad, k, rank);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void gemm_launcher(const at::Tensor& act, const at::Tensor& wgt, const at::Tensor& ascales, const at::Tensor& wscales,
                   const OptTensor& lora_act_in, const OptTensor& lora_up, const OptTensor& bias, bool fp4,
                   double alpha, const OptTensor& wcscales, bool act_unsigned, int64_t out_dtype_id,
                   at::Tensor& out) {
  check_gemm(act, wgt, ascales, wscales, lora_act_in, lora_up, bias, fp4, alpha, wcscales, act_unsigned,
             out_dtype_id, &out);
  const int64_t m_pad = act.size(0), k = act.size(1), n = wgt.size(0);
  const int64_t rank = lora_up ? lora_up->size(1) : 0;
  if (m_pad == 0) return;
  const c10::cuda::CUDAGuard guard(act.device());
  const bool tensor_cores = !portable_gemm_forced() && sm90::usable(act, ascales, lora_act_in, lora_up, bias, out);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const dim3 block(16, 16);
  const dim3 grid(static_cast<unsigned>(cuda::ceil_div(n, 16)), static_cast<unsigned>(cuda::ceil_div(m_pad, 16)));
  dispatch_half(wscales.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto* o) {
      using Out = std::remove_pointer_t<decltype(o)>;
      if (tensor_cores) {
        sm90::gemm<T, Out>(act, wgt, ascales, wscales, lora_act_in, lora_up, bias, o);
        return;
      }
      gemm_kernel<T, Out><<<grid, block, 0, stream>>>(
          static_cast<const uint8_t*>(act.data_ptr()), static_cast<const int32_t*>(wgt.data_ptr()),
          reinterpret_cast<const T*>(ascales.data_ptr()), reinterpret_cast<const T*>(wscales.data_ptr()),
          lora_act_in ? static_cast<const float*>(lora_act_in->data_ptr()) : nullptr, ptr_or_null<T>(lora_up),
          ptr_or_null<T>(bias), o, m_pad, n, k, rank);
    };
    switch (out.scalar_type()) {
      case at::kHalf: launch(reinterpret_cast<__half*>(out.data_ptr())); break;
      case at::kBFloat16: launch(reinterpret_cast<__nv_bfloat16*>(out.data_ptr())); break;
      default: launch(static_cast<float*>(out.data_ptr())); break;
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void quantize_wgt_launcher(const at::Tensor& input, at::Tensor& output, at::Tensor& oscales) {
  check_quantize_wgt(input, &output, &oscales);
  const int64_t n = input.size(0), k = input.size(1);
  if (n == 0 || k == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch_half(input.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const int64_t warps = n * (k / 64);
    quantize_wgt_kernel<T><<<static_cast<unsigned>(cuda::ceil_div(warps, kWarps)), 32 * kWarps, 0, stream>>>(
        reinterpret_cast<const T*>(input.data_ptr()), static_cast<int32_t*>(output.data_ptr()),
        reinterpret_cast<T*>(oscales.data_ptr()), n, k);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

// ---- entry points ------------------------------------------------------------------------------------------

ActQuant svdq_quantize_w4a4_act_fuse_lora_out(const at::Tensor& input, const OptTensor& lora_down,
                                              const OptTensor& smooth, bool fuse_glu, bool fp4, int64_t pad_size,
                                              at::Tensor& output, at::Tensor& oscales, at::Tensor& lora_act_out) {
  quantize_act_launcher(input, lora_down, smooth, fuse_glu, fp4, pad_size, output, oscales, lora_act_out);
  return {output, oscales, lora_act_out};
}

ActQuant svdq_quantize_w4a4_act_fuse_lora(const at::Tensor& input, const OptTensor& lora_down,
                                          const OptTensor& smooth, bool fuse_glu, bool fp4, int64_t pad_size) {
  // The Meta kernel checks and allocates the outputs, on the input's device.
  auto [output, oscales, lora_act_out] =
      svdq_quantize_w4a4_act_fuse_lora_meta(input, lora_down, smooth, fuse_glu, fp4, pad_size);
  quantize_act_launcher(input, lora_down, smooth, fuse_glu, fp4, pad_size, output, oscales, lora_act_out);
  return {output, oscales, lora_act_out};
}

at::Tensor svdq_gemm_w4a4_out(const at::Tensor& act, const at::Tensor& wgt, const at::Tensor& ascales,
                              const at::Tensor& wscales, const OptTensor& lora_act_in, const OptTensor& lora_up,
                              const OptTensor& bias, bool fp4, double alpha, const OptTensor& wcscales,
                              bool act_unsigned, int64_t out_dtype_id, at::Tensor& out) {
  gemm_launcher(act, wgt, ascales, wscales, lora_act_in, lora_up, bias, fp4, alpha, wcscales, act_unsigned,
                out_dtype_id, out);
  return out;
}

at::Tensor svdq_gemm_w4a4(const at::Tensor& act, const at::Tensor& wgt, const at::Tensor& ascales,
                          const at::Tensor& wscales, const OptTensor& lora_act_in, const OptTensor& lora_up,
                          const OptTensor& bias, bool fp4, double alpha, const OptTensor& wcscales,
                          bool act_unsigned, int64_t out_dtype_id) {
  at::Tensor out = svdq_gemm_w4a4_meta(act, wgt, ascales, wscales, lora_act_in, lora_up, bias, fp4, alpha, wcscales,
                                       act_unsigned, out_dtype_id);
  gemm_launcher(act, wgt, ascales, wscales, lora_act_in, lora_up, bias, fp4, alpha, wcscales, act_unsigned,
                out_dtype_id, out);
  return out;
}

std::tuple<at::Tensor, at::Tensor> svdq_quantize_w4a4_wgt_out(const at::Tensor& input, at::Tensor& output,
                                                              at::Tensor& oscales) {
  quantize_wgt_launcher(input, output, oscales);
  return {output, oscales};
}

std::tuple<at::Tensor, at::Tensor> svdq_quantize_w4a4_wgt(const at::Tensor& input) {
  auto [output, oscales] = svdq_quantize_w4a4_wgt_meta(input);
  quantize_wgt_launcher(input, output, oscales);
  return {output, oscales};
}

}  // namespace cache_dit::svdq
