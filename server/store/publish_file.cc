#include "server/store/publish_file.h"

#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <set>
#include <thread>

#include "server/store/safetensors.h"

namespace cache_dit_opd::server {
namespace {

// O_NONBLOCK: opening a FIFO must not wait for a writer.
constexpr int kOpenFlags = O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY;

// The client names the file, so the daemon opens it with the client's
// rights: a daemon running as root would otherwise read, for any peer it
// admits (--allowed-gid), files that peer may not read. The daemon's own uid
// opens directly. Root opens on a thread of its own that takes the peer's
// filesystem uid, gid and supplementary groups and ends with them: these
// credentials are per thread in the kernel, so raw syscalls (glibc's
// setgroups wrapper would change every thread's), and leaving fsuid 0 drops
// the filesystem capabilities (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH) too.
// Any other daemon cannot act as another uid and refuses.
Status OpenAsPeer(const PeerCred& peer, const std::string& path, int* fd) {
  *fd = -1;
  const uid_t own = ::geteuid();
  int err = 0;
  if (peer.uid == own) {
    *fd = ::open(path.c_str(), kOpenFlags);
    if (*fd < 0) err = errno;
  } else if (own != 0) {
    return Status::Rejected(Reason::kStoreDenied, "publish: ", path, ": this daemon (uid ", own,
                            ") opens files only as its own uid, not as uid ", peer.uid,
                            "; publish the tensors from the session instead");
  } else {
    std::thread([&] {
      if (::syscall(SYS_setgroups, peer.groups.size(), peer.groups.data()) != 0) {
        err = errno;
        return;
      }
      ::syscall(SYS_setfsgid, peer.gid);
      ::syscall(SYS_setfsuid, peer.uid);
      // -1 is no id: the call changes nothing and returns the current one.
      if (static_cast<uid_t>(::syscall(SYS_setfsuid, -1)) != peer.uid ||
          static_cast<gid_t>(::syscall(SYS_setfsgid, -1)) != peer.gid) {
        err = EPERM;
        return;
      }
      *fd = ::open(path.c_str(), kOpenFlags);
      if (*fd < 0) err = errno;
    }).join();
  }
  if (*fd >= 0) return Status::Ok();
  if (err == EACCES || err == EPERM) {
    return Status::Rejected(Reason::kStoreDenied, "publish: uid ", peer.uid, " may not read ", path, " (",
                            std::strerror(err), ")");
  }
  return Status::Rejected(Reason::kBadArgument, "safetensors file ", path, ": ", std::strerror(err));
}

}  // namespace

Status PublishFile(WeightStore& store, const PeerCred& owner, const PublishFileParams& p,
                   std::vector<StoreEntryInfo>* out, std::stop_token stop, size_t chunk_bytes) {
  out->clear();
  // The daemon's working directory is nobody's business: a relative path
  // would be resolved against it, not against the client's.
  if (p.path.empty() || p.path.front() != '/') {
    return Status::Rejected(Reason::kBadArgument, "publish: path '", p.path, "' is not absolute");
  }
  if (p.tensors.size() > kMaxPublishTensors) {
    return Status::Rejected(Reason::kBadArgument, "publish: ", p.tensors.size(), " tensors named (at most ",
                            kMaxPublishTensors, " a set)");
  }
  int fd = -1;
  OPD_RETURN_IF_ERROR(OpenAsPeer(owner, p.path, &fd));
  std::unique_ptr<SafetensorsFile> file;
  OPD_RETURN_IF_ERROR(SafetensorsFile::Open(fd, p.path, &file));

  std::vector<const SafetensorsTensor*> chosen;
  if (p.tensors.empty()) {
    for (const SafetensorsTensor& t : file->index().tensors) chosen.push_back(&t);
  } else {
    std::set<std::string_view> seen;
    for (const std::string& name : p.tensors) {
      if (!seen.insert(name).second) {
        return Status::Rejected(Reason::kBadArgument, "publish: tensor '", name, "' named twice");
      }
      const SafetensorsTensor* t = file->Find(name);
      if (t == nullptr) {
        return Status::Rejected(Reason::kBadArgument, "publish: safetensors file ", p.path, " has no tensor '",
                                name, "'");
      }
      chosen.push_back(t);
    }
    std::sort(chosen.begin(), chosen.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
  }
  if (chosen.size() > kMaxPublishTensors) {
    return Status::Rejected(Reason::kBadArgument, "publish: safetensors file ", p.path, " holds ", chosen.size(),
                            " tensors (at most ", kMaxPublishTensors, " a set: name them in several sets)");
  }
  std::vector<StoreTensorSpec> specs;
  for (const SafetensorsTensor* t : chosen) specs.push_back({p.prefix + t->name, t->dtype, t->shape});

  std::vector<std::byte> chunk;
  auto fill = [&](size_t i, const StoreEntry& e) -> Status {
    const SafetensorsTensor& t = *chosen[i];
    chunk.resize(std::min<uint64_t>(chunk_bytes, t.bytes));
    for (uint64_t at = 0; at < t.bytes; at += chunk.size()) {
      if (stop.stop_requested()) {
        return Status::Rejected(Reason::kDraining, "publish: ", p.path, ": the daemon is shutting down (", at,
                                " of ", t.bytes, " bytes of '", t.name, "' read)");
      }
      const uint64_t n = std::min<uint64_t>(chunk.size(), t.bytes - at);
      SafetensorsTensor part = t;  // the next n bytes of the tensor
      part.offset += at;
      part.bytes = n;
      std::span<std::byte> dst(chunk.data(), n);
      OPD_RETURN_IF_ERROR(file->Read(part, dst));
      OPD_RETURN_IF_ERROR(e.Write(at, dst));
    }
    return Status::Ok();
  };
  return store.Publish(owner, specs, p.readers, fill, out);
}

StoreWorker::~StoreWorker() { Stop(); }

bool StoreWorker::Post(std::function<void()> task) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stop_source_.stop_requested()) return false;
  tasks_.push_back(std::move(task));
  if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
  cv_.notify_one();
  return true;
}

void StoreWorker::Stop() {
  std::thread t;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_source_.request_stop();
    t = std::move(thread_);
  }
  cv_.notify_all();
  if (t.joinable()) t.join();
}

void StoreWorker::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_source_.stop_requested() || !tasks_.empty(); });
    if (tasks_.empty()) return;  // stopped, nothing left
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    lock.unlock();
    task();
    lock.lock();
  }
}

}  // namespace cache_dit_opd::server
