// The per-node supervisor (admin/launcher/launcher.h): options, GPU
// enumeration, the backoff policy, and the one-thread loop over a signalfd.
#include "admin/launcher/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <sstream>

#include "common/flags.h"
#include "common/gpu_uuid.h"

extern char** environ;

namespace cache_dit_opd::launcher {
namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kProgram = "cache-dit-opd-launcher";
constexpr const char* kDaemonName = "cache-dit-opd";

// One line on stderr, written with one write(2): lines from the launcher and
// from the daemons (which share its stderr) do not interleave mid-line.
template <typename... A>
void Log(A&&... a) {
  std::ostringstream os;
  os << kProgram << ": ";
  (os << ... << a);
  os << '\n';
  const std::string line = os.str();
  size_t off = 0;
  while (off < line.size()) {
    ssize_t n = ::write(STDERR_FILENO, line.data() + off, line.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // stderr gone: nothing better to do with a log line
    off += static_cast<size_t>(n);
  }
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

// The HOST of HOST:PORT: CheckMetricsHost lets ':' through only in an IPv6
// address, which needs brackets there (the daemon's CheckMetricsAddress
// splits at the last ':').
std::string AddressHost(const std::string& host) {
  return host.find(':') == std::string::npos ? host : "[" + host + "]";
}

// "--socket" for "--socket" and "--socket=...".
std::string FlagName(const std::string& arg) {
  size_t eq = arg.find('=');
  return eq == std::string::npos ? arg : arg.substr(0, eq);
}

bool IsExecutableFile(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

std::optional<std::string> FindOnPath(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::string_view rest = path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin";
  while (true) {
    size_t colon = rest.find(':');
    const std::string_view entry = rest.substr(0, colon);
    // POSIX: an empty entry is the current directory. (Built, not assigned:
    // GCC 12 at -O3 warns -Wrestrict on assigning "." here, a false positive.)
    std::string dir(entry.empty() ? std::string_view(".") : entry);
    std::string candidate = std::move(dir);
    candidate += '/';
    candidate += name;
    if (IsExecutableFile(candidate)) return candidate;
    if (colon == std::string_view::npos) return std::nullopt;
    rest.remove_prefix(colon + 1);
  }
}

std::string SignalName(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return std::string("SIG") + (abbrev != nullptr ? abbrev : "?");
}

// "exited with status 1", "killed by signal 9 (SIGKILL)".
std::string DescribeExit(int wstatus) {
  std::ostringstream os;
  if (WIFEXITED(wstatus)) {
    os << "exited with status " << WEXITSTATUS(wstatus);
  } else if (WIFSIGNALED(wstatus)) {
    os << "killed by signal " << WTERMSIG(wstatus) << " (" << SignalName(WTERMSIG(wstatus)) << ")";
    if (WCOREDUMP(wstatus)) os << ", core dumped";
  } else {
    os << "changed state " << wstatus;
  }
  return os.str();
}

int64_t MillisSince(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

// ---- one daemon -------------------------------------------------------------

// A daemon's command line and environment, fixed when the launcher starts.
struct ExecImage {
  std::vector<std::string> argv;
  std::vector<std::string> env;
};

ExecImage BuildExecImage(const std::string& daemon_path, const std::vector<std::string>& args,
                         const std::string& uuid) {
  ExecImage img;
  img.argv.push_back(daemon_path);
  img.argv.insert(img.argv.end(), args.begin(), args.end());
  constexpr std::string_view kVisible = "CUDA_VISIBLE_DEVICES=";
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    if (std::string_view(*e).substr(0, kVisible.size()) == kVisible) continue;
    img.env.emplace_back(*e);
  }
  img.env.push_back(std::string(kVisible) + uuid);
  return img;
}

// execve's arrays, built before fork: the child only makes system calls (no
// allocation) between fork and exec.
std::vector<char*> CArray(const std::vector<std::string>& strings) {
  std::vector<char*> out;
  out.reserve(strings.size() + 1);
  for (const std::string& s : strings) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

// The child side of fork: async-signal-safe calls only.
[[noreturn]] void ExecChild(char* const* argv, char* const* envp, pid_t launcher, int err_fd) {
  // The launcher blocks its signals and ignores SIGPIPE; both survive exec,
  // and a daemon that starts with SIGTERM blocked would never see it (its own
  // signal thread blocks it deliberately, later). Dispositions first, then
  // the mask: a signal let through finds the default action, never the
  // launcher's SIG_IGN.
  struct sigaction dfl;
  std::memset(&dfl, 0, sizeof(dfl));
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  for (int sig = 1; sig < NSIG; ++sig) {
    if (sig == SIGKILL || sig == SIGSTOP) continue;
    ::sigaction(sig, &dfl, nullptr);  // EINVAL for the C library's own signals: harmless
  }
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  // A SIGKILLed launcher must not leave daemons behind: they get SIGTERM
  // (and drain) when it dies. If it died before the prctl took effect, the
  // child has already been reparented and would never get the signal.
  int err = 0;
  if (::prctl(PR_SET_PDEATHSIG, SIGTERM) != 0) {
    err = errno;
  } else if (::getppid() != launcher) {
    _exit(0);
  } else {
    ::execve(argv[0], argv, envp);
    err = errno;
  }
  ssize_t n = ::write(err_fd, &err, sizeof(err));
  (void)n;
  _exit(127);
}

// Forks and execs the daemon. On success *pid is the child's; an exec that
// failed is reported (the child then exits 127 and is reaped like any
// other), as is a fork that failed (*pid = -1).
Status Spawn(const ExecImage& img, pid_t* pid) {
  *pid = -1;
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return Status::Internal("pipe2: ", std::strerror(errno));
  const std::vector<char*> argv = CArray(img.argv);
  const std::vector<char*> envp = CArray(img.env);
  const pid_t launcher = ::getpid();
  const pid_t child = ::fork();
  if (child < 0) {
    const int e = errno;
    ::close(fds[0]);
    ::close(fds[1]);
    return Status::ResourceExhausted("fork: ", std::strerror(e));
  }
  if (child == 0) {
    ::close(fds[0]);
    ExecChild(argv.data(), envp.data(), launcher, fds[1]);
  }
  ::close(fds[1]);
  *pid = child;
  // The write end closes on exec: 0 bytes read means the daemon is running.
  int err = 0;
  ssize_t n;
  do {
    n = ::read(fds[0], &err, sizeof(err));
  } while (n < 0 && errno == EINTR);
  ::close(fds[0]);
  if (n == static_cast<ssize_t>(sizeof(err))) {
    return Status::FailedPrecondition("exec ", img.argv[0], ": ", std::strerror(err));
  }
  return Status::Ok();
}

struct Gpu {
  Gpu(std::string u, ExecImage img, Backoff b) : uuid(std::move(u)), image(std::move(img)), backoff(b) {}

  std::string uuid;
  ExecImage image;
  Backoff backoff;
  pid_t pid = -1;                           // running when > 0
  Clock::time_point started;
  std::optional<Clock::time_point> restart_at;  // waiting to restart
  // Neither: exited 0 (drained on purpose), or the stop came; not restarted.
};

class Supervisor {
 public:
  Supervisor(const LauncherOptions& opts, const std::string& daemon_path) {
    gpus_.reserve(opts.gpus.size());
    for (size_t i = 0; i < opts.gpus.size(); ++i) {
      gpus_.emplace_back(opts.gpus[i], BuildExecImage(daemon_path, DaemonArgs(opts, i), opts.gpus[i]),
                         Backoff(opts.backoff_initial_ms, opts.backoff_max_ms, opts.stable_ms));
    }
  }

  int Run() {
    sigset_t set;
    sigemptyset(&set);
    for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGCHLD}) sigaddset(&set, sig);
    // Blocked before the first fork: a child that exits at once raises a
    // SIGCHLD that waits in the signalfd.
    if (::sigprocmask(SIG_BLOCK, &set, nullptr) != 0) {
      Log("sigprocmask: ", std::strerror(errno));
      return kExitChildFailed;
    }
    ::signal(SIGPIPE, SIG_IGN);  // a log reader that went away must not kill the supervisor
    sfd_ = ::signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
    if (sfd_ < 0) {
      Log("signalfd: ", std::strerror(errno));
      return kExitChildFailed;
    }

    for (Gpu& g : gpus_) Start(g);
    while (Running() > 0 || (!stopping_ && Waiting() > 0)) {
      timespec ts;
      const timespec* timeout = NextTimeout(&ts);
      pollfd pfd{sfd_, POLLIN, 0};
      int r = ::ppoll(&pfd, 1, timeout, nullptr);
      if (r < 0 && errno != EINTR) {
        Log("ppoll: ", std::strerror(errno));
        break;
      }
      DrainSignals();
      if (!stopping_) StartDue();
    }
    ::close(sfd_);
    if (stopping_) {
      Log("all daemons exited: exit ", stop_failed_ ? kExitChildFailed : kExitOk);
      return stop_failed_ ? kExitChildFailed : kExitOk;
    }
    Log("every daemon exited 0: nothing left to supervise");
    return kExitOk;
  }

 private:
  size_t Running() const {
    return static_cast<size_t>(std::count_if(gpus_.begin(), gpus_.end(), [](const Gpu& g) { return g.pid > 0; }));
  }
  size_t Waiting() const {
    return static_cast<size_t>(
        std::count_if(gpus_.begin(), gpus_.end(), [](const Gpu& g) { return g.restart_at.has_value(); }));
  }

  void Start(Gpu& g) {
    g.restart_at.reset();
    pid_t pid = -1;
    Status s = Spawn(g.image, &pid);
    g.started = Clock::now();
    if (pid > 0) {
      g.pid = pid;
      if (s.ok()) {
        std::ostringstream cmd;
        for (size_t i = 0; i < g.image.argv.size(); ++i) cmd << (i ? " " : "") << g.image.argv[i];
        Log(g.uuid, ": started pid ", pid, ": CUDA_VISIBLE_DEVICES=", g.uuid, " ", cmd.str());
      } else {
        Log(g.uuid, ": pid ", pid, ": ", s.message());  // it exits 127; reaped and restarted as a failure
      }
      return;
    }
    Log(g.uuid, ": not started: ", s.message());
    ScheduleRestart(g, 0);
  }

  void ScheduleRestart(Gpu& g, int64_t uptime_ms) {
    const uint32_t delay = g.backoff.OnFailure(static_cast<uint64_t>(std::max<int64_t>(uptime_ms, 0)));
    g.restart_at = Clock::now() + std::chrono::milliseconds(delay);
    Log(g.uuid, ": restarting in ", delay, " ms (failure ", g.backoff.failures(), " in a row)");
  }

  void StartDue() {
    const Clock::time_point now = Clock::now();
    for (Gpu& g : gpus_) {
      if (g.restart_at && *g.restart_at <= now) Start(g);
    }
  }

  // The earliest restart (none while stopping): ppoll's timeout, or null to
  // wait for a signal alone.
  const timespec* NextTimeout(timespec* ts) const {
    if (stopping_) return nullptr;
    std::optional<Clock::time_point> next;
    for (const Gpu& g : gpus_) {
      if (g.restart_at && (!next || *g.restart_at < *next)) next = g.restart_at;
    }
    if (!next) return nullptr;
    const int64_t ns =
        std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::nanoseconds>(*next - Clock::now()).count());
    ts->tv_sec = static_cast<time_t>(ns / 1000000000);
    ts->tv_nsec = static_cast<long>(ns % 1000000000);
    return ts;
  }

  // Everything the signalfd holds. Exits are reaped before a stop signal is
  // acted on: the kernel hands out SIGTERM (15) before SIGCHLD (17), and a
  // daemon that had failed before the stop came is a failure to restart (then
  // cancelled), not one of the stop.
  void DrainSignals() {
    std::vector<signalfd_siginfo> stops;
    signalfd_siginfo info;
    while (true) {
      ssize_t n = ::read(sfd_, &info, sizeof(info));
      if (n < 0 && errno == EINTR) continue;
      if (n != static_cast<ssize_t>(sizeof(info))) break;  // EAGAIN: all read
      if (info.ssi_signo != SIGCHLD) stops.push_back(info);
    }
    Reap();  // SIGCHLDs coalesce: one may stand for several exits, and none is needed to look
    for (const signalfd_siginfo& s : stops) OnStopSignal(static_cast<int>(s.ssi_signo), static_cast<pid_t>(s.ssi_pid));
  }

  void Reap() {
    while (true) {
      int wstatus = 0;
      const pid_t pid = ::waitpid(-1, &wstatus, WNOHANG);
      if (pid < 0 && errno == EINTR) continue;
      if (pid <= 0) return;  // 0: the others still run; ECHILD: none left
      auto it = std::find_if(gpus_.begin(), gpus_.end(), [pid](const Gpu& g) { return g.pid == pid; });
      if (it == gpus_.end()) continue;  // not a daemon (an orphan reparented to us as PID 1): reaped, that is all
      Gpu& g = *it;
      g.pid = -1;
      const int64_t uptime = MillisSince(g.started);
      const bool clean = WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0;
      if (clean) {
        Log(g.uuid, ": pid ", pid, " ", DescribeExit(wstatus), " after ", uptime, " ms: drained, not restarted");
      } else if (stopping_) {
        stop_failed_ = true;
        Log(g.uuid, ": pid ", pid, " ", DescribeExit(wstatus), " after ", uptime, " ms while stopping");
      } else {
        Log(g.uuid, ": pid ", pid, " ", DescribeExit(wstatus), " after ", uptime, " ms");
        ScheduleRestart(g, uptime);
      }
    }
  }

  void OnStopSignal(int sig, pid_t sender) {
    if (stopping_) {
      Log("received ", SignalName(sig), " from pid ", sender, " while stopping: ignored; waiting for ", Running(),
          " daemon(s) to drain");
      return;
    }
    stopping_ = true;
    Log("received ", SignalName(sig), " from pid ", sender, ": stopping ", Running(), " daemon(s)");
    for (Gpu& g : gpus_) {
      if (g.restart_at) {
        g.restart_at.reset();
        Log(g.uuid, ": restart cancelled");
      }
      if (g.pid > 0) {
        // Not yet reaped, so the pid is still ours even if it just exited.
        Log(g.uuid, ": SIGTERM to pid ", g.pid);
        ::kill(g.pid, SIGTERM);
      }
    }
  }

  std::vector<Gpu> gpus_;
  int sfd_ = -1;
  bool stopping_ = false;
  bool stop_failed_ = false;  // a daemon exited non-zero or by a signal during the stop
};

}  // namespace

// ---- options ----------------------------------------------------------------

Status ParseGpuList(std::string_view text, std::vector<std::string>* out) {
  if (Trim(text).empty()) return Status::InvalidArgument("--gpus: empty list");
  while (true) {
    size_t comma = text.find(',');
    std::string uuid(Trim(text.substr(0, comma)));
    if (!IsGpuUuid(uuid)) {
      return Status::InvalidArgument("--gpus: '", uuid,
                                     "' is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, "
                                     "as nvidia-smi --query-gpu=uuid prints it)");
    }
    for (const std::string& have : *out) {
      if (Lower(have) == Lower(uuid)) return Status::InvalidArgument("--gpus: '", uuid, "' is named twice");
    }
    out->push_back(std::move(uuid));
    if (comma == std::string_view::npos) return Status::Ok();
    text.remove_prefix(comma + 1);
  }
}

Status CheckMetricsHost(std::string_view host) {
  if (host.empty()) {
    return Status::InvalidArgument("--metrics-host '': empty host (give an address the daemons can bind: "
                                   "the pod IP, 0.0.0.0, 127.0.0.1)");
  }
  for (char c : host) {
    if (std::isspace(static_cast<unsigned char>(c)) || std::iscntrl(static_cast<unsigned char>(c))) {
      return Status::InvalidArgument("--metrics-host '", host, "': holds a space or a control character");
    }
  }
  // One IPv6 form only: bare, because the downward API's status.podIP is
  // bare on an IPv6 cluster and Kubernetes cannot add brackets to $(POD_IP)
  // for one family only.
  if (host.find_first_of("[]") != std::string_view::npos) {
    return Status::InvalidArgument("--metrics-host '", host, "': give an IPv6 address without brackets ",
                                   "(the launcher adds them: --metrics-host ::1 -> [::1]:<port>)");
  }
  if (host.find(':') != std::string_view::npos) {
    in6_addr addr;
    if (::inet_pton(AF_INET6, std::string(host).c_str(), &addr) != 1) {
      return Status::InvalidArgument("--metrics-host '", host, "': ':' is allowed only in an IPv6 address ",
                                     "(the port of GPU i is --metrics-port-base + i)");
    }
    return Status::Ok();
  }
  // A leading '-' is no host name (RFC 1123); it is usually the next flag,
  // taken as the value of a --metrics-host given none.
  const bool chars_ok = std::all_of(host.begin(), host.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_';
  });
  if (!chars_ok || host.front() == '-') {
    return Status::InvalidArgument("--metrics-host '", host, "': not a host name or IP address (letters, digits, ",
                                   "'.', '-', '_', not starting with '-'; or an IPv6 address)");
  }
  return Status::Ok();
}

Status ParseLauncherOptions(int argc, const char* const* argv, LauncherOptions* opts, bool* help) {
  *help = false;
  bool metrics_host_given = false;
  FlagArgs args(argc, argv);
  while (args.Next()) {
    const std::string& arg = args.arg();
    if (arg == "--") break;
    if (arg == "-h" || arg == "--help") {
      *help = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0) {
      return Status::InvalidArgument("unexpected argument '", arg, "' (flags start with --; daemon flags go after --)");
    }
    const std::string& flag = args.flag();
    std::string value;
    auto next = [&] { return args.Value(&value); };
    if (flag == "--daemon") {
      OPD_RETURN_IF_ERROR(next());
      if (value.empty()) return Status::InvalidArgument("--daemon: empty path");
      opts->daemon = value;
    } else if (flag == "--gpus") {
      OPD_RETURN_IF_ERROR(next());
      OPD_RETURN_IF_ERROR(ParseGpuList(value, &opts->gpus));
    } else if (flag == "--metrics-host") {
      OPD_RETURN_IF_ERROR(next());
      OPD_RETURN_IF_ERROR(CheckMetricsHost(value));
      opts->metrics_host = value;
      metrics_host_given = true;
    } else if (flag == "--metrics-port-base") {
      OPD_RETURN_IF_ERROR(next());
      OPD_RETURN_IF_ERROR(ParseUnsigned(flag, value, 0, 65535, &opts->metrics_port_base));
    } else if (flag == "--backoff-initial-ms") {
      OPD_RETURN_IF_ERROR(next());
      // Not 0: a daemon that fails at once would be restarted in a tight loop.
      OPD_RETURN_IF_ERROR(ParseUnsigned(flag, value, 1, 3600000, &opts->backoff_initial_ms));
    } else if (flag == "--backoff-max-ms") {
      OPD_RETURN_IF_ERROR(next());
      OPD_RETURN_IF_ERROR(ParseUnsigned(flag, value, 1, 3600000, &opts->backoff_max_ms));
    } else if (flag == "--stable-ms") {
      OPD_RETURN_IF_ERROR(next());
      OPD_RETURN_IF_ERROR(ParseUnsigned(flag, value, 0, 86400000, &opts->stable_ms));
    } else {
      return Status::InvalidArgument("unknown flag '", flag, "' (daemon flags go after --)");
    }
  }
  while (args.Next()) opts->daemon_flags.push_back(args.arg());

  if (opts->backoff_initial_ms > opts->backoff_max_ms) {
    return Status::InvalidArgument("--backoff-initial-ms ", opts->backoff_initial_ms, " exceeds --backoff-max-ms ",
                                   opts->backoff_max_ms);
  }
  // Checked after the loop: the two flags may come in either order. An
  // explicit host that silently went nowhere would leave the operator
  // believing the daemons listen on it.
  if (metrics_host_given && opts->metrics_port_base == 0) {
    return Status::InvalidArgument("--metrics-host '", opts->metrics_host,
                                   "' with --metrics-port-base 0: the launcher then passes no --metrics-address, "
                                   "so there is no address to give the host to (drop one of the two)");
  }
  for (const std::string& f : opts->daemon_flags) {
    const std::string name = FlagName(f);
    if (name == "--device") {
      return Status::InvalidArgument("daemon flag '", f, "': the launcher gives each daemon its GPU "
                                     "(CUDA_VISIBLE_DEVICES=<UUID> --device 0); choose GPUs with --gpus");
    }
    if (name == "--socket") {
      return Status::InvalidArgument("daemon flag '", f, "': every daemon would claim the same socket; "
                                     "each binds <runtime dir>/<GPU-UUID>.sock (choose the dir with --runtime-dir)");
    }
    if (name == "--metrics-address" && opts->metrics_port_base != 0) {
      return Status::InvalidArgument("daemon flag '", f, "': the launcher gives GPU i ", AddressHost(opts->metrics_host),
                                     ":<base+i> (--metrics-port-base ", opts->metrics_port_base,
                                     "); pass --metrics-port-base 0 to set it yourself");
    }
  }
  return Status::Ok();
}

Status CheckGpuCount(const LauncherOptions& opts, size_t gpu_count) {
  if (opts.metrics_port_base != 0 && gpu_count > 0 && opts.metrics_port_base + (gpu_count - 1) > 65535) {
    return Status::InvalidArgument("--metrics-port-base ", opts.metrics_port_base, ": ", gpu_count,
                                   " GPUs need ports up to ", opts.metrics_port_base + (gpu_count - 1),
                                   ", past 65535");
  }
  return Status::Ok();
}

std::vector<std::string> DaemonArgs(const LauncherOptions& opts, size_t index) {
  std::vector<std::string> args = {"--device", "0"};
  if (opts.metrics_port_base != 0) {
    args.push_back("--metrics-address");
    args.push_back(AddressHost(opts.metrics_host) + ":" + std::to_string(opts.metrics_port_base + index));
  }
  args.insert(args.end(), opts.daemon_flags.begin(), opts.daemon_flags.end());
  return args;
}

// ---- discovery --------------------------------------------------------------

Status ParseNvidiaSmiUuids(std::string_view output, std::vector<std::string>* out) {
  out->clear();
  while (!output.empty()) {
    size_t nl = output.find('\n');
    std::string_view line = Trim(output.substr(0, nl));
    if (!line.empty()) {
      if (!IsGpuUuid(line)) {
        return Status::InvalidArgument("nvidia-smi printed '", line, "', which is not a GPU UUID");
      }
      out->emplace_back(line);
    }
    if (nl == std::string_view::npos) break;
    output.remove_prefix(nl + 1);
  }
  if (out->empty()) return Status::NotFound("nvidia-smi lists no GPU");
  return Status::Ok();
}

Status EnumerateGpus(std::vector<std::string>* out) {
  constexpr const char* kHint = "; pass the GPUs with --gpus GPU-<uuid>[,GPU-<uuid>...]";
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return Status::Internal("pipe2: ", std::strerror(errno));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);  // dup2 clears FD_CLOEXEC on the copy
  const char* argv[] = {"nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader", nullptr};
  pid_t pid = -1;
  const int err = ::posix_spawnp(&pid, argv[0], &actions, nullptr, const_cast<char* const*>(argv), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(fds[1]);
  if (err != 0) {
    ::close(fds[0]);
    return Status::NotFound("cannot list the node's GPUs: nvidia-smi: ", std::strerror(err),
                            err == ENOENT ? " (not on PATH: no NVIDIA driver here?)" : "", kHint);
  }
  std::string output;
  char buf[4096];
  while (true) {
    ssize_t n = ::read(fds[0], buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    output.append(buf, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  int wstatus = 0;
  while (::waitpid(pid, &wstatus, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0) {
    std::string first(Trim(std::string_view(output).substr(0, output.find('\n'))));
    return Status::NotFound("cannot list the node's GPUs: nvidia-smi ", DescribeExit(wstatus),
                            first.empty() ? "" : ": ", first, kHint);
  }
  Status s = ParseNvidiaSmiUuids(output, out);
  if (!s.ok()) return Status::NotFound("cannot list the node's GPUs: ", s.message(), kHint);
  return Status::Ok();
}

Status ResolveDaemonBinary(const std::string& flag, std::string* out) {
  if (!flag.empty()) {
    if (flag.find('/') == std::string::npos) {
      std::optional<std::string> found = FindOnPath(flag);
      if (!found) return Status::NotFound("--daemon: '", flag, "' is not an executable on PATH");
      *out = *found;
      return Status::Ok();
    }
    if (!IsExecutableFile(flag)) return Status::NotFound("--daemon: '", flag, "' is not an executable file");
    *out = flag;
    return Status::Ok();
  }
  std::string beside;
  char self[4096];
  ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n > 0) {
    std::string exe(self, static_cast<size_t>(n));
    size_t slash = exe.rfind('/');
    if (slash != std::string::npos) {
      beside = exe.substr(0, slash + 1) + kDaemonName;
      if (IsExecutableFile(beside)) {
        *out = beside;
        return Status::Ok();
      }
    }
  }
  if (std::optional<std::string> found = FindOnPath(kDaemonName)) {
    *out = *found;
    return Status::Ok();
  }
  return Status::NotFound(kDaemonName, " is neither next to the launcher (", beside.empty() ? "?" : beside,
                          ") nor on PATH; pass --daemon PATH");
}

// ---- backoff ----------------------------------------------------------------

uint32_t Backoff::OnFailure(uint64_t uptime_ms) {
  if (uptime_ms >= stable_ms_) failures_ = 0;
  // initial * 2^failures, computed without overflow: stop doubling at max.
  uint64_t delay = initial_ms_;
  for (uint32_t k = 0; k < failures_ && delay < max_ms_; ++k) delay *= 2;
  if (failures_ < std::numeric_limits<uint32_t>::max()) ++failures_;
  return static_cast<uint32_t>(std::min<uint64_t>(delay, max_ms_));
}

// ---- the loop ---------------------------------------------------------------

int RunLauncher(const LauncherOptions& opts, const std::string& daemon_path) {
  Log("supervising ", opts.gpus.size(), " GPU(s) with ", daemon_path, " (launcher pid ", ::getpid(), ")");
  Supervisor supervisor(opts, daemon_path);
  return supervisor.Run();
}

// ---- help -------------------------------------------------------------------

std::string LauncherUsage() {
  return "usage: cache-dit-opd-launcher [--daemon PATH] [--gpus UUID[,UUID...]] [--metrics-host HOST]\n"
         "                              [--metrics-port-base N] [--backoff-initial-ms MS]\n"
         "                              [--backoff-max-ms MS] [--stable-ms MS]\n"
         "                              [-- DAEMON FLAGS...] ; see --help\n";
}

std::string LauncherHelp() {
  return LauncherUsage() +
         "\n"
         "cache-dit-opd-launcher: runs one cache-dit-opd per GPU of this node and keeps them\n"
         "running, for hosts and containers without systemd. GPU i is given to its daemon as\n"
         "CUDA_VISIBLE_DEVICES=<UUID> --device 0, so its sockets are <runtime dir>/<UUID>.sock\n"
         "and <UUID>.session.sock. A daemon that exits 0 (it drained) is not restarted; one that\n"
         "fails or dies of a signal is restarted after a backoff. SIGTERM, SIGINT or SIGHUP:\n"
         "SIGTERM to every daemon (each drains), then exit once all have exited; a second signal\n"
         "is ignored (each daemon's --drain-deadline-ms bounds the wait). If the launcher itself\n"
         "is killed, its daemons get SIGTERM (PR_SET_PDEATHSIG). Events are logged on stderr.\n"
         "\n"
         "Flags (--flag VALUE or --flag=VALUE):\n"
         "  --daemon PATH            The daemon binary (a name without '/' is looked up on PATH).\n"
         "                           Default: cache-dit-opd next to this executable, else on PATH.\n"
         "  --gpus UUID[,UUID...]    The GPUs to serve, GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx\n"
         "                           (repeatable). Default: every GPU that\n"
         "                           `nvidia-smi --query-gpu=uuid --format=csv,noheader` lists.\n"
         "  --metrics-host HOST      The host of every daemon's --metrics-address (default\n"
         "                           127.0.0.1, reachable only from this host or pod). A host name,\n"
         "                           an IPv4 address, or an IPv6 address WITHOUT brackets (the\n"
         "                           launcher adds them: fd00::5 -> [fd00::5]:<N+i>; [fd00::5] is\n"
         "                           refused). In Kubernetes: --metrics-host=$(POD_IP). Not with\n"
         "                           --metrics-port-base 0.\n"
         "  --metrics-port-base N    GPU i's daemon gets --metrics-address HOST:<N+i>\n"
         "                           (default 9464; 0: no --metrics-address, the daemon's default).\n"
         "  --backoff-initial-ms MS  Delay before restarting a failed daemon (default 500, >= 1);\n"
         "                           doubled for each consecutive failure...\n"
         "  --backoff-max-ms MS      ...up to MS (default 30000).\n"
         "  --stable-ms MS           A daemon that ran this long before failing starts the\n"
         "                           doubling again (default 60000).\n"
         "  -- DAEMON FLAGS...       Passed to every daemon unchanged, e.g.\n"
         "                           -- --runtime-dir /run/cache-dit-opd --log-level info\n"
         "                           (not --device or --socket, which are per GPU; not\n"
         "                           --metrics-address unless --metrics-port-base 0).\n"
         "\n"
         "Exit status: 0 when every daemon running at the stop exited 0 (or all exited 0 by\n"
         "themselves); 1 when one failed or was killed during the stop; 2 for a usage error\n"
         "(a bad flag, no GPU found, no daemon binary).\n";
}

}  // namespace cache_dit_opd::launcher
