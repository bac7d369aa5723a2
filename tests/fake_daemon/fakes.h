// File: tests/fake_daemon/fakes.h
//
// Fakes of the daemon's device seams (server/device/) and of its CallRunner,
// for the C++ CPU tests of the daemon's core and for the fake-device daemon
// (tests/fake_daemon/main.cc): device operations that write host memory at
// once, a region opener with configurable allocations, a call runner that
// records what ran where, and the weight store's memory in host blocks.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "server/device/device_ops.h"
#include "server/device/region_opener.h"
#include "server/exec/call_runner.h"
#include "server/device/store_memory.h"

namespace cache_dit_opd::testing {

// Device addresses are host addresses. A stream runs its work at once,
// except behind a wait whose value is not reached yet: then what follows
// (writes, and runs enqueued through Enqueue) stays queued, in order, until
// a pump thread (started by the first such wait) sees the value. With
// `max_queued` set, a stream holds at most that many queued operations and
// enqueueing one more blocks the caller until the stream moves, as a CUDA
// launch blocks on a full command queue.
class FakeDeviceOps : public DeviceOps {
 public:
  ~FakeDeviceOps() override {
    {
      std::lock_guard<std::mutex> lock(mu);
      pump_stop_ = true;
    }
    pump_cv_.notify_all();
    room_cv_.notify_all();
    if (pump_.joinable()) pump_.join();
  }
  Status RegisterHostMemory(void* p, size_t bytes, uint64_t* device_address) override {
    std::lock_guard<std::mutex> lock(mu);
    if (fail_register) return Status::Internal("fake cuMemHostRegister failure");
    registered[p] = bytes;
    *device_address = reinterpret_cast<uint64_t>(p);
    return Status::Ok();
  }
  void UnregisterHostMemory(void* p) override {
    std::lock_guard<std::mutex> lock(mu);
    registered.erase(p);
  }
  Status CreateStream(void** stream) override {
    std::lock_guard<std::mutex> lock(mu);
    *stream = reinterpret_cast<void*>(++next_stream);
    streams.insert(*stream);
    return Status::Ok();
  }
  void DestroyStream(void* stream) override {
    std::lock_guard<std::mutex> lock(mu);
    streams.erase(stream);
    // What it still had queued never reads its (soon unmapped) memory.
    if (auto it = queued_.find(stream); it != queued_.end()) it->second.clear();
    room_cv_.notify_all();
  }
  Status WaitValue64(void* stream, uint64_t address, uint64_t value, bool* sticky) override {
    (void)sticky;
    std::unique_lock<std::mutex> lock(mu);
    if (!streams.count(stream)) return Status::Internal("wait on unknown stream");
    WaitForRoom(lock, stream);
    waits.push_back({stream, value});
    auto& q = queued_[stream];
    if (q.empty() && Passes(Load(address), value)) return Status::Ok();
    q.push_back(Op{address, value, {}, {}, true});
    if (!pump_.joinable()) pump_ = std::thread([this] { Pump(); });
    pump_cv_.notify_all();
    return Status::Ok();
  }
  // Runs `fn` in `stream`'s order: now, or once the waits before it pass.
  void Enqueue(void* stream, std::function<void()> fn) {
    {
      std::unique_lock<std::mutex> lock(mu);
      WaitForRoom(lock, stream);
      auto it = queued_.find(stream);
      if (it != queued_.end() && !it->second.empty()) {
        it->second.push_back(Op{0, 0, {}, std::move(fn), false});
        return;
      }
    }
    fn();
  }
  // Streams with work queued behind a wait.
  size_t blocked_streams() {
    std::lock_guard<std::mutex> lock(mu);
    size_t n = 0;
    for (auto& [st, q] : queued_) n += q.empty() ? 0 : 1;
    return n;
  }
  Status WriteValue64(void* stream, std::span<const uint64_t> addrs, uint64_t value, bool* sticky) override {
    {
      std::unique_lock<std::mutex> lock(mu);
      if (!streams.count(stream)) return Status::Internal("write on unknown stream");
      WaitForRoom(lock, stream);
      writes.push_back({stream, value});
      if (sticky_after > 0 && writes.size() >= sticky_after) {
        if (sticky) *sticky = true;
        return Status::Internal("fake illegal address (a sticky CUDA error)");
      }
      if (auto it = queued_.find(stream); it != queued_.end() && !it->second.empty()) {
        it->second.push_back(Op{0, value, std::vector<uint64_t>(addrs.begin(), addrs.end()), {}, false});
        return Status::Ok();
      }
      if (hold_writes) {
        held.push_back({std::vector<uint64_t>(addrs.begin(), addrs.end()), value});
        return Status::Ok();
      }
    }
    for (uint64_t a : addrs) {
      std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(a)).store(value, std::memory_order_release);
    }
    return Status::Ok();
  }
  // Lets held writes "execute" (simulates the GPU catching up).
  void FlushHeld() {
    std::vector<std::pair<std::vector<uint64_t>, uint64_t>> h;
    {
      std::lock_guard<std::mutex> lock(mu);
      h.swap(held);
    }
    for (auto& [addrs, v] : h) {
      for (uint64_t a : addrs) std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(a)).store(v);
    }
  }
  size_t held_count() {
    std::lock_guard<std::mutex> lock(mu);
    return held.size();
  }
  size_t stream_count() {
    std::lock_guard<std::mutex> lock(mu);
    return streams.size();
  }
  size_t registered_count() {
    std::lock_guard<std::mutex> lock(mu);
    return registered.size();
  }

  std::mutex mu;
  std::map<void*, size_t> registered;
  std::set<void*> streams;
  std::vector<std::pair<void*, uint64_t>> waits;  // every WaitValue64 (stream, value)
  uintptr_t next_stream = 0x1000;
  std::vector<std::pair<void*, uint64_t>> writes;
  // The knobs below are set by the test's thread while the daemon's threads
  // (executor, gRPC handlers) read them: atomics, not fields under `mu`.
  std::atomic<bool> hold_writes{false};  // queue writes until FlushHeld (GPU "behind")
  std::atomic<size_t> sticky_after{0};   // the n-th write (and every later one) fails with a sticky error; 0: never
  std::vector<std::pair<std::vector<uint64_t>, uint64_t>> held;
  std::atomic<bool> fail_register{false};
  std::atomic<size_t> max_queued{0};  // operations a stream holds behind a wait; 0: unbounded

 private:
  struct Op {
    uint64_t wait_address;  // a wait: until Passes(*wait_address, value)
    uint64_t value;
    std::vector<uint64_t> write_addresses;  // a write of `value`
    std::function<void()> run;              // an enqueued run
    bool is_wait;
  };
  // Blocks (releasing `mu`) while `stream` holds max_queued operations.
  void WaitForRoom(std::unique_lock<std::mutex>& lock, void* stream) {
    room_cv_.wait(lock, [&] {
      const size_t limit = max_queued.load();
      auto it = queued_.find(stream);
      return pump_stop_ || limit == 0 || it == queued_.end() || it->second.size() < limit;
    });
  }
  // CU_STREAM_WAIT_VALUE_GEQ as the GPU evaluates it: cyclic, so a value
  // 2^63 or more above `n` does not pass.
  static bool Passes(uint64_t seen, uint64_t n) { return static_cast<int64_t>(seen - n) >= 0; }
  static uint64_t Load(uint64_t address) {
    return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(address)).load(std::memory_order_acquire);
  }
  // The "GPU": advances every stream past the waits whose values arrived.
  void Pump() {
    std::unique_lock<std::mutex> lock(mu);
    while (!pump_stop_) {
      std::vector<std::pair<std::deque<Op>*, std::function<void()>>> runs;
      bool any = false;
      for (auto& [stream, q] : queued_) {
        while (!q.empty()) {
          Op& op = q.front();
          if (op.is_wait) {
            if (!Passes(Load(op.wait_address), op.value)) break;
          } else if (op.run) {
            // Runs outside our lock (it takes the runner's); it stays at
            // the front meanwhile, so later work still queues behind it.
            runs.emplace_back(&q, op.run);
            break;
          } else {
            for (uint64_t a : op.write_addresses) {
              std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(a)).store(op.value, std::memory_order_release);
            }
          }
          q.pop_front();
        }
        any = any || !q.empty();
      }
      room_cv_.notify_all();
      if (!runs.empty()) {
        lock.unlock();
        for (auto& [q, fn] : runs) fn();
        lock.lock();
        for (auto& [q, fn] : runs) {
          if (!q->empty()) q->pop_front();  // DestroyStream may have cleared it
        }
        room_cv_.notify_all();
        continue;
      }
      if (any) {
        pump_cv_.wait_for(lock, std::chrono::microseconds(100));
      } else {
        pump_cv_.wait(lock, [&] {
          if (pump_stop_) return true;
          for (auto& [st, q] : queued_) {
            if (!q.empty()) return true;
          }
          return false;
        });
      }
    }
  }
  std::map<void*, std::deque<Op>> queued_;  // guarded by mu
  std::condition_variable pump_cv_;
  std::condition_variable room_cv_;  // a stream's queue got shorter
  bool pump_stop_ = false;  // guarded by mu
  std::thread pump_;
};

inline std::string Handle(uint8_t tag) { return std::string(64, static_cast<char>(tag)); }

// Allocation size per handle's first byte; bases are fake addresses. With
// `decode_handles`, a handle instead carries its allocation as the Python
// client's FakeDriver writes it (tests/python/_client_fixtures.py):
// little-endian u64 base, u64 size, u64 buffer id, zeros; the base is the
// "device pointer".
class FakeRegionOpener : public RegionOpener {
 public:
  Status Open(std::string_view handle, void** base, uint64_t* size) override {
    std::lock_guard<std::mutex> lock(mu);
    if (handle.size() != kIpcHandleBytes) return Status::InvalidArgument("bad handle size");
    if (decode_handles) {
      uint64_t fields[2];
      std::memcpy(fields, handle.data(), sizeof(fields));
      if (fields[1] == 0) return Status::InvalidArgument("fake cudaIpcOpenMemHandle: not a FakeDriver handle");
      *base = reinterpret_cast<void*>(fields[0]);
      *size = fields[1];
      ++open[*base];
      ++opens;
      return Status::Ok();
    }
    uint8_t tag = static_cast<uint8_t>(handle[0]);
    if (refuse.count(tag)) return Status::InvalidArgument("fake cudaIpcOpenMemHandle refused");
    auto it = sizes.find(tag);
    *size = it == sizes.end() ? default_size : it->second;
    *base = reinterpret_cast<void*>(uintptr_t{0x7f0000000000} + uintptr_t{tag} * (uintptr_t{1} << 32));
    ++open[*base];
    ++opens;
    return Status::Ok();
  }
  void Close(void* base) override {
    std::lock_guard<std::mutex> lock(mu);
    if (--open[base] == 0) open.erase(base);
    ++closes;
  }
  // Chunks: each descriptor must hold at least its chunk's bytes (a memfd in
  // the tests and the Python client's FakeDriver); the base is a fake
  // address, never dereferenced.
  Status OpenChunks(std::span<const int> fds, std::span<const uint64_t> chunk_bytes, void** base,
                    uint64_t* size) override {
    uint64_t total = 0;
    for (size_t i = 0; i < fds.size(); ++i) {
      struct stat st {};
      if (fstat(fds[i], &st) != 0 || static_cast<uint64_t>(st.st_size) < chunk_bytes[i]) {
        return Status::Rejected(Reason::kBadArgument, "chunk ", i, " of ", chunk_bytes[i],
                                " bytes: fake cuMemMap: the descriptor holds ", st.st_size, " bytes");
      }
      total += chunk_bytes[i];
    }
    std::lock_guard<std::mutex> lock(mu);
    *base = reinterpret_cast<void*>(uintptr_t{0x7e0000000000} + (uintptr_t{++chunk_runs} << 32));
    *size = total;
    ++open[*base];
    return Status::Ok();
  }
  void CloseChunks(void* base) override { Close(base); }
  int open_count() {
    std::lock_guard<std::mutex> lock(mu);
    int n = 0;
    for (auto& [b, c] : open) n += c;
    return n;
  }
  std::mutex mu;
  std::map<uint8_t, uint64_t> sizes;
  std::set<uint8_t> refuse;
  uint64_t default_size = 1 << 20;
  bool decode_handles = false;
  std::map<void*, int> open;
  int opens = 0;
  int closes = 0;
  uint64_t chunk_runs = 0;
};

class FakePrepared : public PreparedCall {
 public:
  std::string name;
  std::vector<uint64_t> region_ids;
  uint64_t seq = 0;
  uint32_t lane = 0;
  const std::string& op_name() const override { return name; }
  const std::vector<uint64_t>& regions() const override { return region_ids; }
};

// op "reject": Prepare fails INVALID_ARGUMENT. op "sticky": Run reports a
// sticky error. op "slow": Run takes 2 ms of the calling thread (a launch
// that blocks). Tensor args are resolved through the resolver (marks use).
class FakeRunner : public CallRunner {
 public:
  struct Ran {
    void* stream;
    uint32_t lane;
    uint64_t seq;
    std::string op;
  };
  Status Prepare(const CallRequest& req, const RegionResolver& regions,
                 std::unique_ptr<PreparedCall>* out) override {
    auto p = std::make_unique<FakePrepared>();
    p->name = req.op;
    p->seq = req.seq;
    p->lane = req.lane;
    for (const Arg& a : req.args) {
      if (const auto* t = std::get_if<TensorRef>(&a)) {
        MappedRegion r;
        OPD_RETURN_IF_ERROR(regions.Resolve(t->region_id, &r));
        p->region_ids.push_back(t->region_id);
      }
    }
    if (req.op == "reject") return Status::InvalidArgument("fake validation refused seq ", req.seq);
    *out = std::move(p);
    return Status::Ok();
  }
  Status Run(PreparedCall& call, void* stream, bool* sticky) override {
    auto& p = static_cast<FakePrepared&>(call);
    if (p.name == "sticky") {
      std::lock_guard<std::mutex> lock(mu);
      ran.push_back({stream, p.lane, p.seq, p.name});
      *sticky = true;
      return Status::Internal("fake illegal address");
    }
    if (p.name == "slow") std::this_thread::sleep_for(std::chrono::milliseconds(2));
    Ran r{stream, p.lane, p.seq, p.name};
    auto record = [this, r] {
      std::lock_guard<std::mutex> lock(mu);
      ran.push_back(r);
    };
    // In stream order (behind a parked wait) when wired to the device fake.
    if (device != nullptr) {
      device->Enqueue(stream, record);
    } else {
      record();
    }
    return Status::Ok();
  }
  FakeDeviceOps* device = nullptr;  // when set, runs "execute" on its streams
  std::vector<Ran> ran_copy() {
    std::lock_guard<std::mutex> lock(mu);
    return ran;
  }
  std::mutex mu;
  std::vector<Ran> ran;
};

// The weight store's memory as host blocks: each one a memfd mapped shared,
// so that ExportFd hands a client a descriptor it can map (read-only) and
// read the very bytes the store holds, as a client maps a CUDA block's fd.
// Counts what is live and can be told to fail from the n-th allocation on.
// CopyFromDevice cannot read a fake client's "device" address (it names no
// memory of this process): it writes what the copy would have been told,
// each 8-byte word the source address of that word (src + 8 i), so a test
// sees which region and offset the daemon resolved.
class HostStoreAllocator : public StoreAllocator {
 public:
  class Block : public StoreBlock {
   public:
    Block(HostStoreAllocator* a, uint64_t n, int fd, void* mem) : a_(a), bytes_(n), fd_(fd), mem_(mem) { ++a_->live; }
    ~Block() override {
      munmap(mem_, bytes_);
      close(fd_);
      --a_->live;
    }
    uint64_t address() const override { return reinterpret_cast<uint64_t>(mem_); }
    uint64_t bytes() const override { return bytes_; }
    Status Write(uint64_t offset, std::span<const std::byte> src) override {
      if (offset > bytes_ || src.size() > bytes_ - offset) return Status::Internal("write past the block");
      std::memcpy(static_cast<std::byte*>(mem_) + offset, src.data(), src.size());
      return Status::Ok();
    }
    Status CopyFromDevice(uint64_t offset, const void* src, uint64_t n) override {
      if (offset > bytes_ || n > bytes_ - offset) return Status::Internal("copy past the block");
      auto* dst = static_cast<std::byte*>(mem_) + offset;
      for (uint64_t i = 0; i < n; i += 8) {
        const uint64_t word = reinterpret_cast<uint64_t>(src) + i;
        std::memcpy(dst + i, &word, std::min<uint64_t>(8, n - i));
      }
      return Status::Ok();
    }
    Status ExportFd(int* fd) override {
      if (a_->fail_export) return Status::Internal("fake cuMemExportToShareableHandle failed");
      *fd = fcntl(fd_, F_DUPFD_CLOEXEC, 0);
      return *fd >= 0 ? Status::Ok() : Status::Internal("dup: ", std::strerror(errno));
    }

   private:
    HostStoreAllocator* a_;
    uint64_t bytes_;
    int fd_;
    void* mem_;
  };
  Status Allocate(uint64_t bytes, std::unique_ptr<StoreBlock>* out) override {
    if (fail_after >= 0 && allocations.load() >= fail_after) return Status::Rejected(Reason::kResourceExhausted, "device memory full");
    const uint64_t n = AllocationBytes(bytes);
    int fd = memfd_create("cache-dit-opd-fake-store", MFD_CLOEXEC);
    if (fd < 0) return Status::Internal("memfd_create: ", std::strerror(errno));
    void* mem = ftruncate(fd, static_cast<off_t>(n)) == 0 ? mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                                                          : MAP_FAILED;
    if (mem == MAP_FAILED) {
      close(fd);
      return Status::Internal("mapping a fake store block: ", std::strerror(errno));
    }
    ++allocations;
    *out = std::make_unique<Block>(this, n, fd, mem);
    return Status::Ok();
  }
  uint64_t AllocationBytes(uint64_t bytes) const override {
    return granularity <= 1 ? bytes : (bytes + granularity - 1) / granularity * granularity;
  }
  std::atomic<int> live{0};
  std::atomic<int> allocations{0};
  int fail_after = -1;
  bool fail_export = false;
  uint64_t granularity = 1;  // bytes a block is rounded up to
};

}  // namespace cache_dit_opd::testing
