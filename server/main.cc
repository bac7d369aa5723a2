// cache-dit-opd: the daemon on the GPU (server/daemon_main.h does the rest).
#include <memory>
#include <string>
#include <vector>

#include <spdlog/spdlog.h>

#include "server/daemon_main.h"
#include "server/device/cuda_device_ops.h"
#include "server/device/cuda_store_allocator.h"
#include "server/device/device_probe.h"
#include "server/device/ipc_region_opener.h"
#include "server/dispatch/torch_call_runner.h"

namespace cache_dit_opd {
namespace {

class CudaBackend final : public DeviceBackend {
 public:
  DeviceInfo Probe(int device) override {
    std::vector<std::string> notes;
    cuda::ConfigureCudaEnvironment(&notes);
    for (const std::string& n : notes) spdlog::warn("{}", n);
    return cuda::ProbeDevice(device);
  }
  Status Open(const DeviceInfo& device, std::unique_ptr<DeviceOps>* ops,
              std::unique_ptr<RegionOpener>* opener) override {
    std::unique_ptr<cuda::CudaDeviceOps> cuda_ops;
    OPD_RETURN_IF_ERROR(cuda::CudaDeviceOps::Create(device.index, &cuda_ops));
    *ops = std::move(cuda_ops);
    *opener = std::make_unique<cuda::IpcRegionOpener>(device.index);
    // The device a call without any region tensor (only empty ones) runs on.
    runner_ = std::make_unique<TorchCallRunner>(TorchCallRunner::Device::kCuda, device.index);
    store_allocator_ = std::make_unique<cuda::CudaStoreAllocator>(device.index);
    return Status::Ok();
  }
  Status LoadOpLibrary(const std::string& path) override { return TorchCallRunner::LoadOpLibrary(path); }
  std::vector<OpInfo> ListOps() override { return TorchCallRunner::ListOps(); }
  CallRunner* runner() override { return runner_.get(); }
  StoreAllocator* store_allocator() override { return store_allocator_.get(); }

 private:
  std::unique_ptr<TorchCallRunner> runner_;  // made by Open, for the opened device
  std::unique_ptr<cuda::CudaStoreAllocator> store_allocator_;
};

}  // namespace
}  // namespace cache_dit_opd

int main(int argc, char** argv) {
  cache_dit_opd::CudaBackend backend;
  return cache_dit_opd::RunDaemon(argc, argv, backend);
}
