// Checks, output shapes and Meta kernels of the SVDQuant W4A4 ops (host-only),
// so validation and shape logic run without a GPU.
#include "kernels/svdq/svdq.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <string>

#include "kernels/common/checks.h"
#include "kernels/ops.h"

namespace cache_dit::svdq {

using checks::shape_str;

namespace {

constexpr const char* kActQuant = "svdq_quantize_w4a4_act_fuse_lora";
constexpr const char* kGemm = "svdq_gemm_w4a4";
constexpr const char* kWgtQuant = "svdq_quantize_w4a4_wgt";

// Every tensor of the family is contiguous and 16-byte aligned: the kernels
// read and write in 16-byte vectors and TMA boxes.
void check_dense(const char* op, const char* name, const at::Tensor& t) {
  checks::check_contiguous(op, name, t);
  checks::check_aligned(op, name, t, kTensorAlign);
}

// An output (checks::check_output), 16-byte aligned as well.
void check_out(const char* op, const char* name, const at::Tensor& out, c10::SymIntArrayRef sizes,
               at::ScalarType dtype, const at::Tensor& device_ref, std::initializer_list<const at::Tensor*> inputs) {
  checks::check_output(op, name, out, sizes, dtype, device_ref, inputs);
  checks::check_aligned(op, name, out, kTensorAlign);
}

void check_int4_only(const char* op, bool fp4, const char* flag, bool value) {
  TORCH_CHECK_VALUE(!fp4, op, ": fp4=True is not supported: this build serves INT4 only (NVFP4 needs FP4 tensor "
                    "cores, which sm_90 has not)");
  TORCH_CHECK_VALUE(!value, op, ": ", flag, "=True is not supported: this build serves signed INT4 without it");
}

void check_multiple(const char* op, const char* what, const c10::SymInt& v, int64_t of, const at::Tensor& t) {
  TORCH_CHECK_VALUE(v % of == 0, op, ": ", what, " must be a multiple of ", of, ", got ", v, " (shape ",
                    shape_str(t.sym_sizes()), ")");
}

// M_pad within the grids' reach (kMaxRows).
void check_rows(const char* op, const c10::SymInt& m_pad, const at::Tensor& t) {
  TORCH_CHECK_VALUE(m_pad <= kMaxRows, op, ": M_pad (rows after padding) must be at most ", kMaxRows, ", got ", m_pad,
                    " (shape ", shape_str(t.sym_sizes()), ")");
}

// A 1-D packed per-channel vector of `n` entries in the model dtype.
void check_vector(const char* op, const char* name, const at::Tensor& v, const c10::SymInt& n, at::ScalarType dtype,
                  const at::Tensor& ref, const char* ref_name) {
  checks::check_dims(op, name, v, 1, "[N] (packed)");
  TORCH_CHECK_VALUE(v.sym_size(0) == n, op, ": ", name, " must have ", n, " entries, got shape ",
                    shape_str(v.sym_sizes()));
  checks::check_dtype(op, name, v, dtype);
  check_dense(op, name, v);
  checks::check_same_device(op, ref, ref_name, {{name, &v}});
}

// A packed low-rank factor [channels, R] (proj_down [K, R], proj_up [N, R]):
// its leading dim `channels`, R a multiple of 16, the model dtype, contiguous.
void check_lowrank(const char* op, const char* name, const char* layout, const char* dim, const at::Tensor& t,
                   const c10::SymInt& channels, at::ScalarType dtype) {
  checks::check_dims(op, name, t, 2, layout);
  TORCH_CHECK_VALUE(t.sym_size(0) == channels, op, ": ", name, " must be [", dim, ", R] with ", dim, " = ", channels,
                    ", got shape ", shape_str(t.sym_sizes()));
  check_multiple(op, (std::string("R (") + name + ".shape[1])").c_str(), t.sym_size(1), kRankAlign, t);
  checks::check_dtype(op, name, t, dtype);
  check_dense(op, name, t);
}

}  // namespace

ActQuantShapes act_quant_shapes(const at::Tensor& input, const std::optional<at::Tensor>& lora_down,
                                int64_t pad_size) {
  const c10::SymInt m_pad = (input.sym_size(0) + pad_size - 1) / pad_size * pad_size;
  const c10::SymInt k = input.sym_size(1);
  const c10::SymInt rank = lora_down ? lora_down->sym_size(1) : c10::SymInt(0);
  return {{m_pad, k}, {k / kGroup, m_pad}, {m_pad, rank}};
}

WgtQuantShapes wgt_quant_shapes(const at::Tensor& input) {
  const c10::SymInt n = input.sym_size(0), k = input.sym_size(1);
  return {{n, k / 2}, {k / kGroup, n}};
}

std::vector<c10::SymInt> gemm_out_shape(const at::Tensor& act, const at::Tensor& wgt) {
  return {act.sym_size(0), wgt.sym_size(0)};
}

at::ScalarType gemm_out_dtype(int64_t out_dtype_id) {
  TORCH_CHECK_VALUE(out_dtype_id >= 0 && out_dtype_id <= 2, kGemm,
                    ": out_dtype_id must be 0 (float16), 1 (bfloat16) or 2 (float32), got ", out_dtype_id);
  constexpr at::ScalarType kOut[] = {at::kHalf, at::kBFloat16, at::kFloat};
  return kOut[out_dtype_id];
}

void check_quantize_act(const at::Tensor& input, const std::optional<at::Tensor>& lora_down,
                        const std::optional<at::Tensor>& smooth, bool fuse_glu, bool fp4, int64_t pad_size,
                        const ActQuantOutputs* outs) {
  const char* op = kActQuant;
  check_int4_only(op, fp4, "fuse_glu", fuse_glu);
  checks::check_device(op, "input", input);
  checks::check_dims(op, "input", input, 2, "[M, K]");
  checks::check_dtype_in(op, "input", input, {at::kHalf, at::kBFloat16});
  check_dense(op, "input", input);
  check_multiple(op, "K (input.shape[1])", input.sym_size(1), kKAlign, input);
  TORCH_CHECK_VALUE(pad_size >= 1 && pad_size <= kMaxRows, op, ": pad_size must be in [1, ", kMaxRows, "], got ",
                    pad_size);
  const at::ScalarType dtype = input.scalar_type();
  const c10::SymInt k = input.sym_size(1);
  TORCH_CHECK_VALUE(k <= kMaxK, op, ": K (input.shape[1]) must be at most ", kMaxK, ", got ", k);
  check_rows(op, act_quant_shapes(input, lora_down, pad_size).output[0], input);
  if (lora_down) {
    check_lowrank(op, "lora_down", "[K, R] (packed proj_down)", "K", *lora_down, k, dtype);
    checks::check_same_device(op, input, "input", {{"lora_down", &*lora_down}});
  }
  if (smooth) check_vector(op, "smooth", *smooth, k, dtype, input, "input");
  if (outs) {
    const ActQuantShapes shapes = act_quant_shapes(input, lora_down, pad_size);
    const at::Tensor* d = lora_down ? &*lora_down : &input;
    const at::Tensor* s = smooth ? &*smooth : &input;
    check_out(op, "output", *outs->output, shapes.output, kActDtype, input, {&input, d, s});
    check_out(op, "oscales", *outs->oscales, shapes.oscales, dtype, input, {&input, d, s, outs->output});
    check_out(op, "lora_act_out", *outs->lora_act_out, shapes.lora_act_out, at::kFloat, input,
              {&input, d, s, outs->output, outs->oscales});
  }
}

void check_gemm(const at::Tensor& act, const at::Tensor& wgt, const at::Tensor& ascales, const at::Tensor& wscales,
                const std::optional<at::Tensor>& lora_act_in, const std::optional<at::Tensor>& lora_up,
                const std::optional<at::Tensor>& bias, bool fp4, double alpha,
                const std::optional<at::Tensor>& wcscales, bool act_unsigned, int64_t out_dtype_id,
                const at::Tensor* out) {
  const char* op = kGemm;
  check_int4_only(op, fp4, "act_unsigned", act_unsigned);
  TORCH_CHECK_VALUE(alpha == 1.0, op, ": alpha must be 1.0 for INT4 (it scales NVFP4 only), got ", alpha);
  TORCH_CHECK_VALUE(!wcscales, op, ": wcscales must be None for INT4 (it scales NVFP4 only)");
  const at::ScalarType out_dtype = gemm_out_dtype(out_dtype_id);
  checks::check_device(op, "act", act);
  checks::check_dims(op, "act", act, 2, "[M_pad, K] (from svdq_quantize_w4a4_act_fuse_lora)");
  checks::check_dtype(op, "act", act, kActDtype);
  check_dense(op, "act", act);
  checks::check_dims(op, "wgt", wgt, 2, "[N, K/2] (packed qweight)");
  checks::check_dtype(op, "wgt", wgt, at::kChar);
  check_dense(op, "wgt", wgt);
  const c10::SymInt m_pad = act.sym_size(0);
  const c10::SymInt k = act.sym_size(1);
  const c10::SymInt n = wgt.sym_size(0);
  check_rows(op, m_pad, act);
  TORCH_CHECK_VALUE(wgt.sym_size(1) * 2 == k, op, ": wgt must be [N, K/2] with K = ", k,
                    " as in act, got wgt shape ", shape_str(wgt.sym_sizes()), " and act shape ",
                    shape_str(act.sym_sizes()));
  check_multiple(op, "K (act.shape[1])", k, kKAlign, act);
  check_multiple(op, "N (wgt.shape[0])", n, kBlockN, wgt);
  checks::check_dims(op, "wscales", wscales, 2, "[K/64, N] (packed)");
  checks::check_dtype_in(op, "wscales", wscales, {at::kHalf, at::kBFloat16});
  const at::ScalarType dtype = wscales.scalar_type();
  TORCH_CHECK_VALUE(wscales.sym_size(0) == k / kGroup && wscales.sym_size(1) == n, op, ": wscales must be [",
                    k / kGroup, ", ", n, "], got shape ", shape_str(wscales.sym_sizes()));
  check_dense(op, "wscales", wscales);
  checks::check_dims(op, "ascales", ascales, 2, "[K/64, M_pad]");
  checks::check_dtype(op, "ascales", ascales, dtype);
  TORCH_CHECK_VALUE(ascales.sym_size(0) == k / kGroup && ascales.sym_size(1) == m_pad, op, ": ascales must be [",
                    k / kGroup, ", ", m_pad, "], got shape ", shape_str(ascales.sym_sizes()));
  check_dense(op, "ascales", ascales);
  checks::check_same_device(op, act, "act", {{"wgt", &wgt}, {"ascales", &ascales}, {"wscales", &wscales}});
  TORCH_CHECK_VALUE(lora_act_in.has_value() == lora_up.has_value(), op,
                    ": lora_act_in and lora_up come together (both or neither), got ",
                    lora_act_in ? "lora_act_in without lora_up" : "lora_up without lora_act_in");
  if (lora_up) {
    const at::Tensor& up = *lora_up;
    const at::Tensor& la = *lora_act_in;
    check_lowrank(op, "lora_up", "[N, R] (packed proj_up)", "N", up, n, dtype);
    checks::check_dims(op, "lora_act_in", la, 2, "[M_pad, R]");
    TORCH_CHECK_VALUE(la.sym_size(0) == m_pad && la.sym_size(1) == up.sym_size(1), op,
                      ": lora_act_in must be [", m_pad, ", ", up.sym_size(1), "], got shape ",
                      shape_str(la.sym_sizes()));
    checks::check_dtype(op, "lora_act_in", la, at::kFloat);
    check_dense(op, "lora_act_in", la);
    checks::check_same_device(op, act, "act", {{"lora_up", &up}, {"lora_act_in", &la}});
  }
  if (bias) check_vector(op, "bias", *bias, n, dtype, act, "act");
  if (out) {
    check_out(op, "out", *out, gemm_out_shape(act, wgt), out_dtype, act,
              {&act, &wgt, &ascales, &wscales, lora_up ? &*lora_up : &act, lora_act_in ? &*lora_act_in : &act,
               bias ? &*bias : &act});
  }
}

void check_quantize_wgt(const at::Tensor& input, const at::Tensor* output, const at::Tensor* oscales) {
  const char* op = kWgtQuant;
  checks::check_device(op, "input", input);
  checks::check_dims(op, "input", input, 2, "[N, K]");
  checks::check_dtype_in(op, "input", input, {at::kHalf, at::kBFloat16});
  check_dense(op, "input", input);
  check_multiple(op, "N (input.shape[0])", input.sym_size(0), kBlockN, input);
  check_multiple(op, "K (input.shape[1])", input.sym_size(1), kKAlign, input);
  if (output) {
    const WgtQuantShapes shapes = wgt_quant_shapes(input);
    check_out(op, "output", *output, shapes.output, at::kChar, input, {&input});
    check_out(op, "oscales", *oscales, shapes.oscales, input.scalar_type(), input, {&input, output});
  }
}

namespace {

// A contiguous output of `shape` on `like`'s device (Meta or CUDA).
at::Tensor new_output(const std::vector<c10::SymInt>& shape, const at::Tensor& like, at::ScalarType dtype) {
  return at::empty_symint(shape, like.options().dtype(dtype));
}

}  // namespace

// ---- Meta kernels: the same checks, contiguous outputs, no launch ------------------------------------------
// (The functional CUDA forms call them too: they allocate on the inputs' device.)

ActQuant svdq_quantize_w4a4_act_fuse_lora_meta(const at::Tensor& input, const OptTensor& lora_down,
                                               const OptTensor& smooth, bool fuse_glu, bool fp4,
                                               int64_t pad_size) {
  check_quantize_act(input, lora_down, smooth, fuse_glu, fp4, pad_size, nullptr);
  const ActQuantShapes shapes = act_quant_shapes(input, lora_down, pad_size);
  return {new_output(shapes.output, input, kActDtype), new_output(shapes.oscales, input, input.scalar_type()),
          new_output(shapes.lora_act_out, input, at::kFloat)};
}

ActQuant svdq_quantize_w4a4_act_fuse_lora_out_meta(const at::Tensor& input, const OptTensor& lora_down,
                                                   const OptTensor& smooth, bool fuse_glu, bool fp4,
                                                   int64_t pad_size, at::Tensor& output, at::Tensor& oscales,
                                                   at::Tensor& lora_act_out) {
  const ActQuantOutputs outs{&output, &oscales, &lora_act_out};
  check_quantize_act(input, lora_down, smooth, fuse_glu, fp4, pad_size, &outs);
  return {output, oscales, lora_act_out};
}

at::Tensor svdq_gemm_w4a4_meta(const at::Tensor& act, const at::Tensor& wgt, const at::Tensor& ascales,
                               const at::Tensor& wscales, const OptTensor& lora_act_in, const OptTensor& lora_up,
                               const OptTensor& bias, bool fp4, double alpha, const OptTensor& wcscales,
                               bool act_unsigned, int64_t out_dtype_id) {
  check_gemm(act, wgt, ascales, wscales, lora_act_in, lora_up, bias, fp4, alpha, wcscales, act_unsigned,
             out_dtype_id, nullptr);
  return new_output(gemm_out_shape(act, wgt), act, gemm_out_dtype(out_dtype_id));
}

at::Tensor svdq_gemm_w4a4_out_meta(const at::Tensor& act, const at::Tensor& wgt, const at::Tensor& ascales,
                                   const at::Tensor& wscales, const OptTensor& lora_act_in,
                                   const OptTensor& lora_up, const OptTensor& bias, bool fp4, double alpha,
                                   const OptTensor& wcscales, bool act_unsigned, int64_t out_dtype_id,
                                   at::Tensor& out) {
  check_gemm(act, wgt, ascales, wscales, lora_act_in, lora_up, bias, fp4, alpha, wcscales, act_unsigned,
             out_dtype_id, &out);
  return out;
}

std::tuple<at::Tensor, at::Tensor> svdq_quantize_w4a4_wgt_meta(const at::Tensor& input) {
  check_quantize_wgt(input, nullptr, nullptr);
  const WgtQuantShapes shapes = wgt_quant_shapes(input);
  return {new_output(shapes.output, input, at::kChar), new_output(shapes.oscales, input, input.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor> svdq_quantize_w4a4_wgt_out_meta(const at::Tensor& input, at::Tensor& output,
                                                                   at::Tensor& oscales) {
  check_quantize_wgt(input, &output, &oscales);
  return {output, oscales};
}

}  // namespace cache_dit::svdq
