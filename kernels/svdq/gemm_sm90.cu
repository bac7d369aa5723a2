// The sm_90a W4A4 GEMM (kernels/svdq/gemm_sm90.h says what and why). Hand-
// written PTX: TMA tensor copies, mbarriers, wgmma on 128-byte-swizzled
// shared memory, setmaxnreg. Compiled for every target of the build; the
// body exists only in the sm_90a image, and the host takes this path only on
// an sm 9.0 device of a build that has that image.
#include "kernels/svdq/gemm_sm90.h"

#include <ATen/ops/empty.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>

#include "kernels/common/cuda_utils.cuh"
#include "kernels/svdq/epilogue.cuh"
#include "kernels/svdq/layouts.cuh"
#include "kernels/svdq/mma.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CACHE_DIT_SVDQ_WGMMA_BODY 1
#endif

namespace cache_dit::svdq::sm90 {
namespace {

constexpr int kBM = 128;     // tile rows (tokens): two consumer warpgroups of 64
constexpr int kBN = 128;     // tile columns (output channels), one packed-scale block
constexpr int kBK = 128;     // K per stage: two 64-groups, one 128-byte swizzle row of e4m3
constexpr int kStages = 6;   // 6 x 33.5 KB of the 227 KB a block may have
constexpr int kThreads = 384;  // warpgroup 0: the producer; 1 and 2: the consumers
constexpr int kTileBytes = kBM * kBK;

// The consumer's main loop (consume()): kSerial waits for each group before
// rescaling it; kOverlap rescales a stage's first group under its second's
// MMAs (the default); kScaleMma has the tensor cores form the scale products.
enum Loop : int { kSerial = 0, kOverlap = 1, kScaleMma = 2 };

// Per stage, the weight scales of the two groups: with kScaleMma the B
// operand of a TF32 MMA, K-major without swizzle: for each group, the
// tile's 128 columns in logical order, each a 16-byte row (w, 0, 0, 0) (k 0..3;
// k 4..7 read `zeros`); otherwise fp32 in the packed order.
template <int kLoop>
struct Smem {
  static constexpr int kScaleFloats = kLoop == kScaleMma ? 2 * kBN * 4 : 2 * kBN;
  uint8_t a[kStages][kTileBytes];   // act rows m0.., 128-byte swizzled (1024-byte aligned atoms)
  uint8_t b[kStages][kTileBytes];   // e4m3 weight rows n0.., same layout
  float ws[kStages][kScaleFloats];  // the two groups' weight scales (above)
  uint16_t as[kStages][2 * kBM];    // the two groups' activation scales (model dtype bits), by row
  float zeros[kLoop == kScaleMma ? kBN * 4 : 4];  // k 4..7 of the scale MMA's B
  uint64_t full[kStages];           // TMA landed (tx count)
  uint64_t empty[kStages];          // the 8 consumer warps are done with the stage
};
template <int kLoop>
constexpr size_t kSmemBytes = sizeof(Smem<kLoop>) + 1024;  // + alignment slack
static_assert(kSmemBytes<kScaleMma> <= 227 * 1024);

#ifdef CACHE_DIT_SVDQ_WGMMA_BODY

template <int kLoop>
constexpr uint32_t kStageTxBytes =
    2 * kTileBytes + sizeof(float) * Smem<kLoop>::kScaleFloats + sizeof(uint16_t) * 2 * kBM;

template <typename T>
__device__ __forceinline__ float scale_bits_to_float(uint16_t bits);
template <>
__device__ __forceinline__ float scale_bits_to_float<__nv_bfloat16>(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}
template <>
__device__ __forceinline__ float scale_bits_to_float<__half>(uint16_t bits) {
  return __half2float(__ushort_as_half(bits));
}

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

// One 64-group of this warpgroup's 64 rows: two k32 MMAs into a fresh d.
// da, db: descriptors of this warpgroup's A rows and of B at stage 0, k 0. A
// descriptor's address field is bits 0..13 of (address >> 4), and every
// shared address is below 2^18, so moving through the ring is an add: a
// stage is kTileBytes on, a group 64 bytes, a k32 step 32.
__device__ __forceinline__ void group_mmas(float (&d)[64], uint64_t da, uint64_t db, int stage, int half) {
  const uint64_t step = static_cast<uint64_t>(stage * (kTileBytes >> 4) + half * (64 >> 4));
  wgmma_e4m3<false>(d, da + step, db + step);
  wgmma_e4m3<true>(d, da + step + (32 >> 4), db + step + (32 >> 4));
}

// group_mmas as one commit group.
__device__ __forceinline__ void issue_group(float (&d)[64], uint64_t da, uint64_t db, int stage, int half) {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  group_mmas(d, da, db, stage, half);
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// No swizzle, K-major: 8-row core matrices of 16-byte rows, 128 bytes apart
// (SBO); the k 4..7 core matrices at `lbo` bytes past the k 0..3 ones.
__device__ __forceinline__ uint64_t interleave_desc(uint32_t addr, uint32_t lbo) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (uint64_t{128 >> 4} << 32);
}

// The kScaleMma group: the same two FP8 MMAs into d, and into sc the
// group's scale products ascale[row] * wscale[column], all 64 x 128 of them,
// as a TF32 MMA of A = this warpgroup's activation scales at k 0 (zeros
// elsewhere; a0, a1: rows g and g + 8 from lanes with t = 0) and B = the
// stage's weight scale rows (w, 0, 0, 0) and `zeros`. One commit group.
template <typename S>
__device__ __forceinline__ void issue_scaled_group(float (&d)[64], float (&sc)[64], uint64_t da, uint64_t db,
                                                   const S& s, int stage, int half, uint32_t a0, uint32_t a1) {
  const uint32_t ws = smem_u32(s.ws[stage] + half * kBN * 4);
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  group_mmas(d, da, db, stage, half);
  wgmma_tf32_rs(sc, a0, a1, 0u, 0u, interleave_desc(ws, smem_u32(s.zeros) - ws));
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// The activation scales of this lane's rows g and g + 8, read before the
// MMAs are waited for.
template <typename T, typename S>
__device__ __forceinline__ float2 act_scales(const S& s, int stage, int half, int wg_row, int lane) {
  const uint16_t* as = s.as[stage] + half * kBM + wg_row + (threadIdx.x % 128) / 32 * 16 + lane / 4;
  return make_float2(scale_bits_to_float<T>(as[0]), scale_bits_to_float<T>(as[8]));
}

// out += (dot * ascale) * wscale, one FMUL (exact: |dot| <= 4096 and the
// scale has at most 11 significant bits) and one FFMA (one rounding) per
// element. d[4 j + r]: row g + 8 (r / 2), column 8 j + 2 t + r % 2.
template <typename S>
__device__ __forceinline__ void rescale(float (&out)[64], float (&d)[64], const S& s, int stage, int half, float2 as,
                                        int lane) {
  const int t = lane % 4;
  const float a0 = as.x, a1 = as.y;
  // float4 at (4 jj + t): columns 16 jj + 2 t + {0, 1} and + 8
  const float4* ws = reinterpret_cast<const float4*>(s.ws[stage] + half * kBN) + t;
  // All 64 products first (independent), then the 64 FFMAs: no FFMA waits on
  // the FMUL just before it.
#pragma unroll
  for (int i = 0; i < 64; ++i) d[i] = __fmul_rn(d[i], (i % 4) < 2 ? a0 : a1);
#pragma unroll
  for (int jj = 0; jj < 8; ++jj) {
    const float4 w = ws[jj * 4];
    const float wv[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = (2 * jj + h) * 4 + r;
        out[i] = __fmaf_rn(d[i], wv[2 * h + r % 2], out[i]);
      }
    }
  }
}

// This warp is done with ring slot `stage` (its MMAs waited for, its scales
// read): one arrival per warp, on the slot's barrier in every CTA whose
// copies filled it.
template <int kCluster, typename S>
__device__ __forceinline__ void release_slot(S& s, int stage, int lane) {
  __syncwarp();
  if (lane == 0) {
    if constexpr (kCluster > 1) {
#pragma unroll
      for (int c = 0; c < kCluster; ++c) mbar_arrive_cluster(&s.empty[stage], c);
    } else {
      mbar_arrive(&s.empty[stage]);
    }
  }
}

// The consumer's step: ring stage `it`, its two 64-groups into this
// warpgroup's rows of acc.
// - kOverlap: the groups go to d0 and d1, the second's MMAs issued before
//   the first is rescaled, so the tensor cores have this warpgroup's next
//   group while its warps rescale; the second's rescale has nothing of this
//   warpgroup's in flight (the other warpgroup's MMAs run then). A step ends
//   with nothing in flight: ptxas serializes every wgmma of the kernel
//   (C7514) when a group issued in one loop iteration is read in the next.
// - kSerial: each group waited for before its rescale (the other
//   warpgroup's MMAs are all that overlap it), kept to be measured against.
// - kScaleMma: each group's MMAs also form its scale products in d1
//   (issue_scaled_group), so the rescale is one FFMA per output and reads no
//   scales from shared memory: out = fma(dot, ascale * wscale, out), the
//   same single rounding of the same exact product as fma(dot * ascale,
//   wscale, out) wherever ascale * wscale is a normal fp32 number (it is
//   exact there: <= 22 significant bits).
template <typename T, int kCluster, int kLoop, typename S>
__device__ __forceinline__ void consume(S& s, float (&acc)[64], float (&d0)[64], float (&d1)[64], uint64_t desc_a,
                                        uint64_t desc_b, int it, int wg_row, int lane) {
  const int slot = it % kStages;
  mbar_wait(&s.full[slot], (it / kStages) & 1);
  if constexpr (kLoop == kScaleMma) {
    const auto group = [&](int half) {
      const float2 as = act_scales<T>(s, slot, half, wg_row, lane);
      const bool k0 = lane % 4 == 0;  // the lanes that hold k 0 of A
      issue_scaled_group(d0, d1, desc_a, desc_b, s, slot, half, k0 ? __float_as_uint(as.x) : 0u,
                         k0 ? __float_as_uint(as.y) : 0u);
      wgmma_wait<0>();
      fence_acc(d0);
      fence_acc(d1);
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] = __fmaf_rn(d0[i], d1[i], acc[i]);
    };
    if constexpr (kCluster > 1) {
      group(0);
      group(1);
    } else {
      // Unrolled here, ptxas serializes the kernel's MMAs (C7512, registers).
#pragma unroll 1
      for (int half = 0; half < 2; ++half) group(half);
    }
  } else if constexpr (kLoop == kSerial) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      issue_group(d0, desc_a, desc_b, slot, half);
      const float2 as = act_scales<T>(s, slot, half, wg_row, lane);
      wgmma_wait<0>();
      fence_acc(d0);
      rescale(acc, d0, s, slot, half, as, lane);
    }
  } else {
    issue_group(d0, desc_a, desc_b, slot, 0);
    issue_group(d1, desc_a, desc_b, slot, 1);
    float2 as = act_scales<T>(s, slot, 0, wg_row, lane);
    wgmma_wait<1>();
    fence_acc(d0);
    rescale(acc, d0, s, slot, 0, as, lane);
    as = act_scales<T>(s, slot, 1, wg_row, lane);
    wgmma_wait<0>();
    fence_acc(d1);
    rescale(acc, d1, s, slot, 1, as, lane);
  }
  release_slot<kCluster>(s, slot, lane);
}

#endif  // CACHE_DIT_SVDQ_WGMMA_BODY

// kCluster 1: one CTA per 128 x 128 tile. kCluster 2: clusters of two CTAs
// on neighbouring column tiles of the same rows, each copying half of the
// shared activation tile to both (TMA multicast), so a CTA reads 24 KB of a
// stage from L2 instead of 32. Each CTA works through units u = its
// cluster's index + j x (clusters launched): one launch covers every unit
// once (j = 0 only) or, persistent, takes one cluster per SM pair and walks
// the units, its ring running on into the next unit while the consumers
// finish the last (the producer is ahead by up to kStages stages).
template <typename T, typename Out, int kCluster, int kLoop>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_kernel(const __grid_constant__ CUtensorMap tm_act, const __grid_constant__ CUtensorMap tm_wgt,
                const __grid_constant__ CUtensorMap tm_as, const __grid_constant__ CUtensorMap tm_ws,
                const float* __restrict__ lora_act, const T* __restrict__ up, const T* __restrict__ bias,
                Out* __restrict__ out, int m_pad, int n_cols, int k_dim, int rank) {
#ifdef CACHE_DIT_SVDQ_WGMMA_BODY
  extern __shared__ uint8_t smem_raw[];
  // Aligned by pointer arithmetic on the shared array (not through an
  // integer), so the compiler still knows the scales are shared memory and
  // reads them with LDS; generic loads cost the rescale its latency (ncu).
  // The offset is the same in every CTA, as multicast copies need.
  using S = Smem<kLoop>;
  S& s = *reinterpret_cast<S*>(smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023));
  const int wg = threadIdx.x / 128, lane = threadIdx.x % 32;
  const int k_stages = k_dim / kBK, groups = k_dim / 64;
  // Units: kCluster column tiles of one 128-row band, column units fastest
  // (the order of the non-cluster 2-D grid this replaced).
  const int n_units = n_cols / (kBN * kCluster);
  const int units = n_units * ((m_pad + kBM - 1) / kBM);
  const int crank = kCluster > 1 ? static_cast<int>(cluster_rank()) : 0;
  const int first_unit = static_cast<int>(blockIdx.x) / kCluster, unit_step = static_cast<int>(gridDim.x) / kCluster;

  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbar_init(&s.full[i], 1);
      mbar_init(&s.empty[i], 8 * kCluster);  // the consumer warps of every CTA the stage's copies reach
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if constexpr (kLoop == kScaleMma) {
    // Written through the generic proxy, read by the MMAs' async proxy.
    for (int i = threadIdx.x; i < kBN * 4; i += kThreads) s.zeros[i] = 0.f;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  if constexpr (kCluster > 1) {
    cluster_sync();  // the other CTA's barriers exist before anything lands on them
  } else {
    __syncthreads();
  }

  if (wg == 0) {  // producer: one thread issues every copy
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      int it = 0;  // stages issued so far, over every unit
      for (int u = first_unit; u < units; u += unit_step) {
        const int n0 = ((u % n_units) * kCluster + crank) * kBN, m0 = u / n_units * kBM;
        for (int st = 0; st < k_stages; ++st, ++it) {
          const int i = it % kStages;
          mbar_wait(&s.empty[i], ((it / kStages) & 1) ^ 1);  // the first round passes at once
          mbar_expect_tx(&s.full[i], kStageTxBytes<kLoop>);
          if constexpr (kCluster > 1) {
            // This CTA's share of the activation rows, to every CTA of the cluster.
            constexpr int kRows = kBM / kCluster;
            tma_load_2d_multicast(s.a[i] + crank * kRows * kBK, &tm_act, &s.full[i], st * kBK, m0 + crank * kRows,
                                  static_cast<uint16_t>((1u << kCluster) - 1));
          } else {
            tma_load_2d(s.a[i], &tm_act, &s.full[i], st * kBK, m0);
          }
          tma_load_2d(s.b[i], &tm_wgt, &s.full[i], st * kBK, n0);
          // The two groups' scale rows (kScaleMma: two 2 KB rows a group).
          tma_load_2d(s.ws[i], &tm_ws, &s.full[i], 0, (n0 / kBN * groups + 2 * st) * (kLoop == kScaleMma ? 2 : 1));
          tma_load_2d(s.as[i], &tm_as, &s.full[i], m0, 2 * st);
        }
      }
      // Clusters: the CTA stays until every consumer warp of the cluster is
      // done with the last kStages stages, so no arrival from the other CTA
      // is still on its way to this one's barriers when it exits (the
      // copies into it are done: its own consumers waited for them).
      for (int j = 0; kCluster > 1 && j < kStages; ++j, ++it) {
        mbar_wait(&s.empty[it % kStages], ((it / kStages) & 1) ^ 1);
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int wg_row = (wg - 1) * 64;  // this warpgroup's rows within the tile
    const uint64_t desc_a = sw128_desc(smem_u32(s.a[0]) + wg_row * kBK), desc_b = sw128_desc(smem_u32(s.b[0]));
    // acc: the tile's sums. d0, d1: a stage's two 64-groups in flight in
    // turn (kOverlap: the other warpgroup's MMAs alone did not keep the
    // tensor cores busy, ncu, DESIGN 8), or a group and its scale products
    // (kScaleMma); consume().
    float acc[64], d0[64], d1[64];

    int it = 0;
    for (int u = first_unit; u < units; u += unit_step) {
      const int n0 = ((u % n_units) * kCluster + crank) * kBN, m0 = u / n_units * kBM;
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] = 0.f;
      for (int st = 0; st < k_stages; ++st, ++it) {
        consume<T, kCluster, kLoop>(s, acc, d0, d1, desc_a, desc_b, it, wg_row, lane);
      }

      // Row g (+ 8) of this warp.
      const int64_t row0 = m0 + wg_row + (threadIdx.x % 128) / 32 * 16 + lane / 4;
      epilogue<T, Out>(acc, bias, lora_act, up, out, row0, n0, m_pad, n_cols, rank, lane);
    }
  }
#else
  __trap();  // never launched: the host takes this path only where the sm_90a image exists
#endif
}

// qweight word (8 nibbles of row n, k .. k + 7) -> 8 e4m3 bytes of row-major [N, K].
__global__ void expand_wgt_kernel(const uint32_t* __restrict__ qw, uint2* __restrict__ wq8, int64_t n_rows,
                                  int64_t k_dim) {
  const int64_t idx = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t units = k_dim / 8;
  if (idx >= n_rows * units) return;
  const int64_t n = idx / units, k = idx % units * 8;
  const uint32_t w = qw[qweight_word(n, k, k_dim / 64)];
  wq8[idx] = make_uint2(e4m3x4_of_int4(w & 0xFFFFu), e4m3x4_of_int4(w >> 16));
}

template <typename T>
__global__ void widen_kernel(const T* __restrict__ in, float* __restrict__ out, int64_t n) {
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i < n) out[i] = cuda::to_float(in[i]);
}

// kScaleMma's weight scales: per block of the packed order (one column
// tile, one group), the 16-byte row (w, 0, 0, 0) of each column in logical
// order.
template <typename T>
__global__ void scale_rows_kernel(const T* __restrict__ in, float4* __restrict__ out, int64_t n, int64_t groups) {
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;  // block i / 128, logical column i % 128
  if (i >= n) return;
  const int64_t block = i / 128, column = block / groups * 128 + i % 128;
  out[i] = make_float4(cuda::to_float(in[scale_pos(column, block % groups, groups)]), 0.f, 0.f, 0.f);
}

// ---- host -------------------------------------------------------------------------------------------------

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status{};
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &status));
    TORCH_CHECK(status == cudaDriverEntryPointSuccess && p != nullptr,
                "svdq_gemm_w4a4: the driver has no cuTensorMapEncodeTiled (status ", static_cast<int>(status), ")");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// A row-major [outer, inner] tensor of `elem` bytes, copied in boxes of
// [box_outer, box_inner]; rows past `outer` read as zeros.
CUtensorMap tensor_map(const void* base, CUtensorMapDataType type, uint64_t elem, uint64_t inner, uint64_t outer,
                       uint32_t box_inner, uint32_t box_outer, CUtensorMapSwizzle swizzle) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {inner * elem};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t steps[2] = {1, 1};
  const CUresult r = encode_tiled()(&map, type, 2, const_cast<void*>(base), dims, strides, box, steps,
                                    CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "svdq_gemm_w4a4: cuTensorMapEncodeTiled failed (", static_cast<int>(r), ")");
  return map;
}

}  // namespace

bool usable(const at::Tensor& act) {
#ifndef CACHE_DIT_SVDQ_SM90A
  (void)act;
  return false;
#else
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(act.get_device());
  return prop->major == 9 && prop->minor == 0 && act.size(0) % 8 == 0 && act.size(1) > 0;
#endif
}

template <typename T, typename Out>
void gemm(const at::Tensor& act, const at::Tensor& wgt, const at::Tensor& ascales, const at::Tensor& wscales,
          const std::optional<at::Tensor>& lora_act, const std::optional<at::Tensor>& lora_up,
          const std::optional<at::Tensor>& bias, Out* out, Schedule schedule) {
  const int64_t m_pad = act.size(0), k = act.size(1), n = wgt.size(0), groups = k / 64;
  const int64_t rank = lora_up ? lora_up->size(1) : 0;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int loop = std::clamp(schedule.loop, 0, 2);
  // Scratch from the caching allocator, on this stream: e4m3 weights and fp32
  // scales (kScaleMma: 16-byte rows, scale_rows_kernel).
  at::Tensor wq8 = at::empty({n, k}, act.options().dtype(at::kByte));
  at::Tensor ws32 = at::empty({groups * n * (loop == kScaleMma ? 4 : 1)}, act.options().dtype(at::kFloat));
  const int64_t units = n * k / 8;
  expand_wgt_kernel<<<static_cast<unsigned>(cuda::ceil_div(units, 256)), 256, 0, stream>>>(
      static_cast<const uint32_t*>(wgt.data_ptr()), static_cast<uint2*>(wq8.data_ptr()), n, k);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const auto grid = static_cast<unsigned>(cuda::ceil_div(groups * n, 256));
  if (loop == kScaleMma) {
    scale_rows_kernel<T><<<grid, 256, 0, stream>>>(reinterpret_cast<const T*>(wscales.data_ptr()),
                                                   static_cast<float4*>(ws32.data_ptr()), groups * n, groups);
  } else {
    widen_kernel<T><<<grid, 256, 0, stream>>>(reinterpret_cast<const T*>(wscales.data_ptr()),
                                              static_cast<float*>(ws32.data_ptr()), groups * n);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  // Two-CTA clusters pair neighbouring column tiles, so N / 128 must be even.
  const int cluster = schedule.multicast && (n / kBN) % 2 == 0 ? 2 : 1;
  const CUtensorMap tm_act = tensor_map(act.data_ptr(), CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, k, m_pad, kBK,
                                        kBM / cluster, CU_TENSOR_MAP_SWIZZLE_128B);
  const CUtensorMap tm_wgt = tensor_map(wq8.data_ptr(), CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, k, n, kBK, kBN,
                                        CU_TENSOR_MAP_SWIZZLE_128B);
  const CUtensorMap tm_as = tensor_map(ascales.data_ptr(), CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, m_pad, groups, kBM, 2,
                                       CU_TENSOR_MAP_SWIZZLE_NONE);
  // A stage's two groups of scales: two rows of 128 floats, or (kScaleMma)
  // four of 256 (a box row holds at most 256 elements).
  const int64_t ws_row = loop == kScaleMma ? 2 * kBN : kBN, ws_rows = loop == kScaleMma ? 4 : 2;
  const CUtensorMap tm_ws = tensor_map(ws32.data_ptr(), CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, ws_row,
                                       ws32.numel() / ws_row, ws_row, ws_rows, CU_TENSOR_MAP_SWIZZLE_NONE);
  using Kernel = decltype(&gemm_kernel<T, Out, 1, 0>);
  static constexpr Kernel kernels[2][3] = {
      {gemm_kernel<T, Out, 1, 0>, gemm_kernel<T, Out, 1, 1>, gemm_kernel<T, Out, 1, 2>},
      {gemm_kernel<T, Out, 2, 0>, gemm_kernel<T, Out, 2, 1>, gemm_kernel<T, Out, 2, 2>}};
  const Kernel kernel = kernels[cluster - 1][loop];
  const size_t smem_bytes = loop == kScaleMma ? kSmemBytes<kScaleMma> : kSmemBytes<kOverlap>;
  static std::atomic<uint64_t> devices[2][3]{};  // per instantiation
  cuda::allow_dynamic_smem(kernel, static_cast<int>(smem_bytes), devices[cluster - 1][loop]);

  cudaLaunchConfig_t config{};
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = static_cast<unsigned>(cluster);
  attribute.val.clusterDim.y = attribute.val.clusterDim.z = 1;
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = cluster > 1 ? 1 : 0;  // the default launch stays a plain one
  // One cluster per unit, or (persistent) as many as the device holds at
  // once (one CTA per SM), each walking the units (the kernel's comment).
  int64_t clusters = n / (kBN * cluster) * cuda::ceil_div(m_pad, kBM);
  if (schedule.persistent) {
    int resident = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    if (cluster > 1) {
      // Clusters the device holds at once: a property of kernel and device,
      // asked once per device (0: not asked yet).
      static std::atomic<int> resident_clusters[3][64]{};
      const int device = c10::cuda::current_device();
      resident = device < 64 ? resident_clusters[loop][device].load(std::memory_order_relaxed) : 0;
      if (resident == 0) {
        config.gridDim = dim3(static_cast<unsigned>(clusters * cluster));
        C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&resident, kernel, &config));
        if (device < 64) resident_clusters[loop][device].store(resident, std::memory_order_relaxed);
      }
    }
    clusters = std::min<int64_t>(clusters, std::max(resident, 1));
  }
  config.gridDim = dim3(static_cast<unsigned>(clusters * cluster));
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, tm_act, tm_wgt, tm_as, tm_ws,
                                    lora_act ? static_cast<const float*>(lora_act->data_ptr()) : nullptr,
                                    lora_up ? reinterpret_cast<const T*>(lora_up->data_ptr()) : nullptr,
                                    bias ? reinterpret_cast<const T*>(bias->data_ptr()) : nullptr, out,
                                    static_cast<int>(m_pad), static_cast<int>(n), static_cast<int>(k),
                                    static_cast<int>(rank)));
}

#define CACHE_DIT_SVDQ_SM90_GEMM(T, Out)                                                                        \
  template void gemm<T, Out>(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,     \
                             const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,              \
                             const std::optional<at::Tensor>&, Out*, Schedule);
CACHE_DIT_SVDQ_SM90_GEMM(__half, __half)
CACHE_DIT_SVDQ_SM90_GEMM(__half, __nv_bfloat16)
CACHE_DIT_SVDQ_SM90_GEMM(__half, float)
CACHE_DIT_SVDQ_SM90_GEMM(__nv_bfloat16, __half)
CACHE_DIT_SVDQ_SM90_GEMM(__nv_bfloat16, __nv_bfloat16)
CACHE_DIT_SVDQ_SM90_GEMM(__nv_bfloat16, float)
#undef CACHE_DIT_SVDQ_SM90_GEMM

}  // namespace cache_dit::svdq::sm90
