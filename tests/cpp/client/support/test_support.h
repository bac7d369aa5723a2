// File: tests/cpp/client/support/test_support.h
//
// Process and device plumbing for the client's GPU tests, helper and
// benchmark (no torch): starting the real daemon binary on a private
// socket, spawning helper processes with captured output, locating the
// binaries the build produced, and moving HostTensors to and from GPU
// memory.
//
// Binaries are found in this order:
//   daemon:   $CACHE_DIT_OPD_DAEMON, $CACHE_DIT_OPD_BUILD_DIR/server/cache-dit-opd,
//             the path compiled in from $<TARGET_FILE:cache-dit-opd>
//   ref tool: $CACHE_DIT_OPD_REF_TOOL, $CACHE_DIT_OPD_BUILD_DIR/tests/cpp/client/opd_ref_tool,
//             the compiled-in path
//   helper:   $CACHE_DIT_OPD_BUILD_DIR/tests/cpp/client/opd_client_test_helper, compiled-in path
// An empty result means "not built" (the tests skip, saying so).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "tests/cpp/client/support/call_file.h"

namespace cache_dit_opd::testing {

std::string FindDaemonBinary();
std::string FindRefTool();
std::string FindHelperBinary();

// A fresh private directory under $TMPDIR (removed with its contents by
// the destructor).
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Child
//
// A spawned process whose stdout and stderr go to a log file.
class Child {
 public:
  // Starts argv[0] with argv; `log_path` receives stdout+stderr.
  static Status Spawn(const std::vector<std::string>& argv, const std::string& log_path,
                      std::unique_ptr<Child>* out);
  ~Child();  // SIGKILL + reap when still running

  pid_t pid() const { return pid_; }
  bool Running();
  // Sends `sig` (if running) and waits up to `timeout`; returns true when it
  // exited, with its wait status in `*wstatus`.
  bool Signal(int sig, std::chrono::milliseconds timeout, int* wstatus = nullptr);
  bool Wait(std::chrono::milliseconds timeout, int* wstatus = nullptr);
  std::string Log() const;
  // The last `lines` lines of the log, indented, for failure messages.
  std::string LogTail(size_t lines = 200) const;
  // Waits until the log contains `needle`; returns the line containing it.
  bool WaitForLogLine(const std::string& needle, std::chrono::milliseconds timeout, std::string* line);
  const std::string& log_path() const { return log_path_; }

 private:
  pid_t pid_ = -1;
  bool reaped_ = false;
  int wstatus_ = 0;
  std::string log_path_;
};

// DaemonProcess
//
// The real cache-dit-opd binary, started on GPU `device` with --socket in a
// private directory, --log-level debug, plus `extra_args` and
// $CACHE_DIT_OPD_TEST_DAEMON_ARGS (space-separated). Start() returns once
// GetVersion answers with serving = true (or fails with the daemon's log).
class DaemonProcess {
 public:
  struct Options {
    std::string binary;
    int device = 0;
    std::vector<std::string> extra_args;
    std::chrono::milliseconds startup_timeout{90000};
    std::string socket_path;  // "" = <tmp>/opd.sock
  };
  static Status Start(const Options& options, std::unique_ptr<DaemonProcess>* out);
  ~DaemonProcess();

  const std::string& socket_path() const { return socket_path_; }
  std::string address() const { return "unix:" + socket_path_; }
  Child& process() { return *child_; }
  const std::string& dir() const;

 private:
  std::unique_ptr<TempDir> dir_;
  std::string socket_path_;
  std::unique_ptr<Child> child_;
};

// GetVersion over a fresh channel to `address` within `timeout`.
Status QueryVersion(const std::string& address, std::chrono::milliseconds timeout, bool* serving,
                    std::string* reason, std::string* gpu_uuid);

// RunRefTool
//
// Runs `opd_ref_tool run` on `calls`; `*results` gets one record per call.
// On failure the message includes the tool's output.
Status RunRefTool(const std::string& tool, const CallFile& calls, int device, CallFile* results);

// DeviceBuffer: a cudaMalloc allocation freed on destruction.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  bool ok() const { return data_ != nullptr; }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// First index where `a` and `b` differ (or -1), for messages.
int64_t FirstMismatch(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b);

// 64-bit FNV-1a.
uint64_t Fnv1a(const void* p, size_t n, uint64_t h = 1469598103934665603ull);

}  // namespace cache_dit_opd::testing
