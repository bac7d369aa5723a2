// File: server/metrics/metrics_http.h
//
// The HTTP endpoint of the metrics: `GET /metrics` on a TCP address, served
// by one thread with poll(). Not prometheus-cpp's Exposer: civetweb as
// Debian builds it (USE_STACK_SIZE=102400) starts its threads with 100 KiB
// stacks, which cannot hold the static TLS libtorch brings into the daemon,
// so its pthread_create fails (EINVAL; measured: "Cannot create threads").
//
// Contract:
//   - `GET /metrics` (a query string is ignored) -> 200, the body `render()`
//     returns, Content-Type text/plain; version=0.0.4; `GET` of another path
//     -> 404; `HEAD` -> the head `GET` would get, with no body; another
//     method -> 405 with `Allow: GET, HEAD`; a request that is not HTTP ->
//     400. Every response closes the connection: its write side is shut
//     and its input read and dropped until the peer closes or kLinger
//     passes (a close with input unread would reset the connection and
//     could destroy the response in flight).
//   - Hostile peers: the listen backlog is drained as connections come
//     (never left full for a scraper's connect to be dropped), each read once
//     at accept. A request head must be complete (at most 8 KiB) within
//     kHeadDeadline of accept and the response written within kIoDeadline;
//     past either the connection is dropped. Beyond kMaxConnections open,
//     connections silent for kHeadGrace are dropped oldest first, and beyond
//     kMaxOpen a newcomer takes the place of the oldest silent one: peers
//     that connect and send nothing, or trickle, cannot keep out a scraper,
//     which sends its request at once; a lingering connection gives way as a
//     silent one does. Out of descriptors, accepting pauses
//     for kAcceptPause instead of polling a listening socket that stays
//     readable.
//   - render() runs on the server's thread, one request at a time.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <thread>

#include "common/status.h"

namespace cache_dit_opd {

class MetricsHttpServer {
 public:
  static constexpr int kMaxConnections = 8;
  static constexpr int kMaxOpen = 256;
  static constexpr std::chrono::milliseconds kIoDeadline{5000};
  static constexpr std::chrono::milliseconds kHeadDeadline{1000};
  static constexpr std::chrono::milliseconds kHeadGrace{100};
  static constexpr std::chrono::milliseconds kAcceptPause{100};
  static constexpr std::chrono::milliseconds kLinger{1000};

  explicit MetricsHttpServer(std::function<std::string()> render);
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // Binds HOST:PORT (IPv4, or IPv6 in brackets) and starts the thread.
  // UNAVAILABLE naming the address and the errno text on failure.
  Status Start(const std::string& address);
  // Joins the thread and closes every socket. Idempotent.
  void Stop();

 private:
  void Loop();

  const std::function<std::string()> render_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;
  std::thread thread_;
  std::atomic<bool> stop_{false};
};

}  // namespace cache_dit_opd
