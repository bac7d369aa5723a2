// File: common/gpu_uuid.h
//
// The GPU UUID as this project writes it: the discovery key of a daemon
// (`<GPU-UUID>.sock`), what GetVersion/OpenSession report and what a client
// asks for. One form for every device, MIG instances included:
//
//   "GPU-" + the 16 bytes cudaDeviceProp::uuid reports, as 8-4-4-4-12
//   lowercase hex.
//
// Under MIG the CUDA runtime reports the compute instance's own UUID, so the
// same bytes formatted the same way on both sides name the same instance.
// nvidia-smi prints MIG instances as "MIG-..."; that spelling is not a key here
// (IsGpuUuid refuses it), because a client never sees it from CUDA. The Python
// client writes the same form (python/cache_dit_opd/_discovery.py) and both are
// tested against the same vectors.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace cache_dit_opd {

// FormatGpuUuid
//
// "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f" for the bytes 0x00 .. 0x0f.
std::string FormatGpuUuid(const uint8_t bytes[16]);

// IsGpuUuid
//
// True for "GPU-" + 8-4-4-4-12 hex digits (either case), nothing else.
bool IsGpuUuid(std::string_view text);

}  // namespace cache_dit_opd
