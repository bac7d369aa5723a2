#include <grpcpp/grpcpp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "cache_dit_opd/v1/opd.grpc.pb.h"
#include "client/core/cuda_backend.h"
#include "client/core/monitor.h"
#include "client/core/ring_producer.h"
#include "client/core/session_channel.h"
#include "client/discovery.h"
#include "client/opd_client.h"
#include "common/cuda/device_guard.h"
#include "common/cuda/driver_api.h"
#include "common/ring_encode.h"

namespace cache_dit_opd::client {

namespace pb = ::cache_dit_opd::v1;
using Clock = std::chrono::system_clock;

namespace {

Status FromGrpc(const grpc::Status& g, std::string_view what) {
  if (g.ok()) return Status::Ok();
  const int code = static_cast<int>(g.error_code());
  StatusCode sc = StatusCode::kUnknown;
  if (code > 0 && code <= static_cast<int>(StatusCode::kUnavailable)) {
    sc = static_cast<StatusCode>(code);
  } else if (code == grpc::StatusCode::UNAUTHENTICATED) {
    sc = StatusCode::kPermissionDenied;
  } else if (code == grpc::StatusCode::DATA_LOSS) {
    sc = StatusCode::kInternal;
  }
  return Status(sc, std::string(what) + ": " + g.error_message());
}

// Codes with which the daemon rejects one call but keeps the session and
// the lane's sequence (it completes the number in order). Anything else may
// mean the lane's numbering is no longer shared with the daemon
// (UNAVAILABLE, DEADLINE_EXCEEDED, FAILED_PRECONDITION, PERMISSION_DENIED,
// INTERNAL) or that the client's view of the session is stale (NOT_FOUND:
// the session ended, or a region was evicted; unknown ops never reach the
// daemon, Prepare checks the catalog), so the session is failed and the next
// call opens a new one.
bool KeepsSession(StatusCode c) {
  switch (c) {
    case StatusCode::kOk:
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
    case StatusCode::kUnimplemented:
      return true;
    default:
      return false;
  }
}

Clock::time_point DeadlineIn(int ms) { return Clock::now() + std::chrono::milliseconds(ms); }

int RemainingMs(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left > 0 ? static_cast<int>(left) : 0;
}

bool RingWantedByEnv() {
  const char* v = std::getenv("CACHE_DIT_OPD_RING");
  if (v == nullptr) return true;
  const std::string s(v);
  return !(s == "0" || s == "false" || s == "off" || s == "no");
}

// The record arguments of an encoded call (the daemon decodes both forms
// into the same CallRequest). False when they do not fit one record.
bool ToRecord(const pb::CallRequest& req, RecordArgs* out) {
  out->Clear();
  for (const pb::Argument& a : req.args()) {
    bool ok = false;
    switch (a.value_case()) {
      case pb::Argument::kTensor: {
        const pb::TensorRef& t = a.tensor();
        if (t.sizes_size() != t.strides_size()) return false;
        ok = out->AddTensor(t.region_id(), t.byte_offset(), static_cast<DType>(static_cast<int>(t.dtype())),
                            static_cast<size_t>(t.sizes_size()), t.sizes().data(), t.strides().data());
        break;
      }
      case pb::Argument::kIntValue: ok = out->AddInt(a.int_value()); break;
      case pb::Argument::kFloatValue: ok = out->AddFloat(a.float_value()); break;
      case pb::Argument::kBoolValue: ok = out->AddBool(a.bool_value()); break;
      case pb::Argument::kIntList:
        ok = out->AddIntList(a.int_list().values().data(), a.int_list().values_size());
        break;
      case pb::Argument::kFloatList:
        ok = out->AddFloatList(a.float_list().values().data(), a.float_list().values_size());
        break;
      case pb::Argument::kBoolList: {
        const auto& v = a.bool_list().values();
        bool b[kMaxListLength];
        if (v.size() > kMaxListLength) return false;
        std::copy(v.begin(), v.end(), b);
        ok = out->AddBoolList(b, v.size());
        break;
      }
      case pb::Argument::kNone: ok = out->AddNone(); break;
      default: return false;
    }
    if (!ok) return false;
  }
  return true;
}

std::string OpName(std::string_view op, std::string_view overload) {
  std::string s(op);
  if (!overload.empty()) {
    s += '.';
    s += overload;
  }
  return s;
}

}  // namespace

// ---------------------------------------------------------------------------
// Session

class Session final : public RegionRegistrar {
 public:
  static Status Open(const ClientOptions& o, const std::string& gpu_uuid, const DaemonAddress& addr,
                     const std::shared_ptr<grpc::Channel>& channel, std::shared_ptr<Session>* out);
  ~Session() override { Shutdown(std::min(options_.rpc_timeout_ms, 2000)); }

  Status Register(const AllocationInfo& alloc, const std::array<uint8_t, 64>& handle,
                  uint64_t* region_id) override;
  Status Unregister(uint64_t region_id) override;

  Status Prepare(std::string_view op, std::string_view overload, const std::vector<Arg>& args,
                 pb::CallRequest* req);
  Status Issue(pb::CallRequest& req, cudaStream_t stream, const CallOptions& o);

  bool failed() const { return core_->lanes->failed(); }
  Status failure() const { return core_->lanes->failure(); }
  void Fail(const Status& reason) { core_->lanes->Fail(reason); }

  uint64_t id() const { return info_.session_id; }
  const std::string& token() const { return token_; }
  const SessionInfo& info() const { return info_; }
  pb::OperatorDaemon::Stub* stub() const { return stub_.get(); }
  RegionCache& regions() { return *regions_; }
  SessionCore& core() { return *core_; }

 private:
  Session(const ClientOptions& o, std::shared_ptr<grpc::Channel> channel)
      : options_(o), channel_(std::move(channel)), stub_(pb::OperatorDaemon::NewStub(channel_)) {}
  Status Init(const pb::OpenSessionReply& reply, const cuda::DriverApi* api, Clock::time_point deadline);
  void Shutdown(int timeout_ms);

  const ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::OperatorDaemon::Stub> stub_;
  std::string token_;
  SessionInfo info_;
  std::unordered_set<std::string> served_;  // "op.overload"
  std::shared_ptr<SessionCore> core_;
  bool watched_ = false;
  std::unique_ptr<CudaAllocationBackend> backend_;
  std::unique_ptr<RegionCache> regions_;
  // With the ring: its producer (over core_->memory) and "op.overload" ->
  // catalog index, the record's op_index.
  std::unique_ptr<RingProducer> ring_;
  std::unordered_map<std::string, uint32_t> op_index_;
  std::atomic<bool> shut_down_{false};
};

Status Session::Open(const ClientOptions& o, const std::string& gpu_uuid, const DaemonAddress& addr,
                     const std::shared_ptr<grpc::Channel>& channel, std::shared_ptr<Session>* out) {
  Status s;
  const cuda::DriverApi* api = cuda::GetDriverApi(&s);
  if (api == nullptr) return s;
  cuda::DeviceGuard guard(o.device);
  OPD_RETURN_IF_ERROR(guard.status());

  const Clock::time_point deadline = DeadlineIn(o.connect_timeout_ms);
  if (!channel->WaitForConnected(deadline)) {
    return Status::Unavailable("no cache-dit-opd daemon answers at ", addr.target, " (found via ",
                               addr.source, ") within ", o.connect_timeout_ms,
                               " ms; is it running? Start it with `cache-dit-opd --device <N>`");
  }
  std::shared_ptr<Session> session(new Session(o, channel));
  pb::OpenSessionRequest req;
  req.set_protocol_version(pb::kProtocolVersion);
  req.set_client_pid(static_cast<int32_t>(::getpid()));
  req.set_gpu_uuid(gpu_uuid);
  req.set_lanes(o.lanes == 0 ? 1 : o.lanes);
  req.set_client_name(o.client_name.substr(0, 128));
  req.set_want_ring(o.use_ring && RingWantedByEnv());
  pb::OpenSessionReply reply;
  grpc::ClientContext ctx;
  ctx.set_deadline(deadline);
  grpc::Status g = session->stub_->OpenSession(&ctx, req, &reply);
  if (!g.ok()) return FromGrpc(g, "OpenSession at " + addr.target);
  session->info_.session_id = reply.session_id();
  session->token_ = reply.token();
  session->info_.target = addr.target;
  session->info_.found_by = addr.source;
  Status st = session->Init(reply, api, deadline);
  if (!st.ok()) return st;  // ~Session closes what Init opened, CloseSession included
  *out = std::move(session);
  return Status::Ok();
}

Status Session::Init(const pb::OpenSessionReply& reply, const cuda::DriverApi* api, Clock::time_point deadline) {
  const uint32_t wanted = options_.lanes == 0 ? 1 : options_.lanes;
  if (reply.session_id() == 0) return Status::Internal("OpenSession returned session id 0");
  if (token_.size() != pb::kTokenBytes) {
    return Status::Internal("OpenSession returned a ", token_.size(), "-byte token, expected ", pb::kTokenBytes);
  }
  if (reply.lanes() == 0 || reply.lanes() > wanted || reply.lanes() > kMaxLanes) {
    return Status::Internal("OpenSession granted ", reply.lanes(), " lanes for ", wanted, " requested");
  }
  if (reply.layout_version() != pb::kLayoutVersion) {
    return Status::FailedPrecondition("the daemon's session memory layout is version ", reply.layout_version(),
                                      ", this client speaks ", pb::kLayoutVersion,
                                      "; install matching versions of the daemon and the client");
  }
  std::string expected_uuid;
  OPD_RETURN_IF_ERROR(DeviceUuid(options_.device, &expected_uuid));
  if (reply.gpu_uuid() != expected_uuid) {
    return Status::FailedPrecondition("the daemon at ", info_.target, " serves ", reply.gpu_uuid(),
                                      " but CUDA device ", options_.device, " of this process is ",
                                      expected_uuid);
  }
  if (reply.session_channel_path().empty()) return Status::Internal("OpenSession returned no session channel path");
  info_.lanes = reply.lanes();
  info_.gpu_uuid = reply.gpu_uuid();
  info_.daemon_device = reply.device_index();
  for (const pb::OpSchema& op : reply.catalog()) {
    info_.catalog.push_back(OpEntry{op.name(), op.overload(), op.schema()});
    served_.insert(OpName(op.name(), op.overload()));
    op_index_.emplace(OpName(op.name(), op.overload()), static_cast<uint32_t>(info_.catalog.size() - 1));
  }

  auto core = std::make_shared<SessionCore>();
  core->session_id = reply.session_id();
  core->device = options_.device;
  core->api = api;
  OPD_RETURN_IF_ERROR(ConnectSessionChannel(reply.session_channel_path(), &core->channel));
  core_ = core;  // from here ~Session shuts the channel down

  int bind_ms = RemainingMs(deadline);
  if (reply.bind_timeout_ms() > 0) bind_ms = std::min<int>(bind_ms, static_cast<int>(reply.bind_timeout_ms()));
  UniqueFd memfd;
  uint64_t shm_bytes = 0;
  OPD_RETURN_IF_ERROR(BindSession(core->channel.get(), reply.session_id(), token_, std::max(bind_ms, 1),
                                  reply.shared_memory_bytes(), &memfd, &shm_bytes));

  // The channel's peer is the daemon process (as seen from this pid
  // namespace). A pidfd on it tells the monitor when the daemon is really
  // gone, which is when releasing waits from the host becomes safe.
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(core->channel.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && cred.pid > 0) {
    core->daemon_pid = cred.pid;
#ifdef SYS_pidfd_open
    const long pfd = ::syscall(SYS_pidfd_open, cred.pid, 0);
    if (pfd >= 0) core->daemon_pidfd.reset(static_cast<int>(pfd));
#endif
  }

  ExpectedLayout expect{reply.session_id(), reply.lanes(), shm_bytes};
  OPD_RETURN_IF_ERROR(SessionMemory::Map(memfd.get(), expect, &core->memory));
  memfd.reset();  // the mapping keeps the object alive

  // Device-mapped so that this process's streams can write and wait on the
  // semaphores; the device address may differ from the host address.
  CUresult r = api->mem_host_register(core->memory->base(), core->memory->bytes(),
                                      CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_PORTABLE);
  if (r != CUDA_SUCCESS) {
    return Status::Internal("cuMemHostRegister(session memory, ", core->memory->bytes(), " bytes): ",
                            cuda::DriverErrorString(r));
  }
  core->host_registered = true;
  CUdeviceptr dev = 0;
  r = api->mem_host_get_device_pointer(&dev, core->memory->base(), 0);
  if (r != CUDA_SUCCESS) {
    return Status::Internal("cuMemHostGetDevicePointer(session memory): ", cuda::DriverErrorString(r));
  }
  core->ops = std::make_unique<CudaLaneOps>(api, options_.device, core->memory.get(), dev);
  core->lanes = std::make_unique<LaneTable>(core->memory.get(), core->ops.get());
  info_.transport = "grpc";
  if (reply.ring_enabled()) {
    const auto* h = static_cast<const v1::SessionMemoryHeader*>(core->memory->base());
    if (h->ring_offset == 0 || h->ring_bytes == 0) {
      return Status::Internal("OpenSession granted the call ring but the session memory holds none");
    }
    RingProducer::Options ro;
    if (options_.call_timeout_ms > 0) ro.timeout = std::chrono::milliseconds(options_.call_timeout_ms);
    // A wait ends when the monitor failed the lanes (daemon gone, session
    // ended) or the daemon process exited.
    SessionCore* c = core.get();
    auto liveness = [c]() -> Status {
      if (c->lanes->failed()) return c->lanes->failure();
      if (c->daemon_pidfd.valid()) {
        pollfd p{c->daemon_pidfd.get(), POLLIN, 0};
        if (::poll(&p, 1, 0) > 0) return Status::Unavailable("the daemon process exited");
      }
      return Status::Ok();
    };
    OPD_RETURN_IF_ERROR(RingProducer::Open(static_cast<uint8_t*>(core->memory->base()) + h->ring_offset,
                                           h->ring_bytes, ro, std::move(liveness), &ring_));
    info_.transport = "ring";
  }
  backend_ = std::make_unique<CudaAllocationBackend>(api);
  regions_ = std::make_unique<RegionCache>(backend_.get(), this, options_.device);
  SessionMonitor* monitor = SessionMonitor::Get();
  if (monitor == nullptr) return Status::Unavailable("the process is exiting");
  monitor->Watch(core);
  watched_ = true;
  return Status::Ok();
}

void Session::Shutdown(int timeout_ms) {
  if (shut_down_.exchange(true)) return;
  if (core_ && core_->lanes) {
    core_->lanes->Fail(Status::FailedPrecondition("session ", id(), " was closed"));
  }
  if (id() != 0) {
    // Asks the daemon to finish (or reject) every call it holds, writing
    // "done" past each, and to unmap our regions. Best effort: the daemon may
    // be gone, and the session channel's closing ends the session anyway.
    pb::CloseSessionRequest req;
    req.set_session_id(id());
    req.set_token(token_);
    pb::CloseSessionReply reply;
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineIn(std::max(timeout_ms, 1)));
    (void)stub_->CloseSession(&ctx, req, &reply);
  }
  if (!core_) return;
  // Half-close: the daemon reads end-of-file and ends the session, while the
  // monitor still sees when the daemon closes its end.
  if (core_->channel.valid()) ::shutdown(core_->channel.get(), SHUT_WR);
  regions_.reset();
  if (watched_) {
    if (SessionMonitor* m = SessionMonitor::Get()) {
      m->Retire(core_);
    } else {
      core_->Leak();  // process exit: streams may still reference it
    }
  }
  // Not watched: Init failed before any stream used the memory; the core
  // frees itself with the last reference.
  core_.reset();
}

Status Session::Register(const AllocationInfo& alloc, const std::array<uint8_t, 64>& handle,
                         uint64_t* region_id) {
  pb::RegisterRegionRequest req;
  req.set_session_id(id());
  req.set_token(token_);
  req.set_ipc_handle(handle.data(), handle.size());
  req.set_client_base_address(alloc.base);
  req.set_size(alloc.size);
  req.set_buffer_id(alloc.buffer_id);
  pb::RegisterRegionReply reply;
  grpc::ClientContext ctx;
  ctx.set_deadline(DeadlineIn(options_.rpc_timeout_ms));
  grpc::Status g = stub_->RegisterRegion(&ctx, req, &reply);
  if (!g.ok()) {
    Status s = FromGrpc(g, "RegisterRegion");
    if (s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded) Fail(s);
    return s;
  }
  if (reply.region_id() == 0) return Status::Internal("RegisterRegion returned region id 0");
  *region_id = reply.region_id();
  return Status::Ok();
}

Status Session::Unregister(uint64_t region_id) {
  pb::UnregisterRegionRequest req;
  req.set_session_id(id());
  req.set_token(token_);
  req.set_region_id(region_id);
  pb::UnregisterRegionReply reply;
  grpc::ClientContext ctx;
  ctx.set_deadline(DeadlineIn(options_.rpc_timeout_ms));
  return FromGrpc(stub_->UnregisterRegion(&ctx, req, &reply), "UnregisterRegion");
}

Status Session::Prepare(std::string_view op, std::string_view overload, const std::vector<Arg>& args,
                        pb::CallRequest* req) {
  const std::string name = OpName(op, overload);
  if (served_.count(name) == 0) {
    std::ostringstream known;
    for (const OpEntry& e : info_.catalog) {
      if (!e.overload.empty()) known << " " << e.name << "." << e.overload;
    }
    return Status::NotFound("the daemon does not serve cache_dit_cuda_ops::", name, "; it serves:", known.str());
  }
  if (args.size() > static_cast<size_t>(kMaxArgs)) {
    return Status::InvalidArgument(name, ": ", args.size(), " arguments, at most ", kMaxArgs);
  }
  req->Clear();
  req->set_session_id(id());
  req->set_token(token_);
  req->set_op(std::string(op));
  req->set_overload(std::string(overload));
  for (size_t i = 0; i < args.size(); ++i) {
    pb::Argument* a = req->add_args();
    const Arg& arg = args[i];
    auto list_ok = [&](size_t n) -> Status {
      if (n > static_cast<size_t>(kMaxListLength)) {
        return Status::InvalidArgument(name, ": argument ", i, " is a list of ", n, " values, at most ",
                                       kMaxListLength);
      }
      return Status::Ok();
    };
    if (std::holds_alternative<NoneArg>(arg)) {
      a->mutable_none();
    } else if (const auto* t = std::get_if<TensorView>(&arg)) {
      if (t->data == nullptr) {
        return Status::InvalidArgument(name, ": tensor argument ", i, " has no data pointer");
      }
      ResolvedRegion region;
      Status s = regions_->Resolve(t->data, &region);
      if (!s.ok()) return Status(s.code(), name + ": tensor argument " + std::to_string(i) + ": " + s.message());
      TensorRef ref;
      s = MakeTensorRef(*t, region.alloc, region.region_id, &ref);
      if (!s.ok()) return Status(s.code(), name + ": tensor argument " + std::to_string(i) + ": " + s.message());
      pb::TensorRef* w = a->mutable_tensor();
      w->set_region_id(ref.region_id);
      w->set_byte_offset(ref.byte_offset);
      for (int64_t v : ref.sizes) w->add_sizes(v);
      for (int64_t v : ref.strides) w->add_strides(v);
      // common/call.h fixes DType's values to the proto enum's.
      w->set_dtype(static_cast<pb::DType>(static_cast<int>(ref.dtype)));
    } else if (const auto* v = std::get_if<int64_t>(&arg)) {
      a->set_int_value(*v);
    } else if (const auto* d = std::get_if<double>(&arg)) {
      a->set_float_value(*d);
    } else if (const auto* b = std::get_if<bool>(&arg)) {
      a->set_bool_value(*b);
    } else if (const auto* il = std::get_if<std::vector<int64_t>>(&arg)) {
      OPD_RETURN_IF_ERROR(list_ok(il->size()));
      for (int64_t x : *il) a->mutable_int_list()->add_values(x);
    } else if (const auto* fl = std::get_if<std::vector<double>>(&arg)) {
      OPD_RETURN_IF_ERROR(list_ok(fl->size()));
      for (double x : *fl) a->mutable_float_list()->add_values(x);
    } else if (const auto* bl = std::get_if<std::vector<bool>>(&arg)) {
      OPD_RETURN_IF_ERROR(list_ok(bl->size()));
      for (bool x : *bl) a->mutable_bool_list()->add_values(x);
    }
  }
  return Status::Ok();
}

Status Session::Issue(pb::CallRequest& req, cudaStream_t stream, const CallOptions& o) {
  cuda::DeviceGuard guard(options_.device);
  OPD_RETURN_IF_ERROR(guard.status());
  const int timeout_ms = o.timeout_ms < 0 ? options_.call_timeout_ms : o.timeout_ms;
  IssueOptions io;
  io.signal_inputs_ready = o.signal_inputs_ready;
  io.wait_done = o.wait_done;
  RecordArgs record;
  auto op = op_index_.find(OpName(req.op(), req.overload()));
  if (ring_ && op != op_index_.end() && ToRecord(req, &record)) {
    return core_->lanes->Issue(stream, io, [&](uint32_t lane, uint64_t seq) -> Status {
      RingCompletion answer;
      uint64_t ticket = 0;
      Status s = ring_->Publish(lane, seq, op->second, record, &answer, nullptr, 0, &ticket);
      if (s.ok()) s = ring_->Wait(ticket, &answer, std::chrono::milliseconds(timeout_ms));
      if (s.ok() && answer.code != 0) {
        s = Status(static_cast<StatusCode>(answer.code),
                   "Call " + OpName(req.op(), req.overload()) + ": " + answer.message);
      }
      if (!KeepsSession(s.code())) {
        Fail(Status(s.code(), s.message() + " (session " + std::to_string(id()) +
                                  " failed; the next call opens a new one)"));
      }
      return s;
    });
  }
  return core_->lanes->Issue(stream, io, [&](uint32_t lane, uint64_t seq) -> Status {
    req.set_lane(lane);
    req.set_seq(seq);
    grpc::ClientContext ctx;
    if (timeout_ms > 0) ctx.set_deadline(DeadlineIn(timeout_ms));
    pb::CallReply reply;
    grpc::Status g = stub_->Call(&ctx, req, &reply);
    if (g.ok()) return Status::Ok();
    Status s = FromGrpc(g, "Call " + OpName(req.op(), req.overload()));
    if (!KeepsSession(s.code())) {
      Fail(Status(s.code(), s.message() + " (session " + std::to_string(id()) +
                                " failed; the next call opens a new one)"));
    }
    return s;
  });
}

// ---------------------------------------------------------------------------
// PreparedCall

PreparedCall::PreparedCall() = default;
PreparedCall::~PreparedCall() = default;
PreparedCall::PreparedCall(PreparedCall&&) noexcept = default;
PreparedCall& PreparedCall::operator=(PreparedCall&&) noexcept = default;

// ---------------------------------------------------------------------------
// Client

namespace {

// One gRPC channel per target for the process: channels are expensive and
// reconnect by themselves (a restarted daemon at the same path is found
// again).
std::shared_ptr<grpc::Channel> ChannelFor(const std::string& target) {
  static std::mutex mu;
  // Never destroyed: destroying gRPC channels during static destruction
  // races gRPC's own shutdown.
  static auto* channels = new std::unordered_map<std::string, std::shared_ptr<grpc::Channel>>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = channels->find(target);
  if (it != channels->end()) return it->second;
  grpc::ChannelArguments args;
  // A daemon restarted by its supervisor should be reached within a second.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  auto ch = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  channels->emplace(target, ch);
  return ch;
}

Status ResolveAddress(const ClientOptions& o, const std::string& gpu_uuid, DaemonAddress* addr) {
  if (!o.address.empty()) {
    OPD_RETURN_IF_ERROR(AddressFromOverride(o.address, addr));
    addr->source = "ClientOptions::address";
    return Status::Ok();
  }
  return FindDaemon(gpu_uuid, DiscoveryEnv::FromEnvironment(), addr);
}

}  // namespace

Client::Client(const ClientOptions& options) : options_(options) {}

Client::~Client() { (void)Close(); }

Status Client::Connect(const ClientOptions& options, std::unique_ptr<Client>* out) {
  std::unique_ptr<Client> c(new Client(options));
  OPD_RETURN_IF_ERROR(DeviceUuid(options.device, &c->gpu_uuid_));
  OPD_RETURN_IF_ERROR(c->EnsureSession());
  *out = std::move(c);
  return Status::Ok();
}

Status Client::EnsureSession() {
  std::shared_ptr<Session> old;  // destroyed after the unlock (see Drop)
  std::lock_guard<std::mutex> lock(mu_);
  if (session_ && !session_->failed()) return Status::Ok();
  if (session_) last_session_error_ = session_->failure();
  old = std::move(session_);
  DaemonAddress addr;
  OPD_RETURN_IF_ERROR(ResolveAddress(options_, gpu_uuid_, &addr));
  std::shared_ptr<Session> s;
  OPD_RETURN_IF_ERROR(Session::Open(options_, gpu_uuid_, addr, ChannelFor(addr.target), &s));
  session_ = std::move(s);
  ++sessions_opened_;
  return Status::Ok();
}

Status Client::CurrentSession(std::shared_ptr<Session>* out) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (session_ && !session_->failed()) {
      *out = session_;
      return Status::Ok();
    }
    if (!options_.reconnect && sessions_opened_ > 0) {
      if (session_) return session_->failure();
      return Status::FailedPrecondition("the client's session was closed and reconnect is off");
    }
  }
  OPD_RETURN_IF_ERROR(EnsureSession());
  std::lock_guard<std::mutex> lock(mu_);
  if (!session_) return Status::Unavailable("session closed while opening");
  *out = session_;
  return Status::Ok();
}

std::shared_ptr<Session> Client::Peek() const {
  std::lock_guard<std::mutex> lock(mu_);
  return session_;
}

void Client::Drop(const std::shared_ptr<Session>& s) {
  // Declared before the lock, so destroyed after the unlock: the last
  // reference runs CloseSession (bounded by 2 s) without blocking other
  // threads on mu_.
  std::shared_ptr<Session> dropped;
  std::lock_guard<std::mutex> lock(mu_);
  if (session_ == s) {
    dropped = std::move(session_);
    last_session_error_ = s->failure();
  }
}

Status Client::LastSessionError() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (session_ && session_->failed()) return session_->failure();
  return last_session_error_;
}

Status Client::Call(std::string_view op, std::string_view overload, const std::vector<Arg>& args,
                    cudaStream_t stream, const CallOptions& options) {
  std::shared_ptr<Session> s;
  OPD_RETURN_IF_ERROR(CurrentSession(&s));
  pb::CallRequest req;
  {
    cuda::DeviceGuard guard(options_.device);
    OPD_RETURN_IF_ERROR(guard.status());
    Status st = s->Prepare(op, overload, args, &req);
    if (!st.ok()) {
      if (s->failed()) Drop(s);
      return st;
    }
  }
  Status st = s->Issue(req, stream, options);
  if (!st.ok() && s->failed()) Drop(s);
  return st;
}

Status Client::Prepare(std::string_view op, std::string_view overload, const std::vector<Arg>& args,
                       PreparedCall* out) {
  std::shared_ptr<Session> s;
  OPD_RETURN_IF_ERROR(CurrentSession(&s));
  cuda::DeviceGuard guard(options_.device);
  OPD_RETURN_IF_ERROR(guard.status());
  PreparedCall pc;
  Status st = s->Prepare(op, overload, args, &pc.request_);
  if (!st.ok()) {
    if (s->failed()) Drop(s);
    return st;
  }
  pc.session_ = s;
  *out = std::move(pc);
  return Status::Ok();
}

Status Client::CallPrepared(PreparedCall& call, cudaStream_t stream, const CallOptions& options) {
  std::shared_ptr<Session> s = call.session_.lock();
  if (!s || s->failed()) {
    if (s) {
      Drop(s);
      return Status(s->failure().code(), s->failure().message() +
                                             " (prepare the call again to use a new session)");
    }
    return Status::FailedPrecondition("the call to ", OpName(call.op(), call.overload()),
                                      " was prepared in session ", call.session_id(),
                                      ", which has ended; prepare it again");
  }
  Status st = s->Issue(call.request_, stream, options);
  if (!st.ok() && s->failed()) Drop(s);
  return st;
}

Status Client::ForgetAllocation(const void* ptr) {
  std::shared_ptr<Session> s = Peek();
  if (!s) return Status::NotFound("no session, nothing registered");
  return s->regions().Forget(ptr);
}

Status Client::PruneRegions(size_t* removed) {
  if (removed) *removed = 0;
  std::shared_ptr<Session> s = Peek();
  if (!s) return Status::Ok();
  cuda::DeviceGuard guard(options_.device);
  OPD_RETURN_IF_ERROR(guard.status());
  return s->regions().Prune(removed);
}

void Client::ForgetStream(cudaStream_t stream) {
  std::shared_ptr<Session> s = Peek();
  if (s) s->core().lanes->Forget(KeyOfStream(stream));
}

Status Client::GetVersion(pb::VersionReply* out) {
  DaemonAddress addr;
  std::shared_ptr<Session> s = Peek();
  if (s) {
    addr.target = s->info().target;
  } else {
    OPD_RETURN_IF_ERROR(ResolveAddress(options_, gpu_uuid_, &addr));
  }
  auto stub = pb::OperatorDaemon::NewStub(ChannelFor(addr.target));
  grpc::ClientContext ctx;
  ctx.set_deadline(DeadlineIn(options_.rpc_timeout_ms));
  return FromGrpc(stub->GetVersion(&ctx, pb::VersionRequest(), out), "GetVersion at " + addr.target);
}

Status Client::GetStats(bool this_session_only, pb::StatsReply* out) {
  std::shared_ptr<Session> s;
  if (this_session_only) {
    OPD_RETURN_IF_ERROR(CurrentSession(&s));
  } else {
    s = Peek();
  }
  pb::StatsRequest req;
  std::string target;
  if (s) {
    target = s->info().target;
    if (this_session_only) {
      req.set_session_id(s->id());
      req.set_token(s->token());
    }
  } else {
    DaemonAddress addr;
    OPD_RETURN_IF_ERROR(ResolveAddress(options_, gpu_uuid_, &addr));
    target = addr.target;
  }
  auto stub = pb::OperatorDaemon::NewStub(ChannelFor(target));
  grpc::ClientContext ctx;
  ctx.set_deadline(DeadlineIn(options_.rpc_timeout_ms));
  return FromGrpc(stub->GetStats(&ctx, req, out), "GetStats");
}

Status Client::Close() {
  std::shared_ptr<Session> s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s = std::move(session_);
    if (sessions_opened_ == 0) sessions_opened_ = 1;  // with reconnect off, stay closed
  }
  if (s) {
    // New calls on this session fail at once; the session itself closes
    // (CloseSession, channel) when its last in-flight call returns.
    s->Fail(Status::FailedPrecondition("session ", s->id(), " was closed by the client"));
  }
  return Status::Ok();
}

SessionInfo Client::session_info() const {
  std::shared_ptr<Session> s = Peek();
  return s ? s->info() : SessionInfo{};
}

size_t Client::region_count() const {
  std::shared_ptr<Session> s = Peek();
  return s ? s->regions().size() : 0;
}

int Client::LaneOfStream(cudaStream_t stream) {
  std::shared_ptr<Session> s = Peek();
  if (!s) return -1;
  return static_cast<int>(s->core().lanes->LaneOf(KeyOfStream(stream)));
}

Status Client::InspectLane(uint32_t lane, LaneState* out) const {
  std::shared_ptr<Session> s = Peek();
  if (!s) return Status::FailedPrecondition("no session");
  SessionCore& c = s->core();
  if (lane >= c.memory->lane_count()) {
    return Status::InvalidArgument("lane ", lane, " of ", c.memory->lane_count());
  }
  out->issued = c.lanes->issued(lane);
  out->inputs_ready = LoadSemaphore(&c.memory->lane(lane)->inputs_ready);
  out->done = LoadSemaphore(&c.memory->lane(lane)->done);
  return Status::Ok();
}

Status Client::RaiseInputsReadyFromHost(uint32_t lane, uint64_t value) {
  std::shared_ptr<Session> s = Peek();
  if (!s) return Status::FailedPrecondition("no session");
  SessionCore& c = s->core();
  if (lane >= c.memory->lane_count()) {
    return Status::InvalidArgument("lane ", lane, " of ", c.memory->lane_count());
  }
  RaiseSemaphore(&c.memory->lane(lane)->inputs_ready, value);
  return Status::Ok();
}

}  // namespace cache_dit_opd::client
