// File: client/core/session_channel.h
//
// The client end of the session channel (`<GPU-UUID>.session.sock`,
// SOCK_SEQPACKET; messages in proto/cache_dit_opd/v1/session_memory.h).
// After OpenSession the client connects, sends one BindRequest with the
// session token, and receives one BindReply with the session memfd attached
// (SCM_RIGHTS). The connection then stays open for the session's life: the
// daemon ends the session when the client's end closes, and the client learns
// that the daemon died or ended the session when the daemon's end closes.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "cache_dit_opd/v1/session_memory.h"
#include "common/status.h"

namespace cache_dit_opd::client {

// UniqueFd: owns a file descriptor.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) reset(o.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// ConnectSessionChannel
//
// A close-on-exec SOCK_SEQPACKET socket connected to `path`. UNAVAILABLE with
// the errno text when nothing listens there.
Status ConnectSessionChannel(const std::string& path, UniqueFd* out);

// BindSession
//
// Sends BindRequest{session_id, token} on the connected channel `fd` and
// waits up to `timeout_ms` for the BindReply. On success `*memfd` holds the
// session memory object and `*shm_bytes` the size the reply announced
// (checked against `expected_bytes` when non-zero). Errors: the daemon's
// refusal with its status code and message (e.g. PERMISSION_DENIED for a
// foreign uid), DEADLINE_EXCEEDED on timeout, UNAVAILABLE when the daemon
// closed the channel, INTERNAL for a malformed reply (wrong size, no or
// extra file descriptors, layout version mismatch). Any descriptor received
// with a malformed reply is closed. A daemon that refuses the connection at
// accept (RESOURCE_EXHAUSTED: too many connections awaiting their bind
// request) replies and closes before the request is read: its refusal is
// returned even when sending the request failed for that (EPIPE).
Status BindSession(int fd, uint64_t session_id, std::string_view token, int timeout_ms,
                   uint64_t expected_bytes, UniqueFd* memfd, uint64_t* shm_bytes);

// A weight-store entry attached to a session: the daemon's reply
// (session_memory.h StoreAttachReply: region, block, offset, dtype, shape)
// and the block's descriptor (invalid for an empty tensor).
struct StoreAttachment {
  v1::StoreAttachReply reply{};
  UniqueFd fd;
};

// AttachStoreEntry
//
// Sends StoreAttachRequest{session_id, token, name} on a freshly connected
// channel `fd` (not the bound one) and waits up to `timeout_ms` for the
// reply. Errors as BindSession's: the daemon's refusal with its status and
// reason (NOT_FOUND / STORE_UNKNOWN for a name the store does not hold,
// PERMISSION_DENIED / STORE_DENIED for an entry this uid may not read,
// PEER_REFUSED when this process did not bind the session), INTERNAL for a
// malformed reply (the wrong number of descriptors, an entry outside its
// block). Mapping the descriptor is the caller's.
Status AttachStoreEntry(int fd, uint64_t session_id, std::string_view token, std::string_view name, int timeout_ms,
                        StoreAttachment* out);

// RequestDrain
//
// Sends AdminRequest{kDrain} on the connected channel `fd` (instead of a
// bind) and waits up to `timeout_ms` for the daemon's answer: OK once the
// daemon has begun draining (it then exits 0 after --drain-deadline-ms at
// most); PERMISSION_DENIED / PEER_REFUSED unless the caller is root or the
// daemon's uid; the other errors as BindSession's.
Status RequestDrain(int fd, int timeout_ms);

}  // namespace cache_dit_opd::client
