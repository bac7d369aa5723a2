// Probe: the svdq sm_90a GEMM's consumer main loops, timed with no producer.
//
//   opd_wgmma_loop_probe [--stages N] [--reps R] [--tile-stages S] [PROBE[:CLUSTER[:CONSUMERS]] ...]
//
// Each CTA (one per SM, the GEMM's 384 threads, register split and shared
// memory) fills its ring once with INT4-valued e4m3 operands and scales, then
// its consumer warpgroups run N ring stages of one loop without waiting for
// copies: the product's own consume() (kernels/svdq/sm90_mainloop.cuh, with
// kWaitFull false) for `serial`, `overlap` and `scalemma`, or one of three
// MMA-only loops that bound them:
//   mma        `overlap` with one FADD per output for its rescale (no
//              scales): about the FP8 tensor rate these tiles reach
//   mma-wait   each group's two MMAs, then wait (each group's latency)
//   scale-wait each group's two FP8 MMAs and its TF32 scale MMA, then wait
//   scalemma-pp `scalemma` with the two consumer warpgroups taking turns to
//              issue (named barriers), so one's rescale runs under the
//              other's MMAs instead of both waiting at once
// So the difference between a loop and the GEMM is what the producer, L2
// and the epilogue cost, and the difference between a loop and its MMA-only
// bound is what its rescale costs. --tile-stages S: the product loops also
// run the product's epilogue (kernels/svdq/epilogue.cuh: bias, LoRA-up at
// rank 32, bf16 stores into a tile of the CTA's own) every S stages, as a
// GEMM with K = 128 S does per tile. CLUSTER 2 launches clusters of two CTAs
// (the GEMM's multicast path: consume() then arrives on both CTAs'
// barriers); CONSUMERS 1 leaves the second consumer warpgroup idle.
// Default: every probe at 2:2 and 1:2. Prints, per run: microseconds,
// cycles per stage (mean over CTAs) and tera-operations per second counted
// as the GEMM counts them (2 x 128 x 128 x 128 per stage and CTA with two
// consumers). bench/results/2026-12-05-h100-svdq-epilogue.md has its figures.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/svdq/epilogue.cuh"
#include "kernels/svdq/sm90_mainloop.cuh"
#include "probe_check.h"

namespace {

using namespace cache_dit::svdq::sm90;
#ifdef CACHE_DIT_SM90A_PTX
using namespace cache_dit::svdq::sm90::ptx;
#endif
using cache_dit::svdq::epilogue;

enum Probe : int {
  kProbeSerial,
  kProbeOverlap,
  kProbeScaleMma,
  kProbeMma,
  kProbeMmaWait,
  kProbeScaleWait,
  kProbeScalePingPong,
  kProbes
};
constexpr const char* kNames[kProbes] = {"serial",   "overlap",    "scalemma",   "mma",
                                         "mma-wait", "scale-wait", "scalemma-pp"};

// The ring layout (Smem<loop>) each probe runs on.
__host__ __device__ constexpr int loop_of(int probe) {
  return probe == kProbeSerial                                                              ? kSerial
         : probe == kProbeScaleMma || probe == kProbeScaleWait || probe == kProbeScalePingPong ? kScaleMma
                                                                                               : kOverlap;
}

constexpr int kRank = 32;  // the epilogue's LoRA rank (the benchmark's)

template <int kProbe, int kCluster>
__global__ void __launch_bounds__(kThreads, 1)
    probe_kernel(int stages, int consumers, int tile_stages, const __nv_bfloat16* __restrict__ bias,
                 const float* __restrict__ lora_act, const __nv_bfloat16* __restrict__ up,
                 __nv_bfloat16* __restrict__ out, float* __restrict__ sink, long long* __restrict__ cycles) {
#ifdef CACHE_DIT_SM90A_PTX
  constexpr int kLoop = loop_of(kProbe);
  using S = Smem<kLoop>;
  extern __shared__ uint8_t smem_raw[];
  S& s = *reinterpret_cast<S*>(smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023));
  // Operands: e4m3 codes of pseudo-random -8..7; weight scales around 1
  // (the scale MMA's rows (w, 0, 0, 0)); activation scales 1.0 (bf16 bits).
  for (int i = threadIdx.x; i < kStages * kTileBytes; i += kThreads) {
    const uint32_t h = (static_cast<uint32_t>(i) + 1u) * 2654435761u;
    (&s.a[0][0])[i] = __nv_fp8_e4m3(static_cast<float>(static_cast<int>((h >> 11) % 16) - 8)).__x;
    (&s.b[0][0])[i] = __nv_fp8_e4m3(static_cast<float>(static_cast<int>((h >> 19) % 16) - 8)).__x;
  }
  for (int i = threadIdx.x; i < kStages * S::kScaleFloats; i += kThreads) {
    (&s.ws[0][0])[i] = kLoop == kScaleMma && i % 4 != 0 ? 0.f : 1.f + static_cast<float>(i % 7) / 8.f;
  }
  for (int i = threadIdx.x; i < kStages * 2 * kBM; i += kThreads) (&s.as[0][0])[i] = 0x3F80;
  for (int i = threadIdx.x; i < static_cast<int>(sizeof(s.zeros) / sizeof(float)); i += kThreads) s.zeros[i] = 0.f;
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbar_init(&s.full[i], 1);
      mbar_init(&s.empty[i], 8 * kCluster);  // consume() arrives here, as in the GEMM
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic writes, read by wgmma
  if constexpr (kCluster > 1) {
    cluster_sync();
  } else {
    __syncthreads();
  }

  const int wg = threadIdx.x / 128, lane = threadIdx.x % 32;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    if (wg <= consumers) {
      const int wg_row = (wg - 1) * 64;
      const uint64_t desc_a = sw128_desc(smem_u32(s.a[0]) + wg_row * kBK), desc_b = sw128_desc(smem_u32(s.b[0]));
      float acc[64], d0[64], d1[64];
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] = 0.f;
      const long long t0 = clock64();
      for (int it = 0; it < stages; ++it) {
        const int slot = it % kStages;
        if constexpr (kProbe <= kProbeScaleMma) {
          consume<__nv_bfloat16, kCluster, kLoop, false>(s, acc, d0, d1, desc_a, desc_b, it, wg_row, lane);
          if (tile_stages > 0 && (it + 1) % tile_stages == 0) {
            // The CTA's tile: columns blockIdx.x * 128.., rows 0..127 of a [128, 128 x CTAs] output.
            const int64_t row0 = wg_row + (threadIdx.x % 128) / 32 * 16 + lane / 4;
            epilogue<__nv_bfloat16, __nv_bfloat16>(acc, bias, lora_act, up, out, row0, blockIdx.x * kBN, kBM,
                                                   gridDim.x * kBN, kRank, lane);
#pragma unroll
            for (int i = 0; i < 64; ++i) acc[i] = 0.f;
          }
        } else if constexpr (kProbe == kProbeMma) {
          issue_group(d0, desc_a, desc_b, slot, 0);
          issue_group(d1, desc_a, desc_b, slot, 1);
          wgmma_wait<1>();
          fence_acc(d0);
#pragma unroll
          for (int i = 0; i < 64; ++i) acc[i] += d0[i];
          wgmma_wait<0>();
          fence_acc(d1);
#pragma unroll
          for (int i = 0; i < 64; ++i) acc[i] += d1[i];
        } else if constexpr (kProbe == kProbeScalePingPong) {
#pragma unroll 1
          for (int half = 0; half < 2; ++half) {
            const float2 as = act_scales<__nv_bfloat16>(s, slot, half, wg_row, lane);
            const bool k0 = lane % 4 == 0;
            // Turns: barrier wg (1 or 2) is this warpgroup's; the first
            // consumer's first issue needs none.
            if (consumers > 1 && (wg == 2 || it + half > 0)) asm volatile("bar.sync %0, 256;" ::"r"(wg) : "memory");
            issue_scaled_group(d0, d1, desc_a, desc_b, s, slot, half, k0 ? __float_as_uint(as.x) : 0u,
                               k0 ? __float_as_uint(as.y) : 0u);
            if (consumers > 1) asm volatile("bar.arrive %0, 256;" ::"r"(3 - wg) : "memory");
            wgmma_wait<0>();
            fence_acc(d0);
            fence_acc(d1);
#pragma unroll
            for (int i = 0; i < 64; ++i) acc[i] = __fmaf_rn(d0[i], d1[i], acc[i]);
          }
        } else {
#pragma unroll 1
          for (int half = 0; half < 2; ++half) {
            if constexpr (kProbe == kProbeMmaWait) {
              issue_group(d0, desc_a, desc_b, slot, half);
            } else {
              issue_scaled_group(d0, d1, desc_a, desc_b, s, slot, half, lane % 4 == 0 ? 0x3F800000u : 0u,
                                 lane % 4 == 0 ? 0x3F800000u : 0u);
            }
            wgmma_wait<0>();
            fence_acc(d0);
            fence_acc(d1);
            acc[0] += d0[0] + (kProbe == kProbeScaleWait ? d1[0] : 0.f);
          }
        }
      }
      // The second consumer's last turn handed to the first: taken here.
      if (kProbe == kProbeScalePingPong && consumers > 1 && wg == 1) asm volatile("bar.sync 1, 256;" ::: "memory");
      const long long t1 = clock64();
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < 64; ++i) sum += acc[i];
      sink[blockIdx.x * kThreads + threadIdx.x] = sum;
      if (threadIdx.x == 128) cycles[blockIdx.x] = t1 - t0;
    }
  }
  if constexpr (kCluster > 1) cluster_sync();  // no arrival on a CTA that has left
#else
  (void)stages, (void)consumers, (void)tile_stages, (void)bias, (void)lora_act, (void)up, (void)out, (void)sink,
      (void)cycles;
#endif
}

using Kernel = void (*)(int, int, int, const __nv_bfloat16*, const float*, const __nv_bfloat16*, __nv_bfloat16*,
                        float*, long long*);

template <int kProbe>
Kernel kernel_for(int cluster) {
  return cluster > 1 ? probe_kernel<kProbe, 2> : probe_kernel<kProbe, 1>;
}

Kernel kernel_for(int probe, int cluster) {
  switch (probe) {
    case kProbeSerial: return kernel_for<kProbeSerial>(cluster);
    case kProbeOverlap: return kernel_for<kProbeOverlap>(cluster);
    case kProbeScaleMma: return kernel_for<kProbeScaleMma>(cluster);
    case kProbeMma: return kernel_for<kProbeMma>(cluster);
    case kProbeMmaWait: return kernel_for<kProbeMmaWait>(cluster);
    case kProbeScalePingPong: return kernel_for<kProbeScalePingPong>(cluster);
    default: return kernel_for<kProbeScaleWait>(cluster);
  }
}

struct Run {
  int probe, cluster, consumers;
};

}  // namespace

int main(int argc, char** argv) {
  int stages = 4000, reps = 5, tile_stages = 0;
  std::vector<Run> runs;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--stages" && i + 1 < argc) {
      stages = std::atoi(argv[++i]);
    } else if (arg == "--tile-stages" && i + 1 < argc) {
      tile_stages = std::atoi(argv[++i]);
    } else if (arg == "--reps" && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else {
      Run r{-1, 2, 2};
      const std::string name = arg.substr(0, arg.find(':'));
      for (int p = 0; p < kProbes; ++p) {
        if (name == kNames[p]) r.probe = p;
      }
      if (r.probe < 0) {
        std::fprintf(stderr, "unknown probe '%s' (serial overlap scalemma mma mma-wait scale-wait scalemma-pp)\n",
                     name.c_str());
        return 2;
      }
      std::sscanf(arg.c_str() + name.size(), ":%d:%d", &r.cluster, &r.consumers);
      if ((r.cluster != 1 && r.cluster != 2) || (r.consumers != 1 && r.consumers != 2)) {
        std::fprintf(stderr, "'%s': CLUSTER and CONSUMERS are 1 or 2, got %d and %d\n", arg.c_str(), r.cluster,
                     r.consumers);
        return 2;
      }
      runs.push_back(r);
    }
  }
  if (stages < 1 || reps < 1 || tile_stages < 0) {
    std::fprintf(stderr, "--stages %d and --reps %d must be >= 1, --tile-stages %d >= 0\n", stages, reps,
                 tile_stages);
    return 2;
  }
  if (runs.empty()) {
    for (int p = 0; p < kProbes; ++p) runs.push_back({p, 2, 2});
    for (int p = 0; p < kProbes; ++p) runs.push_back({p, 1, 2});
  }
  cudaDeviceProp prop{};
  PROBE_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int ctas = prop.multiProcessorCount / 2 * 2;
  float* sink = nullptr;
  long long* cycles = nullptr;
  PROBE_CHECK(cudaMalloc(&sink, sizeof(float) * ctas * kThreads));
  PROBE_CHECK(cudaMalloc(&cycles, sizeof(long long) * ctas));
  // Epilogue operands, zero-filled (their values do not change its time).
  const size_t n_cols = static_cast<size_t>(ctas) * kBN;
  __nv_bfloat16 *bias = nullptr, *up = nullptr, *out = nullptr;
  float* lora_act = nullptr;
  PROBE_CHECK(cudaMalloc(&bias, sizeof(__nv_bfloat16) * n_cols));
  PROBE_CHECK(cudaMalloc(&up, sizeof(__nv_bfloat16) * n_cols * kRank));
  PROBE_CHECK(cudaMalloc(&out, sizeof(__nv_bfloat16) * n_cols * kBM));
  PROBE_CHECK(cudaMalloc(&lora_act, sizeof(float) * kBM * kRank));
  PROBE_CHECK(cudaMemset(bias, 0, sizeof(__nv_bfloat16) * n_cols));
  PROBE_CHECK(cudaMemset(up, 0, sizeof(__nv_bfloat16) * n_cols * kRank));
  PROBE_CHECK(cudaMemset(lora_act, 0, sizeof(float) * kBM * kRank));
  cudaEvent_t e0, e1;
  PROBE_CHECK(cudaEventCreate(&e0));
  PROBE_CHECK(cudaEventCreate(&e1));
  std::printf("# %s, %d CTAs, %d stages, epilogue every %d\nprobe,cluster,consumers,us,cycles_per_stage,tops\n",
              prop.name, ctas, stages, tile_stages);
  for (const Run& r : runs) {
    const Kernel kernel = kernel_for(r.probe, r.cluster);
    const int smem = static_cast<int>(loop_of(r.probe) == kScaleMma ? kSmemBytes<kScaleMma> : kSmemBytes<kOverlap>);
    PROBE_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    cudaLaunchConfig_t config{};
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = static_cast<unsigned>(r.cluster);
    attribute.val.clusterDim.y = attribute.val.clusterDim.z = 1;
    config.gridDim = dim3(static_cast<unsigned>(ctas));
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = static_cast<size_t>(smem);
    config.attrs = &attribute;
    config.numAttrs = 1;
    float best = 1e30f;
    for (int rep = 0; rep <= reps; ++rep) {  // rep 0 warms up
      PROBE_CHECK(cudaEventRecord(e0));
      PROBE_CHECK(cudaLaunchKernelEx(&config, kernel, stages, r.consumers, tile_stages,
                                     static_cast<const __nv_bfloat16*>(bias), static_cast<const float*>(lora_act),
                                     static_cast<const __nv_bfloat16*>(up), out, sink, cycles));
      PROBE_CHECK(cudaEventRecord(e1));
      PROBE_CHECK(cudaEventSynchronize(e1));
      float ms = 0.f;
      PROBE_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (rep > 0) best = std::min(best, ms);
    }
    std::vector<long long> host(static_cast<size_t>(ctas));
    PROBE_CHECK(cudaMemcpy(host.data(), cycles, sizeof(long long) * ctas, cudaMemcpyDeviceToHost));
    double mean = 0;
    for (long long c : host) mean += static_cast<double>(c) / ctas;
    const double ops = 2.0 * 64 * r.consumers * kBN * kBK * stages * ctas;
    std::printf("%s,%d,%d,%.1f,%.0f,%.0f\n", kNames[r.probe], r.cluster, r.consumers, best * 1e3, mean / stages,
                ops / (best * 1e-3) / 1e12);
  }
  return 0;
}
