// File: kernels/common/cuda_utils.cuh
//
// Device helpers shared by the kernel families: 16-byte packs, dtype
// conversions through fp32, a NaN-propagating max, launch arithmetic, and the
// per-device opt-in to large dynamic shared memory.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace cache_dit::cuda {

// N elements of T moved as one aligned vector access (16 bytes when
// sizeof(T) * N == 16).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T e[N];
};

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// max that returns NaN when either side is NaN (fmaxf drops NaN, and a NaN
// amax or LSE must reach the output rather than vanish).
__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

inline bool is_aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

inline int next_pow2(int64_t v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Threads that share one row of `units` vector accesses: a power of two
// <= 32 (a row's reduction stays within a warp), each thread taking about
// `per_thread` of them. Measured on the H200 (bench/kernels.py, D = 128):
// the merge runs fastest with one access per thread (more threads in
// flight), the dequantizers and the tiled quantizers with four (per-row
// scale and index work spread over more bytes; kernels/NOTES.md).
inline int threads_per_row(int64_t units, int64_t per_thread) {
  return std::min(32, next_pow2(ceil_div(units, per_thread)));
}

// Lets `kernel` launch with `bytes` of dynamic shared memory (above the 48 KB
// default) on the current device. The attribute belongs to the function in
// one device's context: set on GPU 0 only, a launch on GPU 1 fails with
// "invalid argument". `devices` is the call site's record of the devices that
// have it (bit d: device d), so it is set once per device; devices from 64 on
// set it every time. Setting it twice (two threads racing) is harmless.
template <typename Kernel>
void allow_dynamic_smem(Kernel* kernel, int bytes, std::atomic<uint64_t>& devices) {
  const int device = c10::cuda::current_device();
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (devices.load(std::memory_order_acquire) & bit) != 0) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  devices.fetch_or(bit, std::memory_order_release);
}

}  // namespace cache_dit::cuda
