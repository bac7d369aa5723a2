// What DRAM moves for a given read : write mix, the yardstick for kernels
// whose traffic is not a copy's. The fp8 dequantizers read 1 byte and write
// 2 for each element (records in, bf16 out), the quantizers the reverse; both
// are reported as a share of a device-to-device copy (1 : 1) in
// bench/kernels.py. This probe runs the simplest kernel of each mix (16-byte
// loads and stores, no arithmetic) and prints its bandwidth beside the copy's,
// so a kernel can be held to its own mix's ceiling.
//
//   opd_traffic_probe [MiB read by the 1:1 case, default 1024]
//
// Every kernel moves the same read + write bytes as the copy case give or take
// rounding, in two grid shapes: one 16-byte vector (of the read side) per
// thread and launch-sized grid ("flat"), and a grid of resident blocks
// striding over the data with four loads in flight per thread ("resident").
// The plain kernels give each thread its own kR, kW consecutive vectors, so
// a warp's store instruction of a 1 : 2 mix writes every other 16 bytes (half
// of each 32-byte sector). Two more 1 : 2 layouts show what that costs: the
// same vectors with a warp's w-th store covering 512 contiguous bytes
// ("warp-contiguous"), and 8-byte loads with one 16-byte store per thread
// ("8-byte loads": the dequantizers' pack, 8 FP8 values to 8 BF16 ones).
// Bandwidth = (bytes read + bytes written) / median time of 20 launches.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_check.h"

namespace {

constexpr int kThreads = 256;

// Unit i reads kR vectors in[i * kR ..] and writes kW vectors out[i * kW ..]
// (each written vector mixes the read ones, so nothing folds away).
template <int kR, int kW>
__device__ __forceinline__ void unit(const uint4* __restrict__ in, uint4* __restrict__ out, long long i) {
  uint4 v[kR];
#pragma unroll
  for (int r = 0; r < kR; ++r) v[r] = in[i * kR + r];
#pragma unroll
  for (int w = 0; w < kW; ++w) {
    uint4 o = v[w % kR];
    o.x ^= static_cast<unsigned>(w);
    out[i * kW + w] = o;
  }
}

template <int kR, int kW>
__global__ void __launch_bounds__(kThreads)
    flat(const uint4* __restrict__ in, uint4* __restrict__ out, long long units) {
  const long long i = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < units) unit<kR, kW>(in, out, i);
}

// Four units per thread per step, their loads issued before any store.
template <int kR, int kW>
__global__ void __launch_bounds__(kThreads)
    resident(const uint4* __restrict__ in, uint4* __restrict__ out, long long units) {
  const long long stride = static_cast<long long>(gridDim.x) * kThreads;
  long long i = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x;
  for (; i + 3 * stride < units; i += 4 * stride) {
    uint4 v[4][kR];
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int r = 0; r < kR; ++r) v[u][r] = in[(i + u * stride) * kR + r];
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int w = 0; w < kW; ++w) {
        uint4 o = v[u][w % kR];
        o.x ^= static_cast<unsigned>(w);
        out[(i + u * stride) * kW + w] = o;
      }
  }
  for (; i < units; i += stride) unit<kR, kW>(in, out, i);
}

// 1 : 2, a warp's w-th store covering 32 contiguous vectors.
__global__ void __launch_bounds__(kThreads)
    flat_warp_contiguous(const uint4* __restrict__ in, uint4* __restrict__ out, long long units) {
  const long long i = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= units) return;
  const uint4 v = in[i];
  const long long base = (i >> 5) * 64 + (i & 31);
  out[base] = v;
  out[base + 32] = make_uint4(v.x ^ 1u, v.y, v.z, v.w);
}

// 1 : 2, each thread reads 8 bytes and writes 16.
__global__ void __launch_bounds__(kThreads)
    flat_pack8(const uint2* __restrict__ in, uint4* __restrict__ out, long long units) {
  const long long i = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= units) return;
  const uint2 v = in[i];
  out[i] = make_uint4(v.x, v.y, v.x ^ 1u, v.y);
}

// The same with four units per thread in flight, blocks resident.
__global__ void __launch_bounds__(kThreads)
    resident_pack8(const uint2* __restrict__ in, uint4* __restrict__ out, long long units) {
  const long long stride = static_cast<long long>(gridDim.x) * kThreads;
  long long i = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x;
  for (; i + 3 * stride < units; i += 4 * stride) {
    uint2 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = in[i + u * stride];
#pragma unroll
    for (int u = 0; u < 4; ++u) out[i + u * stride] = make_uint4(v[u].x, v[u].y, v[u].x ^ 1u, v[u].y);
  }
  for (; i < units; i += stride) out[i] = make_uint4(in[i].x, in[i].y, in[i].x ^ 1u, in[i].y);
}

template <typename F>
float median_ms(F&& launch) {
  cudaEvent_t a, b;
  PROBE_CHECK(cudaEventCreate(&a));
  PROBE_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) launch();
  std::vector<float> t;
  for (int i = 0; i < 20; ++i) {
    PROBE_CHECK(cudaEventRecord(a));
    launch();
    PROBE_CHECK(cudaEventRecord(b));
    PROBE_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    PROBE_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  PROBE_CHECK(cudaGetLastError());
  std::sort(t.begin(), t.end());
  PROBE_CHECK(cudaEventDestroy(a));
  PROBE_CHECK(cudaEventDestroy(b));
  return t[t.size() / 2];
}

struct Mix {
  const char* name;
  int r, w;
};

struct Device {
  const uint4* in;
  uint4* out;
  int sms;
  double memcpy_gbs;
};

// Times `kernel` over `units` units of `unit_bytes` (read + write) each and
// prints its table row; a resident grid has as many blocks as fit at once.
template <typename In>
void run(const Device& d, void (*kernel)(const In*, uint4*, long long), const char* mix, const char* grid,
         bool resident, long long units, int unit_bytes) {
  long long blocks = (units + kThreads - 1) / kThreads;
  if (resident) {
    int per_sm = 0;
    PROBE_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0));
    blocks = std::min<long long>(blocks, static_cast<long long>(per_sm) * d.sms);
  }
  const In* in = reinterpret_cast<const In*>(d.in);
  const double ms = median_ms([&] { kernel<<<static_cast<unsigned>(blocks), kThreads>>>(in, d.out, units); });
  const double gbs = static_cast<double>(unit_bytes) * units / ms / 1e6;
  std::printf("| %s | %s | %.0f | %.0f%% |\n", mix, grid, gbs, 100.0 * gbs / d.memcpy_gbs);
}

}  // namespace

int main(int argc, char** argv) {
  const long long mib = argc > 1 ? std::atoll(argv[1]) : 1024;
  // The 1:1 case reads `mib`; the others move the same total (read + write).
  const long long total = 2 * (mib << 20);
  uint4 *in = nullptr, *out = nullptr;
  PROBE_CHECK(cudaMalloc(&in, total));
  PROBE_CHECK(cudaMalloc(&out, total));
  PROBE_CHECK(cudaMemset(in, 1, total));
  int sms = 0, dev = 0;
  PROBE_CHECK(cudaGetDevice(&dev));
  PROBE_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop{};
  PROBE_CHECK(cudaGetDeviceProperties(&prop, dev));

  const double memcpy_ms =
      median_ms([&] { PROBE_CHECK(cudaMemcpyAsync(out, in, total / 2, cudaMemcpyDeviceToDevice)); });
  const double memcpy_gbs = total / memcpy_ms / 1e6;
  std::printf("%s, %d SMs; %lld MiB moved per case (read + write)\n", prop.name, sms, total >> 20);
  std::printf("cudaMemcpyAsync device to device: %.0f GB/s (read + write)\n\n", memcpy_gbs);
  std::printf("| read : write | grid | GB/s (read + write) | of cudaMemcpy |\n| --- | --- | ---: | ---: |\n");

  const Device d{in, out, sms, memcpy_gbs};
  const Mix mixes[] = {{"1 : 1", 1, 1}, {"1 : 2", 1, 2}, {"2 : 1", 2, 1}};
  for (const Mix& m : mixes) {
    const long long units = total / 16 / (m.r + m.w);
    const int unit_bytes = 16 * (m.r + m.w);
    if (m.w == 2) {
      run(d, flat<1, 2>, m.name, "flat", false, units, unit_bytes);
      run(d, resident<1, 2>, m.name, "resident", true, units, unit_bytes);
      run(d, flat_warp_contiguous, m.name, "flat, warp-contiguous", false, units, unit_bytes);
    } else if (m.r == 2) {
      run(d, flat<2, 1>, m.name, "flat", false, units, unit_bytes);
      run(d, resident<2, 1>, m.name, "resident", true, units, unit_bytes);
    } else {
      run(d, flat<1, 1>, m.name, "flat", false, units, unit_bytes);
      run(d, resident<1, 1>, m.name, "resident", true, units, unit_bytes);
    }
  }
  // 8 bytes read, 16 written per unit: the same total as the cases above.
  run(d, flat_pack8, "1 : 2, 8-byte loads", "flat", false, total / 24, 24);
  run(d, resident_pack8, "1 : 2, 8-byte loads", "resident", true, total / 24, 24);
  PROBE_CHECK(cudaFree(in));
  PROBE_CHECK(cudaFree(out));
  return 0;
}
