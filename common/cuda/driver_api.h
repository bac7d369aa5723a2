// File: common/cuda/driver_api.h
//
// The CUDA driver entry points the daemon and the C++ client use, resolved at
// run time through cudaGetDriverEntryPointByVersion so that no binary links
// libcuda: on a machine without a driver the daemon still loads, answers
// GetVersion and reports NOT_SERVING, and a client program still loads
// (docs/DESIGN.md section 5). Target opd_cuda_driver.
//
// Versions are pinned: the stream memory operations are requested at 12000,
// which resolves to the _v2 entry points (cuStreamWriteValue64_v2 /
// cuStreamWaitValue64_v2 / cuStreamBatchMemOp_v2). The unversioned v1 symbols return
// CUDA_ERROR_NOT_SUPPORTED on current drivers (measured on the H200 host).
//
// Includes CUDA headers, never torch.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <string>

#include "common/status.h"

namespace cache_dit_opd::cuda {

struct DriverApi {
  PFN_cuStreamWriteValue64_v11070 stream_write_value64 = nullptr;  // cuStreamWriteValue64_v2
  PFN_cuStreamWaitValue64_v11070 stream_wait_value64 = nullptr;    // cuStreamWaitValue64_v2
  PFN_cuStreamBatchMemOp_v11070 stream_batch_mem_op = nullptr;      // cuStreamBatchMemOp_v2
  PFN_cuMemHostRegister_v6050 mem_host_register = nullptr;
  PFN_cuMemHostUnregister_v4000 mem_host_unregister = nullptr;
  PFN_cuMemHostGetDevicePointer_v3020 mem_host_get_device_pointer = nullptr;
  PFN_cuMemGetAddressRange_v3020 mem_get_address_range = nullptr;
  PFN_cuIpcGetMemHandle_v4010 ipc_get_mem_handle = nullptr;
  PFN_cuPointerGetAttributes_v7000 pointer_get_attributes = nullptr;
  // Virtual memory management: the weight store's shareable allocations
  // (server/device/cuda_store_allocator.h) and a client's expandable
  // segments mapped into the daemon.
  PFN_cuMemCreate_v10020 mem_create = nullptr;
  PFN_cuMemRelease_v10020 mem_release = nullptr;
  PFN_cuMemAddressReserve_v10020 mem_address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 mem_address_free = nullptr;
  PFN_cuMemMap_v10020 mem_map = nullptr;
  PFN_cuMemUnmap_v10020 mem_unmap = nullptr;
  PFN_cuMemSetAccess_v10020 mem_set_access = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 mem_get_allocation_granularity = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 mem_export_to_shareable_handle = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 mem_import_from_shareable_handle = nullptr;
  PFN_cuMemRetainAllocationHandle_v11000 mem_retain_allocation_handle = nullptr;
  PFN_cuMemGetAllocationPropertiesFromHandle_v10020 mem_get_allocation_properties_from_handle = nullptr;
  PFN_cuGetErrorName_v6000 get_error_name = nullptr;
  PFN_cuGetErrorString_v6000 get_error_string = nullptr;
};

// GetDriverApi
//
// Resolves every entry point once per process (thread-safe). Returns nullptr
// and sets `*status` (UNAVAILABLE, naming the symbol and the runtime error)
// when the driver or a symbol is missing.
const DriverApi* GetDriverApi(Status* status);

// "CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory access was encountered)";
// works without a driver (falls back to the number).
std::string DriverErrorString(CUresult result);

// "cudaErrorInvalidValue (invalid argument)" for a runtime error code.
std::string RuntimeErrorString(int cuda_error);

// True for the errors that leave the CUDA context unusable (illegal address,
// launch failure, hardware exception, ECC, ...): the one table the daemon's
// stream operations and its dispatch layer both consult. Takes a CUresult or
// a cudaError_t: the two agree on every one of these numbers.
bool IsStickyCudaError(int code);

}  // namespace cache_dit_opd::cuda
