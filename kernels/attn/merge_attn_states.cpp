// Checks and Meta kernels of fused_merge_attn_states (host-only, no CUDA), so
// validation and shape logic run on machines without a GPU.
#include "kernels/attn/merge_attn_states.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "kernels/common/checks.h"
#include "kernels/ops.h"

namespace cache_dit::attn {

using checks::shape_str;

void check_merge_attn_states(const at::Tensor& prev_out, const at::Tensor& prev_lse,
                             const at::Tensor& suff_out, const at::Tensor& suff_lse,
                             const at::Tensor* out, const at::Tensor* lse) {
  const char* op = kMergeOp;
  checks::check_dims(op, "prev_out", prev_out, 4, "[B, S, H, D]");
  checks::check_dims(op, "suff_out", suff_out, 4, "[B, S, H, D]");
  checks::check_dims(op, "prev_lse", prev_lse, 4, "[B, S, H, 1]");
  checks::check_dims(op, "suff_lse", suff_lse, 4, "[B, S, H, 1]");
  const auto floats = {at::kHalf, at::kBFloat16, at::kFloat};
  checks::check_dtype_in(op, "prev_out", prev_out, floats);
  checks::check_dtype_in(op, "suff_out", suff_out, floats);
  checks::check_dtype_in(op, "prev_lse", prev_lse, floats);
  checks::check_dtype_in(op, "suff_lse", suff_lse, floats);
  checks::check_same_device(op, suff_out, "suff_out",
                            {{"prev_out", &prev_out}, {"prev_lse", &prev_lse}, {"suff_lse", &suff_lse}});

  TORCH_CHECK_VALUE(prev_out.sym_sizes() == suff_out.sym_sizes(), op,
                    ": prev_out and suff_out must have the same shape, got ",
                    shape_str(prev_out.sym_sizes()), " and ", shape_str(suff_out.sym_sizes()));
  TORCH_CHECK_VALUE(suff_out.sym_size(3) >= 1, op, ": head dim D must be >= 1, got shape ",
                    shape_str(suff_out.sym_sizes()));
  const c10::SymInt one(1);
  std::vector<c10::SymInt> lse_shape(suff_out.sym_sizes().begin(), suff_out.sym_sizes().end());
  lse_shape[3] = one;
  for (const auto& [name, t] : {std::pair{"prev_lse", &prev_lse}, std::pair{"suff_lse", &suff_lse}}) {
    TORCH_CHECK_VALUE(t->sym_sizes() == c10::SymIntArrayRef(lse_shape), op, ": ", name,
                      " must have shape ", shape_str(lse_shape), " ([B, S, H, 1] of the outputs "
                      "of shape ", shape_str(suff_out.sym_sizes()), "), got ",
                      shape_str(t->sym_sizes()));
  }
  // The kernels read each (b, s, h) row of D values as one contiguous run.
  for (const auto& [name, t] : {std::pair{"prev_out", &prev_out}, std::pair{"suff_out", &suff_out}}) {
    TORCH_CHECK_VALUE(t->sym_size(3) == 1 || t->sym_stride(3) == 1, op, ": ", name,
                      " must have a contiguous last dim (stride 1), got strides ",
                      shape_str(t->sym_strides()));
  }

  if (out != nullptr) {
    checks::check_output(op, "out", *out, suff_out.sym_sizes(), suff_out.scalar_type(), suff_out,
                         {&prev_out, &prev_lse, &suff_out, &suff_lse});
  }
  if (lse != nullptr) {
    checks::check_output(op, "lse", *lse, lse_shape, suff_lse.scalar_type(), suff_out,
                         {&prev_out, &prev_lse, &suff_out, &suff_lse, out ? out : &suff_out});
  }
}

std::tuple<at::Tensor, at::Tensor> fused_merge_attn_states_meta(const at::Tensor& prev_out,
                                                                const at::Tensor& prev_lse,
                                                                const at::Tensor& suff_out,
                                                                const at::Tensor& suff_lse) {
  check_merge_attn_states(prev_out, prev_lse, suff_out, suff_lse, nullptr, nullptr);
  return {at::empty_symint(suff_out.sym_sizes(), suff_out.options()),
          at::empty_symint(suff_lse.sym_sizes(), suff_lse.options())};
}

std::tuple<at::Tensor, at::Tensor> fused_merge_attn_states_out_meta(
    const at::Tensor& prev_out, const at::Tensor& prev_lse, const at::Tensor& suff_out,
    const at::Tensor& suff_lse, at::Tensor& out, at::Tensor& lse) {
  check_merge_attn_states(prev_out, prev_lse, suff_out, suff_lse, &out, &lse);
  return {out, lse};
}

}  // namespace cache_dit::attn
