// SVDQuant W4A4 kernels, launchers and entry points (kernels/svdq/svdq.h has
// the contracts): the activation quantizer fused with LoRA-down (one pass
// over x), the weight quantizer, and the portable GEMM that every target but
// sm_90a runs (kernels/svdq/gemm_sm90.cu is the tensor-core one), written to
// be obviously equal to kernels/svdq_reference.py. Each rounding is explicit
// (__fmul_rn, __fmaf_rn, __frcp_rn, __fdiv_rn): no contraction the reference
// does not make.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <cuda_fp8.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cfloat>
#include <cstdlib>
#include <string>

#include "kernels/common/cuda_utils.cuh"
#include "kernels/ops.h"
#include "kernels/svdq/gemm_int4.h"
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

// The activation quantizer and LoRA-down in one pass over x. A warp takes 16
// rows and a run of 64-groups, and streams each group's 16 x 64 tile of x
// into its ring of kQuantStages shared tiles with 16-byte cp.async (rows
// >= m_rows fill with zeros), kQuantStages - 1 groups ahead: the loads in
// flight come without registers. Lane l owns 8 consecutive values (columns
// 8 (l % 8) ..) of rows l / 8, + 4, + 8, + 12, the 16-byte chunks it copied
// itself: a row's group sits in 8 lanes, which quantize it and store its 64
// codes as 8-byte pieces. Chunks are XOR-swizzled by row, so that the
// ldmatrix reads that give LoRA-down its m16n8k16 A fragments (raw x; the
// packed proj_down is the B fragments) touch no bank twice. (The kernel
// before loaded x as those fragments directly, 4-byte loads that each
// touched 8 rows, and staged codes through 2-byte shared stores: L1-bound,
// ncu.) The 8 warps of a block take consecutive 16-row tiles over the same
// groups, so each proj_down fragment comes from L2 once per block.
//
// lora: this launch's rank tiles [tile0, tile0 + kTiles) of the split's
// partial sums, lora + split * m_pad * rank.
constexpr int kQuantWarps = 8;
constexpr int kQuantBlocks = 2;  // resident per SM (128 registers)
constexpr int kQuantStages = 4;  // x tiles per warp (2 KB each)
constexpr int kDownTiles = 4;  // rank tiles of 16 one launch accumulates in registers
constexpr int64_t kMaxSplitGroups = 128;  // 32 KB of 1 / smooth_factor per block
constexpr int64_t kMaxGridY = 65535;
// check_quantize_act's K bound leaves the first candidate (kMaxSplitGroups
// groups a split) within the grid.
static_assert(kMaxK / kGroup <= kMaxGridY * kMaxSplitGroups);
constexpr size_t kQuantTileBytes = 16 * 128;
constexpr size_t kQuantRingBytes = size_t{kQuantStages} * kQuantWarps * kQuantTileBytes;  // 64 KB

// Two adjacent model-dtype values (one 32-bit word) as floats, and two floats
// rounded to the model dtype with one packed conversion (F2FP) where one
// scalar conversion per value was: conversions issue to a narrower pipe than
// FP32 arithmetic.
__device__ __forceinline__ float2 to_float2(uint32_t w, __nv_bfloat16) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
}
__device__ __forceinline__ float2 to_float2(uint32_t w, __half) {
  return __half22float2(*reinterpret_cast<const __half2*>(&w));
}
__device__ __forceinline__ uint32_t round_to2(float2 v, __nv_bfloat16) {
  const __nv_bfloat162 h = __float22bfloat162_rn(v);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t round_to2(float2 v, __half) {
  const __half2 h = __float22half2_rn(v);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// round_half_even(t) saturated to [-8, 7] and NaN kept (its e4m3 code is
// NaN, so the row's outputs are NaN), in FP32 arithmetic instead of a
// float-to-int and an int-to-float conversion: adding and subtracting
// 1.5 * 2^23 rounds any |t| < 2^22 to an integer, ties to even (explicit
// _rn adds, so nothing contracts into an FMA); +-inf stays inf and saturates.
__device__ __forceinline__ float round_q(float t) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  return __fsub_rn(__fadd_rn(t, kMagic), kMagic);
}
// IEEE 1 / s for a normal s below 2^126 (amax / 7 of any bf16 or fp16 value):
// the reciprocal's fast path without __frcp_rn's range check, whose slow path
// these scales never take.
__device__ __forceinline__ float rcp_normal(float s) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(s));
  const float e = __fmaf_rn(-s, r, 1.0f);
  return __fmaf_rn(r, e, r);
}
__device__ __forceinline__ float round_clamp_q(float t) {
  const float r = round_q(t);
  float q;
  asm("min.NaN.f32 %0, %1, 0f40E00000;" : "=f"(q) : "f"(r));  // 7
  asm("max.NaN.f32 %0, %1, 0fC1000000;" : "=f"(q) : "f"(q));  // -8
  return q;
}

__device__ __forceinline__ uint32_t swizzled(int row, int chunk) { return row * 128 + ((chunk ^ (row % 8)) * 16); }

// Copies this lane's 16 bytes of each of its 4 rows of group gi into the
// tile at `tile` (zeros for rows past m_rows), as one cp.async group.
template <typename T>
__device__ __forceinline__ void copy_rows(uint32_t tile, const T* const (&rows)[4], const T* x, int64_t gi, int lane) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const T* src = rows[i] != nullptr ? rows[i] + gi * 64 + (lane % 8) * 8 : x;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(tile + swizzled(i * 4 + lane / 8, lane % 8)),
                 "l"(src), "r"(rows[i] != nullptr ? 16 : 0)
                 : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&d)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(addr));
}

template <typename T, int kTiles>
__global__ void __launch_bounds__(32 * kQuantWarps, kQuantBlocks)
    quantize_act_kernel(const T* __restrict__ x, const T* __restrict__ smooth, const T* __restrict__ down,
                        uint8_t* __restrict__ q, T* __restrict__ scales, float* __restrict__ lora, int64_t m_rows,
                        int64_t m_pad, int64_t k_dim, int64_t rank, int tile0, int64_t groups_per_split,
                        bool quantize) {
  // The warps' x rings, then 1 / smooth_factor over the split in fp32 and
  // logical channel order (each reciprocal computed once per block).
  extern __shared__ float4 smem[];
  float4* const inv_smooth = smem + kQuantRingBytes / sizeof(float4);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, c = lane % 8;
  const int64_t groups = k_dim / 64, rank_tiles = rank / 16;
  const int64_t g_begin = int64_t{blockIdx.y} * groups_per_split, g_end = min(groups, g_begin + groups_per_split);
  if (quantize && smooth != nullptr) {
    float* inv = reinterpret_cast<float*>(inv_smooth);
    for (int64_t i = threadIdx.x; i < (g_end - g_begin) * 64; i += blockDim.x) {
      // smooth_factor is a per-channel vector in the packed order (layouts.cuh).
      inv[i] = __frcp_rn(to_float(smooth[scale_pos(g_begin * 64 + i, 0, 1)]));
    }
  }
  __syncthreads();
  const int64_t m0 = (int64_t{blockIdx.x} * kQuantWarps + warp) * 16;
  if (m0 >= m_pad) return;  // the whole warp (no block-wide barrier below)
  const T* rows[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t row = m0 + i * 4 + lane / 8;
    rows[i] = row < m_rows ? x + row * k_dim : nullptr;
  }
  const uint32_t ring = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) +
                        static_cast<uint32_t>(warp * kQuantStages * kQuantTileBytes);
  auto stage = [&](int64_t gi) { return ring + static_cast<uint32_t>((gi - g_begin) % kQuantStages * kQuantTileBytes); };
  float acc[kTiles > 0 ? kTiles : 1][8] = {};
  constexpr bool kPrefetch = kTiles > 0 && kTiles <= 2;

  // Groups g_begin .. + kQuantStages - 2 in flight; every iteration commits
  // one group (empty past the end), so "all but the newest kQuantStages - 2
  // complete" always means this group's tile has landed.
#pragma unroll
  for (int s = 0; s < kQuantStages - 1; ++s) {
    if (g_begin + s < g_end) {
      copy_rows<T>(stage(g_begin + s), rows, x, g_begin + s, lane);
    } else {
      asm volatile("cp.async.commit_group;" ::: "memory");
    }
  }
  for (int64_t gi = g_begin; gi < g_end; ++gi) {
    asm volatile("cp.async.wait_group %0;" ::"n"(kQuantStages - 2) : "memory");
    __syncwarp();  // every lane's chunks of this tile landed; the previous group's reads of its slot are done
    if (gi + kQuantStages - 1 < g_end) {
      copy_rows<T>(stage(gi + kQuantStages - 1), rows, x, gi + kQuantStages - 1, lane);
    } else {
      asm volatile("cp.async.commit_group;" ::: "memory");
    }
    const uint32_t tile = stage(gi);
    // This group's proj_down fragments now, used after the quantizer's
    // arithmetic has covered their latency (up to 2 rank tiles: registers).
    uint4 b[4][kPrefetch ? kTiles : 1];
#pragma unroll
    for (int st = 0; st < 4; ++st) {
#pragma unroll
      for (int rt = 0; rt < (kPrefetch ? kTiles : 0); ++rt) {
        b[st][rt] = *reinterpret_cast<const uint4*>(down + ((gi * 4 + st) * rank_tiles + tile0 + rt) * 256 + lane * 8);
      }
    }
    if (quantize) {
      float iv[8] = {};
      if (smooth != nullptr) {
        const float4 lo = inv_smooth[(gi - g_begin) * 16 + c * 2], hi = inv_smooth[(gi - g_begin) * 16 + c * 2 + 1];
        iv[0] = lo.x, iv[1] = lo.y, iv[2] = lo.z, iv[3] = lo.w, iv[4] = hi.x, iv[5] = hi.y, iv[6] = hi.z, iv[7] = hi.w;
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint4 xv;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(xv.x), "=r"(xv.y), "=r"(xv.z), "=r"(xv.w)
                     : "r"(tile + swizzled(i * 4 + lane / 8, c)));
        const uint32_t w[4] = {xv.x, xv.y, xv.z, xv.w};
        float v[8];
        float amax = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          uint32_t pair = w[j];
          // x * (1 / s) rounded to the model dtype, as the reference
          if (smooth != nullptr) {
            const float2 x2 = to_float2(pair, T{});
            pair = round_to2(make_float2(__fmul_rn(x2.x, iv[2 * j]), __fmul_rn(x2.y, iv[2 * j + 1])), T{});
          }
          const float2 f = to_float2(pair, T{});
          v[2 * j] = f.x;
          v[2 * j + 1] = f.y;
          amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
        }
        // The row's 8 lanes are lane ^ 1, ^ 2, ^ 4.
        amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 2));
        amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 4));
        const float scale = __fmul_rn(amax, 1.0f / 7.0f);
        uint32_t codes[2];
        auto encode = [&](auto quant) {
#pragma unroll
          for (int j = 0; j < 4; ++j) {  // e4m3 codes (exact) of two neighbouring columns
            const uint32_t two =
                __nv_cvt_float2_to_fp8x2(make_float2(quant(v[2 * j]), quant(v[2 * j + 1])), __NV_SATFINITE, __NV_E4M3);
            codes[j / 2] = j % 2 == 0 ? two : codes[j / 2] | two << 16;
          }
        };
        // With a normal scale, |v r| <= amax / scale * (1 + 2^-23)^2 <=
        // 7 (1 + 2^-21), so rounding alone lands in [-7, 7] (NaN stays NaN).
        // A subnormal scale has lost bits, and its reciprocal may be infinite
        // (0 * inf would make a finite group NaN): those rows (8 lanes each,
        // rare) divide and saturate instead, as the reference does. A zero
        // scale (all zero or NaN) or an infinite one multiplies by 0: finite
        // values give code 0, NaN and inf NaN.
        if (scale >= FLT_MIN && scale <= FLT_MAX) {
          const float recip = rcp_normal(scale);
          // Rounded product, then rounded to an integer: an FFMA with the
          // magic number would round once and save the multiply, but r is 1/s
          // rounded, so a tie x / s = k + 1/2 (x = amax / 2: 3.5) would go to
          // the odd neighbour whenever r rounded down.
          encode([&](float x) { return round_q(__fmul_rn(x, recip)); });
        } else if (scale > 0.f && scale < FLT_MIN) {
          encode([&](float x) { return round_clamp_q(__fdiv_rn(x, scale)); });
        } else {
          encode([&](float x) { return round_q(__fmul_rn(x, 0.f)); });
        }
        const int64_t row = m0 + i * 4 + lane / 8;
        if (row < m_pad) {
          *reinterpret_cast<uint2*>(q + row * k_dim + gi * 64 + c * 8) = make_uint2(codes[0], codes[1]);
          if (c == 0) scales[gi * m_pad + row] = from_float<T>(scale);
        }
      }
    }
    if constexpr (kTiles > 0) {
#pragma unroll
      for (int st = 0; st < 4; ++st) {
        // Matrices: rows 0-7 | 8-15 of columns 16 st .. + 7, then of + 8 .. + 15: the A fragment's order.
        const int mat = lane / 8, row = (mat % 2) * 8 + lane % 8;
        uint32_t a[4];
        ldmatrix_x4(a, tile + swizzled(row, 2 * st + mat / 2));
        const T* frag = down + ((gi * 4 + st) * rank_tiles + tile0) * 256 + lane * 8;
#pragma unroll
        for (int rt = 0; rt < kTiles; ++rt) {
          uint4 bb;
          if constexpr (kPrefetch) {
            bb = b[st][rt];
          } else {
            bb = *reinterpret_cast<const uint4*>(frag + rt * 256);
          }
          mma_16816<T>(acc[rt][0], acc[rt][1], acc[rt][2], acc[rt][3], a, bb.x, bb.y);
          mma_16816<T>(acc[rt][4], acc[rt][5], acc[rt][6], acc[rt][7], a, bb.z, bb.w);
        }
      }
    }
  }
  if constexpr (kTiles == 0) return;
  const int g = lane / 4, t = lane % 4;
  float* out = lora + int64_t{blockIdx.y} * m_pad * rank;
#pragma unroll
  for (int rt = 0; rt < kTiles; ++rt) {
#pragma unroll
    for (int i = 0; i < 8; i += 2) {  // D: row g (+ 8 for i % 4 >= 2), rank 2 t (+ 8 for i >= 4)
      const int64_t row = m0 + g + 8 * ((i / 2) % 2);
      const int64_t r = (tile0 + rt) * 16 + (i / 4) * 8 + 2 * t;
      if (row < m_pad) *reinterpret_cast<float2*>(out + row * rank + r) = make_float2(acc[rt][i], acc[rt][i + 1]);
    }
  }
}

// lora_act = the splits' partial sums, added in split order (deterministic).
__global__ void sum_splits_kernel(const float* __restrict__ partial, float* __restrict__ out, int64_t n,
                                  int64_t splits) {
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float s = partial[i];
  for (int64_t p = 1; p < splits; ++p) s += partial[p * n + i];
  out[i] = s;
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

// CACHE_DIT_SVDQ_GEMM (read once): "portable" sends every GEMM to the
// portable kernel, "int4" to the INT4 mma.sync one wherever that runs (on
// sm_90 too, where the instruction is emulated: slow, but exact), so one GPU
// can check each path against the others; "sm90-tile" (one CTA per tile),
// "sm90-multicast" and "sm90-persistent" launch the sm_90a kernel with
// another schedule than the default's (sm90::Schedule: multicast and
// persistent, the scale-MMA main loop; "sm90", or unset), and
// "sm90-serial" and "sm90-overlap" the default launch with another main
// loop (Schedule::loop), to be measured against it. Any other value warns
// once and is ignored.
struct GemmChoice {
  enum class Path { kAuto, kPortable, kInt4 } path = Path::kAuto;
  sm90::Schedule schedule;
};
GemmChoice forced_gemm_path() {
  static const GemmChoice choice = [] {
    using Path = GemmChoice::Path;
    const char* env = std::getenv("CACHE_DIT_SVDQ_GEMM");
    const std::string v = env != nullptr ? env : "";
    if (v.empty() || v == "sm90") return GemmChoice{};
    if (v == "portable") return GemmChoice{Path::kPortable, {}};
    if (v == "int4") return GemmChoice{Path::kInt4, {}};
    // sm90::Schedule{multicast, persistent}
    if (v == "sm90-tile") return GemmChoice{Path::kAuto, {false, false}};
    if (v == "sm90-multicast") return GemmChoice{Path::kAuto, {true, false}};
    if (v == "sm90-persistent") return GemmChoice{Path::kAuto, {false, true}};
    if (v == "sm90-serial") return GemmChoice{Path::kAuto, {true, true, 0}};
    if (v == "sm90-overlap") return GemmChoice{Path::kAuto, {true, true, 1}};
    TORCH_WARN("CACHE_DIT_SVDQ_GEMM='", v, "' is not one of portable, int4, sm90, sm90-tile, sm90-multicast, ",
               "sm90-persistent, sm90-serial, sm90-overlap; ignored");
    return GemmChoice{};
  }();
  return choice;
}

template <typename T>
const T* ptr_or_null(const OptTensor& t) {
  return t ? reinterpret_cast<const T*>(t->data_ptr()) : nullptr;
}

// The quantizer's instantiation, allowed its ring and smooth table (over
// the 48 KB default) on the current device.
template <typename T, int kTiles>
auto* quant_kernel() {
  static std::atomic<uint64_t> devices{0};
  auto* kernel = quantize_act_kernel<T, kTiles>;
  cuda::allow_dynamic_smem(kernel, static_cast<int>(kQuantRingBytes + kMaxSplitGroups * 64 * sizeof(float)), devices);
  return kernel;
}

// The quantizer grid's blocks along M: a warp takes 16 rows, a block
// kQuantWarps warps.
int64_t quant_row_blocks(int64_t m_pad) { return cuda::ceil_div(cuda::ceil_div(m_pad, 16), kQuantWarps); }

// Groups per K split of the quantizer's grid, from a cost model fitted to
// its time at every split count, M in {256, 1024, 4608} x K in {3072,
// 12288, 15360}, rank 32, on an H100 (DESIGN 8; 7% rms error, each pick
// within 1.5% of the fastest). Two blocks on one SM share its issue slots,
// so the busiest SM's time is its groups per block times its waves of two
// blocks, a lone block costing 0.64 of a pair; a split's partial LoRA sums
// cost a write and a read. In us: 2.36 per group and wave, 0.52 per MB of
// partial sums. A block keeps at most kMaxSplitGroups groups' 1 /
// smooth_factor in shared memory. Only the least groups per split of each
// split count is a candidate (more groups, same splits: slower), fewer
// splits first so that a tie keeps them; the last few answers are kept per
// thread, since the search costs ~0.3-0.7 us of host time against a
// quantizer call of 10-100 us.
int64_t quant_groups_per_split(int64_t groups, int64_t m_pad, int64_t rank, int64_t sms) {
  struct Pick {
    int64_t groups = -1, m_pad, rank, sms, per;
  };
  thread_local std::array<Pick, 8> recent{};
  thread_local size_t next_slot = 0;
  for (const Pick& p : recent) {
    if (p.groups == groups && p.m_pad == m_pad && p.rank == rank && p.sms == sms) return p.per;
  }
  const int64_t row_blocks = quant_row_blocks(m_pad);
  int64_t best_per = groups;
  double best_cost = -1;
  for (int64_t next = std::min(groups, kMaxSplitGroups); next >= 1;) {
    const int64_t splits = cuda::ceil_div(groups, next), per = cuda::ceil_div(groups, splits);
    if (splits > kMaxGridY) break;  // fewer groups per split only makes more
    const int64_t busiest = cuda::ceil_div(row_blocks * splits, sms);  // blocks on the busiest SM
    const double waves = static_cast<double>(busiest / kQuantBlocks) + (busiest % kQuantBlocks != 0 ? 0.64 : 0.0);
    const double partial_mb = splits > 1 && rank > 0 ? 2e-6 * splits * m_pad * rank * sizeof(float) : 0.0;
    const double cost = 2.36 * per * waves + 0.52 * partial_mb;
    if (best_cost < 0 || cost < best_cost) best_cost = cost, best_per = per;
    next = per - 1;
  }
  recent[next_slot++ % recent.size()] = Pick{groups, m_pad, rank, sms, best_per};
  return best_per;
}

void quantize_act_launcher(const at::Tensor& input, const OptTensor& lora_down, const OptTensor& smooth, bool fuse_glu,
                           bool fp4, int64_t pad_size, at::Tensor& output, at::Tensor& oscales,
                           at::Tensor& lora_act_out) {
  const ActQuantOutputs outs{&output, &oscales, &lora_act_out};
  check_quantize_act(input, lora_down, smooth, fuse_glu, fp4, pad_size, &outs);
  const int64_t m = input.size(0), k = input.size(1), m_pad = output.size(0);
  const int64_t rank = lora_act_out.size(1), groups = k / 64;
  if (m_pad == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  if (k == 0) {  // nothing to quantize; x @ proj_down over no channels is 0
    lora_act_out.zero_();
    return;
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t row_blocks = quant_row_blocks(m_pad);
  const int64_t per_split =
      quant_groups_per_split(groups, m_pad, rank, at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
  const int64_t splits = cuda::ceil_div(groups, per_split);
  const size_t smem = kQuantRingBytes + (smooth ? static_cast<size_t>(per_split) * 64 * sizeof(float) : 0);
  at::Tensor partial =
      splits > 1 && rank > 0 ? at::empty({splits, m_pad, rank}, lora_act_out.options()) : lora_act_out;
  const dim3 grid(static_cast<unsigned>(row_blocks), static_cast<unsigned>(splits));
  dispatch_half(input.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    // The first launch quantizes (and takes the first rank tiles); ranks past
    // 16 kDownTiles take more launches over x, LoRA only.
    const int64_t rank_tiles = rank / 16;
    for (int64_t tile0 = 0; tile0 == 0 || tile0 < rank_tiles; tile0 += kDownTiles) {
      const int64_t tiles = std::min<int64_t>(kDownTiles, rank_tiles - tile0);
      auto* kernel = tiles == 0   ? quant_kernel<T, 0>()
                     : tiles == 1 ? quant_kernel<T, 1>()
                     : tiles == 2 ? quant_kernel<T, 2>()
                     : tiles == 3 ? quant_kernel<T, 3>()
                                  : quant_kernel<T, 4>();
      kernel<<<grid, 32 * kQuantWarps, smem, stream>>>(
          reinterpret_cast<const T*>(input.data_ptr()), ptr_or_null<T>(smooth), ptr_or_null<T>(lora_down),
          static_cast<uint8_t*>(output.data_ptr()), reinterpret_cast<T*>(oscales.data_ptr()),
          rank > 0 ? static_cast<float*>(partial.data_ptr()) : nullptr, m, m_pad, k, rank, static_cast<int>(tile0),
          per_split, tile0 == 0);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  if (splits > 1 && rank > 0) {
    const int64_t n = m_pad * rank;
    sum_splits_kernel<<<static_cast<unsigned>(cuda::ceil_div(n, 256)), 256, 0, stream>>>(
        static_cast<const float*>(partial.data_ptr()), static_cast<float*>(lora_act_out.data_ptr()), n, splits);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void gemm_launcher(const at::Tensor& act, const at::Tensor& wgt, const at::Tensor& ascales, const at::Tensor& wscales,
                   const OptTensor& lora_act_in, const OptTensor& lora_up, const OptTensor& bias, bool fp4,
                   double alpha, const OptTensor& wcscales, bool act_unsigned, int64_t out_dtype_id,
                   at::Tensor& out) {
  check_gemm(act, wgt, ascales, wscales, lora_act_in, lora_up, bias, fp4, alpha, wcscales, act_unsigned,
             out_dtype_id, &out);
  const int64_t m_pad = act.size(0), k = act.size(1), n = wgt.size(0);
  const int64_t rank = lora_up ? lora_up->size(1) : 0;
  if (m_pad == 0 || n == 0) return;  // nothing to write (and no grid of zero blocks to launch)
  const c10::cuda::CUDAGuard guard(act.device());
  const GemmChoice forced = forced_gemm_path();
  using Path = GemmChoice::Path;
  const bool wgmma = forced.path == Path::kAuto && sm90::usable(act);
  const bool mma_s4 = forced.path != Path::kPortable && !wgmma && int4::usable(act, forced.path == Path::kInt4);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const dim3 block(16, 16);
  const dim3 grid(static_cast<unsigned>(cuda::ceil_div(n, 16)), static_cast<unsigned>(cuda::ceil_div(m_pad, 16)));
  dispatch_half(wscales.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto* o) {
      using Out = std::remove_pointer_t<decltype(o)>;
      if (wgmma) {
        sm90::gemm<T, Out>(act, wgt, ascales, wscales, lora_act_in, lora_up, bias, o, forced.schedule);
        return;
      }
      if (mma_s4) {
        int4::gemm<T, Out>(act, wgt, ascales, wscales, lora_act_in, lora_up, bias, o);
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
