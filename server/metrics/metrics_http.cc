#include "server/metrics/metrics_http.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "common/out_of_descriptors.h"

namespace cache_dit_opd {

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kMaxHead = 8192;

struct Conn {
  int fd = -1;
  Clock::time_point accepted;
  Clock::time_point deadline;
  std::string in;   // the request head as read so far
  std::string out;  // the response, once the head is complete
  size_t written = 0;
  bool lingering = false;  // response written, write side shut: reading until the peer closes
};

// `extra`: further header lines, each ending in CRLF. A HEAD request gets the
// head GET would get (its Content-Length included) and no body.
std::string Response(int code, const char* status, const std::string& type, const std::string& body,
                     bool head_only = false, const char* extra = "") {
  return "HTTP/1.1 " + std::to_string(code) + " " + status + "\r\nContent-Type: " + type +
         "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n" + extra + "Connection: close\r\n\r\n" +
         (head_only ? std::string() : body);
}

// The response to a complete request head (what the contract in the header says).
std::string Answer(const std::string& head, const std::function<std::string()>& render) {
  const size_t line_end = head.find("\r\n");
  const std::string line = head.substr(0, line_end);
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string::npos ? std::string::npos : line.find(' ', sp1 + 1);
  if (sp2 == std::string::npos || line.compare(sp2 + 1, 5, "HTTP/") != 0) {
    return Response(400, "Bad Request", "text/plain", "not an HTTP request\n");
  }
  const std::string method = line.substr(0, sp1);
  std::string path = line.substr(sp1 + 1, sp2 - sp1 - 1);
  path = path.substr(0, path.find('?'));
  const bool head_only = method == "HEAD";
  if (method != "GET" && !head_only) {  // RFC 9110 15.5.6: a 405 lists the methods the resource allows
    return Response(405, "Method Not Allowed", "text/plain", "only GET /metrics\n", false, "Allow: GET, HEAD\r\n");
  }
  if (path != "/metrics") return Response(404, "Not Found", "text/plain", "the metrics are at /metrics\n", head_only);
  return Response(200, "OK", "text/plain; version=0.0.4; charset=utf-8", render(), head_only);
}

}  // namespace

MetricsHttpServer::MetricsHttpServer(std::function<std::string()> render) : render_(std::move(render)) {}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

Status MetricsHttpServer::Start(const std::string& address) {
  const size_t colon = address.rfind(':');
  std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return Status::Unavailable("metrics: cannot resolve ", address, ": ", gai_strerror(rc));
  }
  int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  const int one = 1;
  int err = 0;
  if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0 ||
      bind(fd, res->ai_addr, res->ai_addrlen) != 0 || listen(fd, 16) != 0) {
    err = errno;
  }
  freeaddrinfo(res);
  if (err != 0) {
    if (fd >= 0) close(fd);
    return Status::Unavailable("metrics: cannot listen on ", address, ": ", std::strerror(err));
  }
  listen_fd_ = fd;
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  thread_ = std::thread([this] { Loop(); });
  return Status::Ok();
}

void MetricsHttpServer::Stop() {
  if (thread_.joinable()) {
    stop_.store(true, std::memory_order_release);
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
    thread_.join();
  }
  for (int* fd : {&listen_fd_, &wake_fd_}) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
  }
}

// One non-blocking read of `c`'s request head; once the head is complete (or
// too long) its response is ready in c.out. False when the peer is gone.
static bool ReadHead(Conn& c, const std::function<std::string()>& render) {
  char buf[2048];
  const ssize_t n = recv(c.fd, buf, sizeof(buf), 0);
  if (n <= 0) return n < 0 && (errno == EAGAIN || errno == EINTR);
  c.in.append(buf, static_cast<size_t>(n));
  if (c.in.find("\r\n\r\n") != std::string::npos) {
    c.out = Answer(c.in, render);
  } else if (c.in.size() > kMaxHead) {
    c.out = Response(431, "Request Header Fields Too Large", "text/plain", "request head over 8 KiB\n");
  }
  return true;
}

void MetricsHttpServer::Loop() {
  std::vector<Conn> conns;
  Clock::time_point accept_paused_until{};
  // The oldest connection that has had its response (lingering) or has not
  // sent its request head, accepted at least `grace` ago: the one to drop
  // when room is needed.
  auto oldest_silent = [&](Clock::time_point now, std::chrono::milliseconds grace) {
    auto oldest = conns.end();
    for (auto it = conns.begin(); it != conns.end(); ++it) {
      const bool silent = it->lingering || (it->out.empty() && now - it->accepted >= grace);
      if (silent && (oldest == conns.end() || it->accepted < oldest->accepted)) oldest = it;
    }
    return oldest;
  };
  while (!stop_.load(std::memory_order_acquire)) {
    // The listening socket is polled always (but while accepting is paused
    // for want of descriptors): the backlog is drained as connections come,
    // never left full for a scraper's connect to be dropped.
    Clock::time_point now = Clock::now();
    const bool listen = now >= accept_paused_until;
    std::vector<pollfd> fds{{wake_fd_, POLLIN, 0}, {listen_fd_, static_cast<short>(listen ? POLLIN : 0), 0}};
    const bool crowded = conns.size() > static_cast<size_t>(kMaxConnections);
    auto next_deadline = now + std::chrono::seconds(1);
    if (!listen) next_deadline = std::min(next_deadline, accept_paused_until);
    for (const Conn& c : conns) {
      fds.push_back({c.fd, static_cast<short>(c.out.empty() || c.lingering ? POLLIN : POLLOUT), 0});
      next_deadline = std::min(next_deadline, c.deadline);
      if (c.out.empty()) {
        next_deadline = std::min(next_deadline, c.accepted + kHeadDeadline);
        if (crowded && c.accepted + kHeadGrace > now) next_deadline = std::min(next_deadline, c.accepted + kHeadGrace);
      }
    }
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next_deadline - Clock::now()).count();
    if (poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(wait, 0) + 1)) < 0 && errno != EINTR) break;
    now = Clock::now();
    for (size_t i = 0; i < conns.size(); ++i) {
      Conn& c = conns[i];
      const short revents = fds[i + 2].revents;
      bool done = false;
      if (revents & (POLLERR | POLLHUP | POLLNVAL)) {
        done = true;
      } else if (c.lingering && (revents & POLLIN)) {
        char sink[16384];
        const ssize_t n = recv(c.fd, sink, sizeof(sink), 0);
        done = n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR);
      } else if (c.out.empty() && (revents & POLLIN)) {
        done = !ReadHead(c, render_);
      } else if (!c.out.empty() && (revents & POLLOUT)) {
        const ssize_t n = send(c.fd, c.out.data() + c.written, c.out.size() - c.written, MSG_NOSIGNAL);
        if (n > 0) c.written += static_cast<size_t>(n);
        done = n < 0 && errno != EAGAIN && errno != EINTR;
        if (!done && c.written == c.out.size()) {
          // Closing a socket with unread input sends a reset, which can
          // destroy the response still in flight (the peer sent a body, or
          // a second request): shut the write side and read what comes
          // until the peer closes, for at most kLinger.
          done = shutdown(c.fd, SHUT_WR) != 0;
          c.lingering = true;
          c.deadline = std::min(c.deadline, now + kLinger);
        }
      }
      if (done || now >= c.deadline || (c.out.empty() && now - c.accepted >= kHeadDeadline)) {
        close(c.fd);
        c.fd = -1;
      }
    }
    std::erase_if(conns, [](const Conn& c) { return c.fd < 0; });
    if (fds[1].revents & POLLIN) {
      // A bounded number a round, so the connections above keep their turn.
      for (int k = 0; k < 64; ++k) {
        const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
          // Out of descriptors the pending peer stays queued and the socket
          // readable: pause instead of polling it in a loop. (EAGAIN: nobody
          // is waiting.)
          if (OutOfDescriptors(errno)) {
            accept_paused_until = now + kAcceptPause;
          }
          break;
        }
        Conn c{fd, now, now + kIoDeadline, {}, {}, 0};
        if (!ReadHead(c, render_)) {  // a peer that sent its request with the connect has it read here
          close(fd);
          continue;
        }
        if (conns.size() < static_cast<size_t>(kMaxOpen)) {
          conns.push_back(std::move(c));
          continue;
        }
        const auto victim = oldest_silent(now, std::chrono::milliseconds(0));
        if (victim == conns.end()) {
          close(fd);
          continue;
        }
        close(victim->fd);
        *victim = std::move(c);
      }
    }
    // Past kMaxConnections, a connection silent for kHeadGrace gives way:
    // the oldest first. A scraper sends its request within that.
    while (conns.size() > static_cast<size_t>(kMaxConnections)) {
      const auto victim = oldest_silent(now, kHeadGrace);
      if (victim == conns.end()) break;
      close(victim->fd);
      conns.erase(victim);
    }
  }
  for (Conn& c : conns) close(c.fd);
}

}  // namespace cache_dit_opd
