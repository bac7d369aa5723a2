#include "client/opd_client.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "cache_dit_opd/v1/opd.grpc.pb.h"
#include "client/core/session_channel.h"
#include "client/core/session_engine.h"
#include "client/discovery.h"
#include "client/grpc_status.h"
#include "common/call_proto.h"
#include "common/cuda/device_guard.h"
#include "common/cuda/driver_api.h"
#include "common/view_extent.h"

namespace cache_dit_opd::client {

namespace pb = ::cache_dit_opd::v1;
using Clock = std::chrono::system_clock;

Status FromGrpc(const grpc::Status& g, const grpc::ClientContext& ctx, std::string_view what) {
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
  Reason reason = Reason::kUnspecified;
  const auto& trailers = ctx.GetServerTrailingMetadata();
  if (auto it = trailers.find(pb::kReasonMetadataKey); it != trailers.end()) {
    const std::string value(it->second.data(), it->second.size());
    char* end = nullptr;
    const unsigned long v = std::strtoul(value.c_str(), &end, 10);
    if (end != value.c_str() && *end == '\0') reason = ReasonFromWire(static_cast<uint32_t>(v));
  }
  return Status(sc, std::string(what) + ": " + g.error_message(), reason);
}

namespace {

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

// The regions a call names, in argument order (views without one, kNoRegion,
// left out).
std::vector<uint64_t> RegionsOf(const std::vector<cache_dit_opd::Arg>& args) {
  std::vector<uint64_t> ids;
  for (const cache_dit_opd::Arg& a : args) {
    if (const auto* t = std::get_if<TensorRef>(&a); t != nullptr && t->region_id != kNoRegion) {
      ids.push_back(t->region_id);
    }
  }
  return ids;
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
// Session: the control plane (gRPC) over one SessionEngine (the data plane).

class Session final : public RegionRegistrar {
 public:
  static Status Open(const ClientOptions& o, const std::string& gpu_uuid, const DaemonAddress& addr,
                     const std::shared_ptr<grpc::Channel>& channel, std::shared_ptr<Session>* out);
  ~Session() override { Shutdown(std::min(options_.rpc_timeout_ms, 2000)); }

  Status Register(const AllocationInfo& alloc, const std::array<uint8_t, 64>& handle,
                  uint64_t* region_id) override;
  Status Unregister(uint64_t region_id) override;

  Status Prepare(std::string_view op, std::string_view overload, const std::vector<Arg>& args, PreparedCall* out);
  Status Issue(PreparedCall& call, cudaStream_t stream, const CallOptions& o);

  bool failed() const { return engine_->failed(); }
  Status failure() const { return engine_->failure(); }
  void Fail(const Status& reason) { engine_->Fail(reason); }

  uint64_t id() const { return info_.session_id; }
  const std::string& token() const { return token_; }
  const SessionInfo& info() const { return info_; }
  SessionEngine& engine() { return *engine_; }

 private:
  Session(const ClientOptions& o, std::shared_ptr<grpc::Channel> channel)
      : options_(o), channel_(std::move(channel)), stub_(pb::OperatorDaemon::NewStub(channel_)) {}
  Status Init(const pb::OpenSessionReply& reply, Clock::time_point deadline);
  void Shutdown(int timeout_ms);

  const ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::OperatorDaemon::Stub> stub_;
  std::string token_;
  SessionInfo info_;
  std::unordered_map<std::string, uint32_t> op_index_;  // "op.overload" -> catalog index (a record's op_index)
  bool use_ring_ = false;
  std::shared_ptr<SessionEngine> engine_;
  std::atomic<bool> shut_down_{false};
};

Status Session::Open(const ClientOptions& o, const std::string& gpu_uuid, const DaemonAddress& addr,
                     const std::shared_ptr<grpc::Channel>& channel, std::shared_ptr<Session>* out) {
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
  if (!g.ok()) return FromGrpc(g, ctx, "OpenSession at " + addr.target);
  session->info_.session_id = reply.session_id();
  session->token_ = reply.token();
  session->info_.target = addr.target;
  session->info_.found_by = addr.source;
  session->use_ring_ = req.want_ring();
  Status st = session->Init(reply, deadline);
  if (!st.ok()) return st;  // ~Session closes what Init opened, CloseSession included
  *out = std::move(session);
  return Status::Ok();
}

Status Session::Init(const pb::OpenSessionReply& reply, Clock::time_point deadline) {
  const uint32_t wanted = options_.lanes == 0 ? 1 : options_.lanes;
  if (reply.session_id() == 0) return Status::Internal("OpenSession returned session id 0");
  if (token_.size() != pb::kTokenBytes) {
    return Status::Internal("OpenSession returned a ", token_.size(), "-byte token, expected ", pb::kTokenBytes);
  }
  if (reply.lanes() == 0 || reply.lanes() > wanted || reply.lanes() > kMaxLanes) {
    return Status::Internal("OpenSession granted ", reply.lanes(), " lanes for ", wanted, " requested");
  }
  if (reply.layout_version() != pb::kLayoutVersion) {
    return Status::Rejected(Reason::kVersionMismatch, "the daemon's session memory layout is version ",
                            reply.layout_version(), ", this client speaks ", pb::kLayoutVersion,
                            "; install matching versions of the daemon and the client");
  }
  std::string expected_uuid;
  OPD_RETURN_IF_ERROR(DeviceUuid(options_.device, &expected_uuid));
  if (reply.gpu_uuid() != expected_uuid) {
    return Status::Rejected(Reason::kWrongDevice, "the daemon at ", info_.target, " serves ", reply.gpu_uuid(),
                            " but CUDA device ", options_.device, " of this process is ", expected_uuid);
  }
  if (reply.session_channel_path().empty()) return Status::Internal("OpenSession returned no session channel path");
  info_.lanes = reply.lanes();
  info_.gpu_uuid = reply.gpu_uuid();
  info_.daemon_device = reply.device_index();
  for (const pb::OpSchema& op : reply.catalog()) {
    info_.catalog.push_back(OpEntry{op.name(), op.overload(), op.schema()});
    op_index_.emplace(OpName(op.name(), op.overload()), static_cast<uint32_t>(info_.catalog.size() - 1));
  }

  BoundSession bound;
  bound.session_id = reply.session_id();
  bound.lanes = reply.lanes();
  OPD_RETURN_IF_ERROR(ConnectSessionChannel(reply.session_channel_path(), &bound.channel));
  int bind_ms = RemainingMs(deadline);
  if (reply.bind_timeout_ms() > 0) bind_ms = std::min<int>(bind_ms, static_cast<int>(reply.bind_timeout_ms()));
  OPD_RETURN_IF_ERROR(BindSession(bound.channel.get(), reply.session_id(), token_, std::max(bind_ms, 1),
                                  reply.shared_memory_bytes(), &bound.memfd, &bound.memory_bytes));
  EngineOptions eo;
  if (options_.call_timeout_ms > 0) eo.call_timeout = std::chrono::milliseconds(options_.call_timeout_ms);
  OPD_RETURN_IF_ERROR(SessionEngine::Create(options_.device, std::move(bound), eo, this, &engine_));
  use_ring_ = use_ring_ && reply.ring_enabled() && engine_->has_ring();
  if (reply.ring_enabled() && !engine_->has_ring()) {
    return Status::Internal("OpenSession granted the call ring but the session memory holds none");
  }
  info_.transport = use_ring_ ? "ring" : "grpc";
  return Status::Ok();
}

void Session::Shutdown(int timeout_ms) {
  if (shut_down_.exchange(true)) return;
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
  // Fails it, half-closes the channel, and hands the memory to the monitor.
  if (engine_) engine_->Close();
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
    Status s = FromGrpc(g, ctx, "RegisterRegion");
    if (s.action() == v1::ClientAction::kReconnect || s.action() == v1::ClientAction::kFail) Fail(s);
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
  return FromGrpc(stub_->UnregisterRegion(&ctx, req, &reply), ctx, "UnregisterRegion");
}

Status Session::Prepare(std::string_view op, std::string_view overload, const std::vector<Arg>& args,
                        PreparedCall* out) {
  const std::string name = OpName(op, overload);
  const auto op_it = op_index_.find(name);
  if (op_it == op_index_.end()) {
    std::ostringstream known;
    for (const OpEntry& e : info_.catalog) {
      if (!e.overload.empty()) known << " " << e.name << "." << e.overload;
    }
    return Status::Rejected(Reason::kOpUnknown, "the daemon does not serve cache_dit_cuda_ops::", name,
                            "; it serves:", known.str());
  }
  if (args.size() > static_cast<size_t>(kMaxArgs)) {
    return Status::Rejected(Reason::kBadArgument, name, ": ", args.size(), " arguments, at most ", kMaxArgs);
  }
  CallRequest& call = out->call_;
  call = CallRequest{};
  call.op = std::string(op);
  call.overload = std::string(overload);
  call.args.reserve(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    const Arg& arg = args[i];
    const auto list_ok = [&](size_t n) -> Status {
      if (n > static_cast<size_t>(kMaxListLength)) {
        return Status::Rejected(Reason::kBadArgument, name, ": argument ", i, " is a list of ", n,
                                " values, at most ", kMaxListLength);
      }
      return Status::Ok();
    };
    if (const auto* t = std::get_if<TensorView>(&arg)) {
      const std::string where = name + ": tensor argument " + std::to_string(i) + ": ";
      TensorRef ref;
      Status s;
      if (HasNoElements(t->sizes)) {
        // No memory to name (its pointer may well be null): region kNoRegion.
        s = MakeEmptyTensorRef(*t, &ref);
      } else if (t->data == nullptr) {
        return Status::Rejected(Reason::kBadArgument, name, ": tensor argument ", i, " has no data pointer");
      } else {
        ResolvedRegion region;
        s = engine_->ResolveRegion(t->data, &region);
        if (s.ok()) s = MakeTensorRef(*t, region.alloc, region.region_id, &ref);
      }
      if (!s.ok()) return s.Annotated(where);
      call.args.emplace_back(std::move(ref));
    } else if (std::holds_alternative<NoneArg>(arg)) {
      call.args.emplace_back(NoneArg{});
    } else if (const auto* v = std::get_if<int64_t>(&arg)) {
      call.args.emplace_back(*v);
    } else if (const auto* d = std::get_if<double>(&arg)) {
      call.args.emplace_back(*d);
    } else if (const auto* b = std::get_if<bool>(&arg)) {
      call.args.emplace_back(*b);
    } else if (const auto* il = std::get_if<std::vector<int64_t>>(&arg)) {
      OPD_RETURN_IF_ERROR(list_ok(il->size()));
      call.args.emplace_back(*il);
    } else if (const auto* fl = std::get_if<std::vector<double>>(&arg)) {
      OPD_RETURN_IF_ERROR(list_ok(fl->size()));
      call.args.emplace_back(*fl);
    } else if (const auto* bl = std::get_if<std::vector<bool>>(&arg)) {
      OPD_RETURN_IF_ERROR(list_ok(bl->size()));
      call.args.emplace_back(*bl);
    }
  }
  // Encoded once for the transport: a ring record when it fits one, the
  // gRPC message otherwise (the daemon decodes both into the same call).
  out->op_index_ = op_it->second;
  out->ring_ = use_ring_ && out->record_.AssignCall(call.args);
  if (!out->ring_) {
    out->request_.Clear();
    out->request_.set_session_id(id());
    out->request_.set_token(token_);
    CallToProto(call, &out->request_);
  }
  out->session_id_ = id();
  return Status::Ok();
}

Status Session::Issue(PreparedCall& call, cudaStream_t stream, const CallOptions& o) {
  const int timeout_ms = o.timeout_ms < 0 ? options_.call_timeout_ms : o.timeout_ms;
  IssueOptions io;
  io.signal_inputs_ready = o.signal_inputs_ready;
  io.wait_done = o.wait_done;
  const std::string name = OpName(call.op(), call.overload());
  Status s;
  if (call.ring_) {
    CallAnswer answer;
    const std::vector<uint64_t> regions = RegionsOf(call.call_.args);
    s = engine_->CallRing(stream, call.op_index_, call.record_, /*asynchronous=*/false, regions, io, &answer);
    if (s.ok()) s = answer.status().Annotated("Call " + name + ": ");
  } else {
    s = engine_->CallWith(stream, io, [&](uint32_t lane, uint64_t seq) -> Status {
      call.request_.set_lane(lane);
      call.request_.set_seq(seq);
      grpc::ClientContext ctx;
      if (timeout_ms > 0) ctx.set_deadline(DeadlineIn(timeout_ms));
      pb::CallReply reply;
      return FromGrpc(stub_->Call(&ctx, call.request_, &reply), ctx, "Call " + name);
    });
  }
  const v1::ClientAction action = s.action();
  if (action == v1::ClientAction::kReconnect || action == v1::ClientAction::kFail) {
    Fail(s.Annotated("", " (session " + std::to_string(id()) + " failed; the next call opens a new one)"));
  }
  return s;
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

bool Client::Recover(const std::shared_ptr<Session>& s, const PreparedCall& call, const Status& status) {
  switch (status.action()) {
    case v1::ClientAction::kReregister: {
      // The daemon no longer knows a region of this call (evicted): forget
      // the call's cached allocations so that preparing again registers them.
      s->engine().regions().ForgetIds(RegionsOf(call.call_.args));
      return true;
    }
    case v1::ClientAction::kReconnect:
      Drop(s);
      return options_.reconnect;
    case v1::ClientAction::kFail:
      Drop(s);
      return false;
    default:
      if (s->failed()) Drop(s);
      return false;
  }
}

Status Client::Call(std::string_view op, std::string_view overload, const std::vector<Arg>& args,
                    cudaStream_t stream, const CallOptions& options) {
  Status st;
  // Once more at most: after a re-registration, or on a new session when the
  // call did not run (wire.h's actions, the same rule as the Python client's).
  for (int attempt = 0; attempt < 2; ++attempt) {
    std::shared_ptr<Session> s;
    OPD_RETURN_IF_ERROR(CurrentSession(&s));
    PreparedCall call;
    {
      cuda::DeviceGuard guard(options_.device);
      OPD_RETURN_IF_ERROR(guard.status());
      st = s->Prepare(op, overload, args, &call);
    }
    if (st.ok()) st = s->Issue(call, stream, options);
    if (st.ok() || !Recover(s, call, st)) return st;
  }
  return st;
}

Status Client::Prepare(std::string_view op, std::string_view overload, const std::vector<Arg>& args,
                       PreparedCall* out) {
  std::shared_ptr<Session> s;
  OPD_RETURN_IF_ERROR(CurrentSession(&s));
  cuda::DeviceGuard guard(options_.device);
  OPD_RETURN_IF_ERROR(guard.status());
  PreparedCall pc;
  Status st = s->Prepare(op, overload, args, &pc);
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
  Status st = s->Issue(call, stream, options);
  if (!st.ok() && s->failed()) Drop(s);
  return st;
}

Status Client::ForgetAllocation(const void* ptr) {
  std::shared_ptr<Session> s = Peek();
  if (!s) return Status::NotFound("no session, nothing registered");
  return s->engine().regions().Forget(ptr);
}

Status Client::PruneRegions(size_t* removed) {
  if (removed) *removed = 0;
  std::shared_ptr<Session> s = Peek();
  if (!s) return Status::Ok();
  cuda::DeviceGuard guard(options_.device);
  OPD_RETURN_IF_ERROR(guard.status());
  return s->engine().regions().Prune(removed);
}

void Client::ForgetStream(cudaStream_t stream) {
  std::shared_ptr<Session> s = Peek();
  if (s) s->engine().lanes().Forget(KeyOfStream(stream));
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
  return FromGrpc(stub->GetVersion(&ctx, pb::VersionRequest(), out), ctx, "GetVersion at " + addr.target);
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
  return FromGrpc(stub->GetStats(&ctx, req, out), ctx, "GetStats");
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
  return s ? s->engine().regions().size() : 0;
}

int Client::LaneOfStream(cudaStream_t stream) {
  std::shared_ptr<Session> s = Peek();
  if (!s) return -1;
  return static_cast<int>(s->engine().lanes().LaneOf(KeyOfStream(stream)));
}

Status Client::InspectLane(uint32_t lane, LaneState* out) const {
  std::shared_ptr<Session> s = Peek();
  if (!s) return Status::FailedPrecondition("no session");
  SessionEngine& e = s->engine();
  if (lane >= e.lane_count()) return Status::InvalidArgument("lane ", lane, " of ", e.lane_count());
  const SessionEngine::LaneState st = e.lane_state(lane);
  out->issued = st.issued;
  out->inputs_ready = st.inputs_ready;
  out->done = st.done;
  return Status::Ok();
}

Status Client::RaiseInputsReadyFromHost(uint32_t lane, uint64_t value) {
  std::shared_ptr<Session> s = Peek();
  if (!s) return Status::FailedPrecondition("no session");
  SessionEngine& e = s->engine();
  if (lane >= e.lane_count()) return Status::InvalidArgument("lane ", lane, " of ", e.lane_count());
  e.RaiseInputsReadyFromHost(lane, value);
  return Status::Ok();
}

}  // namespace cache_dit_opd::client
