#include "server/grpc/proto_convert.h"

namespace cache_dit_opd {
namespace {

// opd.proto's DType enum and wire.h's table are the same numbers.
#define CACHE_DIT_OPD_X(e, v, name, bytes, proto)                                  \
  static_assert(static_cast<int>(v1::DTYPE_##proto) == v && static_cast<int>(DType::e) == v, \
                "opd.proto DTYPE_" #proto " differs from wire.h");
CACHE_DIT_OPD_WIRE_DTYPES(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
static_assert(v1::DType_ARRAYSIZE == kDTypeCount, "opd.proto has a dtype wire.h does not");

// opd.proto's Reason enum and wire.h's table are the same numbers.
#define CACHE_DIT_OPD_X(e, v, proto, code, action)                                       \
  static_assert(static_cast<int>(v1::REASON_##proto) == v && static_cast<int>(Reason::e) == v, \
                "opd.proto REASON_" #proto " differs from wire.h");
CACHE_DIT_OPD_REASONS(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
static_assert(v1::Reason_ARRAYSIZE == v1::kReasonCount, "opd.proto has a reason wire.h does not");

Status TensorFromProto(int index, const v1::TensorRef& in, TensorRef* out) {
  if (in.sizes_size() > kMaxTensorDims) {
    return Status::Rejected(Reason::kBadArgument, "argument ", index, ": tensor has ", in.sizes_size(), " dims, at most ",
                                   kMaxTensorDims);
  }
  if (in.sizes_size() != in.strides_size()) {
    return Status::Rejected(Reason::kBadArgument, "argument ", index, ": tensor has ", in.sizes_size(), " sizes but ",
                                   in.strides_size(), " strides");
  }
  const int dtype = static_cast<int>(in.dtype());
  if (!IsWireDType(dtype)) {
    return Status::Rejected(Reason::kBadArgument, "argument ", index, ": dtype ", dtype, " is not a protocol v1 dtype");
  }
  out->region_id = in.region_id();
  out->byte_offset = in.byte_offset();
  out->sizes.assign(in.sizes().begin(), in.sizes().end());
  out->strides.assign(in.strides().begin(), in.strides().end());
  out->dtype = static_cast<DType>(dtype);
  return Status::Ok();
}

template <typename L>
Status CheckList(int index, const L& list) {
  if (list.values_size() > kMaxListLength) {
    return Status::Rejected(Reason::kBadArgument, "argument ", index, ": list of ", list.values_size(), " values, at most ",
                                   kMaxListLength);
  }
  return Status::Ok();
}

}  // namespace

Status FromProto(const v1::CallRequest& in, CallRequest* out) {
  if (in.args_size() > kMaxArgs) {
    return Status::Rejected(Reason::kBadArgument, "call has ", in.args_size(), " arguments, at most ", kMaxArgs);
  }
  out->op = in.op();
  out->overload = in.overload();
  out->lane = in.lane();
  out->seq = in.seq();
  out->host_ordered = in.host_ordered();
  out->args.clear();
  out->args.reserve(in.args_size());
  for (int i = 0; i < in.args_size(); ++i) {
    const v1::Argument& a = in.args(i);
    switch (a.value_case()) {
      case v1::Argument::kTensor: {
        TensorRef t;
        OPD_RETURN_IF_ERROR(TensorFromProto(i, a.tensor(), &t));
        out->args.emplace_back(std::move(t));
        break;
      }
      case v1::Argument::kIntValue:
        out->args.emplace_back(static_cast<int64_t>(a.int_value()));
        break;
      case v1::Argument::kFloatValue:
        out->args.emplace_back(a.float_value());
        break;
      case v1::Argument::kBoolValue:
        out->args.emplace_back(a.bool_value());
        break;
      case v1::Argument::kIntList:
        OPD_RETURN_IF_ERROR(CheckList(i, a.int_list()));
        out->args.emplace_back(std::vector<int64_t>(a.int_list().values().begin(), a.int_list().values().end()));
        break;
      case v1::Argument::kFloatList:
        OPD_RETURN_IF_ERROR(CheckList(i, a.float_list()));
        out->args.emplace_back(std::vector<double>(a.float_list().values().begin(), a.float_list().values().end()));
        break;
      case v1::Argument::kBoolList:
        OPD_RETURN_IF_ERROR(CheckList(i, a.bool_list()));
        out->args.emplace_back(std::vector<bool>(a.bool_list().values().begin(), a.bool_list().values().end()));
        break;
      case v1::Argument::kNone:
        out->args.emplace_back(NoneArg{});
        break;
      case v1::Argument::VALUE_NOT_SET:
        return Status::Rejected(Reason::kBadArgument, "argument ", i, " has no value");
    }
  }
  return Status::Ok();
}

OpenSessionParams FromProto(const v1::OpenSessionRequest& in) {
  OpenSessionParams p;
  p.protocol_version = in.protocol_version();
  p.client_pid = in.client_pid();
  p.gpu_uuid = in.gpu_uuid();
  p.lanes = in.lanes();
  p.client_name = in.client_name();
  p.want_ring = in.want_ring();
  return p;
}

void ToProto(const VersionInfo& in, v1::VersionReply* out) {
  out->set_daemon_version(in.info.daemon_version);
  out->set_protocol_version(in.protocol_version);
  out->set_git_commit(in.info.git_commit);
  out->set_torch_version(in.info.torch_version);
  out->set_cuda_runtime_version(in.info.cuda_runtime_version);
  out->set_cuda_driver_version(in.info.cuda_driver_version);
  out->set_device_index(in.info.device_index);
  out->set_gpu_uuid(in.info.gpu_uuid);
  out->set_gpu_name(in.info.gpu_name);
  out->set_serving(in.serving);
  out->set_not_serving_reason(in.not_serving_reason);
  out->set_layout_version(in.layout_version);
  out->set_ring_available(in.ring_available);
}

void ToProto(const OpenSessionResult& in, v1::OpenSessionReply* out) {
  out->set_session_id(in.session_id);
  out->set_token(std::string(reinterpret_cast<const char*>(in.token.data()), in.token.size()));
  for (const OpInfo& op : in.catalog) {
    v1::OpSchema* s = out->add_catalog();
    s->set_name(op.name);
    s->set_overload(op.overload);
    s->set_schema(op.schema);
  }
  out->set_session_channel_path(in.session_channel_path);
  out->set_lanes(in.lanes);
  out->set_layout_version(in.layout_version);
  out->set_shared_memory_bytes(in.shared_memory_bytes);
  out->set_ring_enabled(in.ring_enabled);
  out->set_gpu_uuid(in.gpu_uuid);
  out->set_device_index(in.device_index);
  out->set_bind_timeout_ms(in.bind_timeout_ms);
}

void ToProto(const StatsSnapshot& in, v1::StatsReply* out) {
  out->set_sessions(in.sessions);
  out->set_calls(in.calls);
  out->set_errors(in.errors);
  out->set_regions(in.regions);
  out->set_mapped_bytes(in.mapped_bytes);
  out->set_call_p50_us(in.call_p50_us);
  out->set_call_p99_us(in.call_p99_us);
  out->set_sessions_closed(in.sessions_closed);
  for (const SessionStatsEntry& e : in.sessions_detail) {
    v1::SessionStats* s = out->add_session();
    s->set_session_id(e.session_id);
    s->set_client_pid(e.client_pid);
    s->set_client_uid(e.client_uid);
    s->set_calls(e.calls);
    s->set_errors(e.errors);
    s->set_regions(e.regions.regions);
    s->set_mapped_bytes(e.regions.mapped_bytes);
    s->set_pending_unmaps(e.regions.pending_unmaps);
  }
  for (const StatsSnapshot::Stage& st : in.stages) {
    v1::StageLatency* s = out->add_stages();
    s->set_name(st.name);
    s->set_p50_us(st.p50_us);
    s->set_p99_us(st.p99_us);
    s->set_count(st.count);
  }
}

}  // namespace cache_dit_opd
