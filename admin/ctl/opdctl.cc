#include "admin/ctl/opdctl.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iomanip>
#include <ostream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include "cache_dit_opd/v1/opd.grpc.pb.h"
#include "cache_dit_opd/v1/session_memory.h"
#include "client/core/session_channel.h"
#include "client/discovery.h"
#include "client/grpc_status.h"
#include "common/flags.h"
#include "common/gpu_uuid.h"
#include "common/status.h"

namespace cache_dit_opd::admin {

namespace {

namespace pb = ::google::protobuf;
namespace v1 = ::cache_dit_opd::v1;
using client::DaemonAddress;
using client::DiscoveryEnv;

constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;
constexpr int kExitNotServing = 3;

constexpr char kUsage[] =
    "usage: cache-dit-opdctl [--gpu INDEX|UUID | --address PATH] [--runtime-dir DIR] [--json]\n"
    "                        [--timeout-ms MS] COMMAND\n"
    "commands:\n"
    "  status [--all] [--live]  version, GPU, health and why; exit 0 serving, 3 not serving\n"
    "                           (0 with --live when it answers), 1 unreachable\n"
    "  sessions                 every session: pid, uid, command, calls, errors, regions, lanes, idle\n"
    "  stats                    counters, stage latencies, calls per op\n"
    "  store [ls]               the weight store's entries: name, dtype, shape, bytes, set, owner, sessions\n"
    "                           that have its set attached\n"
    "  store rm NAME...         delete entries (their owner or root; memory freed once unused)\n"
    "  drain                    stop accepting sessions, finish in-flight calls, exit (root or the\n"
    "                           daemon's uid)\n";

struct Args {
  std::string gpu;
  std::string address;
  std::string runtime_dir;
  bool json = false;
  int timeout_ms = 5000;
  std::string command;
  bool all = false;
  bool live = false;
  std::vector<std::string> operands;  // after the command (store's subcommand and names)
};

Status ParseArgs(int argc, const char* const* argv, Args* a, bool* help) {
  FlagArgs args(argc, argv);
  while (args.Next()) {
    const std::string& flag = args.flag();
    if (flag == "-h" || flag == "--help") {
      *help = true;
    } else if (flag == "--gpu") {
      OPD_RETURN_IF_ERROR(args.Value(&a->gpu));
    } else if (flag == "--address") {
      OPD_RETURN_IF_ERROR(args.Value(&a->address));
    } else if (flag == "--runtime-dir") {
      OPD_RETURN_IF_ERROR(args.Value(&a->runtime_dir));
    } else if (flag == "--timeout-ms") {
      std::string value;
      OPD_RETURN_IF_ERROR(args.Value(&value));
      OPD_RETURN_IF_ERROR(ParseUnsigned(flag, value, 1, 600000, &a->timeout_ms));
    } else if (flag == "--json") {
      a->json = true;
    } else if (flag == "--all") {
      a->all = true;
    } else if (flag == "--live") {
      a->live = true;
    } else if (flag.rfind("-", 0) == 0) {
      return Status::InvalidArgument("unknown flag '", flag, "'");
    } else if (a->command.empty()) {
      a->command = flag;
    } else if (a->command == "store") {
      a->operands.push_back(flag);
    } else {
      return Status::InvalidArgument("unexpected argument '", flag, "' after command '", a->command, "'");
    }
  }
  if (*help) return Status::Ok();
  static const std::set<std::string> kCommands{"status", "sessions", "stats", "store", "drain"};
  if (a->command.empty()) return Status::InvalidArgument("no command given");
  if (!kCommands.count(a->command)) return Status::InvalidArgument("unknown command '", a->command, "'");
  if ((a->all || a->live) && a->command != "status") {
    return Status::InvalidArgument(a->all ? "--all" : "--live", " applies to status only");
  }
  if (a->command == "store" && !a->operands.empty()) {
    const std::string& sub = a->operands[0];
    if (sub != "ls" && sub != "rm") return Status::InvalidArgument("unknown store command '", sub, "' (ls or rm)");
    if (sub == "ls" && a->operands.size() > 1) {
      return Status::InvalidArgument("unexpected argument '", a->operands[1], "' after 'store ls'");
    }
    if (sub == "rm" && a->operands.size() < 2) return Status::InvalidArgument("store rm needs the names to delete");
  }
  if (!a->gpu.empty() && !a->address.empty()) return Status::InvalidArgument("give --gpu or --address, not both");
  if (a->all && (!a->gpu.empty() || !a->address.empty())) {
    return Status::InvalidArgument("--all reports every daemon: give no --gpu or --address with it");
  }
  return Status::Ok();
}

DiscoveryEnv Env(const Args& a) {
  DiscoveryEnv env = DiscoveryEnv::FromEnvironment();
  if (!a.runtime_dir.empty()) env.runtime_dir = a.runtime_dir;
  return env;
}

// Every `<GPU-UUID>.sock` socket of the search directories, one per GPU
// (the earlier directory wins, as in discovery).
std::vector<DaemonAddress> AllDaemons(const DiscoveryEnv& env) {
  std::vector<DaemonAddress> found;
  std::set<std::string> uuids;
  for (const std::string& dir : client::DaemonSearchDirs(env)) {
    DIR* d = opendir(dir.c_str());
    if (d == nullptr) continue;
    std::vector<std::string> names;
    while (dirent* e = readdir(d)) names.emplace_back(e->d_name);
    closedir(d);
    std::sort(names.begin(), names.end());
    for (const std::string& name : names) {
      constexpr std::string_view kSuffix = ".sock";
      if (name.size() <= kSuffix.size() || name.compare(name.size() - kSuffix.size(), kSuffix.size(), kSuffix) != 0) {
        continue;
      }
      const std::string uuid = name.substr(0, name.size() - kSuffix.size());
      struct stat st{};
      const std::string path = dir + "/" + name;
      if (!IsGpuUuid(uuid) || uuids.count(uuid) || stat(path.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
      uuids.insert(uuid);
      found.push_back(DaemonAddress{"unix:" + path, path, dir});
    }
  }
  return found;
}

Status Resolve(const Args& a, std::vector<DaemonAddress>* out) {
  const DiscoveryEnv env = Env(a);
  DaemonAddress addr;
  if (!a.address.empty()) {
    OPD_RETURN_IF_ERROR(client::AddressFromOverride(a.address, &addr));
    out->push_back(addr);
    return Status::Ok();
  }
  if (!a.gpu.empty()) {
    std::string uuid = a.gpu;
    if (!IsGpuUuid(uuid)) {
      char* end = nullptr;
      const long index = std::strtol(a.gpu.c_str(), &end, 10);
      if (*end != '\0' || index < 0) {
        return Status::InvalidArgument("--gpu '", a.gpu, "': expected a CUDA ordinal or a GPU-... UUID");
      }
      OPD_RETURN_IF_ERROR(client::DeviceUuid(static_cast<int>(index), &uuid));
    }
    OPD_RETURN_IF_ERROR(client::FindDaemon(uuid, env, &addr));
    out->push_back(addr);
    return Status::Ok();
  }
  if (!env.address.empty()) {
    OPD_RETURN_IF_ERROR(client::AddressFromOverride(env.address, &addr));
    out->push_back(addr);
    return Status::Ok();
  }
  std::vector<DaemonAddress> all = AllDaemons(env);
  if (a.all && !all.empty()) {
    *out = std::move(all);
    return Status::Ok();
  }
  std::string dirs;
  for (const std::string& d : client::DaemonSearchDirs(env)) dirs += (dirs.empty() ? "" : ", ") + d;
  if (all.empty()) return Status::NotFound("no daemon socket (GPU-*.sock) in ", dirs);
  if (all.size() > 1) {
    std::string list;
    for (const DaemonAddress& d : all) list += "\n  " + d.socket_path;
    return Status::InvalidArgument(all.size(), " daemons found; pass --gpu UUID (or --all with status):", list);
  }
  out->push_back(all[0]);
  return Status::Ok();
}

using client::FromGrpc;

// A reply's fields by their proto names, numbers as JSON numbers (proto3's
// own JSON mapping writes 64-bit integers as strings).
pb::Value ToJson(const pb::Message& m);

pb::Value FieldValue(const pb::Message& m, const pb::FieldDescriptor* f, int index) {
  const pb::Reflection* r = m.GetReflection();
  pb::Value v;
  const bool rep = f->is_repeated();
  switch (f->cpp_type()) {
    case pb::FieldDescriptor::CPPTYPE_INT32:
      v.set_number_value(rep ? r->GetRepeatedInt32(m, f, index) : r->GetInt32(m, f));
      break;
    case pb::FieldDescriptor::CPPTYPE_INT64:
      v.set_number_value(static_cast<double>(rep ? r->GetRepeatedInt64(m, f, index) : r->GetInt64(m, f)));
      break;
    case pb::FieldDescriptor::CPPTYPE_UINT32:
      v.set_number_value(rep ? r->GetRepeatedUInt32(m, f, index) : r->GetUInt32(m, f));
      break;
    case pb::FieldDescriptor::CPPTYPE_UINT64:
      v.set_number_value(static_cast<double>(rep ? r->GetRepeatedUInt64(m, f, index) : r->GetUInt64(m, f)));
      break;
    case pb::FieldDescriptor::CPPTYPE_DOUBLE:
      v.set_number_value(rep ? r->GetRepeatedDouble(m, f, index) : r->GetDouble(m, f));
      break;
    case pb::FieldDescriptor::CPPTYPE_FLOAT:
      v.set_number_value(rep ? r->GetRepeatedFloat(m, f, index) : r->GetFloat(m, f));
      break;
    case pb::FieldDescriptor::CPPTYPE_BOOL:
      v.set_bool_value(rep ? r->GetRepeatedBool(m, f, index) : r->GetBool(m, f));
      break;
    case pb::FieldDescriptor::CPPTYPE_ENUM:
      v.set_string_value((rep ? r->GetRepeatedEnum(m, f, index) : r->GetEnum(m, f))->name());
      break;
    case pb::FieldDescriptor::CPPTYPE_STRING:
      v.set_string_value(rep ? r->GetRepeatedString(m, f, index) : r->GetString(m, f));
      break;
    case pb::FieldDescriptor::CPPTYPE_MESSAGE:
      v = ToJson(rep ? r->GetRepeatedMessage(m, f, index) : r->GetMessage(m, f));
      break;
  }
  return v;
}

pb::Value ToJson(const pb::Message& m) {
  pb::Value out;
  pb::Struct* s = out.mutable_struct_value();
  const pb::Descriptor* d = m.GetDescriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const pb::FieldDescriptor* f = d->field(i);
    pb::Value& v = (*s->mutable_fields())[f->name()];
    if (f->is_repeated()) {
      pb::ListValue* list = v.mutable_list_value();
      for (int k = 0; k < m.GetReflection()->FieldSize(m, f); ++k) *list->add_values() = FieldValue(m, f, k);
    } else {
      v = FieldValue(m, f, 0);
    }
  }
  return out;
}

pb::Value Str(const std::string& s) {
  pb::Value v;
  v.set_string_value(s);
  return v;
}

pb::Value Bool(bool b) {
  pb::Value v;
  v.set_bool_value(b);
  return v;
}

void PrintJson(const pb::Value& v, std::ostream& out) {
  pb::util::JsonPrintOptions o;
  o.add_whitespace = true;
  std::string text;
  (void)pb::util::MessageToJsonString(v, &text, o);
  out << text;
  if (text.empty() || text.back() != '\n') out << "\n";
}

std::string Bytes(uint64_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  std::ostringstream s;
  s << std::fixed << std::setprecision(u ? 1 : 0) << v << " " << units[u];
  return s.str();
}

std::string Seconds(uint64_t ms) {
  std::ostringstream s;
  if (ms < 60000) {
    s << std::fixed << std::setprecision(1) << static_cast<double>(ms) / 1000 << " s";
  } else if (ms < 3600000) {
    s << ms / 60000 << " min";
  } else {
    s << std::fixed << std::setprecision(1) << static_cast<double>(ms) / 3600000 << " h";
  }
  return s.str();
}

// Left-aligned columns, two spaces apart.
void PrintTable(const std::vector<std::vector<std::string>>& rows, std::ostream& out) {
  std::vector<size_t> width;
  for (const auto& r : rows) {
    width.resize(std::max(width.size(), r.size()));
    for (size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
  }
  for (const auto& r : rows) {
    std::string line;
    for (size_t i = 0; i < r.size(); ++i) {
      line += r[i];
      if (i + 1 < r.size()) line += std::string(width[i] - r[i].size() + 2, ' ');
    }
    out << line << "\n";
  }
}

class Daemon {
 public:
  Daemon(const DaemonAddress& addr, int timeout_ms)
      : addr_(addr),
        timeout_ms_(timeout_ms),
        stub_(v1::OperatorDaemon::NewStub(grpc::CreateChannel(addr.target, grpc::InsecureChannelCredentials()))) {}

  Status Version(v1::VersionReply* out) {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    return FromGrpc(stub_->GetVersion(&ctx, v1::VersionRequest{}, out), ctx, "GetVersion on " + addr_.target);
  }
  Status Stats(v1::StatsReply* out) {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    return FromGrpc(stub_->GetStats(&ctx, v1::StatsRequest{}, out), ctx, "GetStats on " + addr_.target);
  }
  Status Store(v1::ListStoreReply* out) {  // session 0: every entry
    grpc::ClientContext ctx;
    Deadline(&ctx);
    return FromGrpc(stub_->ListStore(&ctx, v1::ListStoreRequest{}, out), ctx, "ListStore on " + addr_.target);
  }
  // Deleting needs an identity: a session of this process, bound on the
  // session channel (the daemon reads SO_PEERCRED there), ring off; closed
  // again by the destructor.
  Status OpenBoundSession() {
    v1::OpenSessionRequest req;
    req.set_protocol_version(v1::kProtocolVersion);
    req.set_client_pid(static_cast<int32_t>(getpid()));
    req.set_lanes(1);
    req.set_client_name("cache-dit-opdctl");
    grpc::ClientContext ctx;
    Deadline(&ctx);
    OPD_RETURN_IF_ERROR(FromGrpc(stub_->OpenSession(&ctx, req, &session_), ctx, "OpenSession at " + addr_.target));
    client::UniqueFd memfd;
    uint64_t shm_bytes = 0;
    Status s = client::ConnectSessionChannel(session_.session_channel_path(), &channel_);
    if (s.ok()) {
      s = client::BindSession(channel_.get(), session_.session_id(), session_.token(), timeout_ms_, 0, &memfd,
                              &shm_bytes);
    }
    return s;  // the memfd is not needed: it closes here
  }
  Status DeleteStore(const std::string& name) {
    v1::DeleteStoreRequest req;
    req.set_session_id(session_.session_id());
    req.set_token(session_.token());
    req.set_name(name);
    v1::DeleteStoreReply reply;
    grpc::ClientContext ctx;
    Deadline(&ctx);
    return FromGrpc(stub_->DeleteStore(&ctx, req, &reply), ctx, "DeleteStore '" + name + "'");
  }
  ~Daemon() {
    if (session_.session_id() == 0) return;
    v1::CloseSessionRequest req;
    req.set_session_id(session_.session_id());
    req.set_token(session_.token());
    v1::CloseSessionReply reply;
    grpc::ClientContext ctx;
    Deadline(&ctx);
    (void)stub_->CloseSession(&ctx, req, &reply);  // best effort: closing the channel ends it too
  }
  const DaemonAddress& address() const { return addr_; }
  int timeout_ms() const { return timeout_ms_; }

 private:
  void Deadline(grpc::ClientContext* ctx) const {
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms_));
    ctx->set_wait_for_ready(false);
  }
  DaemonAddress addr_;
  int timeout_ms_;
  std::unique_ptr<v1::OperatorDaemon::Stub> stub_;
  v1::OpenSessionReply session_;  // session_id 0 until OpenBoundSession
  client::UniqueFd channel_;
};

// ---- status -------------------------------------------------------------------

struct StatusResult {
  bool reachable = false;
  std::string error;
  v1::VersionReply version;
  v1::StatsReply stats;
};

StatusResult QueryStatus(Daemon& d) {
  StatusResult r;
  Status s = d.Version(&r.version);
  if (s.ok()) s = d.Stats(&r.stats);
  r.reachable = s.ok();
  if (!s.ok()) r.error = s.message();
  return r;
}

pb::Value StatusJson(const DaemonAddress& addr, const StatusResult& r) {
  pb::Value v;
  auto& f = *v.mutable_struct_value()->mutable_fields();
  f["address"] = Str(addr.target);
  f["reachable"] = Bool(r.reachable);
  if (!r.reachable) {
    f["error"] = Str(r.error);
    return v;
  }
  f["serving"] = Bool(r.version.serving());
  f["health"] = Str(r.version.serving() ? "SERVING" : "NOT_SERVING");
  f["health_reason"] = Str(v1::Reason_Name(r.version.health_reason()));
  f["not_serving_reason"] = Str(r.version.not_serving_reason());
  f["version"] = ToJson(r.version);
  v1::StatsReply counts = r.stats;
  counts.clear_session();
  counts.clear_ops();
  counts.clear_stages();
  f["stats"] = ToJson(counts);
  return v;
}

void PrintStatus(const DaemonAddress& addr, const StatusResult& r, std::ostream& out) {
  if (!r.reachable) {
    PrintTable({{"address", addr.target}, {"health", "UNREACHABLE: " + r.error}}, out);
    return;
  }
  const v1::VersionReply& v = r.version;
  const v1::StatsReply& s = r.stats;
  std::string health = v.serving() ? "SERVING" : "NOT_SERVING (" + v1::Reason_Name(v.health_reason()) + ": " +
                                                     v.not_serving_reason() + ")";
  // Each executor thread's busy time as a share of the daemon's uptime.
  std::string executors = std::to_string(s.executor_threads()) + " thread(s) polling the rings and launching";
  for (int e = 0; e < s.executor_busy_ns_size() && v.uptime_ms() > 0; ++e) {
    char share[32];
    std::snprintf(share, sizeof share, "%.1f%%", 100.0 * static_cast<double>(s.executor_busy_ns(e)) * 1e-6 /
                                                     static_cast<double>(v.uptime_ms()));
    executors += (e == 0 ? "; busy since start: " : ", ") + std::string(share);
  }
  std::string gpu = v.gpu_uuid().empty() ? "none"
                                         : v.gpu_uuid() + " " + v.gpu_name() + " (device " +
                                               std::to_string(v.device_index()) + ")";
  PrintTable({{"address", addr.target},
              {"daemon", "cache-dit-opd " + v.daemon_version() + (v.git_commit().empty() ? "" : " (" + v.git_commit() + ")") +
                             ", protocol " + std::to_string(v.protocol_version()) + ", pid " +
                             std::to_string(v.daemon_pid()) + ", uid " + std::to_string(v.daemon_uid()) + ", up " +
                             Seconds(v.uptime_ms())},
              {"gpu", gpu},
              {"runtime", "CUDA runtime " + std::to_string(v.cuda_runtime_version()) + ", driver " +
                              std::to_string(v.cuda_driver_version()) + ", torch " + v.torch_version()},
              {"health", health},
              {"sessions", std::to_string(s.sessions()) + " open, " + std::to_string(s.sessions_closed()) +
                               " closed; " + std::to_string(s.calls()) + " calls, " + std::to_string(s.errors()) +
                               " rejected; " + std::to_string(s.regions()) + " regions (" + Bytes(s.mapped_bytes()) +
                               ")"},
              {"executors", executors},
              {"metrics", v.metrics_address().empty() ? "off" : "http://" + v.metrics_address() + "/metrics"}},
             out);
}

int RunStatus(const Args& a, const std::vector<DaemonAddress>& daemons, std::ostream& out) {
  int code = kExitOk;
  pb::Value all;
  pb::ListValue* list = all.mutable_list_value();
  for (size_t i = 0; i < daemons.size(); ++i) {
    Daemon d(daemons[i], a.timeout_ms);
    const StatusResult r = QueryStatus(d);
    if (!r.reachable) {
      code = kExitFailed;
    } else if (!r.version.serving() && !a.live && code == kExitOk) {
      code = kExitNotServing;
    }
    if (a.json) {
      *list->add_values() = StatusJson(daemons[i], r);
    } else {
      if (i) out << "\n";
      PrintStatus(daemons[i], r, out);
    }
  }
  if (a.json) PrintJson(a.all ? all : list->values(0), out);
  return code;
}

// ---- sessions, stats, store, drain --------------------------------------------

int RunSessions(const Args& a, Daemon& d, std::ostream& out, std::ostream& err) {
  v1::StatsReply s;
  if (Status st = d.Stats(&s); !st.ok()) {
    err << "cache-dit-opdctl: " << st.message() << "\n";
    return kExitFailed;
  }
  if (a.json) {
    pb::Value v;
    auto& f = *v.mutable_struct_value()->mutable_fields();
    f["address"] = Str(d.address().target);
    pb::Value list;
    list.mutable_list_value();
    for (const v1::SessionStats& e : s.session()) *list.mutable_list_value()->add_values() = ToJson(e);
    f["sessions"] = list;
    PrintJson(v, out);
    return kExitOk;
  }
  std::vector<std::vector<std::string>> rows{
      {"SESSION", "PID", "UID", "LANES", "RING", "EXEC", "CALLS", "ERRORS", "REGIONS", "MAPPED", "IDLE", "AGE",
       "COMMAND"}};
  for (const v1::SessionStats& e : s.session()) {
    std::string command = e.command().empty() ? e.client_name() : e.command();
    if (command.size() > 60) command = command.substr(0, 57) + "...";
    rows.push_back({std::to_string(e.session_id()), e.bound() ? std::to_string(e.client_pid()) : "unbound",
                    e.bound() ? std::to_string(e.client_uid()) : "-", std::to_string(e.lanes()),
                    e.ring_slots() ? std::to_string(e.ring_pending()) + "/" + std::to_string(e.ring_slots()) : "-",
                    e.executor() >= 0 ? std::to_string(e.executor()) : "-", std::to_string(e.calls()), std::to_string(e.errors()), std::to_string(e.regions()),
                    Bytes(e.mapped_bytes()), Seconds(e.idle_ms()), Seconds(e.age_ms()), command});
  }
  PrintTable(rows, out);
  if (s.session().empty()) out << "(no session)\n";
  return kExitOk;
}

std::string Micros(double us) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(us < 100 ? 1 : 0) << us;
  return s.str();
}

// --json of one reply: {"address": ..., "<key>": the reply}.
void PrintReplyJson(const Daemon& d, const char* key, const pb::Message& reply, std::ostream& out) {
  pb::Value v;
  auto& f = *v.mutable_struct_value()->mutable_fields();
  f["address"] = Str(d.address().target);
  f[key] = ToJson(reply);
  PrintJson(v, out);
}

int RunStats(const Args& a, Daemon& d, std::ostream& out, std::ostream& err) {
  v1::StatsReply s;
  if (Status st = d.Stats(&s); !st.ok()) {
    err << "cache-dit-opdctl: " << st.message() << "\n";
    return kExitFailed;
  }
  if (a.json) {
    s.clear_session();  // `sessions` reports those
    PrintReplyJson(d, "stats", s, out);
    return kExitOk;
  }
  out << s.calls() << " calls run, " << s.errors() << " rejected; " << s.sessions() << " sessions open, "
      << s.sessions_closed() << " closed; " << s.regions() << " regions (" << Bytes(s.mapped_bytes()) << ")\n\n";
  std::vector<std::vector<std::string>> stages{{"STAGE", "P50_US", "P99_US", "SAMPLES"}};
  for (const v1::StageLatency& st : s.stages()) {
    stages.push_back({st.name(), Micros(st.p50_us()), Micros(st.p99_us()), std::to_string(st.count())});
  }
  stages.push_back({"call", Micros(s.call_p50_us()), Micros(s.call_p99_us()), "-"});
  PrintTable(stages, out);
  out << "\n";
  std::vector<std::vector<std::string>> ops{{"OP", "TRANSPORT", "CALLS", "REJECTED", "ACCEPT_US", "INPUTS_WAIT_US",
                                             "RUN_US", "TOTAL_US"}};
  for (const v1::OpStats& o : s.ops()) {
    const std::string name = o.name().empty() ? "(not in the catalog)" : o.name() + (o.overload().empty() ? "" : "." + o.overload());
    ops.push_back({name, o.transport(), std::to_string(o.calls()), std::to_string(o.rejections()),
                   Micros(o.accept_mean_us()), Micros(o.inputs_wait_mean_us()), Micros(o.run_mean_us()),
                   Micros(o.total_mean_us())});
  }
  PrintTable(ops, out);
  if (s.ops().empty()) out << "(no call yet)\n";
  return kExitOk;
}

// Deletes every name, going on past a failed one; exit 1 when any failed.
int RunStoreRm(const Args& a, Daemon& d, std::ostream& out, std::ostream& err) {
  std::vector<std::string> deleted;
  std::vector<std::pair<std::string, Status>> failed;
  const std::vector<std::string> names(a.operands.begin() + 1, a.operands.end());
  if (Status s = d.OpenBoundSession(); !s.ok()) {
    for (const std::string& n : names) failed.emplace_back(n, s);
  } else {
    for (const std::string& n : names) {
      if (Status s = d.DeleteStore(n); s.ok()) {
        deleted.push_back(n);
      } else {
        failed.emplace_back(n, s);
      }
    }
  }
  if (a.json) {
    pb::Value j;
    auto& f = *j.mutable_struct_value()->mutable_fields();
    f["address"] = Str(d.address().target);
    auto& del = *f["deleted"].mutable_list_value();
    for (const std::string& n : deleted) *del.add_values() = Str(n);
    auto& errs = *f["errors"].mutable_list_value();
    for (const auto& [n, s] : failed) {
      pb::Value e;
      auto& ef = *e.mutable_struct_value()->mutable_fields();
      ef["name"] = Str(n);
      ef["error"] = Str(s.message());
      ef["reason"] = Str(ReasonName(s.reason()));
      *errs.add_values() = e;
    }
    PrintJson(j, out);
  } else {
    for (const std::string& n : deleted) out << "deleted " << n << "\n";
  }
  for (const auto& [n, s] : failed) err << "cache-dit-opdctl: store rm " << n << ": " << s.message() << "\n";
  return failed.empty() ? kExitOk : kExitFailed;
}

int RunStore(const Args& a, Daemon& d, std::ostream& out, std::ostream& err) {
  if (!a.operands.empty() && a.operands[0] == "rm") return RunStoreRm(a, d, out, err);
  v1::ListStoreReply l;
  if (Status st = d.Store(&l); !st.ok()) {
    err << "cache-dit-opdctl: " << st.message() << "\n";
    return kExitFailed;
  }
  if (a.json) {
    PrintReplyJson(d, "store", l, out);
    return kExitOk;
  }
  std::vector<std::vector<std::string>> rows{{"NAME", "DTYPE", "SHAPE", "BYTES", "SET", "OWNER", "ATTACHED"}};
  for (const v1::StoreEntry& e : l.entries()) {
    std::string shape = "[";
    for (int i = 0; i < e.shape_size(); ++i) shape += (i ? ", " : "") + std::to_string(e.shape(i));
    std::string dtype = v1::DType_Name(e.dtype());
    if (dtype.rfind("DTYPE_", 0) == 0) dtype = dtype.substr(6);
    rows.push_back({e.name(), dtype, shape + "]", Bytes(e.bytes()), std::to_string(e.set_id()),
                    std::to_string(e.owner_uid()), std::to_string(e.refs())});
  }
  PrintTable(rows, out);
  out << l.entries_size() << " entries; " << Bytes(l.store_bytes()) << " of " << Bytes(l.max_store_bytes())
      << " in use\n";
  return kExitOk;
}

int RunDrain(const Args& a, Daemon& d, std::ostream& out, std::ostream& err) {
  v1::VersionReply v;
  Status s = d.Version(&v);
  client::UniqueFd fd;
  if (s.ok() && v.session_channel_path().empty()) {
    s = Status::FailedPrecondition("the daemon at ", d.address().target, " does not say where its session channel is");
  }
  if (s.ok()) s = client::ConnectSessionChannel(v.session_channel_path(), &fd);
  if (s.ok()) s = client::RequestDrain(fd.get(), d.timeout_ms());
  if (a.json) {
    pb::Value j;
    auto& f = *j.mutable_struct_value()->mutable_fields();
    f["address"] = Str(d.address().target);
    f["draining"] = Bool(s.ok());
    if (!s.ok()) {
      f["error"] = Str(s.message());
      f["reason"] = Str(ReasonName(s.reason()));
    }
    PrintJson(j, out);
  } else if (s.ok()) {
    out << "draining: the daemon (pid " << v.daemon_pid() << ") stops accepting sessions, finishes its calls and exits\n";
  }
  if (!s.ok()) {
    err << "cache-dit-opdctl: drain: " << s.message() << "\n";
    return kExitFailed;
  }
  return kExitOk;
}

}  // namespace

int RunOpdctl(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  Args a;
  bool help = false;
  if (Status s = ParseArgs(argc, argv, &a, &help); !s.ok()) {
    err << "cache-dit-opdctl: " << s.message() << "\n" << kUsage;
    return kExitUsage;
  }
  if (help) {
    out << kUsage;
    return kExitOk;
  }
  std::vector<DaemonAddress> daemons;
  if (Status s = Resolve(a, &daemons); !s.ok()) {
    err << "cache-dit-opdctl: " << s.message() << "\n";
    return s.code() == StatusCode::kInvalidArgument ? kExitUsage : kExitFailed;
  }
  if (a.command == "status") return RunStatus(a, daemons, out);
  Daemon d(daemons[0], a.timeout_ms);
  if (a.command == "sessions") return RunSessions(a, d, out, err);
  if (a.command == "stats") return RunStats(a, d, out, err);
  if (a.command == "store") return RunStore(a, d, out, err);
  return RunDrain(a, d, out, err);
}

}  // namespace cache_dit_opd::admin
