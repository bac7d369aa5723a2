// FP8 communication records: per-token and QKV-permute quant/dequant.
//
// A record is D e4m3 bytes plus a 2- or 4-byte scale (kernels/comm/fp8_comm.h),
// so record rows are D + 2 or D + 4 bytes long and almost never 16-byte
// aligned. Both directions therefore move records through shared memory: a
// block owns a run of consecutive records, one contiguous byte range, and
// copies it to or from global memory with 16-byte accesses (a few single bytes
// at its two ends); the narrow, record-aligned accesses stay in shared memory.
// The bf16 side is read or written with 16-byte packs whenever its rows are
// aligned.
//
// Quantization keeps each row in registers between the amax reduction and the
// conversion, so x is read from HBM once. Rows longer than the register budget
// (D > 4096) take a one-block-per-row path that reads the row twice.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "kernels/comm/fp8_comm.h"
#include "kernels/common/cuda_utils.cuh"
#include "kernels/ops.h"

namespace cache_dit::comm {

namespace {

using bf16 = __nv_bfloat16;
using cuda::Pack;

constexpr int kThreads = 256;
constexpr int kPack = 8;               // bf16 values per 16-byte pack
constexpr int kMaxRegisterChunks = 16;  // packs per thread kept in registers
constexpr float kFp8Max = 448.f;

// ---- record formats ---------------------------------------------------------

// Per-token: scale = max(amax, 1e-4) / 448 (fp32), q = e4m3(x * (1 / scale)),
// scale stored as bf16.
struct PerTokenFormat {
  static constexpr int kScaleBytes = kPerTokenScaleBytes;
  __device__ static float scale(float amax) { return cuda::nan_max(amax, 1e-4f) / kFp8Max; }
  struct Quantizer {
    float inv;
    __device__ float operator()(float v) const { return v * inv; }
  };
  __device__ static Quantizer quantizer(float scale) { return {1.f / scale}; }
  template <class F>
  __device__ static void with_row_quantizer(float scale, const F& f) { f(quantizer(scale)); }
  __device__ static void store_scale(uint8_t* dst, float scale) {
    const uint16_t bits = __bfloat16_as_ushort(__float2bfloat16_rn(scale));
    if (reinterpret_cast<uintptr_t>(dst) % 2 == 0) {
      *reinterpret_cast<uint16_t*>(dst) = bits;
    } else {
      dst[0] = bits & 0xff;
      dst[1] = bits >> 8;
    }
  }
  __device__ static float load_scale(const uint8_t* src) {
    return __bfloat162float(__ushort_as_bfloat16(static_cast<uint16_t>(src[0] | (src[1] << 8))));
  }
  // src 2-byte aligned.
  __device__ static float load_aligned_scale(const uint8_t* src) {
    return __bfloat162float(__ushort_as_bfloat16(*reinterpret_cast<const uint16_t*>(src)));
  }
};

// QKV: scale = max(amax / 448, 1e-6) (fp32, stored as is), q = e4m3(x / scale).
struct QkvFormat {
  static constexpr int kScaleBytes = kQkvScaleBytes;
  __device__ static float scale(float amax) { return cuda::nan_max(amax / kFp8Max, 1e-6f); }
  struct Quantizer {
    float scale;
    __device__ float operator()(float v) const { return __fdiv_rn(v, scale); }
  };
  __device__ static Quantizer quantizer(float scale) { return {scale}; }

  // x / scale must round as one IEEE division, as the reference's does, and
  // div.rn costs ~10 instructions per value: a reciprocal estimate of the
  // divisor refined by two FMAs, an FMA product, an FMA remainder, an FMA
  // correction, and a range check that sends extreme exponents to a slow path.
  // For a row's fixed divisor, RowQuantizer refines the reciprocal once and
  // runs the last three steps per value (a multiply, two FMAs). That sequence
  // returns the correctly rounded quotient for every scale this format produces
  // up to 2^64 and every bf16 significand of x, for any reciprocal estimate
  // within 8 ulps (rcp.approx is within 1): checked exhaustively on the host
  // (kernels/NOTES.md, v6). |x| >= scale * 2^-11 keeps every operand and
  // intermediate far from underflow, where that check carries over by exact
  // power-of-two scaling. A smaller |x| has |x / scale| < 2^-11, below half of
  // e4m3's least subnormal (2^-9): it rounds to a zero with x's sign, and so
  // does the product x * rcp, which keeps that sign (the FMAs would turn -0
  // into +0).
  struct RowQuantizer {
    float scale, rcp, tiny;
    __device__ float operator()(float v) const {
      const float q0 = v * rcp;
      return fabsf(v) >= tiny ? __fmaf_rn(rcp, __fmaf_rn(-scale, q0, v), q0) : q0;
    }
  };
  // Calls f with the quantizer of a row; rows with an inf, NaN or huge amax
  // divide with div.rn.
  template <class F>
  __device__ static void with_row_quantizer(float scale, const F& f) {
    if (scale <= 0x1p64f) {  // false for NaN
      float r0;
      asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(scale));
      f(RowQuantizer{scale, __fmaf_rn(r0, __fmaf_rn(-scale, r0, 1.f), r0), scale * 0x1p-11f});
    } else {
      f(quantizer(scale));
    }
  }
  __device__ static void store_scale(uint8_t* dst, float scale) {
    const uint32_t bits = __float_as_uint(scale);
    if (reinterpret_cast<uintptr_t>(dst) % 4 == 0) {
      *reinterpret_cast<uint32_t*>(dst) = bits;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) dst[i] = (bits >> (8 * i)) & 0xff;
    }
  }
  __device__ static float load_scale(const uint8_t* src) {
    return __uint_as_float(src[0] | (src[1] << 8) | (src[2] << 16) | (static_cast<uint32_t>(src[3]) << 24));
  }
  // src 4-byte aligned.
  __device__ static float load_aligned_scale(const uint8_t* src) {
    return __uint_as_float(*reinterpret_cast<const uint32_t*>(src));
  }
};

// ---- where the bf16 row of record r lives (element offsets) ------------------

// Row maps do their index arithmetic in the type of the record index: the
// staged kernels pass uint32_t (they run only when the record count fits, and
// a 64-bit division costs ~60 instructions on the way to a row's first load),
// the long-row kernels int64_t. They return a 64-bit element offset.
struct ContiguousRows {
  template <typename I>
  __device__ int64_t operator()(I r, int64_t D) const { return static_cast<int64_t>(r) * D; }
};

// n / d as a multiply-high and a shift (Granlund & Montgomery 1994, fig. 4.1;
// the same scheme as ATen's IntDivider): exact for n < 2^31, where t + n below
// cannot overflow. A runtime 32-bit division is ~20 instructions, and the QKV
// row map needs three per record, ahead of the record's first load.
struct FastDiv {
  uint32_t magic = 1;
  uint32_t shift = 0;

  static FastDiv make(uint64_t d) {
    FastDiv f;
    if (d <= 1 || d > INT32_MAX) return f;  // d = 1; a larger d never reaches the 32-bit maps
    while ((uint64_t{1} << f.shift) < d) ++f.shift;
    f.magic = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << f.shift) - d)) / d + 1);
    return f;
  }
  __device__ uint32_t div(uint32_t n) const { return (__umulhi(n, magic) + n) >> shift; }
};

// r / d, and r % d into *rem: through FastDiv for the 32-bit indices of the
// common case, by division for the 64-bit ones of tensors past 2^31 rows.
template <typename I>
__device__ __forceinline__ I div_mod(I r, uint32_t d, const FastDiv& fast, I* rem) {
  if constexpr (std::is_same_v<I, uint32_t>) {
    const uint32_t q = fast.div(r);
    *rem = r - q * d;
    return q;
  } else {
    *rem = r % d;
    return r / d;
  }
}

// Send side of the Ulysses all-to-all: record r is in [P, S, B, N] order and
// reads x[b, s, p, n, :] through x's B/S/P strides.
struct QkvSendRows {
  uint32_t S, B, N;
  FastDiv div_s, div_b, div_n;
  int64_t stride_b, stride_s, stride_p;
  template <typename I>
  __device__ int64_t operator()(I r, int64_t D) const {
    I n, b, s;
    const I p = div_mod(div_mod(div_mod(r, N, div_n, &n), B, div_b, &b), S, div_s, &s);
    return b * stride_b + s * stride_s + p * stride_p + static_cast<int64_t>(n) * D;
  }
};

// Receive side: record r is in [S, B, N] order and lands in out[b, s, n, :] of
// a contiguous [B, S, N, D] tensor.
struct QkvRecvRows {
  uint32_t S, B, N;
  FastDiv div_b, div_n;
  template <typename I>
  __device__ int64_t operator()(I r, int64_t D) const {
    I n, b;
    const I s = div_mod(div_mod(r, N, div_n, &n), B, div_b, &b);
    return ((static_cast<int64_t>(b) * S + s) * N + n) * D;
  }
};

// ---- per-pack arithmetic ----------------------------------------------------------
// These ops are memory-bound only if the per-element work stays a few
// instructions: amax runs on bf16x2 pairs (abs and max are exact in bf16, and
// __hmax2_nan keeps NaN), conversions go two values at a time.

__device__ __forceinline__ __nv_bfloat162 pack_amax(const Pack<bf16, kPack>& v, __nv_bfloat162 m) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(v.e);
#pragma unroll
  for (int i = 0; i < kPack / 2; ++i) m = __hmax2_nan(m, __habs2(h[i]));
  return m;
}

__device__ __forceinline__ float amax_of(__nv_bfloat162 m) {
  return cuda::nan_max(__low2float(m), __high2float(m));
}

__device__ __forceinline__ const Pack<bf16, kPack>& as_pack(const uint4& u) {
  return *reinterpret_cast<const Pack<bf16, kPack>*>(&u);
}

// 8 bf16 values -> 8 e4m3 bytes (little-endian in a uint64). bf16 -> fp32 is
// a 16-bit shift, done here on the pair's word (two instructions per pair
// rather than three), and the byte pairs are joined with byte permutes.
template <class Quantizer>
__device__ __forceinline__ uint64_t quantize_pack(const Pack<bf16, kPack>& v, const Quantizer& q) {
  const auto* w = reinterpret_cast<const uint32_t*>(v.e);
  uint32_t b[kPack / 2];
#pragma unroll
  for (int i = 0; i < kPack / 2; ++i) {
    const float lo = __uint_as_float(w[i] << 16);
    const float hi = __uint_as_float(w[i] & 0xffff0000u);
    b[i] = __nv_cvt_float2_to_fp8x2(make_float2(q(lo), q(hi)), __NV_SATFINITE, __NV_E4M3);
  }
  return __byte_perm(b[0], b[1], 0x5410) | (static_cast<uint64_t>(__byte_perm(b[2], b[3], 0x5410)) << 32);
}

// 8 e4m3 bytes -> 8 bf16 values, y = bf16(float(q) * scale). e4m3 -> f16 is
// exact, so going through half2 gives the same floats as a direct conversion.
__device__ __forceinline__ Pack<bf16, kPack> dequantize_pack(uint64_t bytes, float scale) {
  Pack<bf16, kPack> o;
  auto* h = reinterpret_cast<__nv_bfloat162*>(o.e);
#pragma unroll
  for (int i = 0; i < kPack / 2; ++i) {
    const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(bytes >> (16 * i)), __NV_E4M3);
    const float2 f = __half22float2(__half2(r));
    h[i] = __floats2bfloat162_rn(f.x * scale, f.y * scale);
  }
  return o;
}

// Reads 8 bytes (or the n < 8 that remain) at p with the widest loads its
// alignment allows.
__device__ __forceinline__ uint64_t load_bytes(const uint8_t* p, int n) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (n == 8 && a % 8 == 0) return *reinterpret_cast<const uint64_t*>(p);
  if (n == 8 && a % 4 == 0) {
    return reinterpret_cast<const uint32_t*>(p)[0] |
           (static_cast<uint64_t>(reinterpret_cast<const uint32_t*>(p)[1]) << 32);
  }
  uint64_t v = 0;
  if (n == 8 && a % 2 == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) v |= static_cast<uint64_t>(reinterpret_cast<const uint16_t*>(p)[i]) << (16 * i);
    return v;
  }
  for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

// ---- shared <-> global copies of a contiguous byte range ---------------------

// smem + a and g have the same address mod 16 (a = g % 16), so the aligned
// body of the range moves as uint4 on both sides.
__device__ __forceinline__ void copy_global_to_smem(uint8_t* smem, const uint8_t* g, int a,
                                                    int64_t n) {
  const int64_t head = n < ((16 - a) & 15) ? n : ((16 - a) & 15);
  const int64_t body = (n - head) / 16;
  for (int64_t i = threadIdx.x; i < head; i += blockDim.x) smem[a + i] = g[i];
  const auto* gv = reinterpret_cast<const uint4*>(g + head);
  auto* sv = reinterpret_cast<uint4*>(smem + a + head);
  // Four loads in flight per thread before their stores: the copy is the only
  // HBM traffic of the dequant kernels, so memory-level parallelism matters.
  int64_t i = threadIdx.x;
  for (; i + 3 * blockDim.x < body; i += 4 * blockDim.x) {
    const uint4 v0 = gv[i], v1 = gv[i + blockDim.x], v2 = gv[i + 2 * blockDim.x],
                v3 = gv[i + 3 * blockDim.x];
    sv[i] = v0;
    sv[i + blockDim.x] = v1;
    sv[i + 2 * blockDim.x] = v2;
    sv[i + 3 * blockDim.x] = v3;
  }
  for (; i < body; i += blockDim.x) sv[i] = gv[i];
  for (int64_t j = head + body * 16 + threadIdx.x; j < n; j += blockDim.x) smem[a + j] = g[j];
}

// The mirror image: smem + a and g have the same address mod 16 (a = g % 16).
__device__ __forceinline__ void copy_smem_to_global(uint8_t* g, const uint8_t* smem, int a, int n) {
  const int head = min(n, (16 - a) & 15);
  const int body = (n - head) / 16;
  const int tail = head + body * 16;
  if (static_cast<int>(threadIdx.x) < head) g[threadIdx.x] = smem[a + threadIdx.x];
  if (tail + static_cast<int>(threadIdx.x) < n) g[tail + threadIdx.x] = smem[a + tail + threadIdx.x];
  const auto* sv = reinterpret_cast<const uint4*>(smem + a + head);
  auto* gv = reinterpret_cast<uint4*>(g + head);
  for (int i = threadIdx.x; i < body; i += kThreads) gv[i] = sv[i];
}

// ---- quantization ------------------------------------------------------------

struct QuantParams {
  const bf16* x;
  uint8_t* out;  // records, contiguous
  int64_t rows, D;
  int log2_tpr;  // threads per row (<= 32, so a row's reduction stays in a warp)
};

// Stores the low n (<= 8) bytes of v at shared-memory dst in pieces of `align`
// bytes. The caller passes one alignment for the whole launch (it divides every
// record's address): a warp holds rows of different alignments, and choosing
// per thread would run each width the warp holds, one after the other.
__device__ __forceinline__ void store_smem_bytes(uint8_t* dst, uint64_t v, int n, int align) {
  if (n == 8 && align == 8) {
    *reinterpret_cast<uint64_t*>(dst) = v;
  } else if (n == 8 && align == 4) {
    reinterpret_cast<uint32_t*>(dst)[0] = static_cast<uint32_t>(v);
    reinterpret_cast<uint32_t*>(dst)[1] = static_cast<uint32_t>(v >> 32);
  } else if (n == 8 && align == 2) {
#pragma unroll
    for (int i = 0; i < 4; ++i) reinterpret_cast<uint16_t*>(dst)[i] = static_cast<uint16_t>(v >> (16 * i));
  } else {
    for (int i = 0; i < n; ++i) dst[i] = static_cast<uint8_t>(v >> (8 * i));
  }
}

// Block = kThreads / tpr row groups x ROWS rows each, one tile of consecutive
// records. Every thread loads CHUNKS packs of each of its rows into registers
// (all loads in flight before the first use), the row's amax is reduced across
// its tpr lanes, and the quantized bytes and the scale go to the tile's records
// in shared memory, laid out at the same address mod 16 as in global memory.
// After one barrier the block writes its whole record range with 16-byte stores:
// storing records straight from registers needs 2- or 4-byte global stores
// (rows are D + 2 or D + 4 bytes), which capped this op at ~50% of copy
// bandwidth. Rows per tile: D <= 2048, so a tile is at most ~16 KiB of records.
//
// MIN_BLOCKS: blocks per SM the registers must allow (0: no bound, ptxas
// chooses; it takes 64 registers at D = 128, which caps the SM at 4 blocks).
template <class Format, class RowMap, int CHUNKS, int ROWS, bool VECTOR, int MIN_BLOCKS>
__global__ void __launch_bounds__(kThreads, MIN_BLOCKS) fp8_quant_tile_kernel(const QuantParams p, const RowMap map) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int tpr = 1 << p.log2_tpr;
  const int lane = threadIdx.x & (tpr - 1);
  const int group = threadIdx.x >> p.log2_tpr;
  const int groups = kThreads >> p.log2_tpr;
  const int D = static_cast<int>(p.D);
  const int rec = D + Format::kScaleBytes;
  const int rows_per_block = groups * ROWS;
  // Record addresses are out + row * rec, so the lowest set bit of out | rec
  // (at most 8) divides all of them, in global and, by the layout, in shared memory.
  const int wide = static_cast<int>(reinterpret_cast<uintptr_t>(p.out)) | rec | 8;
  const int align = wide & -wide;

  for (int64_t row0 = static_cast<int64_t>(blockIdx.x) * rows_per_block; row0 < p.rows;
       row0 += static_cast<int64_t>(gridDim.x) * rows_per_block) {
    const int nrows = static_cast<int>(min(static_cast<int64_t>(rows_per_block), p.rows - row0));
    uint8_t* gdst = p.out + row0 * rec;
    const int a = static_cast<int>(reinterpret_cast<uintptr_t>(gdst) & 15);

    // All loads first, then their first use: reducing a pack between two loads
    // makes each load wait for the one before it. Packs stay as four 32-bit
    // words (bf16 pairs); held as bf16 elements, they get split into 16-bit
    // registers and merged again.
    uint4 v[ROWS][CHUNKS];
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      const int r = i * groups + group;
      // A thread past the tile's last row still joins the shuffles; it reads
      // row 0 (always valid) and writes nothing.
      const bf16* src = p.x + (r < nrows ? map(static_cast<uint32_t>(row0 + r), p.D) : 0);
#pragma unroll
      for (int k = 0; k < CHUNKS; ++k) {
        const int c = lane + k * tpr;
        v[i][k] = make_uint4(0, 0, 0, 0);
        if (VECTOR) {
          if (c * kPack < D) v[i][k] = reinterpret_cast<const uint4*>(src)[c];
        } else {
          auto* e = reinterpret_cast<bf16*>(&v[i][k]);
#pragma unroll
          for (int j = 0; j < kPack; ++j) {
            if (c * kPack + j < D) e[j] = src[c * kPack + j];
          }
        }
      }
    }
    __nv_bfloat162 m[ROWS];
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      m[i] = __float2bfloat162_rn(0.f);
#pragma unroll
      for (int k = 0; k < CHUNKS; ++k) m[i] = pack_amax(as_pack(v[i][k]), m[i]);
    }
    // max over bf16 pairs: the same value as the fp32 max of the converted
    // halves, and a NaN anywhere in the row is the canonical NaN either way.
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      for (int off = tpr >> 1; off > 0; off >>= 1) m[i] = __hmax2_nan(m[i], __shfl_xor_sync(0xffffffffu, m[i], off));
    }

#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      const int r = i * groups + group;
      if (r >= nrows) continue;
      const float scale = Format::scale(amax_of(m[i]));
      uint8_t* srec = smem + a + r * rec;
      Format::with_row_quantizer(scale, [&](const auto& q) {
#pragma unroll
        for (int k = 0; k < CHUNKS; ++k) {
          const int c = lane + k * tpr;
          if (c * kPack >= D) break;
          store_smem_bytes(srec + c * kPack, quantize_pack(as_pack(v[i][k]), q), min(kPack, D - c * kPack), align);
        }
      });
      if (lane == 0) Format::store_scale(srec + D, scale);
    }
    __syncthreads();
    copy_smem_to_global(gdst, smem, a, nrows * rec);
    __syncthreads();  // the next tile reuses smem
  }
}

// Stores the low n (<= 8) bytes of v at dst with the widest accesses dst's
// alignment allows: record rows are D + 2 or D + 4 bytes long, so a thread's
// 8 payload bytes are usually only 2- or 4-byte aligned.
__device__ __forceinline__ void store_bytes(uint8_t* dst, uint64_t v, int n) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst);
  if (n == 8 && a % 8 == 0) {
    *reinterpret_cast<uint64_t*>(dst) = v;
  } else if (n == 8 && a % 4 == 0) {
    reinterpret_cast<uint32_t*>(dst)[0] = static_cast<uint32_t>(v);
    reinterpret_cast<uint32_t*>(dst)[1] = static_cast<uint32_t>(v >> 32);
  } else if (n == 8 && a % 2 == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) reinterpret_cast<uint16_t*>(dst)[i] = static_cast<uint16_t>(v >> (16 * i));
  } else {
    for (int i = 0; i < n; ++i) dst[i] = static_cast<uint8_t>(v >> (8 * i));
  }
}

// Block = kThreads / tpr row groups x ROWS rows each; every thread holds
// CHUNKS packs of each of its rows in registers, so all of its loads are in
// flight before the first reduction, and writes its bytes straight to the
// record. Kept for 2048 < D <= 4096 (16 packs per thread), beyond the tile
// kernel's configurations.
template <class Format, class RowMap, int CHUNKS, int ROWS, bool VECTOR>
__global__ void __launch_bounds__(kThreads) fp8_quant_kernel(const QuantParams p, const RowMap map) {
  const int tpr = 1 << p.log2_tpr;
  const int lane = threadIdx.x & (tpr - 1);
  const int group = threadIdx.x >> p.log2_tpr;
  const int groups = kThreads >> p.log2_tpr;
  const int64_t rec = p.D + Format::kScaleBytes;
  const int64_t rows_per_block = static_cast<int64_t>(groups) * ROWS;

  for (int64_t row0 = blockIdx.x * rows_per_block; row0 < p.rows;
       row0 += static_cast<int64_t>(gridDim.x) * rows_per_block) {
    Pack<bf16, kPack> v[ROWS][CHUNKS];
    float amax[ROWS];
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      const int64_t row = row0 + static_cast<int64_t>(i) * groups + group;
      // A thread past the last row still joins the shuffles; it reads row 0
      // (always valid) and writes nothing.
      const bf16* src = p.x + (row < p.rows ? map(static_cast<uint32_t>(row), p.D) : 0);
      __nv_bfloat162 m = __float2bfloat162_rn(0.f);
#pragma unroll
      for (int k = 0; k < CHUNKS; ++k) {
        const int64_t c = lane + static_cast<int64_t>(k) * tpr;
        if (VECTOR && c * kPack < p.D) {
          v[i][k] = reinterpret_cast<const Pack<bf16, kPack>*>(src)[c];
        } else {
#pragma unroll
          for (int e = 0; e < kPack; ++e) {
            const int64_t d = c * kPack + e;
            v[i][k].e[e] = d < p.D ? src[d] : __float2bfloat16_rn(0.f);
          }
        }
        m = pack_amax(v[i][k], m);
      }
      amax[i] = amax_of(m);
    }
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      for (int off = tpr >> 1; off > 0; off >>= 1) {
        amax[i] = cuda::nan_max(amax[i], __shfl_xor_sync(0xffffffffu, amax[i], off));
      }
    }

#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      const int64_t row = row0 + static_cast<int64_t>(i) * groups + group;
      if (row >= p.rows) continue;
      const float scale = Format::scale(amax[i]);
      const auto q = Format::quantizer(scale);
      uint8_t* drow = p.out + row * rec;
#pragma unroll
      for (int k = 0; k < CHUNKS; ++k) {
        const int64_t c = lane + static_cast<int64_t>(k) * tpr;
        if (c * kPack >= p.D) break;
        const uint64_t bytes = quantize_pack(v[i][k], q);
        store_bytes(drow + c * kPack, bytes, static_cast<int>(p.D - c * kPack < kPack ? p.D - c * kPack : kPack));
      }
      if (lane == 0) Format::store_scale(drow + p.D, scale);
    }
  }
}

// One block per row, row read twice (amax, then conversion): for rows too long
// to keep in registers.
template <class Format, class RowMap>
__global__ void __launch_bounds__(kThreads) fp8_quant_long_rows_kernel(const QuantParams p, const RowMap map) {
  __shared__ float warp_amax[kThreads / 32];
  const int64_t rec = p.D + Format::kScaleBytes;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const bf16* src = p.x + map(row, p.D);
    float amax = 0.f;
    for (int64_t d = threadIdx.x; d < p.D; d += blockDim.x) amax = cuda::nan_max(amax, fabsf(__bfloat162float(src[d])));
    for (int off = 16; off > 0; off >>= 1) amax = cuda::nan_max(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    if ((threadIdx.x & 31) == 0) warp_amax[threadIdx.x >> 5] = amax;
    __syncthreads();
    amax = 0.f;
    for (int w = 0; w < kThreads / 32; ++w) amax = cuda::nan_max(amax, warp_amax[w]);
    const float scale = Format::scale(amax);
    const auto q = Format::quantizer(scale);
    uint8_t* dst = p.out + row * rec;
    for (int64_t d = threadIdx.x; d < p.D; d += blockDim.x) {
      dst[d] = __nv_cvt_float_to_fp8(q(__bfloat162float(src[d])), __NV_SATFINITE, __NV_E4M3);
    }
    if (threadIdx.x == 0) Format::store_scale(dst + p.D, scale);
    __syncthreads();  // warp_amax is reused by the next row
  }
}

template <class Format, class RowMap, int CHUNKS, int ROWS>
void launch_quant(const QuantParams& p, const RowMap& map, bool vector, cudaStream_t stream) {
  const int groups = kThreads >> p.log2_tpr;
  const int64_t rows_per_block = static_cast<int64_t>(groups) * ROWS;
  const int64_t blocks = std::min<int64_t>(cuda::ceil_div(p.rows, rows_per_block), INT32_MAX);
  if (vector) {
    fp8_quant_kernel<Format, RowMap, CHUNKS, ROWS, true><<<blocks, kThreads, 0, stream>>>(p, map);
  } else {
    fp8_quant_kernel<Format, RowMap, CHUNKS, ROWS, false><<<blocks, kThreads, 0, stream>>>(p, map);
  }
}

template <class Format, class RowMap, int CHUNKS, int ROWS>
void launch_quant_tile(QuantParams p, int tpr, const RowMap& map, bool vector, cudaStream_t stream) {
  p.log2_tpr = __builtin_ctz(tpr);
  const int64_t rows_per_block = static_cast<int64_t>(kThreads / tpr) * ROWS;
  // + 16: the records sit at their global address mod 16.
  const size_t smem = static_cast<size_t>(rows_per_block * (p.D + Format::kScaleBytes)) + 16;
  const int64_t blocks = std::min<int64_t>(cuda::ceil_div(p.rows, rows_per_block), INT32_MAX);
  // Six blocks per SM for the per-token records at four packs per thread:
  // 40 registers, no spills, and at the Wan shapes 86% (per rank) and 99%
  // (H = 40) of copy bandwidth against 78% and 86% at 64 registers and four
  // blocks (kernels/NOTES.md, H200). The QKV records spill at that bound.
  constexpr int kMinBlocks = std::is_same_v<Format, PerTokenFormat> && CHUNKS == 4 && ROWS == 1 ? 6 : 0;
  if (vector) {
    fp8_quant_tile_kernel<Format, RowMap, CHUNKS, ROWS, true, kMinBlocks><<<blocks, kThreads, smem, stream>>>(p, map);
  } else {
    fp8_quant_tile_kernel<Format, RowMap, CHUNKS, ROWS, false, 0><<<blocks, kThreads, smem, stream>>>(p, map);
  }
}

template <class Format, class RowMap>
void quantize_rows(const bf16* x, uint8_t* out, int64_t rows, int64_t D, const RowMap& map,
                   bool vector, cudaStream_t stream) {
  QuantParams p{x, out, rows, D, 0};
  const int64_t packs = cuda::ceil_div(D, kPack);
  const bool huge = rows > INT32_MAX;  // record indices must fit the 32-bit row maps
  // Tiles keep four 16-byte loads in flight per thread: four rows of one pack
  // while a row has at most four packs, then four packs of one row (per-row
  // work, the row map and the scale, spread over more bytes).
  if (huge) {
    const int64_t blocks = std::min<int64_t>(rows, INT32_MAX);
    fp8_quant_long_rows_kernel<Format, RowMap><<<blocks, kThreads, 0, stream>>>(p, map);
  } else if (packs <= 4) {  // D <= 32
    launch_quant_tile<Format, RowMap, 1, 4>(p, cuda::threads_per_row(packs, 1), map, vector, stream);
  } else if (packs <= 4 * 32) {  // D <= 1024
    launch_quant_tile<Format, RowMap, 4, 1>(p, cuda::threads_per_row(packs, 4), map, vector, stream);
  } else if (packs <= 8 * 32) {  // D <= 2048
    launch_quant_tile<Format, RowMap, 8, 1>(p, 32, map, vector, stream);
  } else if (packs <= kMaxRegisterChunks * 32) {  // D <= 4096
    p.log2_tpr = 5;
    launch_quant<Format, RowMap, kMaxRegisterChunks, 1>(p, map, vector, stream);
  } else {
    const int64_t blocks = std::min<int64_t>(rows, INT32_MAX);
    fp8_quant_long_rows_kernel<Format, RowMap><<<blocks, kThreads, 0, stream>>>(p, map);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---- dequantization ------------------------------------------------------------

struct DequantParams {
  const uint8_t* in;  // records, contiguous
  bf16* out;
  int64_t rows, D;
  int log2_tpr;
  int rows_per_thread;
};

template <class Format, class RowMap, bool VECTOR>
__global__ void __launch_bounds__(kThreads) fp8_dequant_kernel(const DequantParams p, const RowMap map) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int tpr = 1 << p.log2_tpr;
  const int lane = threadIdx.x & (tpr - 1);
  const int group = threadIdx.x >> p.log2_tpr;
  const int groups = kThreads >> p.log2_tpr;
  const int64_t rec = p.D + Format::kScaleBytes;
  const int64_t rows_per_block = static_cast<int64_t>(groups) * p.rows_per_thread;

  for (int64_t row0 = blockIdx.x * rows_per_block; row0 < p.rows;
       row0 += static_cast<int64_t>(gridDim.x) * rows_per_block) {
    const int64_t nrows = min(rows_per_block, p.rows - row0);
    const uint8_t* gsrc = p.in + row0 * rec;
    const int a = reinterpret_cast<uintptr_t>(gsrc) & 15;
    copy_global_to_smem(smem, gsrc, a, nrows * rec);
    __syncthreads();
    for (int64_t r = group; r < nrows; r += groups) {
      const uint8_t* srow = smem + a + r * rec;
      const float scale = Format::load_scale(srow + p.D);
      bf16* dst = p.out + map(static_cast<uint32_t>(row0 + r), p.D);
      for (int64_t c = lane; c * kPack < p.D; c += tpr) {
        const int n = static_cast<int>(p.D - c * kPack < kPack ? p.D - c * kPack : kPack);
        const Pack<bf16, kPack> o = dequantize_pack(load_bytes(srow + c * kPack, n), scale);
        if (VECTOR) {
          reinterpret_cast<Pack<bf16, kPack>*>(dst)[c] = o;
        } else {
          for (int e = 0; e < n; ++e) dst[c * kPack + e] = o.e[e];
        }
      }
    }
    __syncthreads();
  }
}

// No staging (D % 8 == 0, records 16-byte aligned, fewer than 2^31 packs):
// a warp dequantizes 32 consecutive packs (pack g = row * P + c, its 8 bytes
// at row * rec + 8c). The lanes load the 16-byte aligned chunks that cover the
// warp's bytes (at most 26: 32 packs and the scales between them), one chunk
// per lane; each lane then takes its pack's 8 bytes out of the two chunks that
// hold them with shuffles. Every global load is an aligned 16-byte vector, no
// barrier, and a warp's stores are 32 consecutive packs. kLog2P >= 0 when
// P = 2^kLog2P divides 32: a warp's packs are then whole rows, so row and
// column are shifts and the lane offsets 32-bit (10% fewer instructions than
// through FastDiv, measured); -1 for any other P.
template <class Format, class RowMap, int kLog2P>
__global__ void __launch_bounds__(kThreads) fp8_dequant_shfl_kernel(const DequantParams p, const RowMap map,
                                                                    uint32_t P, FastDiv div_p,
                                                                    uint32_t total_packs, uint64_t total_bytes) {
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  const uint32_t g0 = ((blockIdx.x * kThreads + threadIdx.x) >> 5) * 32u;
  if (g0 >= total_packs) return;  // the same for the whole warp
  const uint64_t rec = static_cast<uint64_t>(p.D) + Format::kScaleBytes;
  // Row of pack g; its column goes to *c.
  auto split = [&](uint32_t g, uint32_t* c) {
    if constexpr (kLog2P >= 0) {
      *c = g & ((1u << kLog2P) - 1);
      return g >> kLog2P;
    } else {
      return div_mod(g, P, div_p, c);
    }
  };
  auto start = [&](uint32_t g) {
    uint32_t c;
    const uint32_t r = split(g, &c);
    return static_cast<uint64_t>(r) * rec + 8 * c;
  };
  const uint32_t g = min(g0 + lane, total_packs - 1);
  const uint64_t base = start(g0) & ~uint64_t{15};
  const uint64_t end = start(min(g0 + 31, total_packs - 1)) + 8;
  const uint64_t at = base + 16 * static_cast<uint64_t>(lane);
  uint4 chunk = make_uint4(0, 0, 0, 0);
  if (at + 16 <= total_bytes && at < end) {
    chunk = *reinterpret_cast<const uint4*>(p.in + at);
  } else if (at < end) {  // the buffer's last chunk, cut short
    uint8_t b[16] = {};
    for (uint64_t i = at; i < total_bytes; ++i) b[i - at] = p.in[i];
    memcpy(&chunk, b, 16);
  }
  uint32_t c;
  const uint32_t row = split(g, &c);
  // One load, not one per byte: with p.in 16-byte aligned and D % 8 == 0, the
  // scale at row * (D + kScaleBytes) + D is kScaleBytes-aligned.
  const float scale = Format::load_aligned_scale(p.in + static_cast<uint64_t>(row) * rec + p.D);
  uint32_t rel;
  if constexpr (kLog2P >= 0) {  // g0 starts a row (P divides 32): no 64-bit offsets per lane
    rel = (row - (g0 >> kLog2P)) * static_cast<uint32_t>(rec) + 8 * c + static_cast<uint32_t>(start(g0) & 15);
  } else {
    rel = static_cast<uint32_t>(static_cast<uint64_t>(row) * rec + 8 * c - base);
  }
  const int src = static_cast<int>(rel >> 4), off = static_cast<int>(rel & 15);
  const uint32_t w0 = __shfl_sync(kAll, chunk.x, src), w1 = __shfl_sync(kAll, chunk.y, src),
                 w2 = __shfl_sync(kAll, chunk.z, src), w3 = __shfl_sync(kAll, chunk.w, src),
                 w4 = __shfl_sync(kAll, chunk.x, src + 1), w5 = __shfl_sync(kAll, chunk.y, src + 1);
  const int wi = off >> 2;
  const uint32_t x0 = wi == 0 ? w0 : wi == 1 ? w1 : wi == 2 ? w2 : w3;
  const uint32_t x1 = wi == 0 ? w1 : wi == 1 ? w2 : wi == 2 ? w3 : w4;
  const uint32_t x2 = wi == 0 ? w2 : wi == 1 ? w3 : wi == 2 ? w4 : w5;
  const uint32_t sh = (off & 3) * 8;
  const uint64_t bytes = __funnelshift_r(x0, x1, sh) | (static_cast<uint64_t>(__funnelshift_r(x1, x2, sh)) << 32);
  if (g0 + lane < total_packs) {
    reinterpret_cast<Pack<bf16, kPack>*>(p.out + map(row, p.D))[c] = dequantize_pack(bytes, scale);
  }
}

// Rows too long to stage a block's worth of records in shared memory.
template <class Format, class RowMap>
__global__ void __launch_bounds__(kThreads) fp8_dequant_long_rows_kernel(const DequantParams p, const RowMap map) {
  const int64_t rec = p.D + Format::kScaleBytes;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const uint8_t* src = p.in + row * rec;
    const float scale = Format::load_scale(src + p.D);
    bf16* dst = p.out + map(row, p.D);
    for (int64_t d = threadIdx.x; d < p.D; d += blockDim.x) {
      __nv_fp8_e4m3 q;
      q.__x = src[d];
      dst[d] = __float2bfloat16_rn(static_cast<float>(q) * scale);
    }
  }
}

template <class Format, class RowMap>
void dequantize_rows(const uint8_t* in, bf16* out, int64_t rows, int64_t D, const RowMap& map,
                     bool vector, cudaStream_t stream) {
  DequantParams p{in, out, rows, D, 0, 1};
  const int64_t packs = cuda::ceil_div(D, kPack);
  const int tpr = cuda::threads_per_row(packs, 4);
  p.log2_tpr = __builtin_ctz(tpr);
  const int groups = kThreads / tpr;
  // Stage ~16 KiB of records per block, so each thread has four 16-byte loads
  // in flight: the staging copy is all the HBM traffic these kernels read.
  const int64_t rec = D + Format::kScaleBytes;
  p.rows_per_thread = static_cast<int>(std::clamp<int64_t>(cuda::ceil_div(16384, groups * rec), 1, 16));
  const size_t smem = static_cast<size_t>(groups) * p.rows_per_thread * rec + 16;
  // Realigned in registers where the records allow it (16-byte aligned,
  // fewer than 2^31 packs), one group of 32 packs per warp: on an H100 79% of
  // copy at Wan per rank against 75-77% staged, 84% against 79-81% at H = 40,
  // 75% against 57-59% at FLUX per rank; four groups per warp lost to staging
  // (bench/results/2026-12-06-h100-fence-answered-direct-dequant.md).
  const int64_t total_packs = rows * packs;
  if (vector && cuda::is_aligned(in, 16) && total_packs < INT32_MAX) {
    const auto blocks = static_cast<unsigned>(cuda::ceil_div(total_packs, int64_t{kThreads}));
    const auto launch = [&](auto log2p) {
      fp8_dequant_shfl_kernel<Format, RowMap, decltype(log2p)::value><<<blocks, kThreads, 0, stream>>>(
          p, map, static_cast<uint32_t>(packs), FastDiv::make(packs), static_cast<uint32_t>(total_packs),
          static_cast<uint64_t>(rows) * rec);
    };
    switch (packs) {  // D = 64, 128, 256: every head size in use
      case 8: launch(std::integral_constant<int, 3>{}); break;
      case 16: launch(std::integral_constant<int, 4>{}); break;
      case 32: launch(std::integral_constant<int, 5>{}); break;
      default: launch(std::integral_constant<int, -1>{});
    }
  } else if (smem > 48 * 1024 || rows > INT32_MAX) {
    const int64_t blocks = std::min<int64_t>(rows, INT32_MAX);
    fp8_dequant_long_rows_kernel<Format, RowMap><<<blocks, kThreads, 0, stream>>>(p, map);
  } else {
    const int64_t blocks =
        std::min<int64_t>(cuda::ceil_div(rows, static_cast<int64_t>(groups) * p.rows_per_thread), INT32_MAX);
    if (vector) {
      fp8_dequant_kernel<Format, RowMap, true><<<blocks, kThreads, smem, stream>>>(p, map);
    } else {
      fp8_dequant_kernel<Format, RowMap, false><<<blocks, kThreads, smem, stream>>>(p, map);
    }
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---- launchers: checks, device guard, current stream -----------------------------

const bf16* bf16_ptr(const at::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr()); }
bf16* bf16_ptr(at::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr()); }
const uint8_t* byte_ptr(const at::Tensor& t) { return static_cast<const uint8_t*>(t.data_ptr()); }
uint8_t* byte_ptr(at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

void per_token_quant_launcher(const at::Tensor& x, at::Tensor& out) {
  check_per_token_quant(x, &out);
  const int64_t D = x.size(-1);
  const int64_t rows = x.numel() / D;
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const bool vector = D % kPack == 0 && cuda::is_aligned(x.data_ptr(), 16);
  quantize_rows<PerTokenFormat>(bf16_ptr(x), byte_ptr(out), rows, D, ContiguousRows{}, vector,
                                at::cuda::getCurrentCUDAStream());
}

void per_token_dequant_launcher(const at::Tensor& x, at::Tensor& out) {
  check_per_token_dequant(x, &out);
  const int64_t D = x.size(-1) - kPerTokenScaleBytes;
  const int64_t rows = x.numel() / (D + kPerTokenScaleBytes);
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const bool vector = D % kPack == 0 && cuda::is_aligned(out.data_ptr(), 16);
  dequantize_rows<PerTokenFormat>(byte_ptr(x), bf16_ptr(out), rows, D, ContiguousRows{}, vector,
                                  at::cuda::getCurrentCUDAStream());
}

void qkv_permute_quant_launcher(const at::Tensor& x, at::Tensor& out) {
  check_qkv_permute_quant(x, &out);
  const int64_t B = x.size(0), S = x.size(1), P = x.size(2), N = x.size(3), D = x.size(4);
  const int64_t rows = P * S * B * N;
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const QkvSendRows map{static_cast<uint32_t>(S), static_cast<uint32_t>(B), static_cast<uint32_t>(N),
                        FastDiv::make(S), FastDiv::make(B), FastDiv::make(N),
                        x.stride(0), x.stride(1), x.stride(2)};
  const bool vector = D % kPack == 0 && cuda::is_aligned(x.data_ptr(), 16) &&
                      map.stride_b % kPack == 0 && map.stride_s % kPack == 0 &&
                      map.stride_p % kPack == 0;
  quantize_rows<QkvFormat>(bf16_ptr(x), byte_ptr(out), rows, D, map, vector,
                           at::cuda::getCurrentCUDAStream());
}

void qkv_permute_dequant_launcher(const at::Tensor& quant_x, at::Tensor& out) {
  check_qkv_permute_dequant(quant_x, &out);
  const int64_t S = quant_x.size(0), B = quant_x.size(1), N = quant_x.size(2);
  const int64_t D = quant_x.size(3) - kQkvScaleBytes;
  const int64_t rows = S * B * N;
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(quant_x.device());
  const bool vector = D % kPack == 0 && cuda::is_aligned(out.data_ptr(), 16);
  if (B == 1) {  // record r = s * N + n lands at row r: no row map to compute per lane
    dequantize_rows<QkvFormat>(byte_ptr(quant_x), bf16_ptr(out), rows, D, ContiguousRows{}, vector,
                               at::cuda::getCurrentCUDAStream());
    return;
  }
  const QkvRecvRows map{static_cast<uint32_t>(S), static_cast<uint32_t>(B), static_cast<uint32_t>(N),
                        FastDiv::make(B), FastDiv::make(N)};
  dequantize_rows<QkvFormat>(byte_ptr(quant_x), bf16_ptr(out), rows, D, map, vector,
                             at::cuda::getCurrentCUDAStream());
}

at::Tensor empty_like_shape(const std::vector<c10::SymInt>& shape, const at::Tensor& like,
                            at::ScalarType dtype) {
  return at::empty_symint(shape, like.options().dtype(dtype));
}

}  // namespace

// ---- entry points --------------------------------------------------------------

at::Tensor fp8_comm_per_token_quant_out(const at::Tensor& x, at::Tensor& out) {
  per_token_quant_launcher(x, out);
  return out;
}

at::Tensor fp8_comm_per_token_quant(const at::Tensor& x) {
  check_per_token_quant(x, nullptr);
  at::Tensor out = empty_like_shape(per_token_quant_shape(x), x, at::kFloat8_e4m3fn);
  per_token_quant_launcher(x, out);
  return out;
}

at::Tensor fp8_comm_per_token_dequant_out(const at::Tensor& x, at::Tensor& out) {
  per_token_dequant_launcher(x, out);
  return out;
}

at::Tensor fp8_comm_per_token_dequant(const at::Tensor& x) {
  check_per_token_dequant(x, nullptr);
  at::Tensor out = empty_like_shape(per_token_dequant_shape(x), x, at::kBFloat16);
  per_token_dequant_launcher(x, out);
  return out;
}

at::Tensor fp8_comm_qkv_permute_quant_out(const at::Tensor& x, at::Tensor& out) {
  qkv_permute_quant_launcher(x, out);
  return out;
}

at::Tensor fp8_comm_qkv_permute_quant(const at::Tensor& x) {
  check_qkv_permute_quant(x, nullptr);
  at::Tensor out = empty_like_shape(qkv_permute_quant_shape(x), x, at::kFloat8_e4m3fn);
  qkv_permute_quant_launcher(x, out);
  return out;
}

at::Tensor fp8_comm_qkv_permute_dequant_out(const at::Tensor& quant_x, at::Tensor& out) {
  qkv_permute_dequant_launcher(quant_x, out);
  return out;
}

at::Tensor fp8_comm_qkv_permute_dequant(const at::Tensor& quant_x) {
  check_qkv_permute_dequant(quant_x, nullptr);
  at::Tensor out = empty_like_shape(qkv_permute_dequant_shape(quant_x), quant_x, at::kBFloat16);
  qkv_permute_dequant_launcher(quant_x, out);
  return out;
}

}  // namespace cache_dit::comm
