// File: kernels/svdq/layouts.cuh
//
// Device-side positions in the checkpoint's packed layouts (the same
// permutations as kernels/svdq_reference.py, which is normative for them),
// and the e4m3 codes of INT4 values that the tensor-core path feeds to FP8
// MMAs. Shared by kernels/svdq/svdq.cu and kernels/svdq/gemm_sm90.cu.
#pragma once

#include <cstdint>

namespace cache_dit::svdq {

// wscales [G, N] / per-channel vectors [N] (groups = 1): column n of its
// 128-wide block sits at lane 4 j + i, slot 2 a + b, where n % 128 = 16 j + 8 a + 2 i + b.
__device__ __forceinline__ int64_t scale_pos(int64_t n, int64_t g, int64_t groups) {
  const int64_t c = n % 128;
  const int64_t j = c / 16, a = (c / 8) % 2, i = (c / 2) % 4, b = c % 2;
  return (((n / 128) * groups + g) * 32 + j * 4 + i) * 4 + a * 2 + b;
}

// qweight: the int32 word holding k .. k + 7 (k % 8 == 0) of row n.
__device__ __forceinline__ int64_t qweight_word(int64_t n, int64_t k, int64_t k_tiles) {
  const int64_t c = n % 128, kk = k % 64;
  const int64_t n_pack = c / 16, n_half = (c / 8) % 2, n_lane = c % 8;
  const int64_t k_half = kk / 32, k_lane = (kk / 8) % 4;
  return (((((n / 128) * k_tiles + k / 64) * 8 + n_pack) * 8 + n_lane) * 4 + k_lane) * 2 * 2 + n_half * 2 + k_half;
}

// proj_down [K, R] (down: logical (rank r, channel c)) and proj_up [N, R]
// (logical (channel c, rank r)): 16 x 16 tiles of mma B fragments.
__device__ __forceinline__ int64_t lowrank_pos(int64_t c, int64_t r, int64_t rank, bool down) {
  const int64_t row = down ? r % 16 : c % 16, col = down ? c % 16 : r % 16;
  const int64_t n_half = row / 8, n_lane = row % 8, k_half = col / 8, k_lane = (col % 8) / 2, e = col % 2;
  return ((c / 16) * (rank / 16) + r / 16) * 256 + (((n_lane * 4 + k_lane) * 2 + n_half) * 2 + k_half) * 2 + e;
}

// The e4m3 codes of the four signed nibbles in the low 16 bits of v (nibble
// i -> byte i). -8..7 are all exact e4m3 numbers; the two tables hold the
// codes of 0..7 and of -8..-1 by the nibble's low three bits.
__device__ __forceinline__ uint32_t e4m3x4_of_int4(uint32_t v) {
  const uint32_t sel = v & 0x7777u;  // bit 3 of a selector would ask byte_perm for sign replication
  const uint32_t pos = __byte_perm(0x44403800u, 0x4E4C4A48u, sel);
  const uint32_t neg = __byte_perm(0xCACCCED0u, 0xB8C0C4C8u, sel);
  const uint32_t sign = ((v & 0x8u) >> 3) | ((v & 0x80u) << 1) | ((v & 0x800u) << 5) | ((v & 0x8000u) << 9);
  const uint32_t mask = sign * 0xFFu;
  return (pos & ~mask) | (neg & mask);
}

// The INT4 value of an e4m3 code that holds one (inverse of the above).
__device__ __forceinline__ int int4_of_e4m3(uint32_t code) {
  const uint32_t mag = code & 0x7Fu;
  // 0x00 -> 0, 0x38 -> 1, 0x40 -> 2, 0x44 -> 3, 0x48 -> 4, 0x4A -> 5, 0x4C -> 6, 0x4E -> 7, 0x50 -> 8
  const int e = static_cast<int>(mag >> 3) - 7, m = static_cast<int>(mag & 7u);  // e in 0..3 for |q| in 1..8
  const int out = mag == 0 ? 0 : ((8 + m) << e) >> 3;
  return (code & 0x80u) ? -out : out;
}

}  // namespace cache_dit::svdq
