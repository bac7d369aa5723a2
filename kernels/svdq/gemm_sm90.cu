// The sm_90a W4A4 GEMM (kernels/svdq/gemm_sm90.h says what and why). Hand-
// written PTX: TMA tensor copies, mbarriers, wgmma on 128-byte-swizzled
// shared memory, setmaxnreg. Compiled for every target of the build; the
// body exists only in the sm_90a image, and the host takes this path only on
// an sm 9.0 device of a build that has that image.
#include "kernels/svdq/gemm_sm90.h"

#include <ATen/ops/empty.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>

#include "kernels/common/cuda_utils.cuh"
#include "kernels/svdq/epilogue.cuh"
#include "kernels/svdq/layouts.cuh"
#include "kernels/svdq/mma.cuh"
#include "kernels/svdq/sm90_mainloop.cuh"

namespace cache_dit::svdq::sm90 {
namespace {

#ifdef CACHE_DIT_SM90A_PTX
using namespace ptx;  // the kernel's PTX wrappers (kernels/svdq/sm90_ptx.cuh)
#endif

// kCluster 1: one CTA per 128 x 128 tile. kCluster 2: clusters of two CTAs
// on neighbouring column tiles of the same rows, each copying half of the
// shared activation tile to both (TMA multicast), so a CTA reads 24 KB of a
// stage from L2 instead of 32. Each CTA works through units u = its
// cluster's index + j x (clusters launched): one launch covers every unit
// once (j = 0 only) or, persistent, takes one cluster per SM pair and walks
// the units, its ring running on into the next unit while the consumers
// finish the last (the producer is ahead by up to kStages stages).
template <typename T, typename Out, int kCluster, int kLoop>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_kernel(const __grid_constant__ CUtensorMap tm_act, const __grid_constant__ CUtensorMap tm_wgt,
                const __grid_constant__ CUtensorMap tm_as, const __grid_constant__ CUtensorMap tm_ws,
                const float* __restrict__ lora_act, const T* __restrict__ up, const T* __restrict__ bias,
                Out* __restrict__ out, int m_pad, int n_cols, int k_dim, int rank) {
#ifdef CACHE_DIT_SM90A_PTX
  extern __shared__ uint8_t smem_raw[];
  // Aligned by pointer arithmetic on the shared array (not through an
  // integer), so the compiler still knows the scales are shared memory and
  // reads them with LDS; generic loads cost the rescale its latency (ncu).
  // The offset is the same in every CTA, as multicast copies need.
  using S = Smem<kLoop>;
  S& s = *reinterpret_cast<S*>(smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023));
  const int wg = threadIdx.x / 128, lane = threadIdx.x % 32;
  const int k_stages = k_dim / kBK, groups = k_dim / 64;
  // Units: kCluster column tiles of one 128-row band, column units fastest
  // (the order of the non-cluster 2-D grid this replaced).
  const int n_units = n_cols / (kBN * kCluster);
  const int units = n_units * ((m_pad + kBM - 1) / kBM);
  const int crank = kCluster > 1 ? static_cast<int>(cluster_rank()) : 0;
  const int first_unit = static_cast<int>(blockIdx.x) / kCluster, unit_step = static_cast<int>(gridDim.x) / kCluster;

  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbar_init(&s.full[i], 1);
      mbar_init(&s.empty[i], 8 * kCluster);  // the consumer warps of every CTA the stage's copies reach
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if constexpr (kLoop == kScaleMma) {
    // Written through the generic proxy, read by the MMAs' async proxy.
    for (int i = threadIdx.x; i < kBN * 4; i += kThreads) s.zeros[i] = 0.f;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  if constexpr (kCluster > 1) {
    cluster_sync();  // the other CTA's barriers exist before anything lands on them
  } else {
    __syncthreads();
  }

  if (wg == 0) {  // producer: one thread issues every copy
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      int it = 0;  // stages issued so far, over every unit
      for (int u = first_unit; u < units; u += unit_step) {
        const int n0 = ((u % n_units) * kCluster + crank) * kBN, m0 = u / n_units * kBM;
        for (int st = 0; st < k_stages; ++st, ++it) {
          const int i = it % kStages;
          mbar_wait(&s.empty[i], ((it / kStages) & 1) ^ 1);  // the first round passes at once
          mbar_expect_tx(&s.full[i], kStageTxBytes<kLoop>);
          if constexpr (kCluster > 1) {
            // This CTA's share of the activation rows, to every CTA of the cluster.
            constexpr int kRows = kBM / kCluster;
            tma_load_2d_multicast(s.a[i] + crank * kRows * kBK, &tm_act, &s.full[i], st * kBK, m0 + crank * kRows,
                                  static_cast<uint16_t>((1u << kCluster) - 1));
          } else {
            tma_load_2d(s.a[i], &tm_act, &s.full[i], st * kBK, m0);
          }
          tma_load_2d(s.b[i], &tm_wgt, &s.full[i], st * kBK, n0);
          // The two groups' scale rows (kScaleMma: two 2 KB rows a group).
          tma_load_2d(s.ws[i], &tm_ws, &s.full[i], 0, (n0 / kBN * groups + 2 * st) * (kLoop == kScaleMma ? 2 : 1));
          tma_load_2d(s.as[i], &tm_as, &s.full[i], m0, 2 * st);
        }
      }
      // Clusters: the CTA stays until every consumer warp of the cluster is
      // done with the last kStages stages, so no arrival from the other CTA
      // is still on its way to this one's barriers when it exits (the
      // copies into it are done: its own consumers waited for them).
      for (int j = 0; kCluster > 1 && j < kStages; ++j, ++it) {
        mbar_wait(&s.empty[it % kStages], ((it / kStages) & 1) ^ 1);
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int wg_row = (wg - 1) * 64;  // this warpgroup's rows within the tile
    const uint64_t desc_a = sw128_desc(smem_u32(s.a[0]) + wg_row * kBK), desc_b = sw128_desc(smem_u32(s.b[0]));
    // acc: the tile's sums. d0, d1: a stage's two 64-groups in flight in
    // turn (kOverlap: the other warpgroup's MMAs alone did not keep the
    // tensor cores busy, ncu, DESIGN 8), or a group and its scale products
    // (kScaleMma); consume().
    float acc[64], d0[64], d1[64];

    int it = 0;
    for (int u = first_unit; u < units; u += unit_step) {
      const int n0 = ((u % n_units) * kCluster + crank) * kBN, m0 = u / n_units * kBM;
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] = 0.f;
      for (int st = 0; st < k_stages; ++st, ++it) {
        consume<T, kCluster, kLoop>(s, acc, d0, d1, desc_a, desc_b, it, wg_row, lane);
      }

      // Row g (+ 8) of this warp.
      const int64_t row0 = m0 + wg_row + (threadIdx.x % 128) / 32 * 16 + lane / 4;
      epilogue<T, Out>(acc, bias, lora_act, up, out, row0, n0, m_pad, n_cols, rank, lane);
    }
  }
#else
  __trap();  // never launched: the host takes this path only where the sm_90a image exists
#endif
}

// qweight word (8 nibbles of row n, k .. k + 7) -> 8 e4m3 bytes of row-major [N, K].
__global__ void expand_wgt_kernel(const uint32_t* __restrict__ qw, uint2* __restrict__ wq8, int64_t n_rows,
                                  int64_t k_dim) {
  const int64_t idx = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t units = k_dim / 8;
  if (idx >= n_rows * units) return;
  const int64_t n = idx / units, k = idx % units * 8;
  const uint32_t w = qw[qweight_word(n, k, k_dim / 64)];
  wq8[idx] = make_uint2(e4m3x4_of_int4(w & 0xFFFFu), e4m3x4_of_int4(w >> 16));
}

template <typename T>
__global__ void widen_kernel(const T* __restrict__ in, float* __restrict__ out, int64_t n) {
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i < n) out[i] = cuda::to_float(in[i]);
}

// kScaleMma's weight scales: per block of the packed order (one column
// tile, one group), the 16-byte row (w, 0, 0, 0) of each column in logical
// order.
template <typename T>
__global__ void scale_rows_kernel(const T* __restrict__ in, float4* __restrict__ out, int64_t n, int64_t groups) {
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;  // block i / 128, logical column i % 128
  if (i >= n) return;
  const int64_t block = i / 128, column = block / groups * 128 + i % 128;
  out[i] = make_float4(cuda::to_float(in[scale_pos(column, block % groups, groups)]), 0.f, 0.f, 0.f);
}

// ---- host -------------------------------------------------------------------------------------------------

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status{};
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &status));
    TORCH_CHECK(status == cudaDriverEntryPointSuccess && p != nullptr,
                "svdq_gemm_w4a4: the driver has no cuTensorMapEncodeTiled (status ", static_cast<int>(status), ")");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// A row-major [outer, inner] tensor of `elem` bytes, copied in boxes of
// [box_outer, box_inner]; rows past `outer` read as zeros.
CUtensorMap tensor_map(const void* base, CUtensorMapDataType type, uint64_t elem, uint64_t inner, uint64_t outer,
                       uint32_t box_inner, uint32_t box_outer, CUtensorMapSwizzle swizzle) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {inner * elem};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t steps[2] = {1, 1};
  const CUresult r = encode_tiled()(&map, type, 2, const_cast<void*>(base), dims, strides, box, steps,
                                    CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "svdq_gemm_w4a4: cuTensorMapEncodeTiled failed (", static_cast<int>(r), ")");
  return map;
}

}  // namespace

bool usable(const at::Tensor& act) {
#ifndef CACHE_DIT_SVDQ_SM90A
  (void)act;
  return false;
#else
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(act.get_device());
  return prop->major == 9 && prop->minor == 0 && act.size(0) % 8 == 0 && act.size(1) > 0;
#endif
}

template <typename T, typename Out>
void gemm(const at::Tensor& act, const at::Tensor& wgt, const at::Tensor& ascales, const at::Tensor& wscales,
          const std::optional<at::Tensor>& lora_act, const std::optional<at::Tensor>& lora_up,
          const std::optional<at::Tensor>& bias, Out* out, Schedule schedule) {
  const int64_t m_pad = act.size(0), k = act.size(1), n = wgt.size(0), groups = k / 64;
  const int64_t rank = lora_up ? lora_up->size(1) : 0;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int loop = std::clamp(schedule.loop, 0, 2);
  // The scale-MMA loop reads the weight scales as 16-byte rows (w, 0, 0, 0)
  // (Smem<kScaleMma>); the others as fp32 in the packed order.
  const bool scale_rows = loop == kScaleMma;
  // Scratch from the caching allocator, on this stream: e4m3 weights and fp32
  // scales (kScaleMma: 16-byte rows, scale_rows_kernel).
  at::Tensor wq8 = at::empty({n, k}, act.options().dtype(at::kByte));
  at::Tensor ws32 = at::empty({groups * n * (scale_rows ? 4 : 1)}, act.options().dtype(at::kFloat));
  const int64_t units = n * k / 8;
  expand_wgt_kernel<<<static_cast<unsigned>(cuda::ceil_div(units, 256)), 256, 0, stream>>>(
      static_cast<const uint32_t*>(wgt.data_ptr()), static_cast<uint2*>(wq8.data_ptr()), n, k);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const auto grid = static_cast<unsigned>(cuda::ceil_div(groups * n, 256));
  if (scale_rows) {
    scale_rows_kernel<T><<<grid, 256, 0, stream>>>(reinterpret_cast<const T*>(wscales.data_ptr()),
                                                   static_cast<float4*>(ws32.data_ptr()), groups * n, groups);
  } else {
    widen_kernel<T><<<grid, 256, 0, stream>>>(reinterpret_cast<const T*>(wscales.data_ptr()),
                                              static_cast<float*>(ws32.data_ptr()), groups * n);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  // Two-CTA clusters pair neighbouring column tiles, so N / 128 must be even.
  const int cluster = schedule.multicast && (n / kBN) % 2 == 0 ? 2 : 1;
  const CUtensorMap tm_act = tensor_map(act.data_ptr(), CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, k, m_pad, kBK,
                                        kBM / cluster, CU_TENSOR_MAP_SWIZZLE_128B);
  const CUtensorMap tm_wgt = tensor_map(wq8.data_ptr(), CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, k, n, kBK, kBN,
                                        CU_TENSOR_MAP_SWIZZLE_128B);
  const CUtensorMap tm_as = tensor_map(ascales.data_ptr(), CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, m_pad, groups, kBM, 2,
                                       CU_TENSOR_MAP_SWIZZLE_NONE);
  // A stage's two groups of scales: two rows of 128 floats, or (kScaleMma)
  // four of 256 (a box row holds at most 256 elements).
  const int64_t ws_row = scale_rows ? 2 * kBN : kBN, ws_rows = scale_rows ? 4 : 2;
  const CUtensorMap tm_ws = tensor_map(ws32.data_ptr(), CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, ws_row,
                                       ws32.numel() / ws_row, ws_row, ws_rows, CU_TENSOR_MAP_SWIZZLE_NONE);
  using Kernel = decltype(&gemm_kernel<T, Out, 1, 0>);
  static constexpr Kernel kernels[2][3] = {
      {gemm_kernel<T, Out, 1, 0>, gemm_kernel<T, Out, 1, 1>, gemm_kernel<T, Out, 1, 2>},
      {gemm_kernel<T, Out, 2, 0>, gemm_kernel<T, Out, 2, 1>, gemm_kernel<T, Out, 2, 2>}};
  const Kernel kernel = kernels[cluster - 1][loop];
  const size_t smem_bytes = scale_rows ? kSmemBytes<kScaleMma> : kSmemBytes<kOverlap>;
  static std::atomic<uint64_t> devices[2][3]{};  // per instantiation
  cuda::allow_dynamic_smem(kernel, static_cast<int>(smem_bytes), devices[cluster - 1][loop]);

  cudaLaunchConfig_t config{};
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = static_cast<unsigned>(cluster);
  attribute.val.clusterDim.y = attribute.val.clusterDim.z = 1;
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = cluster > 1 ? 1 : 0;  // the default launch stays a plain one
  // One cluster per unit, or (persistent) as many as the device holds at
  // once (one CTA per SM), each walking the units (the kernel's comment).
  int64_t clusters = n / (kBN * cluster) * cuda::ceil_div(m_pad, kBM);
  if (schedule.persistent) {
    int resident = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    if (cluster > 1) {
      // Clusters the device holds at once: a property of kernel and device,
      // asked once per device (0: not asked yet).
      static std::atomic<int> resident_clusters[3][64]{};
      const int device = c10::cuda::current_device();
      resident = device < 64 ? resident_clusters[loop][device].load(std::memory_order_relaxed) : 0;
      if (resident == 0) {
        config.gridDim = dim3(static_cast<unsigned>(clusters * cluster));
        C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&resident, kernel, &config));
        if (device < 64) resident_clusters[loop][device].store(resident, std::memory_order_relaxed);
      }
    }
    clusters = std::min<int64_t>(clusters, std::max(resident, 1));
  }
  config.gridDim = dim3(static_cast<unsigned>(clusters * cluster));
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, tm_act, tm_wgt, tm_as, tm_ws,
                                    lora_act ? static_cast<const float*>(lora_act->data_ptr()) : nullptr,
                                    lora_up ? reinterpret_cast<const T*>(lora_up->data_ptr()) : nullptr,
                                    bias ? reinterpret_cast<const T*>(bias->data_ptr()) : nullptr, out,
                                    static_cast<int>(m_pad), static_cast<int>(n), static_cast<int>(k),
                                    static_cast<int>(rank)));
}

#define CACHE_DIT_SVDQ_SM90_GEMM(T, Out)                                                                        \
  template void gemm<T, Out>(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,     \
                             const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,              \
                             const std::optional<at::Tensor>&, Out*, Schedule);
CACHE_DIT_SVDQ_SM90_GEMM(__half, __half)
CACHE_DIT_SVDQ_SM90_GEMM(__half, __nv_bfloat16)
CACHE_DIT_SVDQ_SM90_GEMM(__half, float)
CACHE_DIT_SVDQ_SM90_GEMM(__nv_bfloat16, __half)
CACHE_DIT_SVDQ_SM90_GEMM(__nv_bfloat16, __nv_bfloat16)
CACHE_DIT_SVDQ_SM90_GEMM(__nv_bfloat16, float)
#undef CACHE_DIT_SVDQ_SM90_GEMM

}  // namespace cache_dit::svdq::sm90
