// fused_merge_attn_states: merge two partial attention results by their
// log-sum-exp, one (b, s, h) row of D values at a time.
//
// Math per row, in fp32 (docs/DESIGN.md section 3): an LSE of +inf means "empty"
// and is treated as -inf; m = max(p, s) (NaN-propagating); if m == -inf both
// sides are empty: out = prev row, lse = -inf. Otherwise wp = exp(p - m),
// ws = exp(s - m), out = (wp P + ws S) / (wp + ws), lse = m + log(wp + ws).
// The max form never overflows: wp, ws are in [0, 1] and one of them is 1, so
// the LSE stays right however far apart p and s are (upstream's sigmoid form
// returns +inf past a gap of ~88 and NaN when one side is empty). A side whose
// weight is exactly 0 contributes nothing, so its (possibly garbage) values
// never leak into the result.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>

#include "kernels/attn/merge_attn_states.h"
#include "kernels/common/cuda_utils.cuh"
#include "kernels/ops.h"

namespace cache_dit::attn {

namespace {

using cuda::Pack;
using cuda::from_float;
using cuda::to_float;

enum class LseType : int { kFloat = 0, kHalf = 1, kBFloat16 = 2 };

struct Strides3 {
  int64_t b, s, h;
};

__device__ __forceinline__ float load_lse(const void* base, LseType type, int64_t idx) {
  switch (type) {
    case LseType::kHalf: return to_float(static_cast<const __half*>(base)[idx]);
    case LseType::kBFloat16: return to_float(static_cast<const __nv_bfloat16*>(base)[idx]);
    default: return static_cast<const float*>(base)[idx];
  }
}

__device__ __forceinline__ void store_lse(void* base, LseType type, int64_t idx, float v) {
  switch (type) {
    case LseType::kHalf: static_cast<__half*>(base)[idx] = from_float<__half>(v); break;
    case LseType::kBFloat16: static_cast<__nv_bfloat16*>(base)[idx] = from_float<__nv_bfloat16>(v); break;
    default: static_cast<float*>(base)[idx] = v;
  }
}

struct MergeParams {
  void* out;            // [rows, D] contiguous
  void* out_lse;        // [rows] contiguous
  const void* prev;
  const void* suff;
  const void* prev_lse;
  const void* suff_lse;
  LseType prev_lse_type, suff_lse_type, out_lse_type;
  Strides3 prev_st, suff_st, prev_lse_st, suff_lse_st;  // elements
  int64_t rows, S, H, D;
  int log2_tpr;  // threads per row = 1 << log2_tpr (<= 32: a row never spans warps)
};

// Each row is handled by a group of 2^log2_tpr threads of one warp; the group
// walks the row in VEC-element packs (16-byte accesses of out_t when VECTOR),
// so one block covers blockDim / tpr rows and every access is coalesced.
// index_t is uint32_t whenever the row count allows: the (b, s, h) split of
// a row is on the path to its first load, and 64-bit division is ~60
// instructions.
template <typename out_t, typename prev_t, int VEC, bool VECTOR, typename index_t>
__global__ void __launch_bounds__(256) merge_attn_states_kernel(const MergeParams p) {
  const int tpr = 1 << p.log2_tpr;
  const int lane = threadIdx.x & (tpr - 1);
  const index_t H = static_cast<index_t>(p.H), S = static_cast<index_t>(p.S);
  const int64_t row_step = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> p.log2_tpr;
  for (int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> p.log2_tpr;
       row < p.rows; row += row_step) {
    const index_t r = static_cast<index_t>(row);
    const int64_t h = r % H;
    const index_t bs = r / H;
    const int64_t s = bs % S;
    const int64_t b = bs / S;

    float lp = load_lse(p.prev_lse, p.prev_lse_type,
                        b * p.prev_lse_st.b + s * p.prev_lse_st.s + h * p.prev_lse_st.h);
    float ls = load_lse(p.suff_lse, p.suff_lse_type,
                        b * p.suff_lse_st.b + s * p.suff_lse_st.s + h * p.suff_lse_st.h);
    lp = lp == INFINITY ? -INFINITY : lp;
    ls = ls == INFINITY ? -INFINITY : ls;
    const float m = cuda::nan_max(lp, ls);

    const prev_t* prow = static_cast<const prev_t*>(p.prev) + b * p.prev_st.b + s * p.prev_st.s +
                         h * p.prev_st.h;
    const out_t* srow = static_cast<const out_t*>(p.suff) + b * p.suff_st.b + s * p.suff_st.s +
                        h * p.suff_st.h;
    out_t* orow = static_cast<out_t*>(p.out) + row * p.D;

    float wp, ws, lse;
    if (m == -INFINITY) {  // both sides empty
      wp = 1.f;
      ws = 0.f;
      lse = -INFINITY;
    } else {
      const float ep = expf(lp - m);
      const float es = expf(ls - m);
      const float denom = ep + es;
      wp = ep / denom;
      ws = es / denom;
      lse = m + logf(denom);
    }
    if (lane == 0) store_lse(p.out_lse, p.out_lse_type, row, lse);

    if constexpr (VECTOR) {
      const int64_t packs = p.D / VEC;
      for (int64_t c = lane; c < packs; c += tpr) {
        const Pack<prev_t, VEC> pv = reinterpret_cast<const Pack<prev_t, VEC>*>(prow)[c];
        const Pack<out_t, VEC> sv = reinterpret_cast<const Pack<out_t, VEC>*>(srow)[c];
        Pack<out_t, VEC> ov;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          float v = wp != 0.f ? wp * to_float(pv.e[i]) : 0.f;
          if (ws != 0.f) v = fmaf(ws, to_float(sv.e[i]), v);
          ov.e[i] = from_float<out_t>(v);
        }
        reinterpret_cast<Pack<out_t, VEC>*>(orow)[c] = ov;
      }
    } else {
      for (int64_t d = lane; d < p.D; d += tpr) {
        float v = wp != 0.f ? wp * to_float(prow[d]) : 0.f;
        if (ws != 0.f) v = fmaf(ws, to_float(srow[d]), v);
        orow[d] = from_float<out_t>(v);
      }
    }
  }
}

// Calls f with a value of the CUDA element type of `dtype` (checked before:
// one of fp16, bf16, fp32).
template <typename F>
void dispatch_float(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kHalf: return f(__half{});
    case at::kBFloat16: return f(__nv_bfloat16{});
    default: return f(float{});
  }
}

LseType lse_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf: return LseType::kHalf;
    case at::kBFloat16: return LseType::kBFloat16;
    default: return LseType::kFloat;
  }
}

Strides3 strides3(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

template <typename out_t, typename prev_t>
void launch_typed(MergeParams& p, const at::Tensor& prev_out, const at::Tensor& suff_out,
                  cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(out_t);
  constexpr int kThreads = 256;
  // 16-byte packs need every row start aligned: the base pointers and the
  // (b, s, h) strides of both inputs, and D a whole number of packs.
  const bool vector =
      p.D % kVec == 0 && cuda::is_aligned(p.out, 16) && cuda::is_aligned(p.suff, 16) &&
      cuda::is_aligned(p.prev, sizeof(prev_t) * kVec) &&
      p.prev_st.b % kVec == 0 && p.prev_st.s % kVec == 0 && p.prev_st.h % kVec == 0 &&
      p.suff_st.b % kVec == 0 && p.suff_st.s % kVec == 0 && p.suff_st.h % kVec == 0;
  const int64_t units = vector ? p.D / kVec : p.D;
  const int tpr = cuda::threads_per_row(units, 1);
  p.log2_tpr = __builtin_ctz(tpr);
  const int64_t rows_per_block = kThreads / tpr;
  const int64_t blocks = std::min<int64_t>(cuda::ceil_div(p.rows, rows_per_block), INT32_MAX);
  const bool small = p.rows <= UINT32_MAX;
  if (vector && small) {
    merge_attn_states_kernel<out_t, prev_t, kVec, true, uint32_t><<<blocks, kThreads, 0, stream>>>(p);
  } else if (small) {
    merge_attn_states_kernel<out_t, prev_t, kVec, false, uint32_t><<<blocks, kThreads, 0, stream>>>(p);
  } else {
    merge_attn_states_kernel<out_t, prev_t, kVec, false, int64_t><<<blocks, kThreads, 0, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Launcher: checks, device guard, current stream, dtype dispatch.
void merge_attn_states_launcher(const at::Tensor& prev_out, const at::Tensor& prev_lse,
                                const at::Tensor& suff_out, const at::Tensor& suff_lse,
                                at::Tensor& out, at::Tensor& lse) {
  check_merge_attn_states(prev_out, prev_lse, suff_out, suff_lse, &out, &lse);
  const int64_t rows = suff_out.size(0) * suff_out.size(1) * suff_out.size(2);
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(suff_out.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  MergeParams p{};
  p.out = out.data_ptr();
  p.out_lse = lse.data_ptr();
  p.prev = prev_out.data_ptr();
  p.suff = suff_out.data_ptr();
  p.prev_lse = prev_lse.data_ptr();
  p.suff_lse = suff_lse.data_ptr();
  p.prev_lse_type = lse_type(prev_lse);
  p.suff_lse_type = lse_type(suff_lse);
  p.out_lse_type = lse_type(lse);
  p.prev_st = strides3(prev_out);
  p.suff_st = strides3(suff_out);
  p.prev_lse_st = strides3(prev_lse);
  p.suff_lse_st = strides3(suff_lse);
  p.rows = rows;
  p.S = suff_out.size(1);
  p.H = suff_out.size(2);
  p.D = suff_out.size(3);

  dispatch_float(suff_out.scalar_type(), [&](auto out_tag) {
    dispatch_float(prev_out.scalar_type(), [&](auto prev_tag) {
      launch_typed<decltype(out_tag), decltype(prev_tag)>(p, prev_out, suff_out, stream);
    });
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> fused_merge_attn_states_out(
    const at::Tensor& prev_out, const at::Tensor& prev_lse, const at::Tensor& suff_out,
    const at::Tensor& suff_lse, at::Tensor& out, at::Tensor& lse) {
  merge_attn_states_launcher(prev_out, prev_lse, suff_out, suff_lse, out, lse);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> fused_merge_attn_states(const at::Tensor& prev_out,
                                                           const at::Tensor& prev_lse,
                                                           const at::Tensor& suff_out,
                                                           const at::Tensor& suff_lse) {
  check_merge_attn_states(prev_out, prev_lse, suff_out, suff_lse, nullptr, nullptr);
  at::Tensor out = at::empty(suff_out.sizes(), suff_out.options());
  at::Tensor lse = at::empty(suff_lse.sizes(), suff_lse.options());
  merge_attn_states_launcher(prev_out, prev_lse, suff_out, suff_lse, out, lse);
  return {out, lse};
}

}  // namespace cache_dit::attn
