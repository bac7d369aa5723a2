// Argument decoding, bounds checks and boxed dispatch against the kernel
// library's real schemas, on meta tensors: runs without a GPU. The kernel
// library's Meta kernels carry its per-op checks, so Run on meta also
// shows those rejections surfacing as INVALID_ARGUMENT.
#include "server/dispatch/torch_call_runner.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <torch/library.h>

namespace {

// Test-only ops in the kernel library's namespace, covering the schema types
// the real ops do not use. The Meta kernel records what it received.
std::vector<c10::IValue>& SeenArgs() {
  static auto* seen = new std::vector<c10::IValue>();
  return *seen;
}

void RecordArgs(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  SeenArgs().assign(stack->end() - n, stack->end());
  torch::jit::drop(*stack, n);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cache_dit_cuda_ops, m) {
  m.def(
      "_opd_test_types(Tensor x, Tensor? maybe, int n, SymInt s, float f, bool b, int[] ints, "
      "SymInt[] syms, float[] floats, bool[] bools, int? oi, float? of, int[]? ol, "
      "ScalarType? dt, int[2] pair, *, Tensor(a!) out) -> ()");
  m.def("_opd_test_layout(Tensor x, Layout? layout) -> ()");
  m.def("_opd_test_tensor_list(Tensor[] xs) -> ()");
}

TORCH_LIBRARY_IMPL(cache_dit_cuda_ops, Meta, m) {
  m.impl("_opd_test_types", torch::CppFunction::makeFromBoxedFunction<&RecordArgs>());
}

namespace cache_dit_opd {
namespace {

// One runner per device kind: a call goes back to the runner that prepared it.
TorchCallRunner& Runner(bool meta) {
  static TorchCallRunner cuda(TorchCallRunner::Device::kCuda);
  static TorchCallRunner on_meta(TorchCallRunner::Device::kMeta);
  return meta ? on_meta : cuda;
}

constexpr uint64_t kBig = 1;       // 1 MiB
constexpr uint64_t kSmall = 2;     // 256 bytes
constexpr uint64_t kOddBase = 3;   // base address not 2-byte aligned
constexpr uint64_t kOtherGpu = 4;  // on device 1
constexpr uint64_t kStore = 5;     // weight-store memory, read-only
constexpr uint64_t kSmallSize = 256;

class FakeRegions final : public RegionResolver {
 public:
  FakeRegions() {
    // Meta calls never dereference these.
    regions_[kBig] = {reinterpret_cast<void*>(0x7f0000000000), 1 << 20, 0};
    regions_[kSmall] = {reinterpret_cast<void*>(0x7f0000200000), kSmallSize, 0};
    regions_[kOddBase] = {reinterpret_cast<void*>(0x7f0000300001), 4096, 0};
    regions_[kOtherGpu] = {reinterpret_cast<void*>(0x7f0000400000), 4096, 1};
    regions_[kStore] = {reinterpret_cast<void*>(0x7f0000500000), 1 << 20, 0, /*read_only=*/true};
  }
  Status Resolve(uint64_t region_id, MappedRegion* out) const override {
    auto it = regions_.find(region_id);
    if (it == regions_.end()) return Status::NotFound("region ", region_id, " is not registered");
    *out = it->second;
    return Status::Ok();
  }
  // A region registered again (another mapping or size), or gone.
  void Set(uint64_t id, MappedRegion region) { regions_[id] = region; }
  void Remove(uint64_t id) { regions_.erase(id); }

 private:
  std::map<uint64_t, MappedRegion> regions_;
};

std::vector<int64_t> ContiguousStrides(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> strides(sizes.size(), 1);
  for (size_t i = sizes.size(); i-- > 1;) strides[i - 1] = strides[i] * sizes[i];
  return strides;
}

TensorRef View(uint64_t region, uint64_t offset, std::vector<int64_t> sizes, DType dtype,
               std::vector<int64_t> strides = {}) {
  if (strides.empty()) strides = ContiguousStrides(sizes);
  return TensorRef{region, offset, std::move(sizes), std::move(strides), dtype};
}

CallRequest Call(std::string op, std::string overload, std::vector<Arg> args) {
  CallRequest req;
  req.op = std::move(op);
  req.overload = std::move(overload);
  req.args = std::move(args);
  req.lane = 0;
  req.seq = 1;
  return req;
}

// x [4, 64] bf16 -> out [4, 66] fp8 records, both in the big region.
CallRequest PerTokenQuant(TensorRef x, TensorRef out) {
  return Call("fp8_comm_per_token_quant", "out", {std::move(x), std::move(out)});
}
TensorRef QuantIn() { return View(kBig, 0, {4, 64}, DType::kBFloat16); }
TensorRef QuantOut() { return View(kBig, 4096, {4, 66}, DType::kFloat8E4M3FN); }

std::string Normalize(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (std::isspace(static_cast<unsigned char>(c))) {
      if (!out.empty() && out.back() != ' ') out += ' ';
    } else {
      out += c;
    }
  }
  while (!out.empty() && out.back() == ' ') out.pop_back();
  return out;
}

std::string OpsLibraryPath() {
  const char* env = std::getenv("CACHE_DIT_OPS_LIBRARY");
  return env != nullptr && *env != '\0' ? env : CACHE_DIT_OPS_LIBRARY;
}

class DispatchTest : public ::testing::Test {
 protected:
  Status Prepare(const CallRequest& req, bool meta = true) {
    std::unique_ptr<PreparedCall> call;
    return Runner(meta).Prepare(req, regions_, &call);
  }

  // PrepareCall, then RunCall on meta.
  Status PrepareAndRun(const CallRequest& req) {
    std::unique_ptr<PreparedCall> call;
    OPD_RETURN_IF_ERROR(Runner(true).Prepare(req, regions_, &call));
    bool sticky = false;
    Status status = Runner(true).Run(*call, nullptr, &sticky);
    EXPECT_FALSE(sticky);
    return status;
  }

  static void ExpectError(const Status& status, StatusCode code,
                          const std::vector<std::string>& needles) {
    EXPECT_EQ(status.code(), code) << status.ToString();
    for (const std::string& needle : needles) {
      EXPECT_NE(status.message().find(needle), std::string::npos)
          << "message \"" << status.message() << "\" does not name \"" << needle << "\"";
    }
  }

  FakeRegions regions_;
};

// Tests that need the kernel library's ops.
class KernelOpsTest : public DispatchTest {
 protected:
  static void SetUpTestSuite() {
    const std::string path = OpsLibraryPath();
    if (path.empty()) return;
    load_status_ = new Status(TorchCallRunner::LoadOpLibrary(path));
  }
  void SetUp() override {
    if (load_status_ == nullptr) GTEST_SKIP() << "no kernel library target in this build";
    ASSERT_TRUE(load_status_->ok()) << load_status_->ToString();
  }
  static inline Status* load_status_ = nullptr;
};

// ---- good calls: every op's out overload -----------------------------------

TEST_F(KernelOpsTest, MergeAttnStatesOut) {
  const int64_t b = 2, s = 3, h = 4, d = 40;
  const uint64_t out_bytes = b * s * h * d * 2;
  const uint64_t lse_bytes = b * s * h * 4;
  // lse views as flash-attn produces them: [B, H, S] storage read as [B, S, H, 1].
  const std::vector<int64_t> lse_sizes = {b, s, h, 1};
  const std::vector<int64_t> lse_strides = {h * s, 1, s, 1};
  auto merge = [&](std::vector<int64_t> out_sizes) {
    return Call("fused_merge_attn_states", "out",
                {View(kBig, 0, {b, s, h, d}, DType::kBFloat16),
                 View(kBig, out_bytes, lse_sizes, DType::kFloat32, lse_strides),
                 View(kBig, out_bytes + lse_bytes, {b, s, h, d}, DType::kBFloat16),
                 View(kBig, 2 * out_bytes + lse_bytes, lse_sizes, DType::kFloat32, lse_strides),
                 View(kBig, 2 * out_bytes + 2 * lse_bytes, out_sizes, DType::kBFloat16),
                 View(kBig, 3 * out_bytes + 2 * lse_bytes, lse_sizes, DType::kFloat32)});
  };
  std::unique_ptr<PreparedCall> call;
  Status status = Runner(true).Prepare(merge({b, s, h, d}), regions_, &call);
  ASSERT_TRUE(status.ok()) << status.ToString();
  EXPECT_EQ(call->op_name(), "cache_dit_cuda_ops::fused_merge_attn_states.out");
  EXPECT_EQ(call->regions(), std::vector<uint64_t>{kBig});
  bool sticky = false;
  status = Runner(true).Run(*call, nullptr, &sticky);
  EXPECT_TRUE(status.ok()) << status.ToString();
  EXPECT_FALSE(sticky);

  // An out of the wrong shape passes the generic checks; the op's own reject it.
  ExpectError(PrepareAndRun(merge({1, 1, 1, d})), StatusCode::kInvalidArgument,
              {"cache_dit_cuda_ops::fused_merge_attn_states.out", "[1, 1, 1, 40]"});
}

TEST_F(KernelOpsTest, PerTokenQuantOut) {
  Status status = PrepareAndRun(PerTokenQuant(QuantIn(), QuantOut()));
  EXPECT_TRUE(status.ok()) << status.ToString();
}

TEST_F(KernelOpsTest, PerTokenDequantOut) {
  Status status = PrepareAndRun(Call("fp8_comm_per_token_dequant", "out",
                                     {View(kBig, 0, {2, 3, 66}, DType::kFloat8E4M3FN),
                                      View(kBig, 4096, {2, 3, 64}, DType::kBFloat16)}));
  EXPECT_TRUE(status.ok()) << status.ToString();
}

TEST_F(KernelOpsTest, QkvPermuteQuantOutWithStridedBatchSeqAndRank) {
  const int64_t b = 2, s = 3, p = 2, n = 4, d = 16;
  // x is a slice of a [B, S, 2P, N, D] buffer: B, S and P strided, [N, D] dense.
  const std::vector<int64_t> x_strides = {s * 2 * p * n * d, 2 * p * n * d, n * d, d, 1};
  Status status =
      PrepareAndRun(Call("fp8_comm_qkv_permute_quant", "out",
                         {View(kBig, 0, {b, s, p, n, d}, DType::kBFloat16, x_strides),
                          View(kBig, 65536, {p, s, b, n, d + 4}, DType::kFloat8E4M3FN)}));
  EXPECT_TRUE(status.ok()) << status.ToString();
}

TEST_F(KernelOpsTest, QkvPermuteDequantOut) {
  const int64_t b = 2, s = 3, n = 4, d = 16;
  Status status = PrepareAndRun(Call("fp8_comm_qkv_permute_dequant", "out",
                                     {View(kBig, 0, {s, b, n, d + 4}, DType::kFloat8E4M3FN),
                                      View(kBig, 4096, {b, s, n, d}, DType::kBFloat16)}));
  EXPECT_TRUE(status.ok()) << status.ToString();
}

TEST_F(KernelOpsTest, RunCallCanRepeat) {
  std::unique_ptr<PreparedCall> call;
  ASSERT_TRUE(Runner(true).Prepare(PerTokenQuant(QuantIn(), QuantOut()), regions_, &call).ok());
  EXPECT_TRUE(Runner(true).Run(*call, nullptr, nullptr).ok());
  EXPECT_TRUE(Runner(true).Run(*call, nullptr, nullptr).ok());
}

TEST_F(KernelOpsTest, RegionsListedOnceInFirstUseOrder) {
  std::unique_ptr<PreparedCall> call;
  ASSERT_TRUE(Runner(true).Prepare(PerTokenQuant(View(kSmall, 0, {1, 64}, DType::kBFloat16), QuantOut()),
                          regions_, &call)
                  .ok());
  EXPECT_EQ(call->regions(), (std::vector<uint64_t>{kSmall, kBig}));
}

// An equal call is handed the prepared call back only while each of its
// regions is the mapping that call was made with; every bound is checked
// again, and both kinds of runner (meta and CUDA wrapping) agree.
TEST_F(KernelOpsTest, PrepareAgainHandsBackTheSameCallOnlyWhileItsRegionsAreTheSame) {
  for (const bool meta : {true, false}) {
    SCOPED_TRACE(meta ? "meta" : "cuda");
    FakeRegions regions;
    const CallRequest req = PerTokenQuant(QuantIn(), QuantOut());
    std::unique_ptr<PreparedCall> first;
    ASSERT_TRUE(Runner(meta).Prepare(req, regions, &first).ok());
    const std::shared_ptr<PreparedCall> prepared = std::move(first);
    std::shared_ptr<PreparedCall> again;
    bool reused = false;
    ASSERT_TRUE(Runner(meta).PrepareAgain(req, regions, prepared, &again, &reused).ok());
    EXPECT_TRUE(reused);
    EXPECT_EQ(again, prepared);

    // Mapped elsewhere: prepared afresh, at the new base.
    regions.Set(kBig, {reinterpret_cast<void*>(0x7f0000600000), 1 << 20, 0});
    ASSERT_TRUE(Runner(meta).PrepareAgain(req, regions, prepared, &again, &reused).ok());
    EXPECT_FALSE(reused);
    ASSERT_NE(again, nullptr);
    EXPECT_NE(again, prepared);

    // The same base but too small for the output view: the bound is checked again.
    regions.Set(kBig, {reinterpret_cast<void*>(0x7f0000000000), 4096, 0});
    Status s = Runner(meta).PrepareAgain(req, regions, prepared, &again, &reused);
    ExpectError(s, StatusCode::kInvalidArgument, {"'out'", "region 1"});
    EXPECT_EQ(s.reason(), Reason::kBadArgument);

    // Gone: the region's reason.
    regions.Remove(kBig);
    s = Runner(meta).PrepareAgain(req, regions, prepared, &again, &reused);
    ExpectError(s, StatusCode::kNotFound, {"region 1"});
  }
}

TEST_F(KernelOpsTest, CudaWrappingNeedsNoGpu) {
  // from_blob with an explicit device must not ask the driver about the
  // pointer: this machine may have no GPU at all.
  std::unique_ptr<PreparedCall> call;
  Status status = Runner(false).Prepare(PerTokenQuant(QuantIn(), QuantOut()), regions_, &call);
  EXPECT_TRUE(status.ok()) << status.ToString();
}

// ---- op lookup ------------------------------------------------------------------

TEST_F(KernelOpsTest, UnknownOp) {
  ExpectError(Prepare(Call("no_such_op", "out", {})), StatusCode::kNotFound,
              {"cache_dit_cuda_ops::no_such_op"});
}

TEST_F(KernelOpsTest, UnknownOverload) {
  ExpectError(Prepare(Call("fp8_comm_per_token_quant", "bogus", {QuantIn(), QuantOut()})),
              StatusCode::kNotFound, {"'bogus'", "'out'"});
}

TEST_F(KernelOpsTest, FunctionalOverloadRefused) {
  ExpectError(Prepare(Call("fp8_comm_per_token_quant", "", {QuantIn()})),
              StatusCode::kUnimplemented,
              {"cache_dit_cuda_ops::fp8_comm_per_token_quant", "new tensor"});
}

// ---- arity and types ------------------------------------------------------------

TEST_F(KernelOpsTest, WrongArity) {
  ExpectError(Prepare(Call("fp8_comm_per_token_quant", "out", {QuantIn()})),
              StatusCode::kInvalidArgument, {"expects 2", "got 1"});
  ExpectError(Prepare(Call("fp8_comm_per_token_quant", "out", {QuantIn(), QuantOut(), int64_t{1}})),
              StatusCode::kInvalidArgument, {"expects 2", "got 3"});
}

TEST_F(KernelOpsTest, IntWhereTensorExpected) {
  ExpectError(Prepare(Call("fp8_comm_per_token_quant", "out", {int64_t{7}, QuantOut()})),
              StatusCode::kInvalidArgument, {"'x'", "Tensor", "got int"});
}

TEST_F(KernelOpsTest, ListWhereTensorExpected) {
  ExpectError(
      Prepare(Call("fp8_comm_per_token_quant", "out", {QuantIn(), std::vector<int64_t>{4, 66}})),
      StatusCode::kInvalidArgument, {"'out'", "Tensor", "got int[]"});
}

TEST_F(KernelOpsTest, MissingTensor) {
  ExpectError(Prepare(Call("fp8_comm_per_token_quant", "out", {NoneArg{}, QuantOut()})),
              StatusCode::kInvalidArgument, {"'x'", "None"});
}

// ---- regions and bounds ---------------------------------------------------------

TEST_F(KernelOpsTest, UnknownRegion) {
  ExpectError(Prepare(PerTokenQuant(View(42, 0, {4, 64}, DType::kBFloat16), QuantOut())),
              StatusCode::kNotFound, {"'x'", "region 42"});
}

TEST_F(KernelOpsTest, NegativeSize) {
  ExpectError(
      Prepare(PerTokenQuant(View(kBig, 0, {-1, 64}, DType::kBFloat16, {64, 1}), QuantOut())),
      StatusCode::kInvalidArgument, {"'x'", "negative size -1"});
}

TEST_F(KernelOpsTest, NegativeStride) {
  ExpectError(
      Prepare(PerTokenQuant(View(kBig, 1024, {4, 64}, DType::kBFloat16, {-64, 1}), QuantOut())),
      StatusCode::kInvalidArgument, {"'x'", "negative stride -64"});
}

TEST_F(KernelOpsTest, ZeroStrideOnWrittenTensor) {
  ExpectError(
      Prepare(PerTokenQuant(QuantIn(), View(kBig, 4096, {4, 66}, DType::kFloat8E4M3FN, {0, 1}))),
      StatusCode::kInvalidArgument, {"'out'", "contiguous", "strides [0, 1]"});
}

TEST_F(KernelOpsTest, OverlappingStrideOnWrittenTensor) {
  ExpectError(Prepare(PerTokenQuant(View(kBig, 0, {4, 2}, DType::kBFloat16),
                                    View(kBig, 4096, {4, 4}, DType::kFloat8E4M3FN, {1, 1}))),
              StatusCode::kInvalidArgument, {"'out'", "contiguous", "strides [1, 1]"});
}

TEST_F(KernelOpsTest, ZeroStrideOnReadTensorLeftToTheOp) {
  // A broadcast read stays inside its extent, so the generic layer lets it
  // through; the op's layout contract decides (per-token quant wants a
  // contiguous input and says so at RunCall).
  std::unique_ptr<PreparedCall> call;
  ASSERT_TRUE(
      Runner(true).Prepare(PerTokenQuant(View(kSmall, 0, {4, 64}, DType::kBFloat16, {0, 1}), QuantOut()),
                  regions_, &call)
          .ok());
  ExpectError(Runner(true).Run(*call, nullptr, nullptr), StatusCode::kInvalidArgument,
              {"fp8_comm_per_token_quant.out", "contiguous"});
}

TEST_F(KernelOpsTest, WeightStoreMemoryIsReadButNeverWritten) {
  Status read = Prepare(PerTokenQuant(View(kStore, 0, {4, 64}, DType::kBFloat16), QuantOut()));
  EXPECT_TRUE(read.ok()) << read.ToString();
  ExpectError(Prepare(PerTokenQuant(QuantIn(), View(kStore, 4096, {4, 66}, DType::kFloat8E4M3FN))),
              StatusCode::kInvalidArgument, {"'out'", "region 5 is weight-store memory, which no op may write"});
  // Also a written view without an element (it would write nothing, and says so).
  ExpectError(Prepare(PerTokenQuant(View(kBig, 0, {0, 64}, DType::kBFloat16),
                                    View(kStore, 0, {0, 66}, DType::kFloat8E4M3FN))),
              StatusCode::kInvalidArgument, {"'out'", "weight-store memory"});
}

TEST_F(KernelOpsTest, OffsetPastRegionEnd) {
  ExpectError(
      Prepare(PerTokenQuant(View(kSmall, kSmallSize + 2, {1, 64}, DType::kBFloat16), QuantOut())),
      StatusCode::kInvalidArgument, {"'x'", "258", "256 bytes"});
}

TEST_F(KernelOpsTest, ViewEndingExactlyAtRegionEndPasses) {
  // [2, 64] bf16 = 256 bytes = the whole small region.
  Status status = Prepare(PerTokenQuant(View(kSmall, 0, {2, 64}, DType::kBFloat16),
                                        View(kBig, 4096, {2, 66}, DType::kFloat8E4M3FN)));
  EXPECT_TRUE(status.ok()) << status.ToString();
}

TEST_F(KernelOpsTest, ViewOneBytePastRegionEnd) {
  // 255 fp8 records bytes at offset 2 end at 257 in a 256-byte region.
  ExpectError(Prepare(Call("fp8_comm_per_token_dequant", "out",
                           {View(kSmall, 2, {1, 255}, DType::kFloat8E4M3FN),
                            View(kBig, 0, {1, 253}, DType::kBFloat16)})),
              StatusCode::kInvalidArgument, {"'x'", "ends at byte 257", "256 bytes"});
  Status at_end = Prepare(Call("fp8_comm_per_token_dequant", "out",
                               {View(kSmall, 1, {1, 255}, DType::kFloat8E4M3FN),
                                View(kBig, 0, {1, 253}, DType::kBFloat16)}));
  EXPECT_TRUE(at_end.ok()) << at_end.ToString();
}

TEST_F(KernelOpsTest, StridedViewPastRegionEnd) {
  // Dense, [2, 64] bf16 fills the region exactly; the padded row stride
  // pushes the last element out.
  ExpectError(
      Prepare(PerTokenQuant(View(kSmall, 0, {2, 64}, DType::kBFloat16, {65, 1}), QuantOut())),
      StatusCode::kInvalidArgument, {"'x'", "ends at byte 258", "strides [65, 1]"});
}

TEST_F(KernelOpsTest, WrittenViewPastRegionEnd) {
  ExpectError(Prepare(PerTokenQuant(View(kBig, 0, {4, 64}, DType::kBFloat16),
                                    View(kSmall, 0, {4, 66}, DType::kFloat8E4M3FN))),
              StatusCode::kInvalidArgument, {"'out'", "ends at byte 264", "256 bytes"});
}

TEST_F(KernelOpsTest, EmptyViewTouchesNoBytes) {
  // Any size 0: nothing is touched, so an offset at the very end is fine...
  Status status = Prepare(PerTokenQuant(View(kSmall, kSmallSize, {0, 64}, DType::kBFloat16),
                                        View(kSmall, kSmallSize, {0, 66}, DType::kFloat8E4M3FN)));
  EXPECT_TRUE(status.ok()) << status.ToString();
  // ...but the offset itself must still lie inside the region.
  ExpectError(
      Prepare(PerTokenQuant(View(kSmall, kSmallSize + 2, {0, 64}, DType::kBFloat16), QuantOut())),
      StatusCode::kInvalidArgument, {"'x'", "byte offset 258"});
}

// ---- views without a region (wire.h kNoRegion) ------------------------------------

// svdq_quantize_w4a4_act_fuse_lora.out without LoRA (rank 0): input [200, 128]
// bf16, output [256, 128] e4m3 and oscales [2, 256] bf16 in the big region,
// lora_act_out `lora` ([256, 0] f32: empty, no memory).
CallRequest ActNoLora(TensorRef lora) {
  return Call("svdq_quantize_w4a4_act_fuse_lora", "out",
              {View(kBig, 0, {200, 128}, DType::kBFloat16), NoneArg{}, NoneArg{}, false, false, int64_t{256},
               View(kBig, 65536, {256, 128}, DType::kFloat8E4M3FN),
               View(kBig, 2 * 65536, {2, 256}, DType::kBFloat16), std::move(lora)});
}

TEST_F(KernelOpsTest, AnEmptyOutputWithoutARegionRunsBesideTheOthers) {
  // The rank-0 case the clients once dropped: lora_act_out has no element,
  // output and oscales have many; the call is decoded, checked and run.
  std::unique_ptr<PreparedCall> call;
  Status status = Runner(true).Prepare(ActNoLora(View(kNoRegion, 0, {256, 0}, DType::kFloat32)), regions_, &call);
  ASSERT_TRUE(status.ok()) << status.ToString();
  EXPECT_EQ(call->regions(), std::vector<uint64_t>{kBig});  // region 0 is nothing to pin
  status = Runner(true).Validate(*call);
  EXPECT_TRUE(status.ok()) << status.ToString();
  status = Runner(true).Run(*call, nullptr, nullptr);
  EXPECT_TRUE(status.ok()) << status.ToString();
  // The same call wraps without a GPU on the CUDA runner (the empty view on the other tensors' device).
  status = Runner(false).Prepare(ActNoLora(View(kNoRegion, 0, {256, 0}, DType::kFloat32)), regions_, &call);
  EXPECT_TRUE(status.ok()) << status.ToString();
}

TEST_F(KernelOpsTest, RegionZeroWithElementsIsABadArgumentNamingTheTensor) {
  // Rank 16 sent without memory: refused before anything runs, as the
  // caller's mistake (raise ValueError), not as an unknown region (which
  // would make a client register again and retry).
  const Status status = Prepare(ActNoLora(View(kNoRegion, 0, {256, 16}, DType::kFloat32)));
  ExpectError(status, StatusCode::kInvalidArgument,
              {"svdq_quantize_w4a4_act_fuse_lora.out argument 'lora_act_out'", "sizes [256, 16]", "4096 elements",
               "region id 0"});
  EXPECT_EQ(status.reason(), Reason::kBadArgument);
  EXPECT_EQ(status.action(), v1::ClientAction::kRaiseValue);
}

TEST_F(KernelOpsTest, SizeTimesStrideOverflow) {
  const int64_t big = int64_t{1} << 62;
  ExpectError(
      Prepare(PerTokenQuant(View(kBig, 0, {big, 1}, DType::kBFloat16, {big, 1}), QuantOut())),
      StatusCode::kInvalidArgument, {"'x'", "overflows 64-bit", std::to_string(big)});
}

TEST_F(KernelOpsTest, ElementCountOverflow) {
  const int64_t big = int64_t{1} << 62;
  ExpectError(
      Prepare(PerTokenQuant(View(kBig, 0, {big, 64}, DType::kBFloat16, {0, 0}), QuantOut())),
      StatusCode::kInvalidArgument, {"'x'", "element count", std::to_string(big)});
}

TEST_F(KernelOpsTest, TooManyDims) {
  const std::vector<int64_t> sizes(9, 1);
  ExpectError(Prepare(PerTokenQuant(View(kBig, 0, sizes, DType::kBFloat16), QuantOut())),
              StatusCode::kInvalidArgument, {"'x'", "9 dims", "at most 8"});
}

TEST_F(KernelOpsTest, SizesAndStridesOfDifferentRank) {
  ExpectError(Prepare(PerTokenQuant(View(kBig, 0, {4, 64}, DType::kBFloat16, {64}), QuantOut())),
              StatusCode::kInvalidArgument, {"'x'", "2 sizes but 1 strides"});
}

TEST_F(KernelOpsTest, UnknownDtype) {
  ExpectError(Prepare(PerTokenQuant(View(kBig, 0, {4, 64}, static_cast<DType>(99)), QuantOut())),
              StatusCode::kInvalidArgument, {"'x'", "dtype(99)"});
  ExpectError(Prepare(PerTokenQuant(View(kBig, 0, {4, 64}, DType::kUnspecified), QuantOut())),
              StatusCode::kInvalidArgument, {"'x'", "unspecified"});
}

TEST_F(KernelOpsTest, MisalignedByteOffset) {
  ExpectError(Prepare(PerTokenQuant(View(kBig, 1, {4, 64}, DType::kBFloat16), QuantOut())),
              StatusCode::kInvalidArgument, {"'x'", "byte offset 1", "aligned", "bfloat16"});
}

TEST_F(KernelOpsTest, MisalignedRegionBase) {
  ExpectError(Prepare(PerTokenQuant(View(kOddBase, 0, {4, 64}, DType::kBFloat16), QuantOut())),
              StatusCode::kInvalidArgument, {"'x'", "aligned"});
}

TEST_F(KernelOpsTest, TensorsOnDifferentDevices) {
  // Meta calls ignore devices; real ones run on one device.
  ExpectError(Prepare(PerTokenQuant(QuantIn(), View(kOtherGpu, 0, {4, 66}, DType::kFloat8E4M3FN)),
                      /*meta=*/false),
              StatusCode::kInvalidArgument, {"'out'", "device 1", "device 0"});
}

// ---- the kernel library's own checks, through RunCall ---------------------------

TEST_F(KernelOpsTest, KernelRejectsFloat32Input) {
  ExpectError(PrepareAndRun(PerTokenQuant(View(kBig, 0, {4, 64}, DType::kFloat32), QuantOut())),
              StatusCode::kInvalidArgument, {"cache_dit_cuda_ops::fp8_comm_per_token_quant.out"});
}

TEST_F(KernelOpsTest, KernelRejectsMismatchedShapes) {
  ExpectError(
      PrepareAndRun(PerTokenQuant(QuantIn(), View(kBig, 4096, {4, 65}, DType::kFloat8E4M3FN))),
      StatusCode::kInvalidArgument, {"cache_dit_cuda_ops::fp8_comm_per_token_quant.out"});
}

// ---- catalog --------------------------------------------------------------------

TEST_F(KernelOpsTest, ListOpsHasEveryOpAndOverload) {
  const std::map<std::pair<std::string, std::string>, std::string> expected = {
      {{"fused_merge_attn_states", ""},
       "cache_dit_cuda_ops::fused_merge_attn_states(Tensor prev_out, Tensor prev_lse, "
       "Tensor suff_out, Tensor suff_lse) -> (Tensor out, Tensor lse)"},
      {{"fused_merge_attn_states", "out"},
       "cache_dit_cuda_ops::fused_merge_attn_states.out(Tensor prev_out, Tensor prev_lse, "
       "Tensor suff_out, Tensor suff_lse, *, Tensor(a!) out, Tensor(b!) lse) -> "
       "(Tensor(a!) out, Tensor(b!) lse)"},
      {{"fp8_comm_per_token_quant", ""},
       "cache_dit_cuda_ops::fp8_comm_per_token_quant(Tensor x) -> Tensor"},
      {{"fp8_comm_per_token_quant", "out"},
       "cache_dit_cuda_ops::fp8_comm_per_token_quant.out(Tensor x, *, Tensor(a!) out) -> "
       "Tensor(a!)"},
      {{"fp8_comm_per_token_dequant", ""},
       "cache_dit_cuda_ops::fp8_comm_per_token_dequant(Tensor x) -> Tensor"},
      {{"fp8_comm_per_token_dequant", "out"},
       "cache_dit_cuda_ops::fp8_comm_per_token_dequant.out(Tensor x, *, Tensor(a!) out) -> "
       "Tensor(a!)"},
      {{"fp8_comm_qkv_permute_quant", ""},
       "cache_dit_cuda_ops::fp8_comm_qkv_permute_quant(Tensor x) -> Tensor"},
      {{"fp8_comm_qkv_permute_quant", "out"},
       "cache_dit_cuda_ops::fp8_comm_qkv_permute_quant.out(Tensor x, *, Tensor(a!) out) -> "
       "Tensor(a!)"},
      {{"fp8_comm_qkv_permute_dequant", ""},
       "cache_dit_cuda_ops::fp8_comm_qkv_permute_dequant(Tensor quant_x) -> Tensor"},
      {{"fp8_comm_qkv_permute_dequant", "out"},
       "cache_dit_cuda_ops::fp8_comm_qkv_permute_dequant.out(Tensor quant_x, *, "
       "Tensor(a!) out) -> Tensor(a!)"},
  };
  const std::vector<OpInfo> ops = TorchCallRunner::ListOps();
  std::map<std::pair<std::string, std::string>, std::string> listed;
  for (const OpInfo& op : ops) listed[{op.name, op.overload}] = op.schema;
  for (const auto& [key, schema] : expected) {
    auto it = listed.find(key);
    ASSERT_NE(it, listed.end()) << key.first << "." << key.second << " is not listed";
    EXPECT_EQ(Normalize(it->second), Normalize(schema));
  }
  EXPECT_TRUE(std::is_sorted(ops.begin(), ops.end(), [](const OpInfo& a, const OpInfo& b) {
    return std::tie(a.name, a.overload) < std::tie(b.name, b.overload);
  }));
}

TEST(LoadOpLibraryTest, MissingFileNamesPathAndReason) {
  const Status status = TorchCallRunner::LoadOpLibrary("/nonexistent/libnope.so");
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
  EXPECT_NE(status.message().find("/nonexistent/libnope.so"), std::string::npos);
}

// ---- ops the runner takes at its first call, and ops registered after it ------------

// A runner takes the namespace's ops once, at its first Prepare (the daemon
// has loaded its libraries by then); an op registered later is looked up on
// each call: served, checked and refused the same way, and unknown again once
// its registration is gone.
TEST_F(DispatchTest, AnOpRegisteredAfterTheFirstCallIsServedAndCheckedTheSame) {
  TorchCallRunner runner(TorchCallRunner::Device::kMeta);
  std::unique_ptr<PreparedCall> call;
  const CallRequest late = Call("_opd_test_late", "out", {View(kBig, 0, {4, 8}, DType::kFloat32),
                                                          View(kBig, 4096, {4, 8}, DType::kFloat32)});
  const CallRequest late_bad_rows = Call("_opd_test_late", "out", {View(kBig, 0, {4, 8}, DType::kFloat32),
                                                                   View(kBig, 4096, {3, 8}, DType::kFloat32)});
  const CallRequest late_functional = Call("_opd_test_late", "", {View(kBig, 0, {4, 8}, DType::kFloat32)});
  ExpectError(runner.Prepare(late, regions_, &call), StatusCode::kNotFound, {"cache_dit_cuda_ops::_opd_test_late"});
  {
    torch::Library def(torch::Library::FRAGMENT, "cache_dit_cuda_ops", std::nullopt, __FILE__, __LINE__);
    def.def("_opd_test_late.out(Tensor x, *, Tensor(a!) out) -> Tensor(a!)");
    def.def("_opd_test_late(Tensor x) -> Tensor");
    torch::Library meta(torch::Library::IMPL, "cache_dit_cuda_ops", c10::DispatchKey::Meta, __FILE__, __LINE__);
    meta.impl("_opd_test_late.out", [](const at::Tensor& x, at::Tensor& out) -> at::Tensor& {
      TORCH_CHECK(x.size(0) == out.size(0), "late: rows differ (", x.size(0), " vs ", out.size(0), ")");
      return out;
    });

    ASSERT_TRUE(runner.Prepare(late, regions_, &call).ok());
    EXPECT_EQ(call->op_name(), "cache_dit_cuda_ops::_opd_test_late.out");
    EXPECT_TRUE(runner.Validate(*call).ok());
    ASSERT_TRUE(runner.Prepare(late_bad_rows, regions_, &call).ok());
    ExpectError(runner.Validate(*call), StatusCode::kInvalidArgument,
                {"cache_dit_cuda_ops::_opd_test_late.out", "rows differ (4 vs 3)"});
    ExpectError(runner.Prepare(late_functional, regions_, &call), StatusCode::kUnimplemented,
                {"cache_dit_cuda_ops::_opd_test_late", "new tensor"});
  }
  ExpectError(runner.Prepare(late, regions_, &call), StatusCode::kNotFound, {"cache_dit_cuda_ops::_opd_test_late"});
}

// ---- every decodable schema type, on the test-only op -----------------------------

class SchemaTypesTest : public DispatchTest {
 protected:
  // Arguments of _opd_test_types, in schema order, all valid.
  std::vector<Arg> Args() {
    return {View(kBig, 0, {2, 3}, DType::kFloat32),           // x
            NoneArg{},                                        // maybe
            int64_t{-5},                                      // n
            int64_t{7},                                       // s
            2.5,                                              // f
            true,                                             // b
            std::vector<int64_t>{1, 2, 3},                    // ints
            std::vector<int64_t>{4},                          // syms
            std::vector<double>{0.5, -1.0},                   // floats
            std::vector<bool>{true, false, true},             // bools
            NoneArg{},                                        // oi
            1.25,                                             // of
            std::vector<int64_t>{8, 9},                       // ol
            int64_t{static_cast<int32_t>(DType::kBFloat16)},  // dt
            std::vector<int64_t>{10, 11},                     // pair
            View(kBig, 1024, {2, 3}, DType::kFloat32)};       // out
  }
  static CallRequest Types(std::vector<Arg> args) {
    return Call("_opd_test_types", "", std::move(args));
  }
};

TEST_F(SchemaTypesTest, DecodesEveryType) {
  std::vector<Arg> args = Args();
  args[1] = View(kSmall, 0, {4}, DType::kInt64);
  SeenArgs().clear();
  Status status = PrepareAndRun(Types(std::move(args)));
  ASSERT_TRUE(status.ok()) << status.ToString();
  const std::vector<c10::IValue>& seen = SeenArgs();
  ASSERT_EQ(seen.size(), 16u);
  EXPECT_EQ(seen[0].toTensor().sizes(), at::IntArrayRef({2, 3}));
  EXPECT_EQ(seen[0].toTensor().scalar_type(), at::kFloat);
  EXPECT_TRUE(seen[0].toTensor().is_meta());
  EXPECT_EQ(seen[1].toTensor().scalar_type(), at::kLong);
  EXPECT_EQ(seen[2].toInt(), -5);
  EXPECT_EQ(seen[3].toInt(), 7);
  EXPECT_EQ(seen[4].toDouble(), 2.5);
  EXPECT_EQ(seen[5].toBool(), true);
  EXPECT_EQ(seen[6].toIntVector(), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(seen[7].toIntVector(), (std::vector<int64_t>{4}));
  EXPECT_EQ(seen[8].toDoubleVector(), (std::vector<double>{0.5, -1.0}));
  const c10::List<bool> bools = seen[9].toBoolList();
  EXPECT_EQ((std::vector<bool>(bools.begin(), bools.end())),
            (std::vector<bool>{true, false, true}));
  EXPECT_TRUE(seen[10].isNone());
  EXPECT_EQ(seen[11].toDouble(), 1.25);
  EXPECT_EQ(seen[12].toIntVector(), (std::vector<int64_t>{8, 9}));
  EXPECT_EQ(seen[13].toScalarType(), at::kBFloat16);
  EXPECT_EQ(seen[14].toIntVector(), (std::vector<int64_t>{10, 11}));
  EXPECT_EQ(seen[15].toTensor().sizes(), at::IntArrayRef({2, 3}));
}

TEST_F(SchemaTypesTest, NoneForOptionals) {
  std::vector<Arg> args = Args();
  args[11] = NoneArg{};  // float?
  args[12] = NoneArg{};  // int[]?
  args[13] = NoneArg{};  // ScalarType?
  SeenArgs().clear();
  ASSERT_TRUE(PrepareAndRun(Types(std::move(args))).ok());
  EXPECT_TRUE(SeenArgs().at(11).isNone());
  EXPECT_TRUE(SeenArgs().at(12).isNone());
  EXPECT_TRUE(SeenArgs().at(13).isNone());
}

TEST_F(SchemaTypesTest, IntWhereFloatExpected) {
  std::vector<Arg> args = Args();
  args[4] = int64_t{2};
  ExpectError(Prepare(Types(std::move(args))), StatusCode::kInvalidArgument,
              {"'f'", "float", "got int"});
}

TEST_F(SchemaTypesTest, FloatWhereIntExpected) {
  std::vector<Arg> args = Args();
  args[2] = 1.0;
  ExpectError(Prepare(Types(std::move(args))), StatusCode::kInvalidArgument,
              {"'n'", "int", "got float"});
}

TEST_F(SchemaTypesTest, BoolListWhereIntListExpected) {
  std::vector<Arg> args = Args();
  args[6] = std::vector<bool>{true};
  ExpectError(Prepare(Types(std::move(args))), StatusCode::kInvalidArgument,
              {"'ints'", "got bool[]"});
}

TEST_F(SchemaTypesTest, NoneForRequiredScalar) {
  std::vector<Arg> args = Args();
  args[5] = NoneArg{};
  ExpectError(Prepare(Types(std::move(args))), StatusCode::kInvalidArgument,
              {"'b'", "bool", "got None"});
}

TEST_F(SchemaTypesTest, FixedSizeListOfWrongLength) {
  std::vector<Arg> args = Args();
  args[14] = std::vector<int64_t>{1, 2, 3};
  ExpectError(Prepare(Types(std::move(args))), StatusCode::kInvalidArgument,
              {"'pair'", "exactly 2", "got 3"});
}

TEST_F(SchemaTypesTest, ListTooLong) {
  std::vector<Arg> args = Args();
  args[6] = std::vector<int64_t>(kMaxListLength + 1, 0);
  ExpectError(Prepare(Types(std::move(args))), StatusCode::kInvalidArgument,
              {"'ints'", std::to_string(kMaxListLength + 1) + " items"});
}

TEST_F(SchemaTypesTest, UnknownScalarTypeValue) {
  std::vector<Arg> args = Args();
  args[13] = int64_t{99};
  ExpectError(Prepare(Types(std::move(args))), StatusCode::kInvalidArgument, {"'dt'", "99"});
  args = Args();
  args[13] = int64_t{1} << 32 | static_cast<int32_t>(DType::kFloat32);  // must not wrap
  ExpectError(Prepare(Types(std::move(args))), StatusCode::kInvalidArgument, {"'dt'"});
}

TEST_F(SchemaTypesTest, UnsupportedSchemaTypes) {
  const TensorRef x = View(kBig, 0, {2}, DType::kFloat32);
  // Rejected for the type, with or without a value.
  ExpectError(Prepare(Call("_opd_test_layout", "", {x, NoneArg{}})), StatusCode::kUnimplemented,
              {"'layout'", "Layout"});
  ExpectError(Prepare(Call("_opd_test_layout", "", {x, int64_t{0}})), StatusCode::kUnimplemented,
              {"'layout'", "Layout"});
  ExpectError(Prepare(Call("_opd_test_tensor_list", "", {x})), StatusCode::kUnimplemented,
              {"'xs'", "Tensor"});
}

TEST_F(SchemaTypesTest, ZeroStrideAllowedOnReadTensor) {
  std::vector<Arg> args = Args();
  args[0] = View(kSmall, 0, {1000, 3}, DType::kFloat32, {0, 1});
  Status status = PrepareAndRun(Types(std::move(args)));
  EXPECT_TRUE(status.ok()) << status.ToString();
}

TEST_F(SchemaTypesTest, SizeOneDimsIgnoredInContiguityOfWrittenTensor) {
  std::vector<Arg> args = Args();
  args[15] = View(kBig, 1024, {2, 1, 3}, DType::kFloat32, {3, 12345, 1});
  Status status = Prepare(Types(std::move(args)));
  EXPECT_TRUE(status.ok()) << status.ToString();
}

// ---- views without a region (wire.h kNoRegion), on the test op --------------------

TEST_F(SchemaTypesTest, AnEmptyViewWithoutARegionIsAnEmptyTensorOfItsShape) {
  std::vector<Arg> args = Args();
  args[1] = View(kNoRegion, 0, {3, 0, 2}, DType::kFloat16, {7, 5, 1});  // maybe: strides as sent
  std::unique_ptr<PreparedCall> call;
  ASSERT_TRUE(Runner(true).Prepare(Types(std::move(args)), regions_, &call).ok());
  EXPECT_EQ(call->regions(), std::vector<uint64_t>{kBig});
  SeenArgs().clear();
  ASSERT_TRUE(Runner(true).Run(*call, nullptr, nullptr).ok());  // out has elements: the op runs
  ASSERT_EQ(SeenArgs().size(), 16u);
  const at::Tensor empty = SeenArgs()[1].toTensor();
  EXPECT_EQ(empty.sizes(), at::IntArrayRef({3, 0, 2}));
  EXPECT_EQ(empty.strides(), at::IntArrayRef({7, 5, 1}));
  EXPECT_EQ(empty.scalar_type(), at::kHalf);
  EXPECT_TRUE(empty.is_meta());
  EXPECT_EQ(empty.numel(), 0);
}

TEST_F(SchemaTypesTest, AnEmptyViewTakesTheDeviceOfTheOtherTensorsWhateverTheirOrder) {
  // CUDA runner, no GPU needed: the views are wrapped, never touched;
  // Validate hands them to the Meta kernel, which records them.
  std::vector<Arg> args = Args();
  args[0] = View(kNoRegion, 0, {0, 3}, DType::kFloat32);       // x, before any region
  args[15] = View(kOtherGpu, 0, {2, 3}, DType::kFloat32);      // out, on device 1
  std::unique_ptr<PreparedCall> call;
  Status status = Runner(false).Prepare(Types(std::move(args)), regions_, &call);
  ASSERT_TRUE(status.ok()) << status.ToString();
  SeenArgs().clear();
  ASSERT_TRUE(Runner(false).Validate(*call).ok());
  ASSERT_EQ(SeenArgs().size(), 16u);
  const at::Tensor x = SeenArgs()[0].toTensor();
  EXPECT_EQ(x.device(), at::Device(at::kCUDA, 1));
  EXPECT_EQ(x.sizes(), at::IntArrayRef({0, 3}));
  EXPECT_EQ(x.data_ptr(), nullptr);  // no memory behind it
  EXPECT_EQ(SeenArgs()[15].toTensor().device(), at::Device(at::kCUDA, 1));
}

TEST_F(SchemaTypesTest, ACallWithOnlyEmptyViewsRunsOnTheDaemonsDeviceAndLaunchesNothing) {
  static TorchCallRunner on_device_3(TorchCallRunner::Device::kCuda, 3);
  std::vector<Arg> args = Args();
  args[0] = View(kNoRegion, 0, {0, 3}, DType::kFloat32);
  args[15] = View(kNoRegion, 0, {2, 0}, DType::kFloat32);
  std::unique_ptr<PreparedCall> call;
  Status status = on_device_3.Prepare(Types(std::move(args)), regions_, &call);
  ASSERT_TRUE(status.ok()) << status.ToString();
  EXPECT_TRUE(call->regions().empty());
  SeenArgs().clear();
  ASSERT_TRUE(on_device_3.Validate(*call).ok());  // still checked by the Meta kernel
  ASSERT_EQ(SeenArgs().size(), 16u);
  EXPECT_EQ(SeenArgs()[0].toTensor().device(), at::Device(at::kCUDA, 3));
  EXPECT_EQ(SeenArgs()[15].toTensor().device(), at::Device(at::kCUDA, 3));
  // Nothing to write: Run makes no CUDA call at all (this machine may have
  // no GPU, and never a device 3) and succeeds.
  bool sticky = false;
  status = on_device_3.Run(*call, nullptr, &sticky);
  EXPECT_TRUE(status.ok()) << status.ToString();
  EXPECT_FALSE(sticky);
}

TEST_F(SchemaTypesTest, RunLaunchesNothingWhenNoWrittenTensorHasAnElement) {
  const auto ran = [&](TensorRef x, TensorRef out) {
    std::vector<Arg> args = Args();
    args[0] = std::move(x);
    args[15] = std::move(out);
    std::unique_ptr<PreparedCall> call;
    Status status = Runner(true).Prepare(Types(std::move(args)), regions_, &call);
    EXPECT_TRUE(status.ok()) << status.ToString();
    if (!status.ok()) return false;
    SeenArgs().clear();
    EXPECT_TRUE(Runner(true).Run(*call, nullptr, nullptr).ok());
    return !SeenArgs().empty();
  };
  const TensorRef full_x = View(kBig, 0, {2, 3}, DType::kFloat32);
  const TensorRef full_out = View(kBig, 1024, {2, 3}, DType::kFloat32);
  // Every tensor empty, without regions: skipped.
  EXPECT_FALSE(ran(View(kNoRegion, 0, {0, 3}, DType::kFloat32), View(kNoRegion, 0, {0, 3}, DType::kFloat32)));
  // The written tensor empty (in a region or not), an input with elements: nothing can be written, skipped.
  EXPECT_FALSE(ran(full_x, View(kNoRegion, 0, {0, 3}, DType::kFloat32)));
  EXPECT_FALSE(ran(full_x, View(kBig, 1024, {0, 3}, DType::kFloat32)));
  // The written tensor has elements: the op runs, whatever is empty beside it.
  EXPECT_TRUE(ran(View(kNoRegion, 0, {0, 3}, DType::kFloat32), full_out));
  EXPECT_TRUE(ran(full_x, full_out));
}

TEST_F(SchemaTypesTest, RegionZeroIsOnlyForAnEmptyViewAtOffsetZero) {
  std::vector<Arg> args = Args();
  args[0] = View(kNoRegion, 0, {2, 3}, DType::kFloat32);
  Status status = Prepare(Types(std::move(args)));
  ExpectError(status, StatusCode::kInvalidArgument,
              {"_opd_test_types argument 'x'", "sizes [2, 3]", "6 elements", "region id 0"});
  EXPECT_EQ(status.reason(), Reason::kBadArgument);
  // A 0-dim view has one element.
  args = Args();
  args[0] = View(kNoRegion, 0, {}, DType::kFloat32);
  ExpectError(Prepare(Types(std::move(args)), /*meta=*/false), StatusCode::kInvalidArgument,
              {"'x'", "sizes []", "1 elements"});
  args = Args();
  args[15] = View(kNoRegion, 64, {0, 3}, DType::kFloat32);
  ExpectError(Prepare(Types(std::move(args))), StatusCode::kInvalidArgument, {"'out'", "byte offset 64"});
  // Checked like any view otherwise.
  args = Args();
  args[0] = View(kNoRegion, 0, {0, -1}, DType::kFloat32, {1, 1});
  ExpectError(Prepare(Types(std::move(args))), StatusCode::kInvalidArgument, {"'x'", "negative size -1"});
  args = Args();
  args[0] = View(kNoRegion, 0, {0, 3}, DType::kUnspecified);
  ExpectError(Prepare(Types(std::move(args))), StatusCode::kInvalidArgument, {"'x'", "unknown dtype"});
  args = Args();
  args[0] = View(kNoRegion, 0, {0, 3}, DType::kFloat32, {1});
  ExpectError(Prepare(Types(std::move(args))), StatusCode::kInvalidArgument, {"'x'", "2 sizes but 1 strides"});
}

}  // namespace
}  // namespace cache_dit_opd
