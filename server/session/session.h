// File: server/session/session.h
//
// One client session: its token, lanes, shared memory, regions and
// counters. Created by SessionManager::Open, usable once bound on the
// session channel, torn down by the reaper once its lanes have drained.
//
// Lanes (one per client stream). Each has
//   - its own daemon stream (non-blocking), on which calls run in seq order,
//   - the client-visible semaphores in the shared memory (inputs_ready: the
//     client's, read by the executor on the host or waited on by the lane
//     stream when the lane holds a parking slot; done: written by the lane
//     stream after each call),
//   - a daemon-private copy of "done" (`completed`), written by the same
//     stream right after the shared one. Region release and drain decisions
//     read only the private copy: the shared one is client-writable, and a
//     client that faked "done" must not get its mappings closed under a
//     running kernel (a fault would be sticky and end every session).
#pragma once

#include <array>
#include <atomic>
#include <mutex>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cache_dit_opd/v1/session_memory.h"
#include "common/status.h"
#include "server/device/device_ops.h"
#include "server/session/peer_policy.h"
#include "server/session/region_registry.h"
#include "server/session/session_memory.h"

namespace cache_dit_opd {

using SessionToken = std::array<uint8_t, v1::kTokenBytes>;

struct Lane {
  uint32_t index = 0;
  void* stream = nullptr;             // daemon stream (DeviceOps::CreateStream)
  uint64_t shm_done_address = 0;      // device address of the shared "done"
  uint64_t shm_inputs_address = 0;    // device address of the shared "inputs_ready"
  uint64_t* completed = nullptr;      // daemon-private "done" (host pointer)
  uint64_t completed_address = 0;     // its device address
  // The next seq the transports may submit; guarded by the executor's mutex.
  uint64_t next_seq = 1;
  // Highest seq whose "done" write is enqueued on `stream` (executor writes;
  // the reaper reads it to know when the lane has drained).
  std::atomic<uint64_t> enqueued{0};

  // What the lane stream has finished, as the daemon itself recorded it.
  uint64_t Completed() const {
    return std::atomic_ref<uint64_t>(*completed).load(std::memory_order_acquire);
  }
};

enum class SessionState { kUnbound, kBound, kClosed };

struct SessionConfig {
  uint64_t id = 0;
  SessionToken token{};
  int32_t client_pid = 0;     // as OpenSession claimed it
  // The uid of the process that opened it over gRPC (checked against
  // client_pid then); absent for a session opened in-process (tests).
  std::optional<uid_t> opener_uid;
  std::string client_name;
  uint32_t lanes = 1;
  int device = 0;
  RegionLimits region_limits;
  uint32_t ring_capacity = 0;  // call ring slots (a power of two); 0 = no ring
};

class Session {
 public:
  // Session::Create
  //
  // Creates the shared memory, registers it and the private "done" page
  // with the device, and one stream per lane. Everything acquired is
  // released again on failure.
  static Status Create(const SessionConfig& config, DeviceOps* device, RegionOpener* opener,
                       std::shared_ptr<Session>* out);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  uint64_t id() const { return config_.id; }
  const SessionToken& token() const { return config_.token; }
  int32_t client_pid() const { return config_.client_pid; }
  std::optional<uid_t> opener_uid() const { return config_.opener_uid; }
  const std::string& client_name() const { return config_.client_name; }
  uint32_t lane_count() const { return config_.lanes; }
  Lane& lane(uint32_t i) { return *lanes_[i]; }
  const Lane& lane(uint32_t i) const { return *lanes_[i]; }
  SessionMemory& memory() { return *memory_; }
  // The shared memory holds a call ring (OpenSessionReply.ring_enabled).
  bool has_ring() const { return memory_->ring_capacity() > 0; }
  RegionRegistry& regions() { return *regions_; }
  const RegionRegistry& regions() const { return *regions_; }

  // State transitions happen under SessionManager's lock.
  SessionState state() const { return state_.load(std::memory_order_acquire); }
  void set_state(SessionState s) { state_.store(s, std::memory_order_release); }
  bool bound() const { return state() == SessionState::kBound; }
  // Valid once bound.
  const PeerCred& peer() const { return peer_; }
  void set_peer(const PeerCred& p) { peer_ = p; }
  std::chrono::steady_clock::time_point bind_deadline() const { return bind_deadline_; }
  void set_bind_deadline(std::chrono::steady_clock::time_point t) { bind_deadline_ = t; }

  // Every lane's stream has finished everything enqueued on it.
  bool Drained() const;

  // Session::ReleaseDeviceResources
  //
  // After the lanes drained: closes every region, destroys the streams and
  // unregisters the memory from the device. Idempotent. Runs on the reaper.
  void ReleaseDeviceResources();
  // Marks everything released without touching the device: for a session
  // whose lanes did not drain before the process exits.
  void Abandon();

  std::atomic<uint64_t> calls{0};   // calls run
  std::atomic<uint64_t> errors{0};  // calls rejected
  // Calls the executor holds for this session: handed to it and not yet
  // launched or finished (server/exec/executor.h counts them). Its ring is
  // read only while this is below RingConsumerOptions::max_held, so an
  // asynchronous client far ahead of its GPU waits on its own ring instead
  // of growing the daemon's memory.
  std::atomic<uint64_t> held{0};
  // Which of the daemon's executor threads serves this session: -1 until
  // its first call, ring or end picks one (server/exec/executor_pool.h owns
  // the encoding); fixed from then on, so its lanes stay on one thread.
  std::atomic<int> executor_shard{-1};
  // steady_clock nanoseconds of the last call's completion; 0: none yet.
  std::atomic<int64_t> last_call_ns{0};
  std::chrono::steady_clock::time_point opened_at() const { return opened_at_; }
  // The bound peer's command line (/proc/<pid>/cmdline, arguments joined by
  // spaces, at most 256 bytes; for a peer of another uid than the daemon's
  // only "[<its name>]"), read at bind: for people (opdctl sessions).
  const std::string& command() const { return command_; }
  void set_command(std::string command) { command_ = std::move(command); }

 private:
  Session(const SessionConfig& config, DeviceOps* device) : config_(config), device_(device) {}

  const SessionConfig config_;
  DeviceOps* const device_;
  std::unique_ptr<SessionMemory> memory_;
  bool memory_registered_ = false;
  void* private_page_ = nullptr;  // anonymous mmap holding every lane's `completed`
  size_t private_bytes_ = 0;
  bool private_registered_ = false;
  std::vector<std::unique_ptr<Lane>> lanes_;
  std::unique_ptr<RegionRegistry> regions_;
  std::atomic<SessionState> state_{SessionState::kUnbound};
  PeerCred peer_;
  std::chrono::steady_clock::time_point bind_deadline_{};
  const std::chrono::steady_clock::time_point opened_at_ = std::chrono::steady_clock::now();
  std::string command_;  // set once, at bind, before the session is visible as bound
  bool released_ = false;
};

}  // namespace cache_dit_opd
