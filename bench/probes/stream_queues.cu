// File: bench/probes/stream_queues.cu
//
// The hardware facts the executor's launch-ahead and the client/daemon
// hand-off rest on (issue 14, docs/DESIGN.md sections 1 and 7), measured on
// the GPU at hand:
//
//   isolation C S K  With CUDA_DEVICE_MAX_CONNECTIONS = C (set before the
//              context exists) and S streams created in order, waits that
//              never complete are parked on streams 0..K-1; one tiny kernel
//              is launched on every other stream; after 50 ms the streams
//              still busy are the ones the parked waits hold up. Prints them,
//              then releases the waits with a host store (as the daemon
//              releases a dead client's) and says whether the GPU saw it.
//
//   timeline [N]  GPU time per call of a client/daemon hand-off between two
//              processes (fork; each makes its own context), N calls enqueued
//              ahead behind a gate kernel so no host latency is counted, a
//              7 MB device copy as the daemon's kernel:
//                local       the copy back to back on one stream (no hand-off)
//                sem         client writes in=n; daemon waits in>=n, copies,
//                            writes done=n; client waits done>=n (pinned
//                            shared memory, as the daemon's lanes)
//                sem_dev     the same on semaphores in daemon device memory
//                            (cudaIpcGetMemHandle)
//                sem_nowait  as sem, but the client waits only for the last
//                ev_sem      client records an interprocess event; daemon
//                            waits on it, copies, writes done=n; client waits
//                ev_ev       as ev_sem, the daemon records an event too
//                sem_ev      semaphore in, event out
//              Run it under MPS (nvidia-cuda-mps-control -d with private
//              CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY) to see the
//              hand-off without context switches.
//
//   hostcost [N]  Host time per enqueue of what the executor puts on a
//              lane's stream per call, each kind N times on one stream (the
//              GPU drains as it goes; a synchronize every 128, not timed):
//              a tiny kernel launch, a 64-bit stream write / wait (already
//              satisfied) on pinned host memory, two writes as two calls and
//              as one cuStreamBatchMemOp, an event record, and a whole call
//              (wait, launch, the two "done" writes) each way, and with the
//              next call's wait in the "done" batch.
//
//   threads [N]  Whether the driver's enqueue path scales across host
//              threads of one context (what more executor threads,
//              --executor-threads, can buy): for T = 1, 2, 4 and 8 threads,
//              each with its own stream and pinned "done" words, all
//              starting together, N calls each of what an executor enqueues
//              per call (a tiny kernel launch and one cuStreamBatchMemOp of
//              two 64-bit writes); prints the aggregate calls/s and each
//              thread's host time per call.
//
//   pairs [N] [B]  P = 1, 2, 4, 8, 12 client/daemon stream pairs in one
//              context (as under MPS), N calls each enqueued ahead behind a
//              gate, a B-byte copy (default 1 MiB) as the kernel: aggregate
//              calls/s of the kernels alone (local), of the semaphore
//              hand-off (sem: client writes in, waits done; daemon waits in,
//              copies, writes done; in_only: the client's write and the
//              daemon's wait alone) and of the same with the daemon's "done"
//              and next wait in one batch (sem_batch), each with the
//              semaphores in pinned host memory and in device memory (_dev);
//              sem_cb: the client's write and wait in one batch (as the
//              client does); *_mirror: waits on device words, every write
//              also to a pinned host twin (for host readers).
//              No host in the loop: what the GPU allows many launch-bound
//              clients.
//
//   xpairs [N] [B] The same hand-off (the protocol in use: the client's
//              write and wait in one batch; the daemon's wait, a B-byte copy
//              (default 1 MiB; a larger one stands in for a longer kernel),
//              "done" and its own copy in one batch) with P = 1, 2, 4, 8
//              client processes and one daemon process, each its own context
//              (under MPS: one MPS client each, as deployed), beside each
//              client running the copy itself (local), with the daemon's
//              "done" written to one word instead of two (sem_cb_1w: one
//              memory operation fewer a call, what dropping the daemon's own
//              copy would buy), and with the
//              semaphores waited on in the daemon's device memory (CUDA IPC)
//              and every write also to the host word (dev_twin): aggregate
//              calls/s. Then the same two protocols live (live_sem_cb,
//              live_dev_twin): nothing enqueued ahead; each client's host
//              loop enqueues a call and publishes its number in the shared
//              page, and the daemon's one host thread takes what is
//              published and enqueues it, at most 32 calls beyond the
//              "inputs ready" its host sees, as the executor does; and
//              live_sem_cb_slow, whose daemon spends 6 us more of host time
//              per call (about what torch's dispatch and the executor's
//              bookkeeping add to the driver's work). Which of GPU, daemon
//              host and arrival order bounds the daemon's many clients.
//              Two more live modes separate what the real clients add to
//              live_sem_cb, whose asynchronous calls cost the GPU ~7 us more
//              than synchronous ones in bench/run.sh's pipelined case:
//              live_sem_cb_fence records the client's fence event after each
//              call (as the client's lanes do), and live_sem_cb_answered
//              enqueues call i + 1 only once the daemon has enqueued call i
//              (a synchronous client's host timing). live_host (and
//              live_host_1w, one "done" word) is the host-checked path: the
//              daemon enqueues call i only once its host sees "inputs ready"
//              >= i, with no GPU wait: one memory operation fewer a call on
//              the GPU, the host's latency on each call's path instead.
//              live_dev_in: dev_twin for "inputs ready" only ("done" stays
//              in pinned memory, where a client can release its own waits
//              from the host if the daemon dies); live_dev_done the other
//              half.
//
// Kernels are loaded eagerly (CUDA_MODULE_LOADING=EAGER) unless PROBE_LAZY=1:
// with lazy loading the first launch after a parked wait hangs
// (PROBE_LAZY=1 stream_queues isolation 8 9 1 never returns).
//
// Build: nvcc -O2 -arch=sm_90a -o stream_queues stream_queues.cu -lcuda
// Run:   stream_queues isolation C S K | timeline [N] | hostcost [N] | threads [N] | pairs [N] [B] | xpairs [N] [B]
#include <cuda.h>
#include <cuda_runtime.h>

#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "probe_check.h"

#define CU(x)                                                                          \
  do {                                                                                 \
    CUresult r_ = (x);                                                                 \
    if (r_ != CUDA_SUCCESS) {                                                          \
      const char* n_ = nullptr;                                                        \
      cuGetErrorName(r_, &n_);                                                         \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, n_ ? n_ : "?");  \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

__global__ void Touch(int* p) { atomicAdd(p, 1); }

// Spins until the host sets *flag (mapped host memory, volatile loads): a
// gate that does not depend on the GPU seeing a host write to a semaphore.
__global__ void Gate(const volatile uint64_t* flag, uint64_t value) {
  while (*flag < value) __nanosleep(100);
}

__global__ void Copy(const int4* __restrict__ src, int4* __restrict__ dst, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    dst[i] = src[i];
  }
}

static CUdeviceptr MapHost(void* p, size_t bytes) {
  CU(cuMemHostRegister(p, bytes, CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_PORTABLE));
  CUdeviceptr d = 0;
  CU(cuMemHostGetDevicePointer(&d, p, 0));
  return d;
}

// Stream memory operations gathered, then enqueued as one cuStreamBatchMemOp
// (the stream runs them in order).
struct MemOpBatch {
  std::vector<CUstreamBatchMemOpParams> ops;
  void Write(CUdeviceptr at, uint64_t v) {
    CUstreamBatchMemOpParams o = {};
    o.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
    o.writeValue.address = at;
    o.writeValue.value64 = v;
    o.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
    ops.push_back(o);
  }
  void Wait(CUdeviceptr at, uint64_t v) {  // until *at >= v
    CUstreamBatchMemOpParams o = {};
    o.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
    o.waitValue.address = at;
    o.waitValue.value64 = v;
    o.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
    ops.push_back(o);
  }
  void Flush(cudaStream_t s) {
    if (ops.empty()) return;
    CU(cuStreamBatchMemOp(reinterpret_cast<CUstream>(s), static_cast<unsigned>(ops.size()), ops.data(), 0));
    ops.clear();
  }
};

static int Isolation(int connections, int streams, int parked) {
  // parked = k parks waits on streams 0..k-1 (k >= 1).
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", std::to_string(connections).c_str(), 1);
  PROBE_CHECK(cudaSetDevice(0));
  PROBE_CHECK(cudaFree(nullptr));
  std::vector<cudaStream_t> s(streams);
  for (auto& x : s) PROBE_CHECK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
  void* page = nullptr;
  if (posix_memalign(&page, 4096, 4096) != 0) return 1;
  std::memset(page, 0, 4096);
  CUdeviceptr sem = MapHost(page, 4096);
  int* counter = nullptr;
  PROBE_CHECK(cudaMalloc(&counter, sizeof(int)));
  std::fprintf(stderr, "isolation: parking\n");
  for (int i = 0; i < parked; ++i) {
    CU(cuStreamWaitValue64(reinterpret_cast<CUstream>(s[i]), sem, 1, CU_STREAM_WAIT_VALUE_GEQ));
  }
  std::fprintf(stderr, "isolation: parked, launching\n");
  for (int i = parked; i < streams; ++i) Touch<<<1, 1, 0, s[i]>>>(counter);
  PROBE_CHECK(cudaGetLastError());
  std::fprintf(stderr, "isolation: launched\n");
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::string blocked;
  int n_blocked = 0;
  for (int i = parked; i < streams; ++i) {
    if (cudaStreamQuery(s[i]) == cudaErrorNotReady) {
      blocked += " " + std::to_string(i);
      ++n_blocked;
    }
  }
  std::printf("isolation connections=%d streams=%d parked=%d blocked=%d [%s ]\n", connections, streams, parked,
              n_blocked, blocked.c_str());
  std::fflush(stdout);
  // Release: first a host store (what a daemon releasing a dead client's
  // wait would do), then, if the GPU does not see it, a stream write.
  reinterpret_cast<std::atomic<uint64_t>*>(page)->store(1);
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  bool released = false;
  while (!(released = cudaStreamQuery(s[parked - 1]) == cudaSuccess) && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::printf("isolation release_by_host_store=%s\n", released ? "yes" : "no");
  std::fflush(stdout);
  if (!released) {
    cudaStream_t extra;
    PROBE_CHECK(cudaStreamCreateWithFlags(&extra, cudaStreamNonBlocking));
    CU(cuStreamWriteValue64(reinterpret_cast<CUstream>(extra), sem, 2, 0));
    until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while (!(released = cudaStreamQuery(s[parked - 1]) == cudaSuccess) && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::printf("isolation release_by_stream_write=%s\n", released ? "yes" : "no");
    std::fflush(stdout);
    if (!released) _exit(3);
  }
  PROBE_CHECK(cudaDeviceSynchronize());
  return 0;
}

// Host-side hand-off between the two processes (shared anonymous memory).
struct Shared {
  std::atomic<uint64_t> posted;     // client: call n's "inputs" step is enqueued
  std::atomic<uint64_t> launched;   // daemon: call n's kernel and "done" step are enqueued
  std::atomic<uint64_t> mode;       // which protocol (set before a round)
  std::atomic<uint64_t> round;      // round number (client bumps, daemon follows)
  std::atomic<uint64_t> round_done; // daemon finished enqueueing the round
  cudaIpcEventHandle_t in_ev[256];  // client -> daemon
  cudaIpcEventHandle_t done_ev[256];  // daemon -> client
  cudaIpcMemHandle_t dev_sem;         // daemon -> client: semaphores in device memory
  std::atomic<uint64_t> handles_ready;
  alignas(4096) uint64_t sem[512];  // [0] in, [64] done, [128] gate (own page, registered by both)
};

enum Mode : uint64_t { kSem = 1, kEvSem = 2, kEvEv = 3, kSemEv = 4, kSemDev = 5, kSemNoWait = 6 };
static bool DaemonWaitsSem(uint64_t m) { return m == kSem || m == kSemEv || m == kSemDev || m == kSemNoWait; }
static bool DaemonWritesSem(uint64_t m) { return m == kSem || m == kEvSem || m == kSemDev || m == kSemNoWait; }
static const char* ModeName(uint64_t m) {
  switch (m) {
    case kSem: return "sem";
    case kEvSem: return "ev_sem";
    case kEvEv: return "ev_ev";
    case kSemEv: return "sem_ev";
    case kSemDev: return "sem_dev";
    case kSemNoWait: return "sem_nowait";
  }
  return "?";
}

static void Spin(const std::atomic<uint64_t>& a, uint64_t v) {
  while (a.load(std::memory_order_acquire) < v) {
  }
}

constexpr size_t kCopyBytes = 7u << 20;

static int Daemon(Shared* sh, int calls) {
  PROBE_CHECK(cudaSetDevice(0));
  PROBE_CHECK(cudaFree(nullptr));
  CUdeviceptr sem = MapHost(sh->sem, sizeof(sh->sem));
  CUdeviceptr in = sem, done = sem + 64 * 8;
  cudaStream_t st;
  PROBE_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  int4 *a, *b;
  PROBE_CHECK(cudaMalloc(&a, kCopyBytes));
  PROBE_CHECK(cudaMalloc(&b, kCopyBytes));
  std::vector<cudaEvent_t> done_ev(calls), in_ev(calls);
  for (int i = 0; i < calls; ++i) {
    PROBE_CHECK(cudaEventCreateWithFlags(&done_ev[i], cudaEventDisableTiming | cudaEventInterprocess));
    PROBE_CHECK(cudaIpcGetEventHandle(&sh->done_ev[i], done_ev[i]));
  }
  void* dev_sem = nullptr;
  PROBE_CHECK(cudaMalloc(&dev_sem, 1 << 21));
  PROBE_CHECK(cudaMemset(dev_sem, 0, 1 << 21));
  PROBE_CHECK(cudaDeviceSynchronize());
  PROBE_CHECK(cudaIpcGetMemHandle(&sh->dev_sem, dev_sem));
  const CUdeviceptr dev_in = reinterpret_cast<CUdeviceptr>(dev_sem), dev_done = dev_in + 512;
  sh->handles_ready.store(1, std::memory_order_release);
  Spin(sh->handles_ready, 2);
  for (int i = 0; i < calls; ++i) PROBE_CHECK(cudaIpcOpenEventHandle(&in_ev[i], sh->in_ev[i]));
  const size_t n = kCopyBytes / sizeof(int4);
  for (uint64_t r = 1;; ++r) {
    Spin(sh->round, r);
    const uint64_t mode = sh->mode.load();
    if (mode == 0) break;
    const uint64_t base = (r - 1) * calls;
    for (int i = 0; i < calls; ++i) {
      const uint64_t seq = base + i + 1;
      Spin(sh->posted, seq);
      if (DaemonWaitsSem(mode)) {
        CU(cuStreamWaitValue64(reinterpret_cast<CUstream>(st), mode == kSemDev ? dev_in : in, seq,
                               CU_STREAM_WAIT_VALUE_GEQ));
      } else {
        PROBE_CHECK(cudaStreamWaitEvent(st, in_ev[i], 0));
      }
      Copy<<<264, 512, 0, st>>>(a, b, n);
      if (DaemonWritesSem(mode)) {
        CU(cuStreamWriteValue64(reinterpret_cast<CUstream>(st), mode == kSemDev ? dev_done : done, seq, 0));
      } else {
        PROBE_CHECK(cudaEventRecord(done_ev[i], st));
      }
      sh->launched.store(seq, std::memory_order_release);
    }
    sh->round_done.store(r, std::memory_order_release);
  }
  PROBE_CHECK(cudaStreamSynchronize(st));
  return 0;
}

static int Client(Shared* sh, int calls) {
  PROBE_CHECK(cudaSetDevice(0));
  PROBE_CHECK(cudaFree(nullptr));
  CUdeviceptr sem = MapHost(sh->sem, sizeof(sh->sem));
  CUdeviceptr in = sem, done = sem + 64 * 8, gate = sem + 128 * 8;
  cudaStream_t st;
  PROBE_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  std::vector<cudaEvent_t> in_ev(calls), done_ev(calls);
  for (int i = 0; i < calls; ++i) {
    PROBE_CHECK(cudaEventCreateWithFlags(&in_ev[i], cudaEventDisableTiming | cudaEventInterprocess));
    PROBE_CHECK(cudaIpcGetEventHandle(&sh->in_ev[i], in_ev[i]));
  }
  Spin(sh->handles_ready, 1);
  for (int i = 0; i < calls; ++i) PROBE_CHECK(cudaIpcOpenEventHandle(&done_ev[i], sh->done_ev[i]));
  void* dev_sem = nullptr;
  PROBE_CHECK(cudaIpcOpenMemHandle(&dev_sem, sh->dev_sem, cudaIpcMemLazyEnablePeerAccess));
  const CUdeviceptr dev_in = reinterpret_cast<CUdeviceptr>(dev_sem), dev_done = dev_in + 512;
  sh->handles_ready.store(2, std::memory_order_release);
  cudaEvent_t t0, t1;
  PROBE_CHECK(cudaEventCreate(&t0));
  PROBE_CHECK(cudaEventCreate(&t1));

  // Local baseline: the copy back to back on one stream, behind the gate.
  int4 *a, *b;
  PROBE_CHECK(cudaMalloc(&a, kCopyBytes));
  PROBE_CHECK(cudaMalloc(&b, kCopyBytes));
  const size_t n = kCopyBytes / sizeof(int4);
  uint64_t gate_value = 0;
  auto* gate_word = reinterpret_cast<std::atomic<uint64_t>*>(&sh->sem[128]);
  for (int rep = 0; rep < 3; ++rep) {
    ++gate_value;
    Gate<<<1, 1, 0, st>>>(reinterpret_cast<const volatile uint64_t*>(gate), gate_value);
    PROBE_CHECK(cudaEventRecord(t0, st));
    for (int i = 0; i < calls; ++i) Copy<<<264, 512, 0, st>>>(a, b, n);
    PROBE_CHECK(cudaEventRecord(t1, st));
    gate_word->store(gate_value, std::memory_order_release);
    PROBE_CHECK(cudaStreamSynchronize(st));
    float ms = 0;
    PROBE_CHECK(cudaEventElapsedTime(&ms, t0, t1));
    std::printf("timeline mode=local rep=%d us_per_call=%.2f\n", rep, 1000.0 * ms / calls);
    std::fflush(stdout);
  }

  uint64_t round = 0;
  for (uint64_t mode : {kSem, kSemDev, kSemNoWait, kEvSem, kEvEv, kSemEv}) {
    for (int rep = 0; rep < 3; ++rep) {
      ++round;
      ++gate_value;
      sh->mode.store(mode);
      sh->round.store(round, std::memory_order_release);
      Gate<<<1, 1, 0, st>>>(reinterpret_cast<const volatile uint64_t*>(gate), gate_value);
      PROBE_CHECK(cudaEventRecord(t0, st));
      const uint64_t base = (round - 1) * calls;
      for (int i = 0; i < calls; ++i) {
        const uint64_t seq = base + i + 1;
        if (DaemonWaitsSem(mode)) {
          CU(cuStreamWriteValue64(reinterpret_cast<CUstream>(st), mode == kSemDev ? dev_in : in, seq, 0));
        } else {
          PROBE_CHECK(cudaEventRecord(in_ev[i], st));
        }
        sh->posted.store(seq, std::memory_order_release);
        if (mode == kSemNoWait) {
          if (i + 1 == calls) {
            CU(cuStreamWaitValue64(reinterpret_cast<CUstream>(st), done, seq, CU_STREAM_WAIT_VALUE_GEQ));
          }
        } else if (DaemonWritesSem(mode)) {
          CU(cuStreamWaitValue64(reinterpret_cast<CUstream>(st), mode == kSemDev ? dev_done : done, seq,
                                 CU_STREAM_WAIT_VALUE_GEQ));
        } else {
          Spin(sh->launched, seq);  // the daemon's record exists: the wait binds to it
          PROBE_CHECK(cudaStreamWaitEvent(st, done_ev[i], 0));
        }
      }
      PROBE_CHECK(cudaEventRecord(t1, st));
      Spin(sh->round_done, round);
      gate_word->store(gate_value, std::memory_order_release);
      PROBE_CHECK(cudaStreamSynchronize(st));
      float ms = 0;
      PROBE_CHECK(cudaEventElapsedTime(&ms, t0, t1));
      std::printf("timeline mode=%s rep=%d us_per_call=%.2f\n", ModeName(mode), rep, 1000.0 * ms / calls);
      std::fflush(stdout);
    }
  }
  sh->mode.store(0);
  sh->round.store(round + 1, std::memory_order_release);
  return 0;
}

static int Timeline(int calls) {
  if (calls > 256) calls = 256;
  void* mem = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return 1;
  auto* sh = new (mem) Shared();
  pid_t pid = fork();
  if (pid == 0) _exit(Daemon(sh, calls));
  int rc = Client(sh, calls);
  int status = 0;
  waitpid(pid, &status, 0);
  return rc != 0 ? rc : (WIFEXITED(status) ? WEXITSTATUS(status) : 1);
}

// Mean host microseconds of `body` over n enqueues; a synchronize every 128
// (outside the timing) keeps the stream's queue from filling.
template <typename F>
static double EnqueueUs(cudaStream_t s, int n, F body) {
  using Clock = std::chrono::steady_clock;
  Clock::duration total{};
  for (int done = 0; done < n;) {
    const int batch = std::min(128, n - done);
    const auto t0 = Clock::now();
    for (int i = 0; i < batch; ++i) body(done + i + 1);
    total += Clock::now() - t0;
    PROBE_CHECK(cudaStreamSynchronize(s));
    done += batch;
  }
  return std::chrono::duration<double, std::micro>(total).count() / n;
}

static int HostCost(int n) {
  PROBE_CHECK(cudaSetDevice(0));
  cudaStream_t s;
  PROBE_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUstream cs = reinterpret_cast<CUstream>(s);
  void* page = nullptr;
  if (posix_memalign(&page, 4096, 4096) != 0) return 1;
  std::memset(page, 0, 4096);
  const CUdeviceptr base = MapHost(page, 4096);
  const CUdeviceptr ready = base, done = base + 64, completed = base + 128;
  reinterpret_cast<std::atomic<uint64_t>*>(page)->store(~0ull >> 1);  // every wait is already satisfied
  int* counter = nullptr;
  PROBE_CHECK(cudaMalloc(&counter, sizeof(int)));
  cudaEvent_t ev;
  PROBE_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  auto write2_batched = [&](uint64_t v) {
    CUstreamBatchMemOpParams ops[2] = {};
    for (int i = 0; i < 2; ++i) {
      ops[i].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
      ops[i].writeValue.address = i == 0 ? done : completed;
      ops[i].writeValue.value64 = v;
      ops[i].writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
    }
    CU(cuStreamBatchMemOp(cs, 2, ops, 0));
  };
  // The executor's call when the next call's wait goes with this one's
  // "done" (Executor::NextWait): launch, then one batch of two writes and
  // the next wait.
  auto write2_wait_batched = [&](uint64_t v) {
    CUstreamBatchMemOpParams ops[3] = {};
    for (int i = 0; i < 2; ++i) {
      ops[i].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
      ops[i].writeValue.address = i == 0 ? done : completed;
      ops[i].writeValue.value64 = v;
      ops[i].writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
    }
    ops[2].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
    ops[2].waitValue.address = ready;
    ops[2].waitValue.value64 = v + 1;
    ops[2].waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
    CU(cuStreamBatchMemOp(cs, 3, ops, 0));
  };
  auto write1 = [&](uint64_t v) { CU(cuStreamWriteValue64(cs, done, v, CU_STREAM_WRITE_VALUE_DEFAULT)); };
  auto write2 = [&](uint64_t v) {
    write1(v);
    CU(cuStreamWriteValue64(cs, completed, v, CU_STREAM_WRITE_VALUE_DEFAULT));
  };
  auto wait = [&](uint64_t v) { CU(cuStreamWaitValue64(cs, ready, v, CU_STREAM_WAIT_VALUE_GEQ)); };
  auto launch = [&](uint64_t) { Touch<<<1, 32, 0, s>>>(counter); };
  struct Row {
    const char* what;
    double us;
  };
  std::vector<Row> rows;
  for (int pass = 0; pass < 2; ++pass) {  // the first pass warms up
    rows.clear();
    rows.push_back({"kernel launch", EnqueueUs(s, n, launch)});
    rows.push_back({"cuStreamWriteValue64", EnqueueUs(s, n, write1)});
    rows.push_back({"cuStreamWaitValue64 (satisfied)", EnqueueUs(s, n, wait)});
    rows.push_back({"two writes, two calls", EnqueueUs(s, n, write2)});
    rows.push_back({"two writes, one cuStreamBatchMemOp", EnqueueUs(s, n, write2_batched)});
    rows.push_back({"cudaEventRecord", EnqueueUs(s, n, [&](uint64_t) { PROBE_CHECK(cudaEventRecord(ev, s)); })});
    rows.push_back({"cudaGetLastError", EnqueueUs(s, n, [&](uint64_t) { (void)cudaGetLastError(); })});
    rows.push_back({"call: wait, launch, two writes", EnqueueUs(s, n, [&](uint64_t v) {
                      wait(v);
                      launch(v);
                      write2(v);
                    })});
    rows.push_back({"call: wait, launch, one batch of two writes", EnqueueUs(s, n, [&](uint64_t v) {
                      wait(v);
                      launch(v);
                      write2_batched(v);
                    })});
    rows.push_back({"call: launch, one batch of two writes", EnqueueUs(s, n, [&](uint64_t v) {
                      launch(v);
                      write2_batched(v);
                    })});
    rows.push_back({"call: launch, one batch of two writes + next wait", EnqueueUs(s, n, [&](uint64_t v) {
                      launch(v);
                      write2_wait_batched(v);
                    })});
  }
  for (const Row& r : rows) std::printf("hostcost %-52s %7.2f us\n", r.what, r.us);
  PROBE_CHECK(cudaDeviceSynchronize());
  return 0;
}

static int Threads(int n) {
  using Clock = std::chrono::steady_clock;
  PROBE_CHECK(cudaSetDevice(0));
  PROBE_CHECK(cudaFree(nullptr));
  constexpr int kMaxThreads = 8;
  struct Lane {
    cudaStream_t s;
    int* counter;
    void* page;
    CUdeviceptr words;
  };
  std::vector<Lane> lanes(kMaxThreads);
  for (Lane& l : lanes) {
    PROBE_CHECK(cudaStreamCreateWithFlags(&l.s, cudaStreamNonBlocking));
    PROBE_CHECK(cudaMalloc(&l.counter, sizeof(int)));
    if (posix_memalign(&l.page, 4096, 4096) != 0) return 1;
    std::memset(l.page, 0, 4096);
    l.words = MapHost(l.page, 4096);
  }
  auto call = [](Lane& l, uint64_t v) {
    Touch<<<1, 32, 0, l.s>>>(l.counter);
    CUstreamBatchMemOpParams ops[2] = {};
    for (int i = 0; i < 2; ++i) {
      ops[i].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
      ops[i].writeValue.address = l.words + 64 * i;
      ops[i].writeValue.value64 = v;
      ops[i].writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
    }
    CU(cuStreamBatchMemOp(reinterpret_cast<CUstream>(l.s), 2, ops, 0));
  };
  for (Lane& l : lanes) {  // warm up every stream
    for (int i = 0; i < 256; ++i) call(l, i + 1);
  }
  PROBE_CHECK(cudaDeviceSynchronize());
  for (int threads : {1, 2, 4, 8}) {
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    std::vector<double> us(threads, 0);
    std::vector<std::thread> pool;
    const auto start = [&] {
      while (ready.load() < threads) std::this_thread::yield();
      go.store(true);
      return Clock::now();
    };
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        PROBE_CHECK(cudaSetDevice(0));
        Lane& l = lanes[t];
        ready.fetch_add(1);
        while (!go.load()) {
        }
        const auto t0 = Clock::now();
        for (int i = 0; i < n; ++i) {
          call(l, i + 1);
          // The GPU drains as it goes; a full stream queue would time the queue, not the host.
          if (i % 512 == 511) PROBE_CHECK(cudaStreamSynchronize(l.s));
        }
        us[t] = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / n;
      });
    }
    const auto t0 = start();
    for (std::thread& th : pool) th.join();
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    PROBE_CHECK(cudaDeviceSynchronize());
    double worst = 0;
    for (double u : us) worst = std::max(worst, u);
    std::printf("threads %d: %.0f calls/s in all, host time per call %.2f us (slowest thread)\n", threads,
                threads * static_cast<double>(n) / secs, worst);
  }
  return 0;
}

// P client/daemon stream pairs in one context (as under MPS), everything
// enqueued ahead behind a gate: the GPU's aggregate calls/s of the hand-off
// alone, no host in the loop. Whether 8 launch-bound clients can reach a
// rate at all is bounded by this.
static int Pairs(int calls, size_t bytes) {
  using Clock = std::chrono::steady_clock;
  PROBE_CHECK(cudaSetDevice(0));
  constexpr int kMaxPairs = 12;  // 2 x 12 streams within the 32 hardware queues main() asks for
  void* page = nullptr;
  if (posix_memalign(&page, 4096, 8192) != 0) return 1;
  std::memset(page, 0, 8192);
  const CUdeviceptr base = MapHost(page, 8192);
  // The semaphores live in pinned host memory (as the daemon's ring
  // sessions keep them) or, for the *_dev modes, in device memory: whether
  // the hand-off's ceiling is the trips over PCIe or the GPU's memory-op path.
  void* dev_sems = nullptr;
  PROBE_CHECK(cudaMalloc(&dev_sems, 4096));
  bool on_device = false;
  auto sem_base = [&] { return on_device ? reinterpret_cast<CUdeviceptr>(dev_sems) : base; };
  auto in = [&](int p) { return sem_base() + 128 * p; };
  auto done = [&](int p) { return sem_base() + 2048 + 128 * p; };
  const CUdeviceptr gate = base + 4096;
  auto* gate_word = reinterpret_cast<std::atomic<uint64_t>*>(static_cast<char*>(page) + 4096);
  const size_t n = bytes / sizeof(int4);
  int4* src = nullptr;
  PROBE_CHECK(cudaMalloc(&src, bytes));
  std::vector<int4*> dst(kMaxPairs);
  for (auto& d : dst) PROBE_CHECK(cudaMalloc(&d, bytes));
  uint64_t gate_value = 0;
  for (int pairs : {1, 2, 4, 8, 12}) {
    std::vector<cudaStream_t> c(pairs), d(pairs);
    for (int p = 0; p < pairs; ++p) {
      PROBE_CHECK(cudaStreamCreateWithFlags(&c[p], cudaStreamNonBlocking));
      PROBE_CHECK(cudaStreamCreateWithFlags(&d[p], cudaStreamNonBlocking));
    }
    for (const char* mode : {"local", "in_only", "sem", "sem_cb", "sem_batch", "sem_dev", "sem_batch_dev",
                             "sem_cb_mirror", "sem_cb_batch_mirror"}) {
      const bool local = std::strcmp(mode, "local") == 0, batch = std::strstr(mode, "batch") != nullptr;
      const bool in_only = std::strcmp(mode, "in_only") == 0;  // the client's half: no "done" back
      const bool client_batch = std::strstr(mode, "_cb") != nullptr;  // write + wait in one batch, as the client does
      const bool mirror = std::strstr(mode, "mirror") != nullptr;  // waits on device words, writes to both
      on_device = mirror || std::strstr(mode, "_dev") != nullptr;
      std::memset(page, 0, 4096);  // the semaphores; no GPU work is pending
      PROBE_CHECK(cudaMemset(dev_sems, 0, 4096));
      PROBE_CHECK(cudaDeviceSynchronize());
      ++gate_value;
      for (int p = 0; p < pairs; ++p) {
        Gate<<<1, 1, 0, local ? d[p] : c[p]>>>(reinterpret_cast<const volatile uint64_t*>(gate), gate_value);
        MemOpBatch b;
        // Write v to a semaphore where the mode waits on it, and to its
        // pinned host twin too when mirrored.
        const CUdeviceptr host_offset = base - sem_base();
        auto write = [&](CUdeviceptr at, uint64_t v) {
          b.Write(at, v);
          if (mirror) b.Write(at + host_offset, v);
        };
        for (int i = 1; i <= calls; ++i) {
          if (!local) {
            write(in(p), i);
            if (!client_batch) b.Flush(c[p]);
            if (!in_only) b.Wait(done(p), i);
            b.Flush(c[p]);
            // sem_batch: call i's wait went out with call i-1's "done".
            if (!batch || i == 1) {
              b.Wait(in(p), i);
              b.Flush(d[p]);
            }
          }
          Copy<<<132, 512, 0, d[p]>>>(src, dst[p], n);
          if (local || in_only) continue;
          write(done(p), i);
          if (batch && i < calls) b.Wait(in(p), i + 1);
          b.Flush(d[p]);
        }
      }
      const auto t0 = Clock::now();
      gate_word->store(gate_value, std::memory_order_release);
      PROBE_CHECK(cudaDeviceSynchronize());
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      std::printf("pairs P=%-2d mode=%-19s calls/s=%9.0f us_per_call=%6.2f (all pairs together)\n", pairs, mode,
                  pairs * calls / s, 1e6 * s / (pairs * calls));
    }
    for (int p = 0; p < pairs; ++p) {
      PROBE_CHECK(cudaStreamDestroy(c[p]));
      PROBE_CHECK(cudaStreamDestroy(d[p]));
    }
  }
  return 0;
}

// The pairs of Pairs() as processes: P client processes and one daemon
// process, each its own CUDA context (one MPS client each when run under
// MPS, as the daemon and its clients are deployed), the semaphores in one
// shared page that every process maps. Everything is enqueued ahead behind
// the gate, which the parent (no CUDA context) opens once every process has
// enqueued; aggregate calls/s over all clients until the last one drains.
struct XShared {
  alignas(4096) uint64_t sem[512];  // pair p: in at 8p, done at 8p + 1, the daemon's copy at 8p + 2; gate at 500
  cudaIpcMemHandle_t dev_sems;      // daemon -> clients (dev_twin): pair p's in at 16p, done at 16p + 8 (uint64_t)
  std::atomic<int> dev_ready{0};
  std::atomic<int> enqueued{0};
  std::atomic<int64_t> end_ns[64];
  std::atomic<int> go{0};                 // live modes: the parent starts every host loop at once
  std::atomic<uint64_t> published[64]{};  // live modes: client p's last call number enqueued
  std::atomic<uint64_t> answered[64]{};   // live modes: the daemon's last call of client p enqueued
};

enum class XMode {
  kLocal,
  kSemCb,
  kSemCbOneWord,
  kDevTwin,
  kLiveSemCb,
  kLiveDevTwin,
  kLiveSemCbSlow,
  kLiveSemCbFence,
  kLiveSemCbAnswered,
  kLiveHost,
  kLiveHostOneWord,
  kLiveDevIn,
  kLiveDevDone
};

static const char* XModeName(XMode m) {
  switch (m) {
    case XMode::kLocal: return "local";
    case XMode::kSemCb: return "sem_cb";
    case XMode::kSemCbOneWord: return "sem_cb_1w";
    case XMode::kDevTwin: return "dev_twin";
    case XMode::kLiveSemCb: return "live_sem_cb";
    case XMode::kLiveDevTwin: return "live_dev_twin";
    case XMode::kLiveSemCbSlow: return "live_sem_cb_slow";
    case XMode::kLiveSemCbFence: return "live_sem_cb_fence";
    case XMode::kLiveSemCbAnswered: return "live_sem_cb_answered";
    case XMode::kLiveHost: return "live_host";
    case XMode::kLiveHostOneWord: return "live_host_1w";
    case XMode::kLiveDevIn: return "live_dev_in";
    case XMode::kLiveDevDone: return "live_dev_done";
  }
  return "?";
}

static bool XLive(XMode m) { return m >= XMode::kLiveSemCb; }
// Host-checked: the daemon enqueues call i only once its host sees "inputs
// ready" >= i, with no GPU wait (the executor's path for a lane without a
// parking slot).
static bool XHostChecked(XMode m) { return m == XMode::kLiveHost || m == XMode::kLiveHostOneWord; }
static bool XOneWord(XMode m) { return m == XMode::kSemCbOneWord || m == XMode::kLiveHostOneWord; }

static int64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

// who == pairs: the daemon.
static int XPairsChild(XShared* sh, int pairs, int calls, size_t bytes, XMode mode, int who) {
  // As deployed: the daemon asks for a hardware queue per stream, the clients
  // keep CUDA's default. Under MPS the queues come from the server's shared
  // pool, so every process asking for 32 exhausted it at P = 4 (a context
  // could not be made: "busy or unavailable", then "out of memory").
  const bool daemon = who == pairs;
  if (daemon) {
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 1);
  } else {
    unsetenv("CUDA_DEVICE_MAX_CONNECTIONS");
  }
  PROBE_CHECK(cudaSetDevice(0));
  PROBE_CHECK(cudaFree(nullptr));
  const CUdeviceptr base = MapHost(sh->sem, sizeof(sh->sem));
  auto word = [&](int p, int i) { return base + 8 * (8 * p + i); };
  const CUdeviceptr gate = base + 8 * 500;
  // dev_twin: the semaphores waited on live in the daemon's device memory;
  // every write also goes to the host word, for host readers.
  void* dev = nullptr;
  const bool twin = mode == XMode::kDevTwin || mode == XMode::kLiveDevTwin;
  // live_dev_in: only "inputs ready" in device memory (written to both, the
  // daemon's GPU waiting on the device word); "done" stays in pinned memory,
  // which a client can write from its host when the daemon dies.
  // live_dev_done: the other half ("done" in device memory and pinned).
  const bool dev_in = twin || mode == XMode::kLiveDevIn;
  const bool dev_done = twin || mode == XMode::kLiveDevDone;
  if (dev_in || dev_done) {
    if (daemon) {
      PROBE_CHECK(cudaMalloc(&dev, 4096));
      PROBE_CHECK(cudaMemset(dev, 0, 4096));
      PROBE_CHECK(cudaDeviceSynchronize());
      PROBE_CHECK(cudaIpcGetMemHandle(&sh->dev_sems, dev));
      sh->dev_ready.store(1, std::memory_order_release);
    } else {
      while (sh->dev_ready.load(std::memory_order_acquire) == 0) usleep(100);
      PROBE_CHECK(cudaIpcOpenMemHandle(&dev, sh->dev_sems, cudaIpcMemLazyEnablePeerAccess));
    }
  }
  auto dev_word = [&](int p, int i) { return reinterpret_cast<CUdeviceptr>(dev) + 8 * (16 * p + 8 * i); };
  const size_t n = bytes / sizeof(int4);
  int4 *src = nullptr, *dst = nullptr;
  PROBE_CHECK(cudaMalloc(&src, bytes));
  PROBE_CHECK(cudaMalloc(&dst, bytes * (daemon ? pairs : 1)));
  std::vector<cudaStream_t> st(daemon ? pairs : 1);
  for (auto& x : st) PROBE_CHECK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
  MemOpBatch b;
  // One call of either side, as the enqueued-ahead modes and the live ones issue it.
  auto client_call = [&](cudaStream_t s, int p, uint64_t i) {  // "inputs ready", then wait "done", one batch
    b.Write(dev_in ? dev_word(p, 0) : word(p, 0), i);
    if (dev_in) b.Write(word(p, 0), i);
    b.Wait(dev_done ? dev_word(p, 1) : word(p, 1), i);
    b.Flush(s);
  };
  auto daemon_call = [&](cudaStream_t s, int p, uint64_t i, int4* out) {  // wait, run, "done" (+ twin) and own copy
    if (!XHostChecked(mode)) {
      b.Wait(dev_in ? dev_word(p, 0) : word(p, 0), i);
      b.Flush(s);
    }
    Copy<<<132, 512, 0, s>>>(src, out, n);
    if (dev_done) b.Write(dev_word(p, 1), i);
    b.Write(word(p, 1), i);
    if (!XOneWord(mode)) b.Write(word(p, 2), i);
    b.Flush(s);
  };
  if (XLive(mode)) {
    sh->enqueued.fetch_add(1, std::memory_order_acq_rel);  // set up: ready to start
    while (sh->go.load(std::memory_order_acquire) == 0) {
    }
    if (!daemon) {
      cudaEvent_t fence = nullptr;
      if (mode == XMode::kLiveSemCbFence) PROBE_CHECK(cudaEventCreateWithFlags(&fence, cudaEventDisableTiming));
      for (int i = 1; i <= calls; ++i) {
        client_call(st[0], who, i);
        if (fence != nullptr) PROBE_CHECK(cudaEventRecord(fence, st[0]));
        sh->published[who].store(i, std::memory_order_release);
        if (mode == XMode::kLiveSemCbAnswered) {
          while (sh->answered[who].load(std::memory_order_acquire) < static_cast<uint64_t>(i)) {
          }
        }
      }
    } else {
      // The executor's rule: at most 32 calls beyond the "inputs ready" the
      // host sees (the host word; dev_twin writes it too).
      constexpr uint64_t kAhead = 32;
      const auto extra = std::chrono::microseconds(mode == XMode::kLiveSemCbSlow ? 6 : 0);
      std::vector<uint64_t> taken(pairs, 0);
      for (int left = pairs; left > 0;) {
        for (int p = 0; p < pairs; ++p) {
          const uint64_t published = sh->published[p].load(std::memory_order_acquire);
          const auto* in_seen = reinterpret_cast<const volatile uint64_t*>(&sh->sem[8 * p]);
          // Host-checked: nothing beyond what the host sees ready.
          // (Compared signed, as the GPU's ">=" is cyclic.)
          const int64_t ahead = XHostChecked(mode) ? 0 : kAhead;
          while (taken[p] < published && static_cast<int64_t>(taken[p] + 1 - *in_seen) <= ahead) {
            const uint64_t i = ++taken[p];
            daemon_call(st[p], p, i, dst + p * n);
            sh->answered[p].store(i, std::memory_order_release);
            for (const auto until = std::chrono::steady_clock::now() + extra;
                 std::chrono::steady_clock::now() < until;) {
            }
            if (i == static_cast<uint64_t>(calls)) --left;
          }
        }
      }
    }
    PROBE_CHECK(cudaDeviceSynchronize());
    sh->end_ns[who].store(NowNs(), std::memory_order_release);
    return 0;
  }
  if (!daemon || mode != XMode::kLocal) {
    for (size_t q = 0; q < st.size(); ++q) {
      const int p = daemon ? static_cast<int>(q) : who;
      Gate<<<1, 1, 0, st[q]>>>(reinterpret_cast<const volatile uint64_t*>(gate), 1);
      for (int i = 1; i <= calls; ++i) {
        if (mode == XMode::kLocal) {
          Copy<<<132, 512, 0, st[q]>>>(src, dst, n);
        } else if (!daemon) {
          client_call(st[q], p, i);
        } else {
          daemon_call(st[q], p, i, dst + q * n);
        }
      }
    }
  }
  sh->enqueued.fetch_add(1, std::memory_order_acq_rel);
  PROBE_CHECK(cudaDeviceSynchronize());
  sh->end_ns[who].store(NowNs(), std::memory_order_release);
  return 0;
}

static int XPairs(int calls, size_t bytes) {
  std::printf("xpairs: a copy of %zu bytes as each call's kernel\n", bytes);
  for (int pairs : {1, 2, 4, 8}) {
    for (const XMode mode : {XMode::kLocal, XMode::kSemCb, XMode::kSemCbOneWord, XMode::kDevTwin, XMode::kLiveSemCb,
                             XMode::kLiveDevTwin, XMode::kLiveSemCbSlow, XMode::kLiveSemCbFence,
                             XMode::kLiveSemCbAnswered, XMode::kLiveHost, XMode::kLiveHostOneWord,
                             XMode::kLiveDevIn, XMode::kLiveDevDone}) {
      // Live: more calls, so the start (every process leaving its spin) is a small part.
      const int mode_calls = XLive(mode) ? 5 * calls : calls;
      void* mem = mmap(nullptr, sizeof(XShared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
      if (mem == MAP_FAILED) return 1;
      auto* sh = new (mem) XShared();
      std::vector<pid_t> kids;
      for (int who = 0; who <= pairs; ++who) {
        const pid_t pid = fork();
        if (pid == 0) _exit(XPairsChild(sh, pairs, mode_calls, bytes, mode, who));
        kids.push_back(pid);
      }
      while (sh->enqueued.load(std::memory_order_acquire) < pairs + 1) {
        int status = 0;
        if (waitpid(-1, &status, WNOHANG) > 0) {  // a child gave up before enqueuing: say so rather than hang
          for (pid_t pid : kids) kill(pid, SIGKILL);
          while (wait(nullptr) > 0) {
          }
          std::printf("xpairs P=%d mode=%s: a process ended before enqueuing FAILED\n", pairs, XModeName(mode));
          return 1;
        }
        usleep(1000);
      }
      const int64_t t0 = NowNs();
      reinterpret_cast<std::atomic<uint64_t>*>(&sh->sem[500])->store(1, std::memory_order_release);
      sh->go.store(1, std::memory_order_release);
      // A process that fails leaves the others waiting on it (a live daemon
      // on calls never published): the first failure ends them all.
      int failed = 0;
      for (size_t left = kids.size(); left > 0; --left) {
        int status = 0;
        if (wait(&status) <= 0) break;
        if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0) && failed++ == 0) {
          for (pid_t pid : kids) kill(pid, SIGKILL);
        }
      }
      int64_t end = t0;
      for (int who = 0; who <= pairs; ++who) end = std::max(end, sh->end_ns[who].load());
      const double secs = (end - t0) * 1e-9;
      std::printf("xpairs P=%-2d mode=%-16s calls/s=%9.0f us_per_call=%6.2f (all clients together)%s\n", pairs,
                  XModeName(mode), pairs * mode_calls / secs, 1e6 * secs / (pairs * mode_calls),
                  failed ? " FAILED" : "");
      munmap(mem, sizeof(XShared));
      if (failed) return 1;
    }
  }
  return 0;
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  // Lazy module loading would load a kernel at its first launch, which can
  // wait behind a parked stream wait; the probe (like the daemon) loads
  // everything up front unless told otherwise (PROBE_LAZY=1).
  if (!getenv("PROBE_LAZY")) setenv("CUDA_MODULE_LOADING", "EAGER", 1);
  if (argc >= 5 && std::strcmp(argv[1], "isolation") == 0) {
    return Isolation(std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]));
  }
  if (argc >= 2 && std::strcmp(argv[1], "timeline") == 0) return Timeline(argc >= 3 ? std::atoi(argv[2]) : 128);
  if (argc >= 2 && std::strcmp(argv[1], "hostcost") == 0) return HostCost(argc >= 3 ? std::atoi(argv[2]) : 20000);
  if (argc >= 2 && std::strcmp(argv[1], "threads") == 0) return Threads(argc >= 3 ? std::atoi(argv[2]) : 20000);
  if (argc >= 2 && std::strcmp(argv[1], "xpairs") == 0) {
    return XPairs(argc >= 3 ? std::atoi(argv[2]) : 200, argc >= 4 ? std::strtoull(argv[3], nullptr, 10) : 1u << 20);
  }
  if (argc >= 2 && std::strcmp(argv[1], "pairs") == 0) {
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 1);  // a queue per stream: no wait holds up another pair
    return Pairs(argc >= 3 ? std::atoi(argv[2]) : 200, argc >= 4 ? std::strtoull(argv[3], nullptr, 10) : 1u << 20);
  }
  std::fprintf(stderr,
               "usage: %s isolation CONNECTIONS STREAMS PARKED_COUNT | timeline [CALLS] | hostcost [N] | threads [N] | "
               "pairs [CALLS] [BYTES] | xpairs [CALLS] [BYTES]\n",
               argv[0]);
  return 2;
}
