// File: server/store/publish_file.h
//
// Publishing the tensors of a .safetensors file into the weight store: what
// the PublishFile RPC does, on the store's own thread (a model's weights
// take seconds to read; nothing else waits behind them).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "server/session/peer_policy.h"
#include "server/store/weight_store.h"

namespace cache_dit_opd::server {

inline constexpr size_t kMaxPublishTensors = 4096;

struct PublishFileParams {
  std::string path;                  // absolute
  std::string prefix;                // store name = prefix + tensor name
  std::vector<std::string> tensors;  // the file's tensors; empty: all
  std::vector<uid_t> readers;
};

// Opens `p.path` with `owner`'s filesystem rights (its uid, gid and
// supplementary groups: a file the client could not read itself is refused;
// a daemon not running as root opens files for its own uid only), checks it
// (SafetensorsFile), publishes the chosen tensors as one set owned by `owner`
// (WeightStore::Publish), reading each in chunks of at most `chunk_bytes`
// into the store's memory. `out`: the set, in file offset order. Errors: the
// file's (safetensors.h), the store's (weight_store.h), STORE_DENIED when
// `owner` may not open the file (or the daemon may not open it as `owner`),
// BAD_ARGUMENT for a relative path, a tensor the file does not hold or one
// named twice, DRAINING when `stop` is requested before the last chunk is
// read (checked before each chunk: a shutdown waits for one chunk's read,
// not a whole checkpoint's; the set publishes nothing).
Status PublishFile(WeightStore& store, const PeerCred& owner, const PublishFileParams& p,
                   std::vector<StoreEntryInfo>* out, std::stop_token stop = {}, size_t chunk_bytes = 16u << 20);

// One thread that runs posted tasks in order, started by the first Post (an
// idle daemon has no store thread). Stop asks the task in progress to give
// up (stop_token(), which a task passes to PublishFile), runs what is
// queued (each sees the stop requested at once), then joins.
class StoreWorker {
 public:
  StoreWorker() = default;
  ~StoreWorker();  // Stop()
  StoreWorker(const StoreWorker&) = delete;
  StoreWorker& operator=(const StoreWorker&) = delete;

  // False after Stop (the task is not run).
  bool Post(std::function<void()> task);
  // Requested by Stop; tasks read it to end early.
  std::stop_token stop_token() const { return stop_source_.get_token(); }
  // Requests stop, runs what is queued, then joins. Idempotent.
  void Stop();

 private:
  void Loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  std::stop_source stop_source_;  // requested under mu_
  std::thread thread_;
};

}  // namespace cache_dit_opd::server
