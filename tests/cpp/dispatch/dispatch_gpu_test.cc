// PrepareCall/RunCall on a real device: fp8_comm_per_token_quant.out run
// through the dispatch layer on the caller's stream must produce the same
// bytes as the functional op called in-process on the same inputs. Skips
// where no CUDA device exists.
#include "server/dispatch/torch_call_runner.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/BFloat16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

namespace cache_dit_opd {
namespace {

// One runner per device kind: a call goes back to the runner that prepared it.
TorchCallRunner& Runner(bool meta) {
  static TorchCallRunner cuda(TorchCallRunner::Device::kCuda);
  static TorchCallRunner on_meta(TorchCallRunner::Device::kMeta);
  return meta ? on_meta : cuda;
}

constexpr uint64_t kRegionId = 1;
constexpr uint64_t kRegionBytes = 1 << 20;

class OneRegion final : public RegionResolver {
 public:
  explicit OneRegion(MappedRegion region) : region_(region) {}
  Status Resolve(uint64_t region_id, MappedRegion* out) const override {
    if (region_id != kRegionId) return Status::NotFound("region ", region_id, " is not registered");
    *out = region_;
    return Status::Ok();
  }

 private:
  MappedRegion region_;
};

std::string OpsLibraryPath() {
  const char* env = std::getenv("CACHE_DIT_OPS_LIBRARY");
  return env != nullptr && *env != '\0' ? env : CACHE_DIT_OPS_LIBRARY;
}

class DispatchGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      cudaGetLastError();
      GTEST_SKIP() << "no CUDA device";
    }
    if (OpsLibraryPath().empty()) GTEST_SKIP() << "no kernel library target in this build";
    const Status loaded = TorchCallRunner::LoadOpLibrary(OpsLibraryPath());
    ASSERT_TRUE(loaded.ok()) << loaded.ToString();
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&base_, kRegionBytes), cudaSuccess);
    ASSERT_EQ(cudaMemset(base_, 0, kRegionBytes), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    regions_ = std::make_unique<OneRegion>(MappedRegion{base_, kRegionBytes, 0});
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (base_ != nullptr) cudaFree(base_);
  }

  void* base_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<OneRegion> regions_;
};

// Rows of mixed magnitude, a zero row (the amax floor) and a row whose
// values saturate e4m3's range after scaling.
std::vector<c10::BFloat16> Inputs(int64_t rows, int64_t d) {
  std::vector<c10::BFloat16> x(rows * d);
  uint32_t state = 12345;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < d; ++i) {
      state = state * 1664525u + 1013904223u;
      const float unit = static_cast<float>(state >> 8) / static_cast<float>(1 << 24) - 0.5f;
      float v = unit * std::ldexp(1.0f, static_cast<int>(r % 7) * 3 - 6);
      if (r == 1) v = 0.0f;
      if (r == 2 && i == 0) v = 3.0e4f;
      x[r * d + i] = c10::BFloat16(v);
    }
  }
  return x;
}

TEST_F(DispatchGpuTest, PerTokenQuantMatchesInProcessOp) {
  const auto functional =
      c10::Dispatcher::singleton().findSchema({"cache_dit_cuda_ops::fp8_comm_per_token_quant", ""});
  ASSERT_TRUE(functional.has_value());
  for (const int64_t d : {64, 37, 1, 4096}) {
    SCOPED_TRACE("D = " + std::to_string(d));
    const int64_t rows = 9;
    const std::vector<c10::BFloat16> x = Inputs(rows, d);
    const uint64_t x_offset = 256;
    // An odd offset: the fp8 records have no alignment beyond one byte.
    const uint64_t out_offset = 512 * 1024 + 1;
    const size_t out_bytes = rows * (d + 2);
    ASSERT_EQ(cudaMemcpy(static_cast<char*>(base_) + x_offset, x.data(), x.size() * 2,
                         cudaMemcpyHostToDevice),
              cudaSuccess);

    CallRequest req;
    req.op = "fp8_comm_per_token_quant";
    req.overload = "out";
    req.args = {TensorRef{kRegionId, x_offset, {rows, d}, {d, 1}, DType::kBFloat16},
                TensorRef{kRegionId, out_offset, {rows, d + 2}, {d + 2, 1}, DType::kFloat8E4M3FN}};
    std::unique_ptr<PreparedCall> call;
    Status status = Runner(false).Prepare(req, *regions_, &call);
    ASSERT_TRUE(status.ok()) << status.ToString();
    bool sticky = false;
    status = Runner(false).Run(*call, stream_, &sticky);
    ASSERT_TRUE(status.ok()) << status.ToString();
    EXPECT_FALSE(sticky);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    std::vector<uint8_t> served(out_bytes);
    ASSERT_EQ(cudaMemcpy(served.data(), static_cast<char*>(base_) + out_offset, out_bytes,
                         cudaMemcpyDeviceToHost),
              cudaSuccess);

    const at::Device device(at::kCUDA, 0);
    at::Tensor x_tensor = at::for_blob(static_cast<char*>(base_) + x_offset, {rows, d})
                              .options(at::TensorOptions().dtype(at::kBFloat16).device(device))
                              .target_device(device)
                              .make_tensor();
    torch::jit::Stack stack{x_tensor};
    functional->callBoxed(stack);
    ASSERT_EQ(stack.size(), 1u);
    const at::Tensor reference = stack[0].toTensor();
    ASSERT_TRUE(reference.is_contiguous());
    ASSERT_EQ(reference.nbytes(), out_bytes);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint8_t> expected(out_bytes);
    ASSERT_EQ(cudaMemcpy(expected.data(), reference.data_ptr(), out_bytes, cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(std::memcmp(served.data(), expected.data(), out_bytes), 0);
  }
}

TEST_F(DispatchGpuTest, RunsOnTheGivenStream) {
  // The lane stream is held behind a host function until the test releases
  // it: a kernel launched anywhere else would write the output at once.
  const int64_t rows = 4, d = 64;
  const std::vector<c10::BFloat16> x = Inputs(rows, d);
  ASSERT_EQ(cudaMemcpy(base_, x.data(), x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  const uint64_t out_offset = 4096;
  const size_t out_bytes = rows * (d + 2);
  CallRequest req;
  req.op = "fp8_comm_per_token_quant";
  req.overload = "out";
  req.args = {TensorRef{kRegionId, 0, {rows, d}, {d, 1}, DType::kBFloat16},
              TensorRef{kRegionId, out_offset, {rows, d + 2}, {d + 2, 1}, DType::kFloat8E4M3FN}};
  std::unique_ptr<PreparedCall> call;
  ASSERT_TRUE(Runner(false).Prepare(req, *regions_, &call).ok());
  // The process's first call runs torch's lazy CUDA initialization, which
  // may synchronize the device: get it done before the stream is held.
  ASSERT_TRUE(Runner(false).Run(*call, stream_, nullptr).ok());
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  ASSERT_EQ(cudaMemset(static_cast<char*>(base_) + out_offset, 0, out_bytes), cudaSuccess);

  cudaStream_t probe = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&probe, cudaStreamNonBlocking), cudaSuccess);

  // Nothing below may return before `released` is set.
  static std::atomic<bool> released;
  released = false;
  ASSERT_EQ(cudaLaunchHostFunc(
                stream_,
                [](void*) {
                  // Bounded, so that a launch that wrongly synchronizes
                  // fails the test instead of hanging it.
                  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
                  while (!released.load() && std::chrono::steady_clock::now() < deadline) {
                  }
                },
                nullptr),
            cudaSuccess);
  const Status status = Runner(false).Run(*call, stream_, nullptr);
  // Pinned, so the probe's copy is a real async copy: a pageable one may be
  // staged through the driver's own thread, which the host function blocks.
  uint8_t* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&pinned), out_bytes), cudaSuccess);
  std::memset(pinned, 0xff, out_bytes);
  const cudaError_t copied = cudaMemcpyAsync(pinned, static_cast<char*>(base_) + out_offset,
                                             out_bytes, cudaMemcpyDeviceToHost, probe);
  const cudaError_t probed = cudaStreamSynchronize(probe);
  const cudaError_t pending = cudaStreamQuery(stream_);
  released = true;
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  cudaStreamDestroy(probe);
  const std::vector<uint8_t> before(pinned, pinned + out_bytes);
  cudaFreeHost(pinned);

  ASSERT_TRUE(status.ok()) << status.ToString();
  ASSERT_EQ(copied, cudaSuccess);
  ASSERT_EQ(probed, cudaSuccess);
  EXPECT_EQ(pending, cudaErrorNotReady);
  EXPECT_EQ(before, std::vector<uint8_t>(out_bytes, 0)) << "the op ran before its stream did";
  std::vector<uint8_t> after(out_bytes, 0);
  ASSERT_EQ(cudaMemcpy(after.data(), static_cast<char*>(base_) + out_offset, out_bytes,
                       cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_NE(after, std::vector<uint8_t>(out_bytes, 0));
}

TEST_F(DispatchGpuTest, KernelCheckRejectionIsNotSticky) {
  CallRequest req;
  req.op = "fp8_comm_per_token_quant";
  req.overload = "out";
  req.args = {TensorRef{kRegionId, 0, {4, 64}, {64, 1}, DType::kFloat32},
              TensorRef{kRegionId, 4096, {4, 66}, {66, 1}, DType::kFloat8E4M3FN}};
  std::unique_ptr<PreparedCall> call;
  ASSERT_TRUE(Runner(false).Prepare(req, *regions_, &call).ok());
  bool sticky = false;
  const Status status = Runner(false).Run(*call, stream_, &sticky);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
  EXPECT_FALSE(sticky);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
}  // namespace cache_dit_opd
