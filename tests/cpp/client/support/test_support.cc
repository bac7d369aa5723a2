#include "tests/cpp/client/support/test_support.h"

#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "cache_dit_opd/v1/opd.grpc.pb.h"

extern char** environ;

namespace cache_dit_opd::testing {
namespace {

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

bool IsExecutable(const std::string& p) { return !p.empty() && ::access(p.c_str(), X_OK) == 0; }

std::string FirstExecutable(std::initializer_list<std::string> candidates) {
  for (const std::string& c : candidates) {
    if (IsExecutable(c)) return c;
  }
  return "";
}

std::vector<std::string> SplitSpaces(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream is(s);
  std::string w;
  while (is >> w) out.push_back(w);
  return out;
}

}  // namespace

std::string FindDaemonBinary() {
  const std::string build = Env("CACHE_DIT_OPD_BUILD_DIR");
  return FirstExecutable({Env("CACHE_DIT_OPD_DAEMON"), build.empty() ? "" : build + "/server/cache-dit-opd",
#ifdef OPD_TEST_DAEMON_PATH
                          OPD_TEST_DAEMON_PATH,
#endif
                          ""});
}

std::string FindRefTool() {
  const std::string build = Env("CACHE_DIT_OPD_BUILD_DIR");
  return FirstExecutable({Env("CACHE_DIT_OPD_REF_TOOL"),
                          build.empty() ? "" : build + "/tests/cpp/client/opd_ref_tool",
#ifdef OPD_TEST_REF_TOOL_PATH
                          OPD_TEST_REF_TOOL_PATH,
#endif
                          ""});
}

std::string FindHelperBinary() {
  const std::string build = Env("CACHE_DIT_OPD_BUILD_DIR");
  return FirstExecutable({build.empty() ? "" : build + "/tests/cpp/client/opd_client_test_helper",
#ifdef OPD_TEST_HELPER_PATH
                          OPD_TEST_HELPER_PATH,
#endif
                          ""});
}

TempDir::TempDir() {
  // Unix socket paths are limited to 107 bytes: stay under /tmp.
  char tmpl[] = "/tmp/opd-client-test.XXXXXX";
  if (::mkdtemp(tmpl) != nullptr) path_ = tmpl;
}

TempDir::~TempDir() {
  if (path_.empty()) return;
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

Status Child::Spawn(const std::vector<std::string>& argv, const std::string& log_path,
                    std::unique_ptr<Child>* out) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  int rc = posix_spawn(&pid, args[0], &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return Status::Internal("posix_spawn ", argv[0], ": ", std::strerror(rc));
  auto c = std::unique_ptr<Child>(new Child);
  c->pid_ = pid;
  c->log_path_ = log_path;
  *out = std::move(c);
  return Status::Ok();
}

Child::~Child() {
  if (pid_ > 0 && !reaped_) {
    ::kill(pid_, SIGKILL);
    int st;
    ::waitpid(pid_, &st, 0);
  }
}

bool Child::Running() {
  if (reaped_) return false;
  int st = 0;
  pid_t r = ::waitpid(pid_, &st, WNOHANG);
  if (r == pid_) {
    reaped_ = true;
    wstatus_ = st;
    return false;
  }
  return true;
}

bool Child::Wait(std::chrono::milliseconds timeout, int* wstatus) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (Running()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (wstatus) *wstatus = wstatus_;
  return true;
}

bool Child::Signal(int sig, std::chrono::milliseconds timeout, int* wstatus) {
  if (Running()) ::kill(pid_, sig);
  return Wait(timeout, wstatus);
}

std::string Child::Log() const {
  std::ifstream f(log_path_);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string Child::LogTail(size_t lines) const {
  std::istringstream is(Log());
  std::deque<std::string> tail;
  std::string line;
  size_t total = 0;
  while (std::getline(is, line)) {
    tail.push_back(line);
    ++total;
    if (tail.size() > lines) tail.pop_front();
  }
  std::ostringstream os;
  os << "---- " << log_path_ << " (last " << tail.size() << " of " << total << " lines) ----\n";
  for (const auto& l : tail) os << "  | " << l << "\n";
  os << "---- end of log ----";
  return os.str();
}

bool Child::WaitForLogLine(const std::string& needle, std::chrono::milliseconds timeout, std::string* line) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    std::istringstream is(Log());
    std::string l;
    while (std::getline(is, l)) {
      if (l.find(needle) != std::string::npos) {
        if (line) *line = l;
        return true;
      }
    }
    if (!Running() || std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

Status QueryVersion(const std::string& address, std::chrono::milliseconds timeout, bool* serving,
                    std::string* reason, std::string* gpu_uuid) {
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  auto stub = cache_dit_opd::v1::OperatorDaemon::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  cache_dit_opd::v1::VersionReply reply;
  grpc::Status g = stub->GetVersion(&ctx, cache_dit_opd::v1::VersionRequest(), &reply);
  if (!g.ok()) return Status::Unavailable("GetVersion at ", address, ": ", g.error_message());
  if (serving) *serving = reply.serving();
  if (reason) *reason = reply.not_serving_reason();
  if (gpu_uuid) *gpu_uuid = reply.gpu_uuid();
  return Status::Ok();
}

Status DaemonProcess::Start(const Options& o, std::unique_ptr<DaemonProcess>* out) {
  if (!IsExecutable(o.binary)) return Status::NotFound("daemon binary '", o.binary, "' is not executable");
  auto d = std::unique_ptr<DaemonProcess>(new DaemonProcess);
  d->dir_ = std::make_unique<TempDir>();
  if (d->dir_->path().empty()) return Status::Internal("mkdtemp failed");
  d->socket_path_ = o.socket_path.empty() ? d->dir_->path() + "/opd.sock" : o.socket_path;
  std::vector<std::string> argv = {o.binary, "--device", std::to_string(o.device), "--socket",
                                   d->socket_path_, "--log-level", "debug"};
  for (const auto& a : o.extra_args) argv.push_back(a);
  for (const auto& a : SplitSpaces(Env("CACHE_DIT_OPD_TEST_DAEMON_ARGS"))) argv.push_back(a);
  std::string cmd;
  for (const auto& a : argv) cmd += (cmd.empty() ? "" : " ") + a;
  OPD_RETURN_IF_ERROR(Child::Spawn(argv, d->dir_->path() + "/daemon.log", &d->child_));

  const auto deadline = std::chrono::steady_clock::now() + o.startup_timeout;
  std::string last_error = "socket not created yet";
  while (std::chrono::steady_clock::now() < deadline) {
    if (!d->child_->Running()) {
      int st = 0;
      d->child_->Wait(std::chrono::milliseconds(0), &st);
      return Status::Unavailable("the daemon exited during start-up (wait status ", st, ")\ncommand: ", cmd,
                                 "\n", d->child_->LogTail());
    }
    struct stat sb {};
    if (::stat(d->socket_path_.c_str(), &sb) == 0) {
      bool serving = false;
      std::string reason;
      Status s = QueryVersion(d->address(), std::chrono::milliseconds(1000), &serving, &reason, nullptr);
      if (s.ok() && serving) {
        *out = std::move(d);
        return Status::Ok();
      }
      if (s.ok()) {
        last_error = "GetVersion answers serving=false: " + reason;
      } else {
        last_error = s.message();
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return Status::DeadlineExceeded("the daemon did not become ready within ", o.startup_timeout.count(),
                                  " ms (last: ", last_error, ")\ncommand: ", cmd, "\n", d->child_->LogTail());
}

DaemonProcess::~DaemonProcess() {
  if (child_) child_->Signal(SIGKILL, std::chrono::milliseconds(10000));
}

const std::string& DaemonProcess::dir() const { return dir_->path(); }

Status RunRefTool(const std::string& tool, const CallFile& calls, int device, CallFile* results) {
  TempDir dir;
  if (dir.path().empty()) return Status::Internal("mkdtemp failed");
  const std::string in = dir.path() + "/calls.bin", out = dir.path() + "/results.bin";
  OPD_RETURN_IF_ERROR(WriteCallFile(in, calls));
  std::unique_ptr<Child> child;
  OPD_RETURN_IF_ERROR(Child::Spawn({tool, "run", "--in", in, "--out", out, "--device", std::to_string(device)},
                                   dir.path() + "/ref_tool.log", &child));
  int st = 0;
  if (!child->Wait(std::chrono::milliseconds(300000), &st)) {
    return Status::DeadlineExceeded("opd_ref_tool did not finish within 300 s\n", child->LogTail());
  }
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    return Status::Internal("opd_ref_tool failed (wait status ", st, ")\n", child->LogTail());
  }
  OPD_RETURN_IF_ERROR(ReadCallFile(out, results));
  if (results->calls.size() != calls.calls.size()) {
    return Status::Internal("opd_ref_tool returned ", results->calls.size(), " results for ",
                            calls.calls.size(), " calls");
  }
  return Status::Ok();
}

DeviceBuffer::DeviceBuffer(size_t bytes) : size_(bytes) {
  void* p = nullptr;
  if (cudaMalloc(&p, bytes) == cudaSuccess) {
    data_ = static_cast<uint8_t*>(p);
  } else {
    cudaGetLastError();
  }
}

DeviceBuffer::~DeviceBuffer() {
  if (data_) cudaFree(data_);
}

int64_t FirstMismatch(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  }
  return a.size() == b.size() ? -1 : static_cast<int64_t>(n);
}

uint64_t Fnv1a(const void* p, size_t n, uint64_t h) {
  const auto* b = static_cast<const uint8_t*>(p);
  for (size_t i = 0; i < n; ++i) {
    h ^= b[i];
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace cache_dit_opd::testing
