// File: tests/cpp/client/support/op_cases.h
//
// Deterministic inputs and output shapes for the ops of catalog v1
// (docs/DESIGN.md section 3), shared by the GPU tests, opd_ref_tool and the
// latency benchmark. Plain C++ (no torch, no CUDA).
//
// Output shapes follow the schemas:
//   fused_merge_attn_states   out: suff_out's shape/dtype; lse: suff_lse's shape/dtype
//   fp8_comm_per_token_quant  [..., D] bf16 -> [..., D + 2] float8_e4m3fn
//   fp8_comm_per_token_dequant [..., D + 2] fp8 -> [..., D] bf16
//   fp8_comm_qkv_permute_quant [B, S, P, N, D] bf16 -> [P, S, B, N, D + 4] fp8
//   fp8_comm_qkv_permute_dequant [S, B, N, D + 4] fp8 -> [B, S, N, D] bf16
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "tests/cpp/client/support/call_file.h"

namespace cache_dit_opd::testing {

inline constexpr const char* kMerge = "fused_merge_attn_states";
inline constexpr const char* kQuant = "fp8_comm_per_token_quant";
inline constexpr const char* kDequant = "fp8_comm_per_token_dequant";
inline constexpr const char* kQkvQuant = "fp8_comm_qkv_permute_quant";
inline constexpr const char* kQkvDequant = "fp8_comm_qkv_permute_dequant";

// Encoders (round to nearest even; NaN kept NaN).
uint16_t FloatToBf16(float f);
uint16_t FloatToHalf(float f);
float Bf16ToFloat(uint16_t b);

// OutputsFor
//
// Contiguous, zero-filled outputs of `op` for `inputs` (the `out` tensors of
// its .out overload, in schema order). INVALID_ARGUMENT for an unknown op or
// inputs of the wrong rank.
Status OutputsFor(const std::string& op, const std::vector<HostTensor>& inputs,
                  std::vector<HostTensor>* outputs);

// Generators. Every value comes from `rng`, so equal seeds give equal bytes.
// Floats: a mix of normal values, exact zeros, large magnitudes and (where
// the op defines them) infinities.
HostTensor RandomBf16(std::mt19937_64& rng, std::vector<int64_t> sizes, float scale = 3.0f);
HostTensor RandomFloat(std::mt19937_64& rng, DType dtype, std::vector<int64_t> sizes, float scale = 3.0f);
// Per-token FP8 records [..., D + 2]: finite e4m3 codes + a positive bf16 scale.
HostTensor RandomPerTokenRecords(std::mt19937_64& rng, std::vector<int64_t> sizes);
// QKV records [S, B, N, D + 4]: finite e4m3 codes + a positive fp32 scale.
HostTensor RandomQkvRecords(std::mt19937_64& rng, std::vector<int64_t> sizes);
// LSE [B, S, H, 1] of `dtype` with specials mixed in: +inf, -inf, NaN (when
// with_nan), gaps of 100+ between the two sides come from `offset`.
HostTensor RandomLse(std::mt19937_64& rng, DType dtype, std::vector<int64_t> sizes, float offset,
                     bool with_specials, bool with_nan);
// The same LSE values stored as flash-attn does, [B, H, S] contiguous, viewed
// as [B, S, H, 1] (strides [H*S, 1, S, 1]).
HostTensor AsHeadMajorLse(const HostTensor& lse);
// x [B, S, P, N, D] stored as [S, B, P, N, D] (a transposed B/S view).
HostTensor AsBatchSeqTransposed(const HostTensor& x);

// BenchInputs
//
// Inputs of `op` for a benchmark `shape` (the first input's sizes; merge
// takes [B, S, H, D] bf16 with fp32 LSE).
Status BenchInputs(const std::string& op, const std::vector<int64_t>& shape, uint64_t seed,
                   std::vector<HostTensor>* inputs);

}  // namespace cache_dit_opd::testing
