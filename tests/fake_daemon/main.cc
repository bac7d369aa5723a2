// opd_fake_daemon: the real daemon (server/daemon_main.h: the same flags,
// sockets, gRPC service, session channel, rings, executor and error
// reasons) on fake device operations, for tests on machines without a GPU.
//
//   - the "GPU" is always usable; its UUID is $CACHE_DIT_OPD_FAKE_GPU_UUID,
//     else $CUDA_VISIBLE_DEVICES when that is one GPU UUID (what the per-node
//     launcher sets for each daemon it starts), else
//     GPU-00000000-0000-0000-0000-000000000000; unless
//     $CACHE_DIT_OPD_FAKE_NOT_SERVING names a reason not to serve;
//   - stream memory operations write host memory at once (a lane's "done"
//     is written as soon as its call runs); with $CACHE_DIT_OPD_FAKE_HOLD=1
//     they are held forever (kernels that never finish); with
//     $CACHE_DIT_OPD_FAKE_STICKY_AFTER=n the n-th one fails with a sticky
//     CUDA error (the device is lost: the daemon fails every session and
//     exits 1);
//   - a region handle carries its allocation (tests/fake_daemon/fakes.h,
//     as the Python client's FakeDriver writes it);
//   - calls are decoded and checked by the kernel library's Meta kernels
//     (TorchCallRunner on meta tensors): every validation the real daemon
//     makes is made, and no output is computed;
//   - the weight store's memory is host memory (HostStoreAllocator).
#include <cstdlib>
#include <memory>
#include <string>

#include "common/gpu_uuid.h"
#include "server/daemon_main.h"
#include "server/dispatch/torch_call_runner.h"
#include "tests/fake_daemon/fakes.h"

namespace cache_dit_opd {
namespace {

std::string Env(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : fallback;
}

class FakeBackend final : public DeviceBackend {
 public:
  DeviceInfo Probe(int device) override {
    DeviceInfo info;
    info.index = device;
    const std::string visible = Env("CUDA_VISIBLE_DEVICES", "");
    info.uuid = Env("CACHE_DIT_OPD_FAKE_GPU_UUID",
                    IsGpuUuid(visible) ? visible.c_str() : "GPU-00000000-0000-0000-0000-000000000000");
    info.name = "fake device";
    info.reason = Env("CACHE_DIT_OPD_FAKE_NOT_SERVING", "");
    info.ok = info.reason.empty();
    return info;
  }
  Status Open(const DeviceInfo&, std::unique_ptr<DeviceOps>* ops, std::unique_ptr<RegionOpener>* opener) override {
    auto fake_ops = std::make_unique<testing::FakeDeviceOps>();
    fake_ops->hold_writes = Env("CACHE_DIT_OPD_FAKE_HOLD", "0") == "1";
    fake_ops->sticky_after = std::strtoul(Env("CACHE_DIT_OPD_FAKE_STICKY_AFTER", "0").c_str(), nullptr, 10);
    fake_ops->max_queued = std::strtoul(Env("CACHE_DIT_OPD_FAKE_MAX_QUEUED", "0").c_str(), nullptr, 10);
    auto fake_opener = std::make_unique<testing::FakeRegionOpener>();
    fake_opener->decode_handles = true;
    *ops = std::move(fake_ops);
    *opener = std::move(fake_opener);
    return Status::Ok();
  }
  Status LoadOpLibrary(const std::string& path) override { return TorchCallRunner::LoadOpLibrary(path); }
  std::vector<OpInfo> ListOps() override { return TorchCallRunner::ListOps(); }
  CallRunner* runner() override { return &runner_; }
  StoreAllocator* store_allocator() override { return &store_; }

 private:
  TorchCallRunner runner_{TorchCallRunner::Device::kMeta};
  testing::HostStoreAllocator store_;  // the weight store in host memory
};

}  // namespace
}  // namespace cache_dit_opd

int main(int argc, char** argv) {
  cache_dit_opd::FakeBackend backend;
  return cache_dit_opd::RunDaemon(argc, argv, backend);
}
