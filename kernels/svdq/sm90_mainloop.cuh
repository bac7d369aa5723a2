// File: kernels/svdq/sm90_mainloop.cuh
//
// The sm_90a svdq GEMM's tile, shared-memory ring and consumer main loop
// (kernels/svdq/gemm_sm90.h says what the GEMM does and why): included by
// the GEMM kernel (kernels/svdq/gemm_sm90.cu) and by the probe that times
// these loops with no producer (bench/probes/wgmma_loop.cu), so the probe
// measures the product's own instructions.
//
// consume() waits for a ring stage's copies, runs its two 64-groups into
// this warpgroup's accumulators (Loop), and releases the stage. With
// kWaitFull false it skips the wait (the probe's stages are filled once).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>

#include "kernels/svdq/sm90_ptx.cuh"

namespace cache_dit::svdq::sm90 {

inline constexpr int kBM = 128;     // tile rows (tokens): two consumer warpgroups of 64
inline constexpr int kBN = 128;     // tile columns (output channels), one packed-scale block
inline constexpr int kBK = 128;     // K per stage: two 64-groups, one 128-byte swizzle row of e4m3
inline constexpr int kStages = 6;   // 6 x 33.5 KB of the 227 KB a block may have
inline constexpr int kThreads = 384;  // warpgroup 0: the producer; 1 and 2: the consumers
inline constexpr int kTileBytes = kBM * kBK;

// The consumer's main loop (consume()): kSerial waits for each group before
// rescaling it; kOverlap rescales a stage's first group under its second's
// MMAs; kScaleMma has the tensor cores form the scale products (the default,
// gemm_sm90.h Schedule::loop).
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
inline constexpr size_t kSmemBytes = sizeof(Smem<kLoop>) + 1024;  // + alignment slack
static_assert(kSmemBytes<kScaleMma> <= 227 * 1024);

#ifdef CACHE_DIT_SM90A_PTX

template <int kLoop>
inline constexpr uint32_t kStageTxBytes =
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

// One 64-group of this warpgroup's 64 rows: two k32 MMAs into a fresh d.
// da, db: descriptors of this warpgroup's A rows and of B at stage 0, k 0. A
// descriptor's address field is bits 0..13 of (address >> 4), and every
// shared address is below 2^18, so moving through the ring is an add: a
// stage is kTileBytes on, a group 64 bytes, a k32 step 32.
__device__ __forceinline__ void group_mmas(float (&d)[64], uint64_t da, uint64_t db, int stage, int half) {
  const uint64_t step = static_cast<uint64_t>(stage * (kTileBytes >> 4) + half * (64 >> 4));
  ptx::wgmma_e4m3<false>(d, da + step, db + step);
  ptx::wgmma_e4m3<true>(d, da + step + (32 >> 4), db + step + (32 >> 4));
}

// group_mmas as one commit group.
__device__ __forceinline__ void issue_group(float (&d)[64], uint64_t da, uint64_t db, int stage, int half) {
  ptx::wgmma_fence();
  group_mmas(d, da, db, stage, half);
  ptx::wgmma_commit();
}

// The kScaleMma group: the same two FP8 MMAs into d, and into sc the
// group's scale products ascale[row] * wscale[column], all 64 x 128 of them,
// as a TF32 MMA of A = this warpgroup's activation scales at k 0 (zeros
// elsewhere; a0, a1: rows g and g + 8 from lanes with t = 0) and B = the
// stage's weight scale rows (w, 0, 0, 0) and `zeros`. One commit group.
template <typename S>
__device__ __forceinline__ void issue_scaled_group(float (&d)[64], float (&sc)[64], uint64_t da, uint64_t db,
                                                   const S& s, int stage, int half, uint32_t a0, uint32_t a1) {
  const uint32_t ws = ptx::smem_u32(s.ws[stage] + half * kBN * 4);
  ptx::wgmma_fence();
  group_mmas(d, da, db, stage, half);
  ptx::wgmma_tf32_rs(sc, a0, a1, 0u, 0u, ptx::interleave_desc(ws, ptx::smem_u32(s.zeros) - ws));
  ptx::wgmma_commit();
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
      for (int c = 0; c < kCluster; ++c) ptx::mbar_arrive_cluster(&s.empty[stage], c);
    } else {
      ptx::mbar_arrive(&s.empty[stage]);
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
template <typename T, int kCluster, int kLoop, bool kWaitFull = true, typename S>
__device__ __forceinline__ void consume(S& s, float (&acc)[64], float (&d0)[64], float (&d1)[64], uint64_t desc_a,
                                        uint64_t desc_b, int it, int wg_row, int lane) {
  const int slot = it % kStages;
  if constexpr (kWaitFull) ptx::mbar_wait(&s.full[slot], (it / kStages) & 1);
  if constexpr (kLoop == kScaleMma) {
    const auto group = [&](int half) {
      const float2 as = act_scales<T>(s, slot, half, wg_row, lane);
      const bool k0 = lane % 4 == 0;  // the lanes that hold k 0 of A
      issue_scaled_group(d0, d1, desc_a, desc_b, s, slot, half, k0 ? __float_as_uint(as.x) : 0u,
                         k0 ? __float_as_uint(as.y) : 0u);
      ptx::wgmma_wait<0>();
      ptx::fence_acc(d0);
      ptx::fence_acc(d1);
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
      ptx::wgmma_wait<0>();
      ptx::fence_acc(d0);
      rescale(acc, d0, s, slot, half, as, lane);
    }
  } else {
    issue_group(d0, desc_a, desc_b, slot, 0);
    issue_group(d1, desc_a, desc_b, slot, 1);
    float2 as = act_scales<T>(s, slot, 0, wg_row, lane);
    ptx::wgmma_wait<1>();
    ptx::fence_acc(d0);
    rescale(acc, d0, s, slot, 0, as, lane);
    as = act_scales<T>(s, slot, 1, wg_row, lane);
    ptx::wgmma_wait<0>();
    ptx::fence_acc(d1);
    rescale(acc, d1, s, slot, 1, as, lane);
  }
  release_slot<kCluster>(s, slot, lane);
}

#endif  // CACHE_DIT_SM90A_PTX

}  // namespace cache_dit::svdq::sm90
