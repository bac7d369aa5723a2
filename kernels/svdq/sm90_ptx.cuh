// File: kernels/svdq/sm90_ptx.cuh
//
// The sm_90a instructions of the svdq GEMM as device functions: shared-memory
// addresses, mbarriers, clusters, TMA tensor copies (multicast too), wgmma
// descriptors, and the two wgmma shapes the kernel issues (FP8 e4m3
// m64n128k32 from shared memory; TF32 m64n128k8 with A in registers), with
// their fence and wait. Each wraps one PTX instruction (or a fixed sequence)
// and states its operands' layout; what the kernel does with them is
// kernels/svdq/gemm_sm90.cu's business (and bench/probes/wgmma_loop.cu's,
// which times its main loops in isolation).
//
// Defines its functions only where they can compile: device code for
// sm_90a (CACHE_DIT_SM90A_PTX is then 1).
#pragma once

#include <cuda.h>

#include <cstdint>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CACHE_DIT_SM90A_PTX 1

namespace cache_dit::svdq::sm90::ptx {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// Arrives on the barrier at the same shared offset in cluster CTA `cta`
// (this CTA's own when cta is its rank). The default .release.cta order is
// enough, as for the local arrive: what it releases is this warp's reads of
// the stage by MMAs already waited for. (.release.cluster costs a
// MEMBAR.ALL.GPU per arrive in the SASS.)
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "{\n .reg .b32 remote;\n mapa.shared::cluster.u32 remote, %0, %1;\n"
      " mbarrier.arrive.shared::cluster.b64 _, [remote];\n}" ::"r"(smem_u32(bar)),
      "r"(cta)
      : "memory");
}

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Every thread of every CTA of the cluster: what each did before (barrier
// initialization) is seen by all after.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  }
}

__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}

// The same copy into the same shared offset of every CTA in `cta_mask`,
// each CTA's barrier at `bar`'s offset counting the bytes that land there.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const CUtensorMap* map, uint64_t* bar, int c0,
                                                      int c1, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
}

// K-major operand, 128-byte swizzle: rows of 128 bytes, 8-row atoms 1024
// bytes apart (SBO); LBO unused in this mode (1 by convention).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

__device__ __forceinline__ void fence_acc(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d (+)= A[64 x 32] B[128 x 32]^T, both e4m3 in shared memory. The first
// MMA of a group (kAccumulate false) only writes d: its old values are dead,
// so ptxas neither keeps them alive nor reads them while MMAs are in flight.
#define CACHE_DIT_WGMMA_E4M3                                                                                  \
  "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"                                                            \
  "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "                                                  \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "     \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, " \
  "%43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
  "%64, %65, p, 1, 1;\n}\n"
#define CACHE_DIT_D8(c, i) c(d[i]), c(d[i + 1]), c(d[i + 2]), c(d[i + 3]), c(d[i + 4]), c(d[i + 5]), c(d[i + 6]), c(d[i + 7])
#define CACHE_DIT_D64(c)                                                                                     \
  CACHE_DIT_D8(c, 0), CACHE_DIT_D8(c, 8), CACHE_DIT_D8(c, 16), CACHE_DIT_D8(c, 24), CACHE_DIT_D8(c, 32), \
      CACHE_DIT_D8(c, 40), CACHE_DIT_D8(c, 48), CACHE_DIT_D8(c, 56)
#define CACHE_DIT_READ_WRITE(x) "+f"(x)
#define CACHE_DIT_WRITE(x) "=f"(x)
template <bool kAccumulate>
__device__ __forceinline__ void wgmma_e4m3(float (&d)[64], uint64_t da, uint64_t db) {
  if constexpr (kAccumulate) {
    asm volatile(CACHE_DIT_WGMMA_E4M3 : CACHE_DIT_D64(CACHE_DIT_READ_WRITE) : "l"(da), "l"(db), "r"(1));
  } else {
    asm volatile(CACHE_DIT_WGMMA_E4M3 : CACHE_DIT_D64(CACHE_DIT_WRITE) : "l"(da), "l"(db), "r"(0));
  }
}

// d = A[64 x 8] B[128 x 8]^T in TF32, A in registers (this lane's a0..a3:
// rows g, g + 8 at k t, then at k t + 4), B in shared memory; d's old
// values are not read.
__device__ __forceinline__ void wgmma_tf32_rs(float (&d)[64], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                              uint64_t db) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
      "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, "
      "%43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : CACHE_DIT_D64(CACHE_DIT_WRITE)
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(0));
}
#undef CACHE_DIT_WRITE
#undef CACHE_DIT_READ_WRITE
#undef CACHE_DIT_D64
#undef CACHE_DIT_D8
#undef CACHE_DIT_WGMMA_E4M3

// No swizzle, K-major: 8-row core matrices of 16-byte rows, 128 bytes apart
// (SBO); the k 4..7 core matrices at `lbo` bytes past the k 0..3 ones.
__device__ __forceinline__ uint64_t interleave_desc(uint32_t addr, uint32_t lbo) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (uint64_t{128 >> 4} << 32);
}

// Orders this warpgroup's register and shared-memory accesses before the
// wgmmas that follow (before the first of a batch, and whenever their
// registers were touched since).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }

// Closes the wgmmas issued since the last commit into one group.
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }

// Waits until at most N of this warpgroup's committed groups are in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

}  // namespace cache_dit::svdq::sm90::ptx

#endif  // sm_90a device code
